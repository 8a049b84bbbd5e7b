"""Calls in flight on a resource that can be closed: close() waits for them, later calls refuse.

Both the Mooncake adapter and the KV pool need this: closing the Mooncake client (or
unregistering memory) under a running call would crash the process or corrupt a transfer.
"""

from __future__ import annotations

import threading


class CallGate:
    """``enter``/``leave`` around each call; ``close`` refuses new calls and waits for the rest."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._open = True
        self._in_flight = 0

    @property
    def closed(self) -> bool:
        return not self._open

    def enter(self) -> bool:
        """Count a call in; False (and nothing counted) once the gate is closed."""
        with self._cond:
            if not self._open:
                return False
            self._in_flight += 1
            return True

    def leave(self) -> None:
        with self._cond:
            self._in_flight -= 1
            if not self._in_flight:
                self._cond.notify_all()

    def close(self) -> bool:
        """Refuse new calls and wait for those in flight; True for the first close only."""
        with self._cond:
            first = self._open
            self._open = False
            while self._in_flight:
                self._cond.wait()
            return first
