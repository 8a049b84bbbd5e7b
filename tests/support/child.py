"""Code that could crash the interpreter runs in a child process, so that a regression fails its
test instead of killing the suite."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` (dedented) run by this interpreter in a child process; its output captured."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)
