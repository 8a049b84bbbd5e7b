"""Block hashes: a request's hashes at ``hash_block_size`` granularity, as one contiguous blob.

vLLM sends lookup hashes as a blob of equal-length hashes (#45969); :class:`BlockHashes` is
that, zero-copy. A list of bytes-like hashes is joined into one once per lookup.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence, Union, overload

__all__ = ["BlockHashes", "as_block_hashes"]

_BYTES_LIKE = (bytes, bytearray, memoryview)
_FAST_TYPES = {bytes, bytearray}


def _byte_view(blob: Any, name: str) -> memoryview:
    try:
        mv = memoryview(blob)
    except TypeError:
        raise TypeError(f"{name} must be bytes-like, got {type(blob).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{name} must be C-contiguous")
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv


class BlockHashes(Sequence[bytes]):
    """``len(self)`` hashes of ``hash_len`` bytes each, back to back in one buffer."""

    __slots__ = ("_blob", "_hash_len", "_n")

    def __init__(self, blob: Any, hash_len: int) -> None:
        if isinstance(hash_len, bool) or not isinstance(hash_len, int):
            raise TypeError(f"hash_len must be an int, got {type(hash_len).__name__}")
        mv = _byte_view(blob, "blob")
        if hash_len < 0 or (hash_len == 0 and mv.nbytes):
            raise ValueError(f"hash_len must be > 0 for a non-empty blob, got {hash_len}")
        if hash_len and mv.nbytes % hash_len:
            raise ValueError(f"blob length {mv.nbytes} is not a multiple of hash_len {hash_len}")
        self._blob = mv
        self._hash_len = hash_len
        self._n = mv.nbytes // hash_len if hash_len else 0

    @classmethod
    def from_blob(cls, blob: Any, hash_len: int) -> "BlockHashes":
        """Wrap ``blob`` (bytes, bytearray, memoryview, ...) without copying it."""
        return cls(blob, hash_len)

    @classmethod
    def from_list(cls, hashes: Sequence[Any]) -> "BlockHashes":
        """Join bytes-like hashes of equal length into one blob (one copy)."""
        if isinstance(hashes, (str, bytes, bytearray, memoryview)):
            raise TypeError("block_hashes must be a sequence of bytes-like hashes, not a single "
                            f"{type(hashes).__name__}")
        if not isinstance(hashes, (list, tuple)):
            try:
                hashes = list(hashes)  # any sequence or iterable, read once
            except TypeError:
                raise TypeError("block_hashes must be a sequence of bytes-like hashes, "
                                f"got {type(hashes).__name__}") from None
        # The common case, at C speed: bytes (or bytearray) hashes of one non-zero length.
        kinds = set(map(type, hashes))
        if kinds and kinds <= _FAST_TYPES:
            lens = set(map(len, hashes))
            if len(lens) == 1 and 0 not in lens:
                return cls(b"".join(hashes), lens.pop())
        views = []  # the general case, which also names the first bad hash
        hash_len = -1
        for i, h in enumerate(hashes):
            if not isinstance(h, _BYTES_LIKE):
                raise TypeError(f"block_hashes[{i}] must be bytes-like, got {type(h).__name__}")
            mv = _byte_view(h, f"block_hashes[{i}]")
            if hash_len < 0:
                hash_len = mv.nbytes
                if hash_len == 0:
                    raise ValueError("block_hashes[0] is empty")
            elif mv.nbytes != hash_len:
                raise ValueError(
                    f"block_hashes must all have one length: block_hashes[{i}] has {mv.nbytes} "
                    f"bytes, block_hashes[0] has {hash_len}"
                )
            views.append(mv)
        return cls(b"".join(views), max(hash_len, 0))

    @property
    def hash_len(self) -> int:
        """Bytes per hash."""
        return self._hash_len

    @property
    def blob(self) -> memoryview:
        """The underlying bytes (a read-only-or-not memoryview of format ``B``)."""
        return self._blob

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, i: int) -> bytes: ...
    @overload
    def __getitem__(self, i: slice) -> "BlockHashes": ...

    def __getitem__(self, i: Union[int, slice]) -> Any:
        if isinstance(i, slice):
            start, stop, step = i.indices(self._n)
            if step == 1:
                hl = self._hash_len
                return BlockHashes(self._blob[start * hl:max(start, stop) * hl], hl)
            return BlockHashes.from_list([self[j] for j in range(start, stop, step)]) if \
                len(range(start, stop, step)) else BlockHashes(b"", 0)
        n = self._n
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError("block hash index out of range")
        hl = self._hash_len
        return self._blob[i * hl:(i + 1) * hl].tobytes()

    def __iter__(self) -> Iterator[bytes]:
        hl = self._hash_len
        mv = self._blob
        for i in range(self._n):
            yield mv[i * hl:(i + 1) * hl].tobytes()

    def __repr__(self) -> str:
        return f"BlockHashes(n={self._n}, hash_len={self._hash_len})"


def as_block_hashes(block_hashes: Any) -> BlockHashes:
    """``block_hashes`` as a :class:`BlockHashes`: returned as is, or joined from a sequence."""
    if isinstance(block_hashes, BlockHashes):
        return block_hashes
    return BlockHashes.from_list(block_hashes)  # TypeError naming block_hashes for non-sequences
