"""vLLM's Mooncake store lookup, re-expressed in plain Python from vLLM 0.25.x's contract (key
grammar, namespaces, lookup masks, coordinator; docs/architecture.md, "The two contracts"), as
the yardsticks for mooncake_keys.

Two states of vLLM's ``MooncakeStoreWorker.lookup``:

* ``seed``: vLLM PR #46188 (state A) with the PCP/DCP namespaces of #46855 (state B): key
  prefixes built once per group, keys by concatenation ``prefix + "@" + gh[j].hex()``, one meta
  ``(g, bytes(gh[j]))`` per candidate chunk, an ``all()`` reduction over ``res[i*R:(i+1)*R]``.
* ``pre``: the code before #46188: per lookup, one ``dataclasses.replace`` of the group metadata
  per namespace, ``PoolKey(md, hex).to_string()`` per key, one meta per *key*, and a
  ``present_count`` dict reduction (count of 1s >= R). Namespaces are B's (PCP/DCP included),
  so that its keys can be compared with the others on every layout.

Both end in the same coordinator: ``find_longest_cache_hit`` over an ``ExternalCachedBlockPool``
(``get_cached_block(hash, group_ids)`` on the exists set), with its own chunk-hash view, lookup
masks, the full-attention and sliding-window block-list managers, the hybrid fixed-point loop and
EAGLE. Nothing here is copied from vLLM and nothing is imported from mooncake_keys: groups and
layouts are read by duck typing (``.spec``, ``.block_size``, ``.sliding_window``,
``.is_eagle_group``; ``tp_size``, ``pp_size``, ``pcp_size``, ``dcp_size``, ``num_kv_heads``,
``use_mla``), so mooncake_keys' ``KVCacheGroup`` / specs / ``ParallelLayout`` are accepted as is.

Input hashes are what vLLM's lookup server holds after #45969: a blob of equal-length hashes,
seen through :class:`BlobBlockHashes` (item i = a memoryview slice). A list of bytes works too.
This module imports only the standard library.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from dataclasses import dataclass
from math import gcd
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

__all__ = [
    "BlobBlockHashes",
    "ExternalCachedBlockPool",
    "MooncakeStoreCoordinator",
    "PreLookup",
    "SeedLookup",
    "chunk_hashes_for_block_size",
    "lookup_namespaces",
    "make_lookup",
    "pre_reduce",
    "seed_reduce",
]

logger = logging.getLogger(__name__)

Meta = Tuple[int, bytes]


# ------------------------------------------------------------------------------------ hashes
class BlobBlockHashes:
    """A lazy view of equal-length hashes back to back in one buffer (vLLM's wire form, #45969).

    Item i is ``memoryview(blob)[i*hash_len:(i+1)*hash_len]`` (``BlockHash`` is a NewType, so no
    wrapping happens at run time); ``.hex()`` and ``bytes()`` work on it as on bytes.
    """

    __slots__ = ("_mv", "_hash_len", "_n")

    def __init__(self, blob: Any, hash_len: int) -> None:
        self._mv = memoryview(blob).cast("B") if blob is not None else memoryview(b"")
        self._hash_len = hash_len
        self._n = len(self._mv) // hash_len if hash_len else 0

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._n))]
        if i < 0:
            i += self._n
        if not 0 <= i < self._n:
            raise IndexError("BlobBlockHashes index out of range")
        hl = self._hash_len
        return self._mv[i * hl:(i + 1) * hl]

    def __iter__(self):
        mv, hl = self._mv, self._hash_len
        for i in range(self._n):
            yield mv[i * hl:(i + 1) * hl]


class _CompactChunkHashList:
    """Chunk j of a group whose block is ``scale`` hash blocks = hashes[j*scale + scale - 1]."""

    __slots__ = ("_hashes", "_scale", "_n")

    def __init__(self, hashes: Sequence[Any], scale: int) -> None:
        self._hashes = hashes
        self._scale = scale
        self._n = len(hashes) // scale

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, j: Any) -> Any:
        if isinstance(j, slice):
            return [self[k] for k in range(*j.indices(self._n))]
        if j < 0:
            j += self._n
        if not 0 <= j < self._n:
            raise IndexError("chunk hash index out of range")
        return self._hashes[j * self._scale + self._scale - 1]

    def __iter__(self):
        hashes, s = self._hashes, self._scale
        for j in range(self._n):
            yield hashes[j * s + s - 1]


def chunk_hashes_for_block_size(hashes: Sequence[Any], hash_block_size: int, block_size: int) -> Any:
    """The group's chunk hashes: the input itself when sizes match, else the last sub-hash view."""
    if block_size == hash_block_size:
        return hashes
    assert block_size % hash_block_size == 0
    return _CompactChunkHashList(hashes, block_size // hash_block_size)


# ------------------------------------------------------------------------------------ specs
@dataclass(frozen=True)
class _FullSpec:
    block_size: int


@dataclass(frozen=True)
class _SlidingSpec:
    block_size: int
    sliding_window: int


@dataclass(frozen=True)
class _Group:
    spec: Any
    is_eagle_group: bool = False


def _as_group(obj: Any) -> _Group:
    spec = getattr(obj, "spec", obj)
    eagle = bool(getattr(obj, "is_eagle_group", False))
    sw = getattr(spec, "sliding_window", None)
    local = _FullSpec(spec.block_size) if sw is None else _SlidingSpec(spec.block_size, sw)
    return _Group(local, eagle)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------ pool
class KVCacheBlock:
    __slots__ = ("block_id",)

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id


class ExternalCachedBlockPool:
    """A BlockPool look-alike over the set of (group, hash bytes) found in every namespace."""

    def __init__(self, exists: Optional[Set[Meta]] = None) -> None:
        self.exists = exists
        self.null_block = KVCacheBlock(0)
        self._present = KVCacheBlock(1)

    def get_cached_block(self, block_hash: Any, kv_cache_group_ids: Sequence[int]) -> Optional[List[KVCacheBlock]]:
        if self.exists is None:
            return [self._present for _ in kv_cache_group_ids]
        key = bytes(block_hash)
        for g in kv_cache_group_ids:
            if (g, key) not in self.exists:
                return None
        return [self._present for _ in kv_cache_group_ids]


# ------------------------------------------------------------------------------------ managers
def _full_attention_hit(block_hashes, max_length, group_ids, pool, spec, use_eagle, alignment_tokens):
    """FullAttentionManager: leading cached blocks, less one with EAGLE, then aligned down."""
    computed = tuple([] for _ in group_ids)
    block_size = spec.block_size
    for block_hash in itertools.islice(block_hashes, max_length // block_size):
        cached = pool.get_cached_block(block_hash, group_ids)
        if not cached:
            break
        for lst, blk in zip(computed, cached):
            lst.append(blk)
    if use_eagle and computed[0]:
        for lst in computed:
            lst.pop()
    while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens != 0:
        for lst in computed:
            lst.pop()
    return computed


def _sliding_window_hit(block_hashes, max_length, group_ids, pool, spec, use_eagle, alignment_tokens):
    """SlidingWindowManager: right-to-left scan for ``need`` contiguous cached blocks ending aligned."""
    block_size = spec.block_size
    need = _cdiv(spec.sliding_window - 1, block_size) + (1 if use_eagle else 0)
    n = max_length // block_size
    computed = tuple([pool.null_block] * n for _ in group_ids)
    run = 0
    found = False
    for i in range(n - 1, -1, -1):
        cached = pool.get_cached_block(block_hashes[i], group_ids)
        if cached:
            if run == 0 and block_size != alignment_tokens:
                post = i if use_eagle else i + 1
                if post * block_size % alignment_tokens != 0:
                    continue  # cannot end an aligned hit
            for lst, blk in zip(computed, cached):
                lst[i] = blk
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run:]
                found = True
                break
        else:
            run = 0
    if not found:
        for lst in computed:
            del lst[run:]
        while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens != 0:
            for lst in computed:
                lst.pop()
    if use_eagle and computed[0]:
        for lst in computed:
            lst.pop()
        while block_size != alignment_tokens and len(computed[0]) * block_size % alignment_tokens != 0:
            for lst in computed:
                lst.pop()
    return computed


def _manager_for(spec: Any) -> Callable:
    return _sliding_window_hit if isinstance(spec, _SlidingSpec) else _full_attention_hit


# ------------------------------------------------------------------------------------ coordinator
class MooncakeStoreCoordinator:
    """Lookup masks and ``find_longest_cache_hit`` for a list of KV-cache groups."""

    def __init__(self, groups: Sequence[Any], scheduler_block_size: int, hash_block_size: int,
                 use_eagle: bool = False) -> None:
        self.groups = [_as_group(g) for g in groups]
        self.lcm_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.use_eagle = use_eagle
        for grp in self.groups:
            assert grp.spec.block_size % hash_block_size == 0
            assert scheduler_block_size % grp.spec.block_size == 0
        assert scheduler_block_size % hash_block_size == 0
        flagged = {g for g, grp in enumerate(self.groups) if grp.is_eagle_group}
        if use_eagle and not flagged:
            flagged = set(range(len(self.groups)))
        self.eagle_group_ids = flagged
        # Attention groups: equal specs merge; full attention first (stable sort).
        attn: List[Tuple[Any, List[int]]] = []
        for g, grp in enumerate(self.groups):
            for spec, ids in attn:
                if spec == grp.spec:
                    ids.append(g)
                    break
            else:
                attn.append((grp.spec, [g]))
        attn.sort(key=lambda item: not isinstance(item[0], _FullSpec))
        self.attention_groups = attn
        eagle_attn = {a for a, (_, ids) in enumerate(attn) if set(ids) & self.eagle_group_ids}
        if use_eagle and not eagle_attn:
            eagle_attn = set(range(len(attn)))
        self.eagle_attn_group_indices = eagle_attn

    def block_hashes_for_spec(self, block_hashes: Sequence[Any], spec: Any) -> Any:
        return chunk_hashes_for_block_size(block_hashes, self.hash_block_size, spec.block_size)

    def lookup_mask(self, aligned_token_len: int) -> Tuple[Optional[List[bool]], ...]:
        """Per group: None (every chunk) or, for sliding window, the chunks before each lcm boundary."""
        assert aligned_token_len % self.lcm_block_size == 0
        masks: List[Optional[List[bool]]] = []
        for g, grp in enumerate(self.groups):
            spec = grp.spec
            if not isinstance(spec, _SlidingSpec):
                masks.append(None)
                continue
            eagle = g in self.eagle_group_ids
            need = _cdiv(spec.sliding_window - 1, spec.block_size) + (1 if eagle else 0)
            shift = 1 if eagle else 0
            per = self.lcm_block_size // spec.block_size
            if need >= per:
                masks.append(None)
                continue
            masks.append([i >= shift and (i - shift) % per >= per - need
                          for i in range(aligned_token_len // spec.block_size)])
        return tuple(masks)

    def find_longest_cache_hit(self, block_hashes: Sequence[Any], max_length: int,
                               pool: ExternalCachedBlockPool, *, apply_eagle: bool = True):
        eagle = self.eagle_attn_group_indices if apply_eagle else set()
        attn = self.attention_groups
        if len(attn) == 1:
            spec, ids = attn[0]
            blocks = _manager_for(spec)(self.block_hashes_for_spec(block_hashes, spec), max_length, ids,
                                        pool, spec, 0 in eagle, spec.block_size)
            return blocks, len(blocks[0]) * spec.block_size
        lcm_bs = self.lcm_block_size
        simple = len(attn) == 2 and isinstance(attn[0][0], _FullSpec)
        hit_blocks: Dict[int, Any] = {}
        full_done: Set[int] = set()
        verified: Set[int] = set()
        hit_length = max_length
        while True:
            cur = hit_length
            for idx, (spec, ids) in enumerate(attn):
                bs = spec.block_size
                is_full = isinstance(spec, _FullSpec)
                if is_full and idx in full_done:
                    cur = cur // bs * bs
                    continue
                drop = idx in eagle and idx not in verified
                maxlen = min(cur + bs, max_length) if drop else cur
                blocks = _manager_for(spec)(self.block_hashes_for_spec(block_hashes, spec), maxlen, ids,
                                            pool, spec, drop, lcm_bs)
                hit_blocks[idx] = blocks
                new = len(blocks[0]) * bs
                if is_full:
                    full_done.add(idx)
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
        for idx in full_done:  # the full-attention blocks, cut to the final hit
            bs = attn[idx][0].block_size
            for lst in hit_blocks[idx]:
                del lst[hit_length // bs:]
        return hit_blocks, hit_length


# ------------------------------------------------------------------------------------ keys
@dataclass
class KeyMetadata:
    model_name: str
    tp_rank: int
    pcp_rank: int
    dcp_rank: int
    pp_rank: int
    group_id: int = 0
    cache_prefix: str = ""


def build_prefix(md: KeyMetadata, *, tp_rank: Optional[int] = None, pcp_rank: Optional[int] = None,
                 dcp_rank: Optional[int] = None, pp_rank: Optional[int] = None) -> str:
    """State A/B ``PoolKey.build_prefix``: plain concatenation, overrides fall back to ``md``."""
    tp = md.tp_rank if tp_rank is None else tp_rank
    pcp = md.pcp_rank if pcp_rank is None else pcp_rank
    dcp = md.dcp_rank if dcp_rank is None else dcp_rank
    pp = md.pp_rank if pp_rank is None else pp_rank
    head = md.cache_prefix + "@" if md.cache_prefix else ""
    return (head + md.model_name + "@tp_rank:" + str(tp) + "@pcp" + str(pcp) + "@dcp" + str(dcp)
            + "@pp_rank:" + str(pp) + "@group:" + str(md.group_id))


@dataclass(order=True)
class PoolKey:
    """PRE's pool key: the whole string from one f-string per key."""

    key_metadata: KeyMetadata
    chunk_hash: str

    def to_string(self) -> str:
        md = self.key_metadata
        head = f"{md.cache_prefix}@" if md.cache_prefix else ""
        return (f"{head}{md.model_name}@tp_rank:{md.tp_rank}@pcp{md.pcp_rank}@dcp{md.dcp_rank}"
                f"@pp_rank:{md.pp_rank}@group:{md.group_id}@{self.chunk_hash}")


def lookup_namespaces(layout: Any) -> List[Tuple[int, int, int, int]]:
    """State B namespaces (tp, pcp, dcp, pp): pcp outer, tp, pp inner; under DCP every tp rank."""
    tp_size, pp_size = layout.tp_size, layout.pp_size
    pcp_size = getattr(layout, "pcp_size", 1)
    dcp_size = getattr(layout, "dcp_size", 1)
    num_kv_head = 1 if getattr(layout, "use_mla", False) else layout.num_kv_heads
    if dcp_size > 1:
        return [(tp, pcp, tp % dcp_size, pp)
                for pcp in range(pcp_size) for tp in range(tp_size) for pp in range(pp_size)]
    return [(tp, pcp, 0, pp)
            for pcp in range(pcp_size) for tp in range(min(tp_size, num_kv_head)) for pp in range(pp_size)]


# ------------------------------------------------------------------------------------ reductions
def seed_reduce(res: Sequence[int], candidate_meta: Sequence[Meta], r: int) -> Set[Meta]:
    """A/B: candidate i is present iff all of ``res[i*r:(i+1)*r]`` are exactly 1."""
    exists: Set[Meta] = set()
    for i, meta in enumerate(candidate_meta):
        if all(x == 1 for x in res[i * r:(i + 1) * r]):
            exists.add(meta)
    return exists


def pre_reduce(res: Sequence[int], candidate_meta: Sequence[Meta], r: int) -> Set[Meta]:
    """PRE: one meta per key; (g, hash) present iff its count of 1s is >= max(1, r)."""
    if len(res) != len(candidate_meta):
        raise ValueError("batch_is_exist returned a result list of the wrong length")
    present_count: Dict[Meta, int] = {}
    for meta, x in zip(candidate_meta, res):
        if x == 1:
            present_count[meta] = present_count.get(meta, 0) + 1
    need = max(1, r)
    return {meta for meta, count in present_count.items() if count >= need}


# ------------------------------------------------------------------------------------ lookups
class _LookupBase:
    """What both states share: groups, metadata per group, namespaces, coordinator, store."""

    def __init__(self, model_name: str, groups: Sequence[Any], layout: Any, hash_block_size: int,
                 use_eagle: bool, store: Any, *, cache_prefix: str = "",
                 scheduler_block_size: Optional[int] = None) -> None:
        if not isinstance(groups, (list, tuple)):
            groups = [groups]
        self.groups = [_as_group(g) for g in groups]
        if scheduler_block_size is None:
            scheduler_block_size = 1
            for grp in self.groups:
                bs = grp.spec.block_size
                scheduler_block_size = scheduler_block_size * bs // gcd(scheduler_block_size, bs)
        self.hash_block_size = hash_block_size
        self.store = store
        self.coord = MooncakeStoreCoordinator(self.groups, scheduler_block_size, hash_block_size, use_eagle)
        self.namespaces = lookup_namespaces(layout)
        # The lookup-serving rank is global rank 0: its own namespace is all zeros.
        self.metadata = [KeyMetadata(model_name, 0, 0, 0, 0, group_id=g, cache_prefix=str(cache_prefix))
                         for g in range(len(self.groups))]
        self._lookup_expected_per_key = len(self.namespaces)

    def _build(self, token_len: int, block_hashes: Any) -> Tuple[List[str], List[Meta]]:
        raise NotImplementedError

    def candidate_keys(self, token_len: int, block_hashes: Any) -> List[str]:
        """The keys one lookup sends, in order (group, chunk, namespace)."""
        if not block_hashes or token_len <= 0:
            return []
        return self._build(token_len, block_hashes)[0]

    def _reduce(self, res: Sequence[int], meta: Sequence[Meta]) -> Set[Meta]:
        raise NotImplementedError

    def lookup(self, token_len: int, block_hashes: Any) -> int:
        """Hit length in tokens, as ``MooncakeStoreWorker.lookup``."""
        if not block_hashes or token_len <= 0:
            return 0
        keys, meta = self._build(token_len, block_hashes)
        if not keys:
            return 0
        try:
            res = self.store.batch_is_exist(keys)
        except Exception as exc:  # vLLM: logged, error metric, 0
            logger.warning("Remote connection failed in lookup: %s", exc)
            return 0
        exists = self._reduce(res, meta)
        _, hit = self.coord.find_longest_cache_hit(block_hashes, token_len, ExternalCachedBlockPool(exists))
        return hit

    __call__ = lookup


class SeedLookup(_LookupBase):
    """vLLM #46188 (A) with #46855's PCP/DCP namespaces (B)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # _init_lookup_key_prefixes: once per group, shared namespace list.
        self._lookup_key_prefixes = [
            tuple(build_prefix(md, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp)
                  for tp, pcp, dcp, pp in self.namespaces)
            for md in self.metadata
        ]

    def _build(self, token_len: int, block_hashes: Any) -> Tuple[List[str], List[Meta]]:
        lookup_masks = self.coord.lookup_mask(token_len)
        candidate_keys: List[str] = []
        candidate_meta: List[Meta] = []
        for g, prefixes in enumerate(self._lookup_key_prefixes):
            spec = self.groups[g].spec
            bs = spec.block_size
            gh = self.coord.block_hashes_for_spec(block_hashes, spec)
            mask = lookup_masks[g]
            for j, h in enumerate(gh):
                if j * bs >= token_len:
                    break
                if mask is not None and (j >= len(mask) or not mask[j]):
                    continue
                hx = h.hex()
                for prefix in prefixes:
                    candidate_keys.append(prefix + "@" + hx)
                candidate_meta.append((g, bytes(h)))
        return candidate_keys, candidate_meta

    def _reduce(self, res: Sequence[int], meta: Sequence[Meta]) -> Set[Meta]:
        return seed_reduce(res, meta, self._lookup_expected_per_key)


class PreLookup(_LookupBase):
    """Before #46188: metadata templates per lookup, ``PoolKey.to_string()`` per key."""

    def _build(self, token_len: int, block_hashes: Any) -> Tuple[List[str], List[Meta]]:
        lookup_masks = self.coord.lookup_mask(token_len)
        candidate_keys: List[str] = []
        candidate_meta: List[Meta] = []
        for g, md in enumerate(self.metadata):
            templates = [dataclasses.replace(md, tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp)
                         for tp, pcp, dcp, pp in self.namespaces]
            spec = self.groups[g].spec
            bs = spec.block_size
            gh = self.coord.block_hashes_for_spec(block_hashes, spec)
            mask = lookup_masks[g]
            for j, h in enumerate(gh):
                if j * bs >= token_len:
                    break
                if mask is not None and (j >= len(mask) or not mask[j]):
                    continue
                hx = h.hex()
                hb = bytes(h)
                for tmpl in templates:
                    candidate_keys.append(PoolKey(tmpl, hx).to_string())
                    candidate_meta.append((g, hb))
        return candidate_keys, candidate_meta

    def _reduce(self, res: Sequence[int], meta: Sequence[Meta]) -> Set[Meta]:
        return pre_reduce(res, meta, self._lookup_expected_per_key)


def make_lookup(model_name: str, groups: Sequence[Any], layout: Any, hash_block_size: int,
                use_eagle: bool, store: Any, *, state: str = "seed", cache_prefix: str = "",
                scheduler_block_size: Optional[int] = None) -> _LookupBase:
    """A lookup for ``state`` "seed" or "pre": call it as ``lookup(token_len, block_hashes) -> int``;
    ``.candidate_keys(token_len, block_hashes)`` gives the keys it would send."""
    cls = {"seed": SeedLookup, "pre": PreLookup}[state]
    return cls(model_name, groups, layout, hash_block_size, use_eagle, store,
               cache_prefix=cache_prefix, scheduler_block_size=scheduler_block_size)
