"""Calls in flight on a resource that can be closed: close() waits for them, later calls refuse.

Both the Mooncake adapter and the KV pool need this: closing the Mooncake client (or
unregistering memory) under a running call would crash the process or corrupt a transfer.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

__all__ = ["CallGate", "GateClosed"]


class GateClosed(RuntimeError):
    """A call was refused because the gate is closed (or closing)."""


class CallGate:
    """``with gate.call():`` around each call; ``close`` refuses new calls and waits for the rest.

    Closing runs ``on_close`` (if given) once, after the last call in flight has left; every
    ``close`` returns only when that is done, so a second close never returns early.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._in_flight = 0
        self._done = False

    @property
    def closed(self) -> bool:
        return not self._open

    @contextmanager
    def call(self, what: str = "resource") -> Iterator[None]:
        """Count a call in for the ``with`` body; raise :class:`GateClosed` once closed."""
        with self._cond:
            if not self._open:
                raise GateClosed(f"the {what} is closed")
            self._in_flight += 1
        try:
            yield
        finally:
            with self._cond:
                self._in_flight -= 1
                if not self._in_flight:
                    self._cond.notify_all()

    def close(self, on_close: Optional[Callable[[], None]] = None) -> bool:
        """Refuse new calls, wait for those in flight, run ``on_close`` once; True for the first
        close only. A later close waits until the first one's ``on_close`` has finished."""
        with self._cond:
            first = self._open
            self._open = False
            while self._in_flight:
                self._cond.wait()
            if not first:
                while not self._done:
                    self._cond.wait()
                return False
        try:
            if on_close is not None:
                on_close()
        finally:
            with self._cond:
                self._done = True
                self._cond.notify_all()
        return True
