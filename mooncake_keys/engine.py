"""The lookup engine: block hashes in, hit length in tokens out, with one ``batch_is_exist``.

A lookup (vLLM's ``MooncakeStoreWorker.lookup``, PCP/DCP-correct as of vLLM #46855):

1. per group, the chunks to ask: those with a hash, below ``token_len``, allowed by the
   group's lookup mask, and not wholly below ``skip_tokens``;
2. one key per (group, chunk, namespace), ordered group -> chunk -> namespace;
3. one ``store.batch_is_exist(keys)``;
4. a chunk is present when every namespace answered exactly 1;
5. the coordinator turns per-group chunk presence into the longest usable hit.
"""

from __future__ import annotations

import logging
import threading
from array import array
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, List, Optional, Sequence, Tuple, Union

from . import _core
from ._keys import KeyMetadata, PoolKey, _check_str, key_head
from .coordinator import Coordinator, scheduler_block_size_for
from .hashes import BlockHashes, as_block_hashes
from .keycache import DEFAULT_KEY_CACHE_BYTES, KeyCache
from .layout import ParallelLayout
from .specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

__all__ = ["LookupEngine", "LookupStats"]

logger = logging.getLogger("mooncake_keys.engine")


def _int_arg(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def chunks_with_hash(block_size: int, hash_block_size: int, token_len: int, num_hashes: int) -> int:
    """Leading chunks of ``block_size`` tokens below ``token_len`` that have a chunk hash."""
    return min(token_len // block_size, num_hashes // (block_size // hash_block_size))


def chunk_hash_index(block_size: int, hash_block_size: int, chunks: Sequence[int]) -> array:
    """Index into the request's hashes of each chunk's hash: the last sub-hash of the chunk."""
    scale = block_size // hash_block_size
    return array("q", [j * scale + scale - 1 for j in chunks])


@dataclass(frozen=True)
class LookupStats:
    """Counters since the engine was made: lookups answered, store calls, keys sent, hit tokens."""

    lookups: int
    store_calls: int
    store_failures: int
    keys_sent: int
    hit_tokens: int


@dataclass(frozen=True)
class _GroupPlan:
    """What one lookup asks of one group (all counts in chunks of that group)."""

    num_chunks: int  # token_len // block_size: the length of the presence array
    asked: Union[range, array]  # chunk ids to ask, in order
    index: array  # hash index (into the request's hashes) of each asked chunk
    presumed: Union[range, array]  # chunk ids below skip_tokens, counted present


class LookupEngine:
    """Prefix-cache lookups for one deployment (model, KV-cache groups, rank layout).

    Sizes are in tokens: ``hash_block_size`` tokens per request hash, group block sizes per
    chunk, ``scheduler_block_size`` (default: lcm of the group block sizes) per aligned hit.
    ``store`` is anything with ``batch_is_exist(list[str]) -> list[int]``.
    ``key_cache_bytes`` bounds the cache of built keys (0 disables it).
    """

    def __init__(
        self,
        model_name: str,
        groups: Sequence[Union[KVCacheGroup, FullAttentionSpec, SlidingWindowSpec]],
        layout: ParallelLayout,
        *,
        hash_block_size: int,
        scheduler_block_size: Optional[int] = None,
        use_eagle: bool = False,
        cache_prefix: str = "",
        store: Any,
        key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES,
    ) -> None:
        _check_str("model_name", model_name)
        _check_str("cache_prefix", cache_prefix)
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        if not isinstance(use_eagle, bool):
            raise TypeError("use_eagle must be a bool")
        if not callable(getattr(store, "batch_is_exist", None)):
            raise TypeError("store must have a batch_is_exist(list[str]) -> list[int] method")
        if isinstance(groups, (KVCacheGroup, FullAttentionSpec, SlidingWindowSpec)):
            groups = [groups]
        grps: Tuple[KVCacheGroup, ...] = tuple(
            g if isinstance(g, KVCacheGroup) else KVCacheGroup(g) for g in groups
        )
        if not grps:
            raise ValueError("groups must hold at least one KV-cache group")
        hash_block_size = _int_arg("hash_block_size", hash_block_size)
        if hash_block_size <= 0:
            raise ValueError(f"hash_block_size must be > 0, got {hash_block_size}")
        for g, grp in enumerate(grps):
            if grp.spec.block_size % hash_block_size:
                raise ValueError(
                    f"groups[{g}] block_size ({grp.spec.block_size}) must be a multiple of "
                    f"hash_block_size ({hash_block_size})"
                )
        if scheduler_block_size is None:
            scheduler_block_size = scheduler_block_size_for(grps)
        scheduler_block_size = _int_arg("scheduler_block_size", scheduler_block_size)
        if scheduler_block_size <= 0:
            raise ValueError(f"scheduler_block_size must be > 0, got {scheduler_block_size}")
        for g, grp in enumerate(grps):
            if scheduler_block_size % grp.spec.block_size:
                raise ValueError(
                    f"scheduler_block_size ({scheduler_block_size}) must be a multiple of "
                    f"groups[{g}] block_size ({grp.spec.block_size})"
                )
        if len(grps) > 1 and (layout.pcp_size > 1 or layout.dcp_size > 1):
            raise ValueError("PCP/DCP > 1 supports a single KV-cache group only (as in vLLM)")

        self.model_name = model_name
        self.cache_prefix = cache_prefix
        self.layout = layout
        self.groups = grps
        self.hash_block_size = hash_block_size
        self.scheduler_block_size = scheduler_block_size
        self.store = store
        self.coordinator = Coordinator(grps, scheduler_block_size, hash_block_size, use_eagle)
        self.namespaces = layout.lookup_namespaces()
        #: Per group: the key prefix of every lookup namespace, in namespace order.
        self.prefixes: Tuple[Tuple[str, ...], ...] = tuple(
            tuple(
                PoolKey.build_prefix(
                    KeyMetadata(model_name, 0, 0, 0, 0, group_id=g, cache_prefix=cache_prefix),
                    tp_rank=tp, pcp_rank=pcp, dcp_rank=dcp, pp_rank=pp,
                )
                for tp, pcp, dcp, pp in self.namespaces
            )
            for g in range(len(grps))
        )
        self._heads = tuple(tuple(key_head(p) for p in ps) for ps in self.prefixes)
        self.key_cache = KeyCache(len(grps), key_cache_bytes)
        self._entry_sizes: dict = {}
        self._plan = lru_cache(maxsize=256)(self._compute_plan)
        self._chunk_tables: List[Any] = [None] * len(grps)
        self._spare: Optional[List[str]] = None
        self._stats_lock = threading.Lock()
        self._counts = [0, 0, 0, 0, 0]  # LookupStats fields, in order

    @property
    def keys_per_chunk(self) -> int:
        """R: namespaces a chunk must exist in."""
        return len(self.namespaces)

    # --------------------------------------------------------------------------- planning
    def _chunk_table(self, g: int, num_chunks: int) -> Tuple[Optional[array], array]:
        """Group ``g``'s lookup-mask positions (None: every chunk) and their hash indices,
        covering at least chunks ``< num_chunks``; grown by doubling, so a plan is slices."""
        table = self._chunk_tables[g]
        if table is not None and table[2] >= num_chunks:
            return table[0], table[1]
        bs = self.groups[g].spec.block_size
        cap = max(num_chunks, 2 * (table[2] if table else 0), 256)
        lcm_bs = self.scheduler_block_size
        token_len = -(-cap * bs // lcm_bs) * lcm_bs
        mask = self.coordinator.lookup_mask(token_len)[g]
        cap = token_len // bs
        positions = None if mask is None else array("q", [j for j in range(cap) if mask[j]])
        index = chunk_hash_index(bs, self.hash_block_size, range(cap) if positions is None else positions)
        self._chunk_tables[g] = (positions, index, cap)
        return positions, index

    def _compute_plan(self, token_len: int, num_hashes: int, skip_tokens: int) -> Tuple[_GroupPlan, ...]:
        plans = []
        for g, grp in enumerate(self.groups):
            bs = grp.spec.block_size
            num_chunks = token_len // bs
            have = chunks_with_hash(bs, self.hash_block_size, token_len, num_hashes)
            skip = min(skip_tokens // bs, have)  # chunks wholly below skip_tokens
            positions, index = self._chunk_table(g, num_chunks)
            if positions is None:
                plans.append(_GroupPlan(num_chunks, range(skip, have), index[skip:have], range(skip)))
                continue
            lo, hi = bisect_left(positions, skip), bisect_left(positions, have)
            plans.append(_GroupPlan(num_chunks, positions[lo:hi], index[lo:hi], positions[:lo]))
        return tuple(plans)

    def _prepare(
        self, token_len: int, block_hashes: Any, skip_tokens: int
    ) -> Optional[Tuple[BlockHashes, Tuple[_GroupPlan, ...]]]:
        token_len = _int_arg("token_len", token_len)
        skip_tokens = _int_arg("skip_tokens", skip_tokens)
        if skip_tokens < 0:
            raise ValueError(f"skip_tokens must be >= 0, got {skip_tokens}")
        hashes = as_block_hashes(block_hashes)
        if not len(hashes) or token_len <= 0:
            return None
        if token_len % self.scheduler_block_size:
            raise ValueError(
                f"token_len ({token_len}) must be a multiple of the scheduler block size "
                f"({self.scheduler_block_size})"
            )
        return hashes, self._plan(token_len, len(hashes), skip_tokens)

    def _build_keys(
        self, hashes: BlockHashes, plans: Tuple[_GroupPlan, ...], memo_key: Any = None
    ) -> List[str]:
        """The keys of a lookup, group -> chunk -> namespace."""
        cache = self.key_cache
        blob, hash_len = hashes.blob, hashes.hash_len
        repeat = False
        if memo_key is not None and cache.enabled:
            # The same request again (a waiting request, every scheduler step): reuse its keys.
            # Admission on second sight: a request seen once is not worth the memory.
            blob_bytes = blob.tobytes()
            memo_key = (memo_key, hash_len, len(hashes), blob_bytes[-hash_len:])
            keys = cache.request_get(memo_key, blob_bytes)
            if keys is not None:
                return keys
            repeat = cache.request_seen(memo_key)
        r = len(self.namespaces)
        total = r * sum(len(p.asked) for p in plans)
        keys = [None] * total  # type: ignore[list-item]
        if not total:
            return keys
        use_chunks = cache.enabled and r > 1  # one namespace: building beats looking up
        spare, self._spare = self._spare, None  # the last lookup's keys: strings to rewrite
        pos = 0
        key_bytes = 0
        for g, plan in enumerate(plans):
            if not plan.asked:
                continue
            if use_chunks:
                # First sight: reuse the cached prefix only; a repeat: cache every chunk.
                young, old = cache.dicts(g)
                pos, hits, added = _core.fill_keys(keys, pos, self._heads[g], blob, hash_len,
                                                   plan.index, young, old, repeat, spare)
                cache.record(len(plan.asked), hits, added, self._entry_bytes(g, hash_len))
            else:
                pos = _core.fill_keys(keys, pos, self._heads[g], blob, hash_len, plan.index,
                                      None, None, True, spare)[0]
            key_bytes += len(plan.asked) * self._entry_bytes(g, hash_len)
        if repeat:
            cache.request_put(memo_key, blob_bytes, keys, key_bytes)
        elif key_bytes <= cache.spare_budget:
            # Keep the strings: the next lookup rewrites those nobody else references by then
            # instead of the caller freeing them and the next lookup allocating (and
            # page-faulting) new ones. A private copy of the list: a caller or a store may keep
            # the one it was given, and then its strings are never touched.
            self._spare = list(keys)
        return keys

    def _entry_bytes(self, group: int, hash_len: int) -> int:
        size = self._entry_sizes.get((group, hash_len))
        if size is None:
            chars = max(len(h) for h in self._heads[group]) + 2 * hash_len
            size = KeyCache.entry_bytes(len(self._heads[group]), chars, hash_len)
            self._entry_sizes[(group, hash_len)] = size
        return size

    # --------------------------------------------------------------------------- public
    def candidate_keys(self, token_len: int, block_hashes: Any, *, skip_tokens: int = 0) -> List[str]:
        """The keys :meth:`lookup` sends, in order (group, then chunk, then namespace)."""
        prepared = self._prepare(token_len, block_hashes, skip_tokens)
        if prepared is None:
            return []
        return self._build_keys(*prepared, memo_key=(token_len, skip_tokens))

    def lookup(self, token_len: int, block_hashes: Any, *, skip_tokens: int = 0) -> int:
        """Hit length in tokens (0 .. ``token_len``) of the longest usable stored prefix.

        ``token_len`` must be a multiple of the scheduler block size; ``block_hashes`` are
        the request's hashes at ``hash_block_size`` granularity (a sequence of bytes-like, or
        a :class:`BlockHashes`). Chunks wholly below ``skip_tokens`` (tokens the engine holds
        locally) are not asked and count as present. A store fault answers 0, logged.
        """
        prepared = self._prepare(token_len, block_hashes, skip_tokens)
        if prepared is None:
            self._count(0, 0, 0)
            return 0
        hashes, plans = prepared
        keys = self._build_keys(hashes, plans, memo_key=(token_len, skip_tokens))
        flags: Any
        if keys:
            flags = self._ask(keys)
            if flags is None:
                self._count(len(keys), 1, 0)
                return 0
        elif not any(p.presumed for p in plans):
            self._count(0, 0, 0)
            return 0  # nothing to ask and nothing presumed: no hit (vLLM: no candidates)
        else:
            flags = b""
        presence = self._presence(plans, flags)
        hit = self.coordinator.find_longest_cache_hit(presence, token_len)
        self._count(len(keys), 0, hit)
        return hit

    def _count(self, keys: int, failed: int, hit: int) -> None:
        with self._stats_lock:
            c = self._counts
            c[0] += 1
            c[1] += 1 if keys else 0
            c[2] += failed
            c[3] += keys
            c[4] += hit

    def stats(self) -> LookupStats:
        """Counters since creation (see :class:`LookupStats`)."""
        with self._stats_lock:
            return LookupStats(*self._counts)

    def _ask(self, keys: List[str]) -> Optional[bytearray]:
        """One ``batch_is_exist``; per chunk 1 when all its namespaces answered 1; None on a fault."""
        try:
            results = self.store.batch_is_exist(keys)
        except Exception as exc:  # the scheduler must never crash on a store fault
            logger.warning("lookup answered 0: batch_is_exist of %d keys raised %s: %s",
                           len(keys), type(exc).__name__, exc)
            return None
        try:
            n = len(results)
        except TypeError:
            logger.warning("lookup answered 0: batch_is_exist returned %s, not a list",
                           type(results).__name__)
            return None
        if n != len(keys):
            logger.warning("lookup answered 0: batch_is_exist returned %d results for %d keys",
                           n, len(keys))
            return None
        return _core.reduce_presence(results, len(self.namespaces))

    @staticmethod
    def _presence(plans: Tuple[_GroupPlan, ...], flags: Any) -> List[bytearray]:
        presence = []
        off = 0
        for plan in plans:
            p = bytearray(plan.num_chunks)
            if isinstance(plan.presumed, range):
                p[: len(plan.presumed)] = b"\x01" * len(plan.presumed)
            else:
                for j in plan.presumed:
                    p[j] = 1
            n = len(plan.asked)
            if isinstance(plan.asked, range):
                p[plan.asked.start:plan.asked.stop] = flags[off:off + n]
            else:
                for j, f in zip(plan.asked, flags[off:off + n]):
                    p[j] = f
            off += n
            presence.append(p)
        return presence
