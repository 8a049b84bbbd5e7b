"""One deployment's lookup geometry: which chunks a lookup asks, under which keys, and how the
answers become per-chunk presence.

A :class:`Deployment` is the model name, the KV-cache groups, the rank layout and the sizes
(tokens per request hash, per chunk of each group, per scheduler block), checked once. It owns:

* the **chunk-to-hash rule**: chunk ``j`` of a group of ``block_size`` tokens covers tokens
  ``[j * block_size, (j + 1) * block_size)`` and is keyed by the request hash at index
  ``j * scale + scale - 1`` (``scale = block_size // hash_block_size``, the chunk's last hash);
* the **key heads** of every namespace (``keys.key_head``), which the core completes with hex;
* the **plan** of a lookup: per group, the chunks to ask (lookup mask, hashes, ``skip_tokens``)
  and those presumed present, bounded by the hashes given whatever ``token_len`` is.

The lookup engine and the KV pool are both built on one; neither reaches into the other.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass
from functools import lru_cache
from math import lcm
from types import ModuleType
from typing import Any, List, Optional, Sequence, Tuple, Union

from .._checks import MAX_TOKENS, bool_arg, int_arg, str_arg
from . import _core
from .coordinator import Coordinator, Presence
from .hashes import BlockHashes
from .keys import KeyMetadata, PoolKey, key_head
from .layout import Namespace, ParallelLayout
from .specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

__all__ = ["Deployment", "GroupPlan", "LookupPlan", "GroupLike"]

GroupLike = Union[KVCacheGroup, FullAttentionSpec, SlidingWindowSpec]


@dataclass(frozen=True)
class GroupPlan:
    """What one lookup asks of one group (all counts in chunks of that group)."""

    num_chunks: int  # length of the group's presence array: span // block_size
    asked: Union[range, array]  # chunk ids to ask, in order
    index: array  # hash index (into the request's hashes) of each asked chunk
    presumed: Union[range, array]  # chunk ids below skip_tokens, counted present


@dataclass(frozen=True)
class LookupPlan:
    """The chunks of one lookup, per group, and ``span``: the tokens the coordinator looks at.

    ``span`` is ``token_len`` bounded by the hashes given (plus one scheduler block): chunks
    past the hashes are absent, so no hit can reach beyond them and the answer is the same.
    """

    span: int
    groups: Tuple[GroupPlan, ...]

    @property
    def chunks_asked(self) -> int:
        return sum(len(p.asked) for p in self.groups)

    @property
    def presumes_any(self) -> bool:
        return any(len(p.presumed) for p in self.groups)

    def presence(self, flags: Sequence[Any]) -> List[bytearray]:
        """Per group, one byte per chunk: presumed chunks 1, asked chunks their flag (in the
        order asked, groups one after another), every other chunk 0."""
        presence = []
        off = 0
        for plan in self.groups:
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


def _normalise_groups(groups: Any) -> Tuple[KVCacheGroup, ...]:
    if isinstance(groups, (KVCacheGroup, FullAttentionSpec, SlidingWindowSpec)):
        groups = [groups]
    try:
        items = list(groups)
    except TypeError:
        raise TypeError(f"groups must be a sequence of KV-cache groups, got {type(groups).__name__}") from None
    grps = tuple(g if isinstance(g, KVCacheGroup) else KVCacheGroup(g) for g in items)
    if not grps:
        raise ValueError("groups must hold at least one KV-cache group")
    return grps


class Deployment:
    """Model, KV-cache groups, rank layout and sizes of one deployment (sizes in tokens).

    ``hash_block_size`` tokens per request hash; each group's ``block_size`` tokens per chunk
    (a multiple of it); ``scheduler_block_size`` (default: lcm of the group block sizes, and a
    multiple of each) per aligned hit. ``core`` pins the key-building core (``"c"`` compiled,
    ``"py"`` pure Python; None: the active one, see ``mooncake_keys.ACCELERATED``).
    """

    def __init__(
        self,
        model_name: str,
        groups: Sequence[GroupLike],
        layout: ParallelLayout,
        *,
        hash_block_size: int,
        scheduler_block_size: Optional[int] = None,
        use_eagle: bool = False,
        cache_prefix: str = "",
        core: Optional[str] = None,
    ) -> None:
        self.model_name = str_arg("model_name", model_name)
        self.cache_prefix = str_arg("cache_prefix", cache_prefix)
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        bool_arg("use_eagle", use_eagle)
        self.core: ModuleType = _core.get_core(core)
        self.layout = layout
        self.groups = _normalise_groups(groups)
        self.hash_block_size = int_arg("hash_block_size", hash_block_size, min=1, max=MAX_TOKENS)
        for g, grp in enumerate(self.groups):
            if grp.spec.block_size % self.hash_block_size:
                raise ValueError(
                    f"groups[{g}] block_size ({grp.spec.block_size}) must be a multiple of "
                    f"hash_block_size ({self.hash_block_size})"
                )
        if scheduler_block_size is None:
            scheduler_block_size = lcm(*(grp.spec.block_size for grp in self.groups))
        self.scheduler_block_size = int_arg("scheduler_block_size", scheduler_block_size, min=1, max=MAX_TOKENS)
        for g, grp in enumerate(self.groups):
            if self.scheduler_block_size % grp.spec.block_size:
                raise ValueError(
                    f"scheduler_block_size ({self.scheduler_block_size}) must be a multiple of "
                    f"groups[{g}] block_size ({grp.spec.block_size})"
                )
        if len(self.groups) > 1 and (layout.pcp_size > 1 or layout.dcp_size > 1):
            raise ValueError("PCP/DCP > 1 supports a single KV-cache group only (as in vLLM)")
        self.coordinator = Coordinator(self.groups, self.scheduler_block_size, use_eagle)
        #: Every namespace a lookup asks, in order (PCP outer, TP, PP inner).
        self.namespaces: Tuple[Namespace, ...] = layout.lookup_namespaces()
        #: Per group, the key prefix of each lookup namespace (vLLM's lookup key prefixes).
        self.lookup_prefixes: Tuple[Tuple[str, ...], ...] = tuple(
            tuple(self.key_prefix(g, ns) for ns in self.namespaces) for g in range(len(self.groups))
        )
        #: The same as key heads: what the core completes with hex.
        self.lookup_heads: Tuple[Tuple[str, ...], ...] = tuple(
            tuple(key_head(p) for p in ps) for ps in self.lookup_prefixes
        )
        self._chunk_tables: List[Any] = [None] * len(self.groups)
        self.plan = lru_cache(maxsize=256)(self._plan)

    # ----------------------------------------------------------------------------- keys
    def key_prefix(self, group: int, namespace: Namespace) -> str:
        """The prefix of the keys of ``group`` in ``namespace`` (up to ``@group:<g>``)."""
        tp, pcp, dcp, pp = namespace
        md = KeyMetadata(self.model_name, tp, pcp, dcp, pp, group_id=group, cache_prefix=self.cache_prefix)
        return PoolKey.build_prefix(md)

    def key_head(self, group: int, namespace: Namespace) -> str:
        """What stands before the hex in the keys of ``group`` in ``namespace``."""
        return key_head(self.key_prefix(group, namespace))

    def fill_keys(self, out: List[Any], pos: int, heads: Tuple[str, ...], hashes: BlockHashes,
                  index: array, spare: Optional[list] = None) -> int:
        """Write the keys of the hashes at ``index`` (each under every head) into ``out[pos:]``."""
        return self.core.fill_keys(out, pos, heads, hashes.blob, hashes.hash_len, index, spare)

    def reduce(self, results: list, r: int) -> bytearray:
        """Per chunk, 1 when all its ``r`` answers (one per namespace) are present."""
        return self.core.reduce_presence(results, r)

    # ----------------------------------------------------------------------------- chunks
    def chunks_with_hash(self, group: int, token_len: int, num_hashes: int) -> int:
        """Leading chunks of ``group`` below ``token_len`` that have a chunk hash."""
        bs = self.groups[group].spec.block_size
        return min(token_len // bs, num_hashes // (bs // self.hash_block_size))

    def hash_index(self, group: int, chunks: Sequence[int]) -> array:
        """Index into the request's hashes of each chunk's hash: the last sub-hash of the chunk."""
        scale = self.groups[group].spec.block_size // self.hash_block_size
        return array("q", [j * scale + scale - 1 for j in chunks])

    def span(self, token_len: int, num_hashes: int) -> int:
        """``token_len`` bounded by the hashes: one scheduler block past the last hashed one."""
        sbs = self.scheduler_block_size
        covered = -(-num_hashes * self.hash_block_size // sbs) * sbs
        return min(token_len, covered + sbs)

    def _chunk_table(self, g: int, num_chunks: int) -> Tuple[Optional[array], array]:
        """Group ``g``'s lookup-mask positions (None: every chunk) and their hash indices,
        covering at least chunks ``< num_chunks``; grown by doubling, so a plan is slices."""
        table = self._chunk_tables[g]
        if table is not None and table[2] >= num_chunks:
            return table[0], table[1]
        bs = self.groups[g].spec.block_size
        sbs = self.scheduler_block_size
        cap = max(num_chunks, 2 * (table[2] if table else 0), 256)
        token_len = -(-cap * bs // sbs) * sbs
        mask = self.coordinator.lookup_mask(token_len)[g]
        cap = token_len // bs
        positions = None if mask is None else array("q", [j for j in range(cap) if mask[j]])
        index = self.hash_index(g, range(cap) if positions is None else positions)
        self._chunk_tables[g] = (positions, index, cap)
        return positions, index

    def _plan(self, token_len: int, num_hashes: int, skip_tokens: int) -> LookupPlan:
        """The chunks a lookup of ``token_len`` tokens (a multiple of the scheduler block size)
        asks given ``num_hashes`` hashes; chunks wholly below ``skip_tokens`` are presumed."""
        span = self.span(token_len, num_hashes)
        plans = []
        for g, grp in enumerate(self.groups):
            bs = grp.spec.block_size
            num_chunks = span // bs
            have = self.chunks_with_hash(g, span, num_hashes)
            skip = min(skip_tokens // bs, have)  # chunks wholly below skip_tokens
            positions, index = self._chunk_table(g, num_chunks)
            if positions is None:
                plans.append(GroupPlan(num_chunks, range(skip, have), index[skip:have], range(skip)))
                continue
            lo, hi = bisect_left(positions, skip), bisect_left(positions, have)
            plans.append(GroupPlan(num_chunks, positions[lo:hi], index[lo:hi], positions[:lo]))
        return LookupPlan(span, tuple(plans))

    # ----------------------------------------------------------------------------- hits
    def hit_length(self, presence: Sequence[Presence], span: int, *, apply_eagle: bool = True) -> int:
        """The longest usable hit in tokens given per-group chunk presence (the coordinator)."""
        return self.coordinator.find_longest_cache_hit(presence, span, apply_eagle=apply_eagle)
