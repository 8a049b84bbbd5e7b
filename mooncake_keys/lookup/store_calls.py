"""The store-fault policy: one ``batch_is_exist``, its answer checked, a fault logged and timed.

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
from typing import Any, List, Optional

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

    def call(self, keys: List[str]) -> Optional[list]:
        """One ``batch_is_exist`` of ``keys``: the answers, a list as long as ``keys``, or None
        (a fault: logged, and the store unavailable from now)."""
        try:
            results = self.store.batch_is_exist(keys)
        except Exception as exc:  # the serving engine must never crash on a store fault
            return self.failed("batch_is_exist of %d keys raised %s: %s", len(keys), type(exc).__name__, exc)
        if not isinstance(results, (list, tuple)):
            return self.failed("batch_is_exist returned %s, not a list", type(results).__name__)
        try:
            if type(results) is not list:
                results = list(results)  # a tuple, or a subclass: its items, read once
        except Exception as exc:  # a list subclass that fails to iterate, ...
            return self.failed("the answer of batch_is_exist could not be read: %s: %s", type(exc).__name__, exc)
        if len(results) != len(keys):
            return self.failed("batch_is_exist returned %d results for %d keys", len(results), len(keys))
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
