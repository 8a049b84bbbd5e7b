"""The argument types and the one-line error every subcommand shares (no subcommand imported here)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Callable, Optional

__all__ = ["MAX_COUNT", "error", "png_path", "positive_int", "unwritable", "whole_number"]

#: The most prompts a demo serves, or repeats a bench takes: enough for any run, bounded.
MAX_COUNT = 100_000


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high``."""

    def parse(text: str) -> int:
        try:
            value = int(text) if len(text) <= 12 else high + 1
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be from {low} to {high}, got {text}")
        return value

    return parse


#: An argparse type: a whole number from 1 to :data:`MAX_COUNT`.
positive_int = whole_number(1, MAX_COUNT)


def png_path(text: str) -> str:
    """An argparse type: a path a PNG can be written to (checked now, before any work)."""
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is written as PNG: the path must end in .png, got {text!r}")
    why = unwritable(text)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write the plot there: {why}")
    return text


def unwritable(path: str, directory: bool = False) -> Optional[str]:
    """Why a file (or, with ``directory``, a directory) cannot be written at ``path``, or None.

    The nearest existing directory on the way must take a new file (tried, then removed): a
    permission, a read-only file system or a file in the way is found before any work."""
    path = os.path.abspath(path)
    if os.path.exists(path) and os.path.isdir(path) != directory:
        return f"{path} is {'not ' if directory else ''}a directory"
    if not directory and os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    parent = path if directory else os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=parent, suffix=".png")
    except OSError as exc:
        return f"cannot write in {parent}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(probe)
    return None


def error(command: str, message: object, status: int) -> int:
    """Print ``message`` as one line on stderr, as ``command``'s error; return ``status``."""
    print(f"mooncake_keys {command}: error: {' '.join(str(message).split())}", file=sys.stderr, flush=True)
    return status


