"""Pure-Python core: key building and rank reduction (the twin of ``_core_c.pyx``).

Both modules expose the same two functions with the same signatures; ``_core`` picks one.
Neither knows the key grammar: they receive each namespace's *key head* (everything before
the hex, see ``_keys.key_head``) and append the lowercase hex of a hash to it.
"""

from __future__ import annotations

import operator
from itertools import repeat
from typing import Any, Optional, Sequence

__all__ = ["fill_keys", "reduce_presence"]


def fill_keys(
    out: list,
    pos: int,
    heads: Sequence[str],
    blob: Any,
    hash_len: int,
    index: Sequence[int],
    young: Optional[dict] = None,
    old: Optional[dict] = None,
    insert: bool = True,
    spare: Optional[list] = None,
) -> tuple:
    """Write ``len(index) * len(heads)`` keys into ``out[pos:]``; return ``(pos, hits, added)``.

    ``blob`` holds equal-length hashes back to back (``hash_len`` bytes each); ``index`` names
    the hashes (by position in the blob) to build keys for, in order. Keys are ordered hash
    first, then head. With ``young`` (a dict: hash bytes -> tuple of one hash's keys), cached
    tuples are reused and a hit in ``old`` is promoted into ``young``; built tuples are added to
    ``young`` when ``insert``, otherwise probing stops at the first miss (a cached prefix) and
    the rest is built without the cache. ``hits`` counts hashes served from the dicts,
    ``added`` the tuples put into ``young`` (built or promoted). ``spare`` holds the key
    strings of a previous lookup: the compiled core rewrites those nothing else references
    instead of allocating new ones (keys that are not cached); pure Python cannot, and ignores it.
    """
    heads = tuple(heads)
    r = len(heads)
    n = len(index)
    if n == 0 or r == 0:
        return pos, 0, 0
    if pos < 0 or pos + n * r > len(out):
        raise ValueError("out is too short for the keys to write")
    if hash_len <= 0:
        raise ValueError("hash_len must be > 0")
    nbytes = memoryview(blob).nbytes
    for hi in (min(index), max(index)):
        if hi < 0 or (hi + 1) * hash_len > nbytes:
            raise IndexError(f"hash index {hi} is outside the blob")
    hexed = bytes(blob).hex()
    w = 2 * hash_len
    end = pos + n * r
    hits = added = 0
    start = 0  # index positions before ``start`` were served by the cache
    keys: list = []
    if young is not None:
        mv = memoryview(blob)
        extend = keys.extend
        for c, i in enumerate(index):
            hb = bytes(mv[i * hash_len:(i + 1) * hash_len])
            entry = young.get(hb)
            if entry is None and old is not None:
                entry = old.get(hb)
                if entry is not None:
                    young[hb] = entry
                    added += 1
            if entry is None:
                if not insert:
                    break
                hx = hexed[i * w:i * w + w]
                entry = young[hb] = tuple([h + hx for h in heads])
                added += 1
            else:
                hits += 1
            extend(entry)
            start = c + 1
    rest = index[start:]
    if r == 1:
        h0 = heads[0]
        keys += [h0 + hexed[i * w:i * w + w] for i in rest]
    else:
        keys += [h + hx for hx in [hexed[i * w:i * w + w] for i in rest] for h in heads]
    out[pos:end] = keys
    return end, hits, added


def reduce_presence(results: Sequence[Any], r: int) -> bytearray:
    """Flag ``i`` is 1 iff ``results[i*r : (i+1)*r]`` are all exactly 1, else 0."""
    n = len(results) // r
    flags = bytearray(map(operator.eq, results, repeat(1)))
    if r == 1:
        return flags
    acc = int.from_bytes(flags[0::r], "little")
    for j in range(1, r):
        acc &= int.from_bytes(flags[j::r], "little")
    return bytearray(acc.to_bytes(n, "little"))
