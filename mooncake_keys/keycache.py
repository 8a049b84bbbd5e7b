"""A bounded, thread-safe cache of built key strings, per (group, chunk hash).

A scheduler looks a waiting request up again every step, and requests that share a system
prompt share its chunks: their keys need not be built twice. Entries are the tuple of one
chunk's keys over all namespaces of one group. Eviction is generational: new and reused entries
go into a young dict; when young + old exceed the budget, the old dict is dropped and the young
one becomes old. A hit stays one dict lookup, and the estimate never exceeds the budget after a
lookup.
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["KeyCache", "KeyCacheStats", "DEFAULT_KEY_CACHE_BYTES"]

#: Default memory budget: about 190k keys of 110 characters over 8 namespaces.
DEFAULT_KEY_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class KeyCacheStats:
    """Counters since creation (chunks, not keys) and the current estimated size in bytes."""

    hits: int
    misses: int
    entries: int
    bytes: int
    max_bytes: int


class KeyCache:
    """Key tuples of recently seen chunks for ``num_groups`` groups, within ``max_bytes``.

    ``max_bytes=0`` disables caching. Sizes are estimates from ``sys.getsizeof``.
    """

    def __init__(self, num_groups: int, max_bytes: int = DEFAULT_KEY_CACHE_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"key_cache_bytes must be an int, got {type(max_bytes).__name__}")
        if max_bytes < 0:
            raise ValueError(f"key_cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._young: List[dict] = [{} for _ in range(num_groups)]
        self._old: List[dict] = [{} for _ in range(num_groups)]
        self._young_bytes = 0
        self._old_bytes = 0
        self._hits = 0
        self._misses = 0

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def dicts(self, group: int) -> Tuple[dict, dict]:
        """The (young, old) dicts of ``group`` to hand to the core's ``fill_keys``."""
        return self._young[group], self._old[group]

    @staticmethod
    def entry_bytes(num_keys: int, key_chars: int, hash_len: int) -> int:
        """Estimated bytes of one entry: its keys, the tuple, the hash bytes and the dict slot."""
        key = sys.getsizeof("k" * key_chars)
        return num_keys * (key + 8) + sys.getsizeof(()) + sys.getsizeof(b"h" * hash_len) + 64

    def record(self, chunks: int, added: int, entry_bytes: int) -> None:
        """Account for a fill of ``chunks`` chunks of which ``added`` went into the young dict."""
        with self._lock:
            self._misses += added
            self._hits += chunks - added
            self._young_bytes += added * entry_bytes
            if self._young_bytes + self._old_bytes > self.max_bytes:
                self._old, self._young = self._young, [{} for _ in self._young]
                self._old_bytes, self._young_bytes = self._young_bytes, 0
                if self._old_bytes > self.max_bytes:  # one lookup larger than the whole budget
                    self._old = [{} for _ in self._young]
                    self._old_bytes = 0

    def clear(self) -> None:
        with self._lock:
            for d in self._young + self._old:
                d.clear()
            self._young_bytes = self._old_bytes = 0

    def stats(self) -> KeyCacheStats:
        with self._lock:
            entries = sum(map(len, self._young)) + sum(map(len, self._old))
            return KeyCacheStats(self._hits, self._misses, entries,
                                 self._young_bytes + self._old_bytes, self.max_bytes)
