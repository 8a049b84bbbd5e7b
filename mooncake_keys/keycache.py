"""A bounded, thread-safe cache of built key strings.

A scheduler looks a waiting request up again every step, and requests that share a system
prompt share its chunks: their keys need not be built twice. Two layers share one budget:

* **requests**: the whole key list of a recent lookup, by (token_len, skip_tokens, hashes),
  checked byte for byte against the request's hashes; LRU, at most a quarter of the budget.
  Admission on second sight: a request looked up once (most are, when they hit or are
  scheduled at once) costs one fingerprint, not its strings; kept strings live in fresh memory,
  and page faults would make every cold lookup pay for a cache it never uses.
* **chunks**: per group, the tuple of one chunk's keys over all namespaces, by chunk hash.
  A repeated request caches all its chunks; a first-sight request reuses the cached part of
  its prefix (a shared system prompt) and builds the rest. Eviction is generational: new and
  reused entries go into a young dict; when young + old exceed the chunk budget, the old dict
  is dropped and the young one becomes old. A hit stays one dict lookup. (With a single
  namespace a key is cheaper to build than to look up, so the engine skips this layer then.)

Sizes are estimates from ``sys.getsizeof``; after every lookup they are within the budget.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Hashable, List, Optional, Tuple

__all__ = ["KeyCache", "KeyCacheStats", "DEFAULT_KEY_CACHE_BYTES"]

#: Request fingerprints remembered for admission on second sight (about 200 bytes each).
_MAX_SEEN = 4096

#: Default memory budget (bytes): about 300k keys of 110 characters.
DEFAULT_KEY_CACHE_BYTES = 64 << 20


@dataclass(frozen=True)
class KeyCacheStats:
    """Counters since creation and the current estimated size (bytes).

    ``hits``/``misses`` count chunks (a miss builds the chunk's keys, or promotes them from
    the old generation); ``request_hits``/``request_misses`` count whole lookups.
    """

    hits: int
    misses: int
    entries: int
    request_hits: int
    request_misses: int
    requests: int
    bytes: int
    max_bytes: int


class KeyCache:
    """Key strings of recently seen chunks and requests for ``num_groups`` groups.

    ``max_bytes=0`` disables caching.
    """

    def __init__(self, num_groups: int, max_bytes: int = DEFAULT_KEY_CACHE_BYTES) -> None:
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int):
            raise TypeError(f"key_cache_bytes must be an int, got {type(max_bytes).__name__}")
        if max_bytes < 0:
            raise ValueError(f"key_cache_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self._request_budget = max_bytes // 4
        self._chunk_budget = max_bytes - self._request_budget
        self._lock = threading.Lock()
        self._young: List[dict] = [{} for _ in range(num_groups)]
        self._old: List[dict] = [{} for _ in range(num_groups)]
        self._young_bytes = 0
        self._old_bytes = 0
        self._hits = 0
        self._misses = 0
        self._requests: "OrderedDict[Hashable, Tuple[bytes, List[str], int]]" = OrderedDict()
        self._request_bytes = 0
        self._request_hits = 0
        self._request_misses = 0
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    @property
    def spare_budget(self) -> int:
        """Estimated bytes of one lookup's key strings an engine may keep for reuse (a quarter)."""
        return self.max_bytes // 4

    # ------------------------------------------------------------------ chunks
    def dicts(self, group: int) -> Tuple[dict, dict]:
        """The (young, old) dicts of ``group`` to hand to the core's ``fill_keys``."""
        return self._young[group], self._old[group]

    @staticmethod
    def entry_bytes(num_keys: int, key_chars: int, hash_len: int) -> int:
        """Estimated bytes of one chunk entry: its keys, the tuple, the hash bytes, the dict slot."""
        key = sys.getsizeof("k" * key_chars)
        return num_keys * (key + 8) + sys.getsizeof(()) + sys.getsizeof(b"h" * hash_len) + 64

    def record(self, chunks: int, hits: int, added: int, entry_bytes: int) -> None:
        """Account for a fill of ``chunks`` chunks: ``hits`` served from the cache, ``added``
        tuples put into the young dict (built or promoted)."""
        with self._lock:
            self._hits += hits
            self._misses += chunks - hits
            self._young_bytes += added * entry_bytes
            if self._young_bytes + self._old_bytes > self._chunk_budget:
                self._old, self._young = self._young, [{} for _ in self._young]
                self._old_bytes, self._young_bytes = self._young_bytes, 0
                if self._old_bytes > self._chunk_budget:  # one lookup larger than the budget
                    self._old = [{} for _ in self._young]
                    self._old_bytes = 0

    # ------------------------------------------------------------------ requests
    def request_seen(self, key: Hashable) -> bool:
        """Whether ``key`` was looked up before (and remember that it now has been)."""
        with self._lock:
            seen = self._seen
            if key in seen:
                seen.move_to_end(key)
                return True
            seen[key] = None
            if len(seen) > _MAX_SEEN:
                seen.popitem(last=False)
            return False

    def request_get(self, key: Hashable, blob: bytes) -> Optional[List[str]]:
        """A copy of the keys memoised for ``key`` if its hashes equal ``blob``, else None."""
        with self._lock:
            entry = self._requests.get(key)
            if entry is None or entry[0] != blob:
                self._request_misses += 1
                return None
            self._requests.move_to_end(key)
            self._request_hits += 1
            return list(entry[1])

    def request_put(self, key: Hashable, blob: bytes, keys: List[str], key_bytes: int) -> None:
        """Memoise a copy of ``keys`` (``key_bytes``: estimated size of the strings)."""
        size = key_bytes + 8 * len(keys) + 56 + len(blob) + 100
        if size > self._request_budget:
            return
        copy = list(keys)
        with self._lock:
            old = self._requests.pop(key, None)
            if old is not None:
                self._request_bytes -= old[2]
            self._requests[key] = (blob, copy, size)
            self._request_bytes += size
            while self._request_bytes > self._request_budget:
                _, (_, _, dropped) = self._requests.popitem(last=False)
                self._request_bytes -= dropped

    # ------------------------------------------------------------------ both
    def clear(self) -> None:
        with self._lock:
            for d in self._young + self._old:
                d.clear()
            self._young_bytes = self._old_bytes = 0
            self._requests.clear()
            self._seen.clear()
            self._request_bytes = 0

    def stats(self) -> KeyCacheStats:
        with self._lock:
            entries = sum(map(len, self._young)) + sum(map(len, self._old))
            return KeyCacheStats(
                self._hits, self._misses, entries, self._request_hits, self._request_misses,
                len(self._requests), self._young_bytes + self._old_bytes + self._request_bytes,
                self.max_bytes,
            )
