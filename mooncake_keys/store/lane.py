"""A call lane: Mooncake client calls with a time limit, on one long-lived thread.

No setting of the Mooncake client bounds a call to a dead master (each stalls ~4.3 s in four
refused connects a second apart), so the limit comes from outside: the call runs on the lane's
thread and the caller waits at most ``timeout``. A call that overruns cannot be cancelled; it
finishes on the lane's thread, and until it has the lane refuses new calls at once, so stuck
threads never pile up (at most one per lane, whatever the call rate).

The thread is not a daemon (a daemon thread inside a Mooncake call when the interpreter exits
aborts the process); it leaves when the lane is closed or the main thread has ended.
"""

from __future__ import annotations

import queue
import threading
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional

__all__ = ["CallLane", "LaneBusy", "LaneTimeout"]

class LaneBusy(RuntimeError):
    """A call could not start: the previous one overran and is still running, or too many wait."""


class LaneTimeout(RuntimeError):
    """A call missed its time limit (it goes on on the lane's thread until it returns)."""


class CallLane:
    """Runs calls one at a time on its own thread, each waited for at most a time limit."""

    def __init__(self, name: str, max_waiting: int = 64) -> None:
        self.name = name
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max_waiting)
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._overrun: Optional[Future] = None
        self._closed = False

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=False)
            self._thread.start()

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float) -> Any:
        """``fn(*args)`` on the lane; its result, or LaneTimeout after ``timeout`` seconds."""
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise LaneBusy(f"{self.name}: closed")
            if self._overrun is not None:
                raise LaneBusy(f"{self.name}: an earlier call is still running past its time limit")
            self._ensure_thread()
            try:
                self._queue.put_nowait((fut, fn, args))
            except queue.Full:
                raise LaneBusy(f"{self.name}: {self._queue.maxsize} calls already waiting") from None
        try:
            return fut.result(timeout)
        except FutureTimeout:
            if fut.cancel():  # it never started
                raise LaneTimeout(f"{self.name}: waited {timeout:.3g} s for an earlier call") from None
            with self._lock:
                if not fut.done():
                    self._overrun = fut
            raise LaneTimeout(f"{self.name}: the call took longer than {timeout:.3g} s") from None

    @property
    def overrunning(self) -> bool:
        """A call overran its time limit and has not returned yet."""
        return self._overrun is not None

    def _loop(self) -> None:
        main = threading.main_thread()
        while True:
            try:
                item = self._queue.get(timeout=0.2)
            except queue.Empty:
                if self._closed or not main.is_alive():
                    return  # closed, or the interpreter is shutting down, and nothing is queued
                continue
            fut, fn, args = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)
            finally:
                with self._lock:
                    if self._overrun is fut:
                        self._overrun = None

    def close(self, timeout: Optional[float] = None) -> None:
        """Refuse new calls; let the thread finish what it runs and leave (waits up to ``timeout``)."""
        with self._lock:
            self._closed = True
            thread = self._thread
        if thread is not None:
            thread.join(timeout)
