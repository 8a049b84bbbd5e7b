"""The key strings a lookup engine keeps between lookups: the one owner of that policy.

Two uses, each with its own budget (bytes, estimated with ``sys.getsizeof``), both counted in
:meth:`KeyCache.stats`:

* **repeated requests** (``max_bytes``): a scheduler looks a waiting request up again every
  step. The whole key list of a request is memoised by its fingerprint (token_len,
  skip_tokens, number and length of hashes, last hash) and checked byte for byte against the
  request's hashes; LRU. Admission on second sight: a request looked up once (most are) costs
  one fingerprint, not its strings. A request whose keys alone exceed the budget is never
  admitted, so a repeat is never slower than a first sight.
* **spare strings** (``spare_bytes``): the key strings of the last lookup that was not memoised.
  When the caller and the store have dropped them, the compiled core rewrites them in place for
  the next lookup instead of allocating new ones (see ``_core_c.pyx`` for why and when that is
  safe). Only kept when the core in use can reuse strings.

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

#: Default budget of spare strings (bytes): about 100k keys of 110 characters.
DEFAULT_SPARE_BYTES = 16 << 20

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
    def get(self, fingerprint: Hashable, blob: Any) -> Optional[List[str]]:
        """A copy of the keys memoised for ``fingerprint`` if their hashes equal ``blob``."""
        if not self.max_bytes:
            return None
        with self._lock:
            entry = self._requests.get(fingerprint)
            if entry is None or entry[0] != blob:
                self._request_misses += 1
                return None
            self._requests.move_to_end(fingerprint)
            self._request_hits += 1
            return list(entry[1])  # a copy: the caller or the store may change the list

    def _second_sight(self, fingerprint: Hashable) -> bool:
        seen = self._seen
        if fingerprint in seen:
            seen.move_to_end(fingerprint)
            return True
        seen[fingerprint] = None
        if len(seen) > _MAX_SEEN:
            seen.popitem(last=False)
        return False

    def keep(self, fingerprint: Hashable, blob: Any, keys: List[str], size: int) -> None:
        """Keep the keys of a lookup just built (``size``: their estimated bytes): memoised when
        the request is seen for the second time and fits, else as spare strings if they fit."""
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
        if size <= self.max_spare_bytes:
            # A private copy of the list: a caller or a store may keep the one it was given,
            # and then its strings are never rewritten (their reference count is not 1).
            spare = list(keys)
            with self._lock:
                self._spare, self._spare_bytes = spare, size

    # ------------------------------------------------------------------ spare strings
    def take_spare(self) -> Optional[List[str]]:
        """The spare strings (they are no longer the cache's), or None."""
        if not self.max_spare_bytes:
            return None
        with self._lock:
            spare, self._spare, self._spare_bytes = self._spare, None, 0
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
