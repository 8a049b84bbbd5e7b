"""An in-process store with the Mooncake client's method names, for tests and machines
where the mooncake package cannot be installed. Thread-safe; values are bytes."""

from __future__ import annotations

import ctypes
import threading
from typing import Dict, List, Sequence

from .keycheck import check_key, check_keys

__all__ = ["MemoryStore"]

OBJECT_NOT_FOUND = -704
INVALID_PARAMS = -600


class MemoryStore:
    """Keys to bytes in a dict behind a lock. ``batch_is_exist`` answers 1 / 0 per key."""

    #: ``batch_is_exist`` neither changes nor keeps the key list it is given.
    mutates_keys = False

    def __init__(self) -> None:
        self._data: Dict[str, bytes] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: object) -> bool:
        return key in self._data

    def keys(self) -> List[str]:
        with self._lock:
            return list(self._data)

    def put(self, key: str, value: bytes = b"\x01") -> int:
        """Store ``value`` under ``key`` unless it exists (Mooncake's put does not overwrite)."""
        check_key(key)
        value = bytes(value)
        if not key or not value:
            return INVALID_PARAMS
        with self._lock:
            self._data.setdefault(key, value)
        return 0

    def get(self, key: str) -> bytes:
        check_key(key)
        return self._data.get(key, b"")

    def is_exist(self, key: str) -> int:
        check_key(key)
        return 1 if key in self._data else 0

    def batch_is_exist(self, keys: Sequence[str]) -> List[int]:
        """1 for each key that exists, 0 otherwise, in order."""
        data = self._data
        return [1 if k in data else 0 for k in check_keys(keys)]

    def remove(self, key: str, force: bool = False) -> int:
        check_key(key)
        with self._lock:
            return 0 if self._data.pop(key, None) is not None else OBJECT_NOT_FOUND

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> List[int]:
        return [self.remove(k, force) for k in keys]

    def remove_all(self, force: bool = False) -> int:
        with self._lock:
            n = len(self._data)
            self._data.clear()
        return n

    # Zero-copy-shaped API (addresses of registered memory), as the Mooncake client has it.
    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        return 0

    def unregister_buffer(self, buffer_ptr: int) -> int:
        return 0

    def batch_put_from(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        """Copy ``sizes[i]`` bytes at address ``buffer_ptrs[i]`` under ``keys[i]``; 0 or an error code."""
        return [self.put(k, ctypes.string_at(p, n)) if n > 0 else INVALID_PARAMS
                for k, p, n in zip(keys, buffer_ptrs, sizes)]

    def batch_get_into(self, keys: Sequence[str], buffer_ptrs: Sequence[int], sizes: Sequence[int]) -> List[int]:
        """Copy each value to its address; bytes read, -704 if missing, -600 if it does not fit."""
        out = []
        for k, p, n in zip(keys, buffer_ptrs, sizes):
            v = self._data.get(check_key(k))
            if v is None:
                out.append(OBJECT_NOT_FOUND)
            elif len(v) > n:
                out.append(INVALID_PARAMS)
            else:
                ctypes.memmove(p, v, len(v))
                out.append(len(v))
        return out

    def health_check(self) -> int:
        return 0

    def close(self) -> int:
        return 0
