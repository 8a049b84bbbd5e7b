"""The key strings a lookup engine keeps between lookups: the one owner of that policy.

Two uses, each with its own budget (bytes, estimated with ``sys.getsizeof``), both counted in
:meth:`KeyCache.stats`:

* **repeated requests** (``max_bytes``): a scheduler looks a waiting request up again every
  step. The whole key list of a request is memoised by its fingerprint (token_len,
  skip_tokens, number and length of hashes, last hash) and checked byte for byte against the
  request's hashes; LRU. Admission on second sight: a request looked up once (most are) costs
  one fingerprint, not its strings. A request whose keys alone exceed the budget is never
  admitted, so a repeat is never slower than a first sight.
* **spare strings** (``spare_bytes``): the key list of the last lookup that was not memoised.
  When the store has dropped it, the next lookup writes its keys into that list, and the
  compiled core rewrites in place the strings nothing else references instead of allocating
  new ones (see ``_core_c.pyx`` for why and when that is safe). Only kept when the core in use
  can reuse strings.

``max_bytes=0`` / ``spare_bytes=0`` turn each off. Thread-safe.
"""

from __future__ import annotations

import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, List, Optional, Tuple

from .._checks import int_arg

__all__ = ["KeyCache", "KeyCacheStats", "DEFAULT_KEY_CACHE_BYTES", "DEFAULT_SPARE_BYTES"]

#: Request fingerprints remembered for admission on second sight (about 200 bytes each).
_MAX_SEEN = 4096

#: Default budget of memoised requests (bytes): about 400k keys of 110 characters.
DEFAULT_KEY_CACHE_BYTES = 64 << 20

#: Default budget of spare strings (bytes): about 1.5M keys of 110 characters (the last lookup's
#: own strings, kept for the next one to write over; measured: docs/benchmarks.md, scaling).
DEFAULT_SPARE_BYTES = 256 << 20

_LIST_SLOT = 8  # bytes per list item


@dataclass(frozen=True)
class KeyCacheStats:
    """Counters since creation (whole lookups) and current sizes (bytes, estimated)."""

    request_hits: int
    request_misses: int
    requests: int
    bytes: int
    max_bytes: int
    spare_keys: int
    spare_bytes: int
    max_spare_bytes: int


def key_bytes(num_keys: int, key_chars: int) -> int:
    """Estimated bytes of ``num_keys`` ASCII key strings of ``key_chars`` characters, listed."""
    return num_keys * (sys.getsizeof("k" * key_chars) + _LIST_SLOT)


def _same_bytes(kept: bytes, blob: Any) -> bool:
    """``kept == bytes(blob)`` at memcmp speed: comparing bytes with a memoryview unpacks it
    item by item (0.6 ms for 256 KiB here)."""
    if isinstance(blob, bytes):
        return kept == blob
    obj = getattr(blob, "obj", None)
    if isinstance(obj, bytes) and len(obj) == blob.nbytes:  # a view of a whole bytes object
        return kept == obj
    return kept == blob.tobytes()


class KeyCache:
    """Memoised key lists of repeated requests, and the spare strings of the last lookup."""

    def __init__(self, max_bytes: int = DEFAULT_KEY_CACHE_BYTES, spare_bytes: int = DEFAULT_SPARE_BYTES,
                 *, reuse: bool = True) -> None:
        self.max_bytes = int_arg("key_cache_bytes", max_bytes, min=0)
        self.max_spare_bytes = int_arg("spare_key_bytes", spare_bytes, min=0) if reuse else 0
        self._lock = threading.Lock()
        self._requests: "OrderedDict[Hashable, Tuple[bytes, List[str], int]]" = OrderedDict()
        self._request_bytes = 0
        self._request_hits = 0
        self._request_misses = 0
        self._seen: "OrderedDict[Hashable, None]" = OrderedDict()
        self._spare: Optional[List[str]] = None
        self._spare_bytes = 0

    # ------------------------------------------------------------------ requests
    def get(self, fingerprint: Hashable, blob: Any, *, copy: bool = True) -> Optional[List[str]]:
        """The keys memoised for ``fingerprint`` if their hashes equal ``blob``: a copy, or the
        memoised list itself (``copy=False``: for a reader that never changes it)."""
        if not self.max_bytes:
            return None
        with self._lock:
            entry = self._requests.get(fingerprint)
            if entry is None or not _same_bytes(entry[0], blob):
                self._request_misses += 1
                return None
            self._requests.move_to_end(fingerprint)
            self._request_hits += 1
            return list(entry[1]) if copy else entry[1]

    def _second_sight(self, fingerprint: Hashable) -> bool:
        seen = self._seen
        if fingerprint in seen:
            seen.move_to_end(fingerprint)
            return True
        seen[fingerprint] = None
        if len(seen) > _MAX_SEEN:
            seen.popitem(last=False)
        return False

    def keep(self, fingerprint: Hashable, blob: Any, keys: List[str], size: int, *, spare: bool = True) -> None:
        """Keep the keys of a lookup just built (``size``: their estimated bytes): memoised when
        the request is seen for the second time and fits, else (``spare``: the list only goes
        to the store) the list itself as spare strings if they fit."""
        if self.max_bytes:
            entry_size = size + len(blob) + 200
            with self._lock:
                repeat = self._second_sight(fingerprint)
            if repeat and entry_size <= self.max_bytes:
                entry = (bytes(blob), list(keys), entry_size)
                with self._lock:
                    old = self._requests.pop(fingerprint, None)
                    if old is not None:
                        self._request_bytes -= old[2]
                    self._requests[fingerprint] = entry
                    self._request_bytes += entry_size
                    while self._request_bytes > self.max_bytes:
                        _, (_, _, dropped) = self._requests.popitem(last=False)
                        self._request_bytes -= dropped
                return
        if spare and size <= self.max_spare_bytes:
            with self._lock:
                self._spare, self._spare_bytes = keys, size

    # ------------------------------------------------------------------ spare strings
    def take_spare(self) -> Optional[List[str]]:
        """The last lookup's key list, now the taker's alone; None when there is none, or when
        something else still holds it (a store that kept it: it must never change under them)."""
        if not self.max_spare_bytes:
            return None
        with self._lock:
            spare, self._spare, self._spare_bytes = self._spare, None, 0
        # Two references: ``spare`` and getrefcount's argument. A measured trick (docs/benchmarks.md:
        # 2.2x faster key building); the strings inside get CPython's own checks in the core.
        if spare is None or sys.getrefcount(spare) > 2:
            return None
        return spare

    # ------------------------------------------------------------------ both
    def clear(self) -> None:
        with self._lock:
            self._requests.clear()
            self._seen.clear()
            self._request_bytes = 0
            self._spare, self._spare_bytes = None, 0

    def stats(self) -> KeyCacheStats:
        with self._lock:
            return KeyCacheStats(
                self._request_hits, self._request_misses, len(self._requests), self._request_bytes,
                self.max_bytes, len(self._spare or ()), self._spare_bytes, self.max_spare_bytes,
            )
