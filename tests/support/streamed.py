"""A driver process whose JSON lines the test reads while it runs (the hosts of
tests/test_partitions.py): started with :func:`mooncake_keys.store.process.spawn`, so it dies
with the test process whatever ends it, optionally inside a network namespace."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

from mooncake_keys.store.process import file_tail, in_netns, spawn


class DriverFailed(AssertionError):
    """The driver exited, or a line it should have printed did not come within the deadline."""


class StreamedChild:
    """``args`` run in ``netns`` (None: here) with ``env``; every stdout line that is JSON is kept
    in :attr:`lines` (others are ignored); stderr goes to ``log_path``."""

    def __init__(self, args: Sequence[str], *, env: Dict[str, str], log_path: str, netns: Optional[str] = None) -> None:
        self.log_path = log_path
        self.lines: List[Dict[str, Any]] = []
        self._cond = threading.Condition()
        with open(log_path, "ab") as log:
            self.proc = spawn(in_netns(netns, args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                              env=env)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                obj = json.loads(raw)
            except ValueError:
                continue
            with self._cond:
                self.lines.append(obj)
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_for(self, pred: Callable[[Dict[str, Any]], bool], deadline_s: float, what: str) -> Dict[str, Any]:
        """The first line so far or to come for which ``pred`` holds (each line is given to it
        once, in order, so it may keep state). ``deadline_s`` (seconds) is a generous limit
        only: missing it, or the driver's exit, fails with its log tail."""
        end = time.monotonic() + deadline_s
        seen = 0
        with self._cond:
            while True:
                for line in self.lines[seen:]:
                    if pred(line):
                        return line
                seen = len(self.lines)
                if self.proc.poll() is not None and not self._reader.is_alive():
                    raise DriverFailed(f"driver exited ({self.proc.returncode}) before {what}:\n{self.log_tail()}")
                left = end - time.monotonic()
                if left <= 0:
                    raise DriverFailed(f"no {what} within {deadline_s} s:\n{self.log_tail()}")
                self._cond.wait(min(left, 0.5))

    def send(self, text: str) -> None:
        """One line on the driver's stdin."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        self.proc.stdin.flush()

    def log_tail(self, chars: int = 3000) -> str:
        return file_tail(self.log_path, chars)

    def close(self, timeout: float = 10.0) -> None:
        """Close its stdin, wait up to ``timeout`` seconds for it to end, then SIGKILL it."""
        try:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
