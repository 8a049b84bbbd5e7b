"""The store-fault policy: one existence call (``batch_is_exist``), its answer checked, a fault logged and timed.

Whatever the store does (raises, answers something other than a list or tuple, answers a list of
the wrong length), :meth:`StoreCalls.call` returns None and logs one warning line; the lookup that
made the call then answers as its engine's contract says (vLLM's: 0 hits; SGLang's: the error
SGLang's own query path turns into 0 hits). The time from a failed call to the next answered one
counts as the store being unavailable. Every lookup engine asks its store through one of these,
so the policy has one owner whichever serving engine the lookup is for.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, List, Optional

__all__ = ["StoreCalls"]


class StoreCalls:
    """Calls of ``store.batch_is_exist``, with the fault policy (see the module doc); warnings
    go to ``logger``."""

    def __init__(self, store: Any, logger: logging.Logger) -> None:
        if not callable(getattr(store, "batch_is_exist", None)):
            raise TypeError("store must have a batch_is_exist(list[str]) -> list[int] method")
        self.store = store
        self.logger = logger
        self._lock = threading.Lock()
        self._down_since: Optional[float] = None  # when the last failed call was
        self._unavailable = 0.0  # seconds, of the spells that ended
        self._reported = 0.0  # what take_unavailable() has handed out

    def call(self, keys: List[str], method: str = "batch_is_exist",
             fn: Optional[Callable[[List[str]], Any]] = None) -> Optional[list]:
        """One existence call of ``keys`` (``store.batch_is_exist``, or ``fn``, the store's call
        named ``method``, e.g. Mooncake 0.3.14's ``batch_probe_key``): the answers, a list as
        long as ``keys``, or None (a fault: logged, and the store unavailable from now)."""
        try:
            results = (self.store.batch_is_exist if fn is None else fn)(keys)
        except Exception as exc:  # the serving engine must never crash on a store fault
            return self.failed("%s of %d keys raised %s: %s", method, len(keys), type(exc).__name__, exc)
        if not isinstance(results, (list, tuple)):
            return self.failed("%s returned %s, not a list", method, type(results).__name__)
        try:
            if type(results) is not list:
                results = list(results)  # a tuple, or a subclass: its items, read once
        except Exception as exc:  # a list subclass that fails to iterate, ...
            return self.failed("the answer of %s could not be read: %s: %s", method, type(exc).__name__, exc)
        if len(results) != len(keys):
            return self.failed("%s returned %d results for %d keys", method, len(results), len(keys))
        if self._down_since is not None:
            with self._lock:
                if self._down_since is not None:
                    self._unavailable += time.monotonic() - self._down_since
                    self._down_since = None
        return results

    def failed(self, message: str, *args: Any) -> None:
        """One warning line (``message % args`` after "lookup answered 0: "); the store is
        unavailable from now. Returns None, the failed call's answer."""
        self.logger.warning("lookup answered 0: " + message, *args)
        self.mark_down()
        return None

    def mark_down(self) -> None:
        """The store is unavailable from now (unless it was already)."""
        if self._down_since is None:
            with self._lock:
                if self._down_since is None:
                    self._down_since = time.monotonic()

    def unavailable_seconds(self) -> float:
        """Seconds the store has been unavailable, the current spell included."""
        with self._lock:
            return self._unavailable + (0.0 if self._down_since is None else time.monotonic() - self._down_since)

    def take_unavailable(self) -> float:
        """The unavailable seconds since the last call of this method (a record's share)."""
        with self._lock:
            down = self._unavailable + (0.0 if self._down_since is None else time.monotonic() - self._down_since)
            taken, self._reported = down - self._reported, down
            return taken
