"""Child processes of the tests: code that could crash the interpreter runs in a child process,
so that a regression fails its test instead of killing the suite; and whether a process is gone."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from typing import Iterable, List


def run_child(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """``code`` (dedented) run by this interpreter in a child process; its output captured."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout)


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie (this machine's init may reap late)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def wait_gone(pids: Iterable[int], timeout: float = 10.0) -> List[int]:
    """Wait up to ``timeout`` seconds for every process of ``pids`` to be gone; those still alive."""
    pids = list(pids)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(not gone(p) for p in pids):
        time.sleep(0.02)
    return [p for p in pids if not gone(p)]


def kill_all(pids: Iterable[int]) -> None:
    """SIGKILL each of ``pids`` still running (what a failed test must not leave behind)."""
    import os
    import signal
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
