"""Pure-Python core: key building and rank reduction (the twin of ``_core_c.pyx``).

Both modules expose the same two functions, which accept the same arguments and raise the same
errors (``tests/test_core_parity.py`` checks it). Neither knows a key grammar: they receive
each namespace's *key head* (everything before the hex, see ``keys.key_head``) and append the
lowercase hex of a hash to it, and, where a grammar puts something after the hash (SGLang's
``_<rank>_k``), that namespace's *key tail*. Neither holds any policy: what to build, what to
keep and what counts as an answer is decided by the callers.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

__all__ = ["REUSES_STRINGS", "fill_keys", "reduce_presence"]

#: Whether ``fill_keys`` rewrites in place the strings it finds in ``out`` (never in pure Python).
REUSES_STRINGS = False

_ONE_EQ = (1).__eq__  # True for an int (or int subclass) equal to 1; never runs user code


def _check_fill_args(out: Any, pos: Any, heads: Any, blob: Any, hash_len: Any,
                     index: Any, tails: Any = None) -> "tuple[memoryview, memoryview]":
    """The argument checks of ``fill_keys`` (the compiled core makes the same, in the same order)."""
    if type(out) is not list:
        raise TypeError(f"out must be a list, got {type(out).__name__}")
    if type(pos) is not int:
        raise TypeError(f"pos must be an int, got {type(pos).__name__}")
    if type(heads) is not tuple:
        raise TypeError(f"heads must be a tuple of str, got {type(heads).__name__}")
    for h in heads:
        if type(h) is not str:
            raise TypeError(f"heads must be a tuple of str, got an item of type {type(h).__name__}")
    if tails is not None:
        if type(tails) is not tuple:
            raise TypeError(f"tails must be None or a tuple of str, got {type(tails).__name__}")
        for t in tails:
            if type(t) is not str:
                raise TypeError(f"tails must be a tuple of str, got an item of type {type(t).__name__}")
        if len(tails) != len(heads):
            raise ValueError(f"tails must be as many as heads ({len(heads)}), got {len(tails)}")
    if type(hash_len) is not int:
        raise TypeError(f"hash_len must be an int, got {type(hash_len).__name__}")
    try:
        bv = memoryview(blob)
    except TypeError:
        raise TypeError(f"blob must be bytes-like, got {type(blob).__name__}") from None
    if not bv.c_contiguous:
        raise ValueError("blob must be C-contiguous")
    try:
        iv = memoryview(index)
    except TypeError:
        raise TypeError(f"index must be a buffer of int64 ('q'), got {type(index).__name__}") from None
    if iv.format != "q" or iv.ndim != 1 or not iv.c_contiguous:
        raise TypeError(f"index must be a 1-d contiguous buffer of int64 ('q'), got format {iv.format!r}")
    if hash_len <= 0:
        raise ValueError(f"hash_len must be > 0, got {hash_len}")
    if pos < 0 or pos + len(iv) * len(heads) > len(out):
        raise ValueError("out is too short for the keys to write")
    return bv, iv


def _index_out_of_range(lo: int, hi: int, hash_len: int, nbytes: int) -> "IndexError | None":
    """The error for hash indices ``lo`` (smallest) .. ``hi`` (largest) in a blob of ``nbytes``."""
    for i in (lo, hi):
        if i < 0 or (i + 1) * hash_len > nbytes:
            return IndexError(f"hash index {i} is outside the blob")
    return None


def fill_keys(
    out: list,
    pos: int,
    heads: "tuple[str, ...]",
    blob: Any,
    hash_len: int,
    index: Any,
    tails: "tuple[str, ...] | None" = None,
) -> int:
    """Write ``len(index) * len(heads)`` keys into ``out[pos:]``; return the position after them.

    ``blob`` holds equal-length hashes back to back (``hash_len`` bytes each); ``index`` (a
    buffer of int64, e.g. ``array('q')``) names the hashes (by position in the blob) to build
    keys for, in order. Keys are ordered hash first, then head: ``heads[j] + hex(hash)``, or
    ``heads[j] + hex(hash) + tails[j]`` when ``tails`` (as many as ``heads``) is given.
    Whatever ``out[pos:]`` held is replaced; the compiled core writes into a str found there
    that nothing else can see instead of allocating a new one (the result is the same).
    """
    bv, iv = _check_fill_args(out, pos, heads, blob, hash_len, index, tails)
    r = len(heads)
    n = len(iv)
    if n:
        err = _index_out_of_range(min(iv), max(iv), hash_len, bv.nbytes)
        if err is not None:
            raise err
    if not n or not r:
        return pos
    hexed = bv.hex()
    w = 2 * hash_len
    if tails is not None:
        pairs = tuple(zip(heads, tails))
        keys = [h + hx + t for hx in [hexed[i * w:i * w + w] for i in iv] for h, t in pairs]
    elif r == 1:
        h0 = heads[0]
        keys = [h0 + hexed[i * w:i * w + w] for i in iv]
    else:
        keys = [h + hx for hx in [hexed[i * w:i * w + w] for i in iv] for h in heads]
    end = pos + n * r
    out[pos:end] = keys
    return end


def _check_reduce_args(results: Any, r: Any) -> None:
    """The argument checks of ``reduce_presence``, shared by both cores."""
    if type(results) is not list:
        raise TypeError(f"results must be a list, got {type(results).__name__}")
    if type(r) is not int:
        raise TypeError(f"r must be an int, got {type(r).__name__}")
    if r <= 0:
        raise ValueError(f"r must be > 0, got {r}")


def reduce_presence(results: list, r: int) -> "tuple[bytearray, int]":
    """Flag ``i`` is 1 iff ``results[i*r : (i+1)*r]`` are all present, else 0; and how many
    items are present (the keys a store answered present: on Mooncake, the read leases taken).

    ``results`` must be a list whose length is a multiple of ``r``; an item is present when it
    is an ``int`` (bools included) equal to 1. No item's own ``__eq__`` is ever called.
    """
    _check_reduce_args(results, r)
    total = len(results)
    if total % r:
        raise ValueError(f"len(results) ({total}) is not a multiple of r ({r})")
    n = total // r
    flags = bytearray(map(operator.is_, map(_ONE_EQ, results), repeat(True)))
    present = flags.count(1)
    if r == 1:
        return flags, present
    acc = int.from_bytes(flags[0::r], "little")
    for j in range(1, r):
        acc &= int.from_bytes(flags[j::r], "little")
    return bytearray(acc.to_bytes(n, "little")), present
