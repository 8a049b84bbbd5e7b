"""The hybrid full-attention / sliding-window coordinator, on per-chunk presence arrays.

It answers the question vLLM's ``MooncakeStoreCoordinator`` answers: given which chunks of each
KV-cache group exist (in every namespace), how many leading tokens form a usable hit? Presence
is a bytes-like per group, one byte per chunk (1 present, 0 absent), chunk ``j`` covering tokens
``[j * block_size, (j + 1) * block_size)``; chunks past the end of an array are absent. With
partial hash hits there is also one byte per hash unit (``units``), for the interior of the
first incomplete full-attention block.

Hashes within a request are assumed distinct (vLLM chains them, so they are): vLLM's pool keys
presence by (group, hash) while this coordinator keys it by (group, chunk). Where releases
differ, the :class:`~mooncake_keys.lookup.contract.Contract` decides.
"""

from __future__ import annotations

from functools import lru_cache
from math import gcd
from typing import List, Optional, Sequence, Tuple, Union

from .._checks import MAX_TOKENS, bool_arg, int_arg
from .contract import Contract
from .specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheGroup,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

Presence = Union[bytes, bytearray]  # one byte per chunk: 1 present, 0 absent

#: The most chunks (or hash units) of one group in a scheduler block. A lookup covers at most
#: one scheduler block past its last hash, so its work is O(hashes + this) per group; real
#: deployments are far below it (vLLM's lcm of block sizes over a hash block: tens to hundreds).
MAX_CHUNKS_PER_SCHEDULER_BLOCK = 1 << 16

__all__ = ["Coordinator", "Presence"]

Mask = Optional[List[bool]]


def _step(bs: int, alignment: int) -> int:
    """Chunks of ``bs`` tokens per aligned step: a length of k chunks is aligned iff k % step == 0."""
    return alignment // gcd(bs, alignment)


def full_attention_hit(p: Presence, max_length: int, bs: int, alignment: int, drop_eagle: bool,
                       units: Optional[Presence] = None) -> int:
    """Tokens of a full-attention hit: the leading present chunks (at most ``max_length // bs``);
    with ``units`` and an alignment finer than the block, extended to the last present hash unit
    inside the first incomplete block; less one block (one unit when finer) with EAGLE; aligned
    down."""
    n = max_length // bs
    z = p.find(0, 0, n)
    run = min(n, len(p)) if z < 0 else z  # past the array: absent
    hit = run * bs
    if units is not None and alignment < bs and bs % alignment == 0:
        per = bs // alignment
        first = run * per
        end = min(first + per - 1, max_length // alignment, len(units))
        u = units.rfind(1, first, end) if end > first else -1
        if u >= 0:
            hit = (u + 1) * alignment
    if drop_eagle and hit:
        hit -= min(alignment, bs)
    return hit - hit % alignment


def sliding_window_hit(p: Presence, max_length: int, bs: int, alignment: int, need: int,
                       drop_eagle: bool) -> int:
    """Tokens of a sliding-window hit: vLLM's right-to-left scan, jumping over runs.

    A hit ends with ``need`` present chunks whose right edge (one chunk further left with
    EAGLE) is ``alignment``-aligned; failing that, the run touching chunk 0 counts, aligned.
    """
    n = max_length // bs
    off = 0 if drop_eagle else 1
    per = _step(bs, alignment)
    i = min(n, len(p)) - 1  # past the array: absent
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
        length -= length % per
    if drop_eagle and length:
        length -= 1
        length -= length % per
    return length * bs


def chunked_local_hit(p: Presence, max_length: int, bs: int, chunk: int) -> int:
    """Tokens of a chunked-local-attention hit: the chunks before the attention chunk that holds
    token ``max_length`` count as present unread, then the present run from there (at most
    ``max_length // bs`` chunks). The caller guarantees the alignment is ``bs`` and no EAGLE drop
    (vLLM asserts both)."""
    n = max_length // bs
    start = (max_length // chunk * chunk) // bs if max_length > 0 else 0
    if start >= n:
        return n * bs
    z = p.find(0, start, n)
    if z < 0:
        z = min(n, max(start, len(p)))  # past the array: absent
    return z * bs


def mamba_hit(p: Presence, max_length: int, bs: int, alignment: int, units: Optional[Presence] = None) -> int:
    """Tokens of a Mamba (recurrent state) hit: the last present state at or below
    ``max_length`` whose end is ``alignment``-aligned (present states in between are skipped,
    absent ones do not stop the scan); with ``units`` and an alignment finer than the block, the
    last present hash unit. Never an EAGLE drop: a state is exact."""
    if units is not None and alignment < bs and bs % alignment == 0:
        u = units.rfind(1, 0, max_length // alignment)
        return (u + 1) * alignment if u >= 0 else 0
    step = _step(bs, alignment)  # chunk i ends aligned iff (i + 1) % step == 0
    top = max_length // bs  # chunks [0, top) may end the hit
    while top > 0:
        i = p.rfind(1, 0, top)
        if i < 0:
            return 0
        if (i + 1) % step == 0:
            return (i + 1) * bs
        top = (i + 1) // step * step  # the aligned chunk ends below i: chunks [0, top)
    return 0


def _and(arrays: Sequence[Presence]) -> Presence:
    """Presence in every array (the shortest length: past it, something is absent)."""
    if len(arrays) == 1:
        return arrays[0]
    n = min(map(len, arrays))
    acc = int.from_bytes(arrays[0][:n], "little")
    for a in arrays[1:]:
        acc &= int.from_bytes(a[:n], "little")
    return acc.to_bytes(n, "little")


class Coordinator:
    """Lookup masks and the longest usable hit for the store's KV-cache groups.

    Sizes are in tokens: ``scheduler_block_size`` aligns hybrid hits (and, under vLLM 0.33,
    single-group ones), ``hash_block_size`` is one hash unit. ``partial_hash_hits`` aligns every
    hit to the hash unit instead and turns the lookup masks off (vLLM 0.33).
    """

    def __init__(
        self,
        groups: Sequence[KVCacheGroup],
        scheduler_block_size: int,
        use_eagle: bool = False,
        *,
        contract: Contract,
        hash_block_size: int,
        partial_hash_hits: bool = False,
    ) -> None:
        self.groups: Tuple[KVCacheGroup, ...] = tuple(groups)
        if not self.groups or not all(isinstance(g, KVCacheGroup) for g in self.groups):
            raise TypeError("groups must be a non-empty sequence of KVCacheGroup")
        if not isinstance(contract, Contract):
            raise TypeError(f"contract must be a Contract, got {type(contract).__name__}")
        self.scheduler_block_size = int_arg("scheduler_block_size", scheduler_block_size, min=1, max=MAX_TOKENS)
        self.hash_block_size = int_arg("hash_block_size", hash_block_size, min=1, max=MAX_TOKENS)
        bool_arg("use_eagle", use_eagle)
        self.contract = contract
        self.partial_hash_hits = bool_arg("partial_hash_hits", partial_hash_hits)
        for g, grp in enumerate(self.groups):
            per = scheduler_block_size // (hash_block_size if partial_hash_hits else grp.spec.block_size)
            if per > MAX_CHUNKS_PER_SCHEDULER_BLOCK:
                raise ValueError(
                    f"scheduler_block_size ({scheduler_block_size} tokens; by default the lcm of the groups' "
                    f"block sizes) spans {per} chunks of store group {g}; at most "
                    f"{MAX_CHUNKS_PER_SCHEDULER_BLOCK} are supported: a lookup's lengths are scheduler "
                    "blocks, so its work would grow with this number, not with the hashes"
                )
        #: Every hit (and, under vLLM 0.33, every lookup length) is a multiple of this.
        self.alignment = hash_block_size if partial_hash_hits else scheduler_block_size
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
        # An attention group is EAGLE when a member is flagged; with use_eagle and none
        # flagged, all are.
        flagged = {g for g, grp in enumerate(self.groups) if grp.is_eagle_group}
        eagle_attn = {a for a, (_, ids) in enumerate(self.attention_groups) if flagged & set(ids)}
        if use_eagle and not eagle_attn:
            eagle_attn = set(range(len(self.attention_groups)))
            flagged = set(range(len(self.groups)))
        self.eagle_attention_indices = frozenset(eagle_attn)
        if contract.merged_eagle_masks:
            flagged = {g for a in eagle_attn for g in self.attention_groups[a][1]}
        #: Groups whose lookup mask allows for the EAGLE drop.
        self.eagle_group_ids = frozenset(flagged)
        self._lookup_mask = lru_cache(maxsize=64)(self._compute_lookup_mask)
        #: Whether more chunks present never shorten the hit (see :meth:`_hit_is_monotone`).
        self.hit_is_monotone = self._hit_is_monotone()
        self._check_chunked_local()

    def _check_chunked_local(self) -> None:
        """ValueError for a chunked-local-attention group vLLM cannot look up: every lookup of it
        would raise there (its finder asserts no EAGLE drop and a hit alignment of its block)."""
        attn = self.attention_groups
        for a, (spec, ids) in enumerate(attn):
            if not isinstance(spec, ChunkedLocalAttentionSpec):
                continue
            if a in self.eagle_attention_indices:
                raise ValueError(f"a chunked local attention group (groups {list(ids)}) cannot be an EAGLE group")
            single = len(attn) == 1 and not self.contract.single_group_scheduler_alignment
            alignment = spec.block_size if single else self.alignment
            if alignment != spec.block_size:
                raise ValueError(
                    f"a chunked local attention group (groups {list(ids)}, block_size {spec.block_size}) "
                    f"needs hits aligned to its block size, not {alignment} tokens (the scheduler block "
                    "size, or the hash block size with partial hash hits)"
                )

    def _hit_is_monotone(self) -> bool:
        """Whether, for every lookup, a chunk turning from absent to present never shortens
        the hit. Asking in rounds (:mod:`.rounds`) may stop early only where this holds.

        It holds without EAGLE: every manager's hit grows with its presence and its maximum
        length and never exceeds that length, so the fixed point of the hybrid loop, and the
        re-derivation of a full hit one alignment step lower, grow with presence. With EAGLE it
        holds for one attention group (one manager call), for a full-attention group followed
        by one other (one pass), and when every group is full attention (later passes only take
        minima). Otherwise a group verified in one pass is scanned again without the drop and
        with a shorter window after the hit falls, and the hit is no longer monotone: two
        sliding-window groups with EAGLE give 128 tokens on a store holding fewer chunks than
        one on which they give 0 (tests/test_rounds.py).
        """
        attn = self.attention_groups
        if not self.eagle_attention_indices or len(attn) == 1:
            return True
        if len(attn) == 2 and isinstance(attn[0][0], FullAttentionSpec):
            return True
        return all(isinstance(spec, FullAttentionSpec) for spec, _ in attn)

    # ----------------------------------------------------------------------------- masks
    def align(self, num_tokens: int) -> int:
        """``num_tokens`` floored to :attr:`alignment`."""
        return num_tokens - num_tokens % self.alignment

    def lookup_mask(self, token_len: int) -> Tuple[Mask, ...]:
        """Per group, which chunks a lookup of ``token_len`` tokens asks (None: all of them).

        Full attention asks every chunk; a sliding-window group only the ``need`` chunks before
        each scheduler-block boundary (dense boundaries: the retention interval plays no part
        here). With partial hash hits there is no mask.
        """
        if token_len % self.alignment:
            raise ValueError(
                f"token_len ({token_len}) must be a multiple of the scheduler block size "
                f"({self.alignment})"
            )
        return self._lookup_mask(token_len)

    def check_presence(self, presence: Sequence[Presence], max_length: int,
                       units: Optional[Sequence[Presence]] = None) -> None:
        """TypeError/ValueError for arguments of :meth:`longest_hit` it does not check itself:
        presence that is not one bytes-like per group, or a ``max_length`` (tokens) past the
        presence given by more than a scheduler block (the work of a hit grows with
        ``max_length``, and chunks past the presence count as absent). Presence built by a
        lookup plan (``Deployment.hit_length``) is valid by construction, and checking it would
        cost a lookup twice its hit; presence built otherwise is checked here first."""
        int_arg("max_length", max_length, min=0, max=MAX_TOKENS)
        for name, arrays in (("presence", presence), ("units", units)):
            if arrays is None:
                continue
            if len(arrays) != len(self.groups) or not all(isinstance(p, (bytes, bytearray)) for p in arrays):
                raise TypeError(f"{name} must hold one bytes or bytearray per group ({len(self.groups)})")
        for grp, p in zip(self.groups, presence):
            if max_length // grp.spec.block_size > len(p) + MAX_CHUNKS_PER_SCHEDULER_BLOCK:
                raise ValueError(f"max_length ({max_length} tokens) is far past the presence given "
                                 f"({len(p)} chunks of {grp.spec.block_size} tokens)")

    def _compute_lookup_mask(self, token_len: int) -> Tuple[Mask, ...]:
        masks: List[Mask] = []
        for g, grp in enumerate(self.groups):
            spec = grp.spec
            if self.partial_hash_hits or not isinstance(spec, SlidingWindowSpec):
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
    def _manager_hit(self, spec: KVCacheSpec, p: Presence, units: Optional[Presence], max_length: int,
                     alignment: int, drop: bool) -> int:
        """The hit of one attention group: vLLM's manager for its kind, on presence bytes."""
        bs = spec.block_size  # every hit function reads chunks past the array as absent
        if isinstance(spec, SlidingWindowSpec):
            return sliding_window_hit(p, max_length, bs, alignment, spec.blocks_needed(drop), drop)
        if isinstance(spec, MambaSpec):
            return mamba_hit(p, max_length, bs, alignment, units)
        if isinstance(spec, ChunkedLocalAttentionSpec):
            return chunked_local_hit(p, max_length, bs, spec.attention_chunk_size)
        return full_attention_hit(p, max_length, bs, alignment, drop, units)

    def _eagle_margin(self, spec: KVCacheSpec) -> Optional[int]:
        """How far (tokens) an EAGLE pass may look past the current hit; None: not at all (a
        Mamba group, whose finder never drops a block, where the contract says so)."""
        if isinstance(spec, MambaSpec) and not self.contract.mamba_eagle_margin:
            return None
        fine = self.partial_hash_hits and isinstance(spec, FullAttentionSpec)
        return self.hash_block_size if fine and spec.block_size > self.hash_block_size else spec.block_size

    def longest_hit(
        self,
        presence: Sequence[Presence],
        max_length: int,
        *,
        units: Optional[Sequence[Presence]] = None,
        peek_limit: Optional[int] = None,
        apply_eagle: bool = True,
    ) -> int:
        """The longest hit in tokens (``<= max_length``) given per-group chunk presence.

        ``units`` (partial hash hits): per group, presence per hash unit. ``peek_limit``: how
        far (tokens) an EAGLE group may look past the current hit under vLLM 0.33 (the end of
        the hashes); default ``max_length``. The presence is not checked (see
        :meth:`check_presence`).
        """
        eagle = self.eagle_attention_indices if apply_eagle else frozenset()
        attn = self.attention_groups
        views = [_and([presence[g] for g in ids]) for _, ids in attn]
        unit_views = [_and([units[g] for g in ids]) for _, ids in attn] if units is not None else [None] * len(attn)
        if len(attn) == 1:
            spec = attn[0][0]
            single = self.alignment if self.contract.single_group_scheduler_alignment else spec.block_size
            return self._manager_hit(spec, views[0], unit_views[0], max_length, single, 0 in eagle)
        caps = self.contract.full_hit_caps_later_passes
        peek = peek_limit if (self.contract.eagle_peek_to_hashes and peek_limit is not None) else max_length
        simple = len(attn) == 2 and isinstance(attn[0][0], FullAttentionSpec)
        hit_length = max_length
        hit_of: dict = {}  # attention group -> its last hit (tokens)
        verified: set = set()
        while True:
            cur = hit_length
            for idx, (spec, _ids) in enumerate(attn):
                is_full = isinstance(spec, FullAttentionSpec)
                if is_full and idx in hit_of:
                    cur = min(cur, hit_of[idx]) if caps else cur // spec.block_size * spec.block_size
                    continue
                drop = idx in eagle and idx not in verified
                margin = self._eagle_margin(spec) if drop else None
                maxlen = cur if margin is None else min(cur + margin, peek)
                new = self._manager_hit(spec, views[idx], unit_views[idx], maxlen, self.alignment, drop)
                if drop:
                    verified.add(idx)
                elif new < cur:
                    verified.clear()
                cur = hit_of[idx] = new
            if cur >= hit_length:
                break
            hit_length = cur
            if simple:
                break
        return hit_length
