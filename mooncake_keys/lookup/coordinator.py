"""The hybrid full-attention / sliding-window coordinator, on per-chunk presence arrays.

It answers the question vLLM's ``MooncakeStoreCoordinator`` answers: given which chunks of each
KV-cache group exist (in every namespace), how many leading tokens form a usable hit? Presence
is a bytes-like per group, one byte per chunk (1 present, 0 absent), chunk ``j`` covering tokens
``[j * block_size, (j + 1) * block_size)``.

Hashes within a request are assumed distinct (vLLM chains them, so they are): vLLM's pool keys
presence by (group, hash) while this coordinator keys it by (group, chunk).
"""

from __future__ import annotations

from functools import lru_cache
from typing import List, Optional, Sequence, Tuple, Union

from .specs import FullAttentionSpec, KVCacheGroup, KVCacheSpec, SlidingWindowSpec

Presence = Union[bytes, bytearray]  # one byte per chunk: 1 present, 0 absent

__all__ = ["Coordinator", "Presence"]

Mask = Optional[List[bool]]


def _align_down(n: int, bs: int, alignment: int) -> int:
    """Drop chunks from ``n`` until ``n * bs`` is a multiple of ``alignment`` (a multiple of bs)."""
    return n - n % (alignment // bs)


def full_attention_hit(p: Presence, max_length: int, bs: int, alignment: int, drop_eagle: bool) -> int:
    """Leading present chunks (at most ``max_length // bs``), less one with EAGLE, aligned down."""
    n = max_length // bs
    z = p.find(0, 0, n)
    hit = n if z < 0 else z
    if drop_eagle and hit:
        hit -= 1
    return _align_down(hit, bs, alignment)


def sliding_window_hit(
    p: Presence, max_length: int, bs: int, alignment: int, need: int, drop_eagle: bool
) -> int:
    """Chunks of a sliding-window hit: vLLM's right-to-left scan, jumping over runs.

    A hit ends with ``need`` present chunks whose right edge (one chunk further left with
    EAGLE) is ``alignment``-aligned; failing that, the run touching chunk 0 counts.
    """
    n = max_length // bs
    off = 0 if drop_eagle else 1
    per = alignment // bs
    i = n - 1
    length = 0
    found = False
    while i >= 0:
        if not p[i]:
            i = p.rfind(1, 0, i)
            if i < 0:
                break
        z = p.rfind(0, 0, i)  # the absent chunk below this run, or -1
        top = (i + off) // per * per - off  # highest aligned run end in (z, i], if any
        if top > z:
            run = top - z
            if run >= need:
                length = top + 1
                found = True
                break
            if z < 0:
                length = run
                break
        i = z
    if not found:
        length = _align_down(length, bs, alignment)
    if drop_eagle and length:
        length = _align_down(length - 1, bs, alignment)
    return length


class Coordinator:
    """Lookup masks and the longest usable hit for a list of KV-cache groups.

    Sizes are in tokens: ``scheduler_block_size`` is the alignment of hybrid hits (by default
    the lcm of the group block sizes).
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        scheduler_block_size: int,
        use_eagle: bool = False,
    ) -> None:
        self.groups: Tuple[KVCacheGroup, ...] = tuple(groups)
        self.scheduler_block_size = scheduler_block_size
        self.use_eagle = use_eagle
        # Flagged groups count as EAGLE groups; with use_eagle and none flagged, all do.
        flagged = {g for g, grp in enumerate(self.groups) if grp.is_eagle_group}
        if use_eagle and not flagged:
            flagged = set(range(len(self.groups)))
        self.eagle_group_ids = frozenset(flagged)
        # Attention groups: equal specs merge, full attention first (stable).
        merged: List[Tuple[KVCacheSpec, List[int]]] = []
        for g, grp in enumerate(self.groups):
            for spec, ids in merged:
                if spec == grp.spec:
                    ids.append(g)
                    break
            else:
                merged.append((grp.spec, [g]))
        merged.sort(key=lambda item: not isinstance(item[0], FullAttentionSpec))
        self.attention_groups: Tuple[Tuple[KVCacheSpec, Tuple[int, ...]], ...] = tuple(
            (spec, tuple(ids)) for spec, ids in merged
        )
        eagle_attn = {
            a for a, (_, ids) in enumerate(self.attention_groups) if self.eagle_group_ids & set(ids)
        }
        self.eagle_attention_indices = frozenset(eagle_attn)
        self._lookup_mask = lru_cache(maxsize=64)(self._compute_lookup_mask)

    # ----------------------------------------------------------------------------- masks
    def lookup_mask(self, token_len: int) -> Tuple[Mask, ...]:
        """Per group, which chunks a lookup of ``token_len`` tokens asks (None: all of them).

        Full attention asks every chunk; a sliding-window group only the ``need`` chunks before
        each lcm boundary (dense boundaries: the retention interval plays no part here).
        """
        if token_len % self.scheduler_block_size:
            raise ValueError(
                f"token_len ({token_len}) must be a multiple of the scheduler block size "
                f"({self.scheduler_block_size})"
            )
        return self._lookup_mask(token_len)

    def _compute_lookup_mask(self, token_len: int) -> Tuple[Mask, ...]:
        masks: List[Mask] = []
        for g, grp in enumerate(self.groups):
            spec = grp.spec
            if not isinstance(spec, SlidingWindowSpec):
                masks.append(None)
                continue
            eagle = g in self.eagle_group_ids
            need = spec.blocks_needed(eagle)
            shift = 1 if eagle else 0
            per = self.scheduler_block_size // spec.block_size
            if need >= per:
                masks.append(None)
                continue
            num_chunks = token_len // spec.block_size
            masks.append([i >= shift and (i - shift) % per >= per - need for i in range(num_chunks)])
        return tuple(masks)

    # ----------------------------------------------------------------------------- hits
    def _attention_presence(self, presence: Sequence[Presence], ids: Tuple[int, ...]) -> Presence:
        if len(ids) == 1:
            return presence[ids[0]]
        n = min(len(presence[g]) for g in ids)
        acc = int.from_bytes(presence[ids[0]][:n], "little")
        for g in ids[1:]:
            acc &= int.from_bytes(presence[g][:n], "little")
        return acc.to_bytes(n, "little")

    def _manager_hit(
        self, spec: KVCacheSpec, p: Presence, max_length: int, alignment: int, drop: bool
    ) -> int:
        bs = spec.block_size
        if len(p) < max_length // bs:  # chunks past the presence array are absent
            p = bytes(p) + bytes(max_length // bs - len(p))
        if isinstance(spec, SlidingWindowSpec):
            return sliding_window_hit(p, max_length, bs, alignment, spec.blocks_needed(drop), drop)
        return full_attention_hit(p, max_length, bs, alignment, drop)

    def find_longest_cache_hit(
        self, presence: Sequence[Presence], max_length: int, *, apply_eagle: bool = True
    ) -> int:
        """The longest hit in tokens (``<= max_length``) given per-group chunk presence."""
        eagle = self.eagle_attention_indices if apply_eagle else frozenset()
        attn = self.attention_groups
        if len(attn) == 1:
            spec, ids = attn[0]
            p = self._attention_presence(presence, ids)
            return self._manager_hit(spec, p, max_length, spec.block_size, 0 in eagle) * spec.block_size
        lcm_bs = self.scheduler_block_size
        simple = len(attn) == 2 and isinstance(attn[0][0], FullAttentionSpec)
        views = [self._attention_presence(presence, ids) for _, ids in attn]
        hit_length = max_length
        computed_full = set()
        verified = set()
        while True:
            cur = hit_length
            for idx, (spec, _ids) in enumerate(attn):
                bs = spec.block_size
                is_full = isinstance(spec, FullAttentionSpec)
                if is_full and idx in computed_full:
                    cur = cur // bs * bs
                    continue
                drop = idx in eagle and idx not in verified
                maxlen = min(cur + bs, max_length) if drop else cur
                new = self._manager_hit(spec, views[idx], maxlen, lcm_bs, drop) * bs
                if is_full:
                    computed_full.add(idx)
                if drop:
                    verified.add(idx)
                elif new < cur:
                    verified.clear()
                cur = new
            if cur >= hit_length:
                break
            hit_length = cur
            if simple:
                break
        return hit_length
