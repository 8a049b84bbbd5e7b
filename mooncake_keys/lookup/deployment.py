"""One deployment's lookup geometry: which chunks a lookup asks, under which keys, and how the
answers become a hit length.

A :class:`Deployment` is the model name, the KV-cache groups, the rank layout, the sizes
(tokens per request hash, per chunk of each group, per scheduler block) and the vLLM release
whose rules apply (:mod:`.contract`), checked once. It owns:

* the **store groups**: the prefix-cacheable groups, renumbered from 0 (what ``@group:<g>``
  and tail boundaries count);
* the **chunk-to-hash rule**: chunk ``j`` of a group of ``block_size`` tokens covers tokens
  ``[j * block_size, (j + 1) * block_size)`` and is keyed by the request hash at index
  ``j * scale + scale - 1`` (``scale = block_size // hash_block_size``, the chunk's last hash);
  with partial hash hits every hash unit is keyed by its own hash;
* the **namespaces** of each store group and their **key heads** (``keys.key_head``), which the
  core completes with hex;
* the **plan** of a lookup: per group, the chunks (or units) to ask and those presumed present,
  bounded by the hashes given whatever ``token_len`` is;
* the **hit length** and **tail boundaries** of a lookup's answers (the coordinator).

It is the one description of a deployment: the lookup engine and the KV pool are both built
from one (``LookupEngine.for_deployment``, ``KVPool.for_deployment``), so a pool writes the keys a
lookup asks by construction; neither reaches into the other.
"""

from __future__ import annotations

import re
from array import array
from bisect import bisect_left
from dataclasses import replace
from functools import lru_cache
from math import lcm
from types import ModuleType
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

from .._checks import MAX_TOKENS, bool_arg, int_arg, text_arg
from . import _core
from .contract import Contract, named
from .coordinator import Coordinator, Presence
from .hashes import BlockHashes
from .keys import KeyMetadata, PoolKey, key_head
from .layout import Namespace, ParallelLayout
from .specs import SPEC_KINDS, KVCacheGroup, KVCacheSpec, MambaSpec, SlidingWindowSpec

__all__ = ["Deployment", "DeploymentViews", "GroupPlan", "LookupPlan", "GroupLike", "Stride"]

GroupLike = Union[KVCacheGroup, KVCacheSpec]


# The plans are named tuples, not frozen dataclasses: a new request length builds one per
# lookup, and the frozen dataclasses' __init__ cost a short prompt's lookup 0.7 us of its ~20.
class GroupPlan(NamedTuple):
    """What one lookup asks of one store group, in chunks of that group (hash units with
    partial hash hits)."""

    num_chunks: int  # length of the group's presence array: span // block_size (or // unit)
    asked: Union[range, array]  # chunk ids to ask, in order
    index: array  # hash index (into the request's hashes) of each asked chunk
    presumed: Union[range, array]  # chunk ids below skip_tokens, counted present
    #: How the asked chunks of a lookup mask repeat (and the offset of ``asked`` in the
    #: group's mask positions), so that their answers land by a few strided slices; None: no
    #: mask, or one that does not repeat.
    stride: Optional[Tuple["Stride", int]] = None


class Stride(NamedTuple):
    """A lookup mask that repeats every ``period`` chunks (a sliding window's chunks before each
    scheduler-block boundary): from mask position ``first`` on, the ``len(residues)`` positions
    of each period are ``base + m * period + residues``."""

    period: int
    residues: Tuple[int, ...]
    first: int
    base: int

    @classmethod
    def of(cls, positions: array, period: int) -> Optional["Stride"]:
        """The repetition of ``positions`` (ascending chunk ids) from their second period on, or
        None (fewer than three periods, or none that repeats)."""
        if len(positions) < 3 or positions[-1] - positions[0] < 3 * period:
            return None
        base = (positions[0] // period + 1) * period  # the first period may be cut (EAGLE's shift)
        first = bisect_left(positions, base)
        residues = tuple(j - base for j in positions[first:bisect_left(positions, base + period)])
        k = len(residues)
        if not k or positions[first:] != array("q", (base + (t // k) * period + residues[t % k]
                                                     for t in range(len(positions) - first))):
            return None
        return cls(period, residues, first, base)

    def scatter(self, p: bytearray, asked: Sequence[int], lo: int, flags: Sequence[Any]) -> None:
        """``p[asked[t]] = flags[t]`` for every ``t < len(flags)``, where ``asked`` is the mask
        positions from ``lo`` on: whole periods by one strided slice per residue, the cut
        ends one by one."""
        n, k, period = len(flags), len(self.residues), self.period
        a = max(lo, self.first)
        a = min(self.first + -(-(a - self.first) // k) * k, lo + n)  # the first whole period
        for t in range(a - lo):
            p[asked[t]] = flags[t]
        rows = (lo + n - a) // k
        if rows:
            base, off = self.base + (a - self.first) // k * period, a - lo
            for t, r in enumerate(self.residues):
                p[base + r:base + r + rows * period:period] = flags[off + t:off + rows * k:k]
        for t in range(a - lo + rows * k, n):
            p[asked[t]] = flags[t]


class LookupPlan(NamedTuple):
    """The chunks of one lookup, per store group: ``token_len`` tokens (aligned) looked up, of
    which ``span`` have presence arrays.

    ``span`` is ``token_len`` bounded by the hashes given (plus one scheduler block): chunks
    past the hashes are absent (the coordinator reads past an array's end as absent), so the
    work of a lookup follows the hashes, never a ``token_len`` the caller made up.
    """

    span: int
    groups: Tuple[GroupPlan, ...]
    token_len: int
    #: Chunks asked (every group), and their keys (one per namespace): a one-shot lookup's call.
    chunks_asked: int
    num_keys: int
    #: Whether some chunk is presumed present (below ``skip_tokens``).
    presumes_any: bool

    def presence(self, flags: Sequence[Any]) -> List[bytearray]:
        """Per group, one byte per chunk: presumed chunks 1, asked chunks their flag (in the
        order asked, groups one after another), every other chunk 0."""
        presence = []
        off = 0
        for g, plan in enumerate(self.groups):
            n = len(plan.asked)
            presence.append(self.presence_of(g, flags[off:off + n]))
            off += n
        return presence

    def presence_of(self, g: int, flags: Sequence[Any]) -> bytearray:
        """Group ``g``'s presence per chunk given its first ``len(flags)`` asked chunks' flags
        (the rest absent)."""
        plan = self.groups[g]
        p = bytearray(plan.num_chunks)
        if isinstance(plan.presumed, range):
            p[: len(plan.presumed)] = b"\x01" * len(plan.presumed)
        else:
            for j in plan.presumed:
                p[j] = 1
        n = len(flags)
        if isinstance(plan.asked, range):
            p[plan.asked.start:plan.asked.start + n] = flags
        elif plan.stride is not None:
            plan.stride[0].scatter(p, plan.asked, plan.stride[1], flags)
        else:
            for j, f in zip(plan.asked, flags):
                p[j] = f
        return p


class DeploymentViews:
    """Read-only views of ``self.deployment``, for the classes built on one (the engine, the KV
    pool), each word with one meaning on both: sizes in tokens, ``groups`` every group as given,
    ``store_groups`` the prefix-cacheable ones (what the keys number)."""

    deployment: "Deployment"

    @property
    def layout(self) -> ParallelLayout:
        return self.deployment.layout

    @property
    def groups(self) -> Tuple[KVCacheGroup, ...]:
        """Every KV-cache group, as given (``use_mla`` resolved)."""
        return self.deployment.groups

    @property
    def store_groups(self) -> Tuple[KVCacheGroup, ...]:
        """The prefix-cacheable groups, in order: ``@group:<g>`` and tail boundaries count these
        (vLLM 0.33 drops the others from the keys)."""
        return self.deployment.store_groups

    @property
    def group_namespaces(self) -> Tuple[Tuple[Namespace, ...], ...]:
        """Per store group, every namespace a chunk must exist in (PCP outer, TP, PP inner)."""
        return self.deployment.group_namespaces

    @property
    def prefixes(self) -> Tuple[Tuple[str, ...], ...]:
        """Per store group, the key prefix of every namespace, in namespace order (vLLM's lookup
        key prefixes)."""
        return self.deployment.prefixes

    @property
    def model_name(self) -> str:
        return self.deployment.model_name

    @property
    def cache_prefix(self) -> str:
        return self.deployment.cache_prefix

    @property
    def vllm_compat(self) -> str:
        return self.deployment.contract.name

    @property
    def hash_block_size(self) -> int:
        """Tokens per request hash."""
        return self.deployment.hash_block_size

    @property
    def scheduler_block_size(self) -> int:
        """Tokens every hit (and, under vLLM 0.33, every lookup length) is a multiple of."""
        return self.deployment.scheduler_block_size

    @property
    def coordinator(self) -> Any:
        return self.deployment.coordinator


#: vLLM 0.33's store namespace: ``@store_<name>:<value>`` tags (``@store_tp:4@store_pp:1@...``).
_STORE_NAMESPACE = re.compile(r"(?:@store_[A-Za-z0-9_]+:[^@]+)*")
#: A model name that reads as such a tag.
_TAG_LIKE = re.compile(r"store_[A-Za-z0-9_]+:")
_OPT_IN = ("Pass allow_ambiguous_names=True only for an existing deployment whose keys already use "
           "such a name.")


def _contract_of(vllm_compat: Optional[str], contract: Optional[Contract]) -> Contract:
    """The contract ``vllm_compat`` names, or ``contract`` itself (not both)."""
    if contract is None:
        return named("vllm_compat", vllm_compat)
    if not isinstance(contract, Contract):
        raise TypeError(f"contract must be a Contract, got {type(contract).__name__}")
    if vllm_compat is not None:
        raise TypeError("give either vllm_compat or contract, not both")
    return contract


def _check_unambiguous(model_name: str, cache_prefix: str, store_namespace: str) -> None:
    """Refuse names that let two deployments' keys coincide, so ``cache_prefix`` isolates them.

    A key's head is ``[<cache_prefix>@]<model><store_namespace>``, split on ``@``. It reads back
    one way only when the prefix and model hold no ``@``, the namespace is nothing but vLLM's
    ``@store_<name>:<value>`` tags, and the model name does not read as such a tag. Otherwise
    model ``"a@m"`` without a prefix writes exactly the keys of model ``"m"`` with
    ``cache_prefix="a"``, and model ``"a"`` with ``store_namespace="@m"`` those too."""
    for name, value in (("model_name", model_name), ("cache_prefix", cache_prefix)):
        if "@" in value:
            raise ValueError(
                f"{name} {value!r} contains '@', the key grammar's separator: its keys could be "
                "another deployment's (model 'a@m' without a cache prefix writes the keys of model "
                f"'m' with cache_prefix 'a'), so cache_prefix would not isolate them. {_OPT_IN}"
            )
    if not _STORE_NAMESPACE.fullmatch(store_namespace):
        raise ValueError(
            f"store_namespace {store_namespace!r} is not vLLM's store namespace ('' or "
            "'@store_<name>:<value>' tags, e.g. '@store_tp:4@store_pp:1'): another text after the "
            f"model name could make one deployment's keys another's. {_OPT_IN}"
        )
    if _TAG_LIKE.match(model_name):
        raise ValueError(
            f"model_name {model_name!r} reads as a store namespace tag ('store_<name>:'): with a "
            "cache prefix its keys could be those of another model with a store namespace. "
            f"{_OPT_IN}"
        )


def _normalise_groups(groups: Any, layout: ParallelLayout) -> Tuple[KVCacheGroup, ...]:
    if isinstance(groups, (KVCacheGroup,) + SPEC_KINDS):
        groups = [groups]
    try:
        items = list(groups)
    except TypeError:
        raise TypeError(f"groups must be a sequence of KV-cache groups, got {type(groups).__name__}") from None
    grps = tuple(g if isinstance(g, KVCacheGroup) else KVCacheGroup(g) for g in items)
    if not grps:
        raise ValueError("groups must hold at least one KV-cache group")
    # A spec's unset use_mla is the layout's: specs then compare (and merge) as vLLM's do.
    return tuple(
        replace(g, spec=replace(g.spec, use_mla=layout.use_mla)) if g.spec.use_mla is None else g
        for g in grps
    )


class Deployment:
    """Model, KV-cache groups, rank layout and sizes of one deployment (sizes in tokens).

    ``hash_block_size`` tokens per request hash; each group's ``block_size`` tokens per chunk
    (a multiple of it); ``scheduler_block_size`` (default: lcm of every group's block size,
    dropped groups included, and a multiple of each) per aligned hit. ``vllm_compat`` names the
    vLLM release whose lookup is reproduced (``"0.25"`` ... ``"0.33"``; None: the newest, 0.33;
    the rows are ``mooncake_keys.vllm.contracts``); ``contract`` gives the rules of a release
    itself instead (any engine's :class:`~mooncake_keys.lookup.contract.Contract`, see
    :mod:`.contract`). ``store_namespace`` and ``partial_hash_hits`` are vLLM 0.33's. An ``@`` in ``model_name`` or ``cache_prefix`` is
    refused (keys of two deployments could collide) unless ``allow_ambiguous_names``: for an
    existing deployment whose keys already use such a name, and then ``cache_prefix`` does not
    isolate it. ``core`` pins the key-building core (``"c"``
    compiled, ``"py"`` pure Python; None: the active one, see ``mooncake_keys.ACCELERATED``).
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
        store_namespace: str = "",
        partial_hash_hits: bool = False,
        vllm_compat: Optional[str] = None,
        contract: Optional[Contract] = None,
        allow_ambiguous_names: bool = False,
        core: Optional[str] = None,
    ) -> None:
        self.contract: Contract = _contract_of(vllm_compat, contract)
        self.model_name = text_arg("model_name", model_name)
        self.cache_prefix = text_arg("cache_prefix", cache_prefix)
        self.store_namespace = text_arg("store_namespace", store_namespace)
        if not bool_arg("allow_ambiguous_names", allow_ambiguous_names):
            _check_unambiguous(self.model_name, self.cache_prefix, self.store_namespace)
        self.partial_hash_hits = bool_arg("partial_hash_hits", partial_hash_hits)
        if not isinstance(layout, ParallelLayout):
            raise TypeError(f"layout must be a ParallelLayout, got {type(layout).__name__}")
        bool_arg("use_eagle", use_eagle)
        self.core: ModuleType = _core.get_core(core)
        self.layout = layout
        #: Every group as given (``use_mla`` resolved); :attr:`store_groups` are the ones keyed.
        self.groups = _normalise_groups(groups, layout)
        self.hash_block_size = int_arg("hash_block_size", hash_block_size, min=1, max=MAX_TOKENS)
        if scheduler_block_size is None:
            scheduler_block_size = lcm(*(grp.spec.block_size for grp in self.groups))
        self.scheduler_block_size = int_arg("scheduler_block_size", scheduler_block_size, min=1, max=MAX_TOKENS)
        self._check_contract()
        self.store_groups: Tuple[KVCacheGroup, ...] = tuple(g for g in self.groups if g.prefix_cacheable)
        self._check_sizes()
        self.coordinator = Coordinator(
            self.store_groups, self.scheduler_block_size, use_eagle, contract=self.contract,
            hash_block_size=self.hash_block_size, partial_hash_hits=self.partial_hash_hits,
        )
        #: Per store group, the namespaces a chunk must exist in (PCP outer, TP, PP inner).
        self.group_namespaces: Tuple[Tuple[Namespace, ...], ...] = tuple(
            layout.lookup_namespaces(**self._namespace_rule(g)) for g in range(len(self.store_groups))
        )
        #: Per store group, the key prefix of each namespace (vLLM's lookup key prefixes).
        self.prefixes: Tuple[Tuple[str, ...], ...] = tuple(
            tuple(self.key_prefix(g, ns) for ns in nss) for g, nss in enumerate(self.group_namespaces)
        )
        #: The same as key heads: what the core completes with hex.
        self.heads: Tuple[Tuple[str, ...], ...] = tuple(
            tuple(key_head(p) for p in ps) for ps in self.prefixes
        )
        self._chunk_tables: List[Any] = [None] * len(self.store_groups)
        self.plan = lru_cache(maxsize=256)(self._plan)

    # ----------------------------------------------------------------------------- checks
    def _check_contract(self) -> None:
        """ValueError for what the contract's vLLM release does not have, or cannot look up."""
        c, layout = self.contract, self.layout
        release, named_as = c.release, f"({c.argument}={c.name!r})"
        if not c.dropped_groups and not all(g.prefix_cacheable for g in self.groups):
            raise ValueError(f"{release} has no prefix_cacheable=False groups {named_as}")
        if not c.store_namespaces and self.store_namespace:
            raise ValueError(f"{release} has no store_namespace {named_as}")
        if not c.partial_hash_hits and self.partial_hash_hits:
            raise ValueError(f"{release} has no partial hash hits {named_as}")
        stored = [g for g in self.groups if g.prefix_cacheable]
        if not stored:
            raise ValueError("groups must hold at least one prefix-cacheable KV-cache group")
        if len(stored) > 1 and (layout.pcp_size > 1 or (layout.dcp_size > 1 and not c.hybrid_dcp)):
            what = "PCP > 1" if c.hybrid_dcp else "PCP/DCP > 1"
            raise ValueError(f"{what} supports a single KV-cache group only (as in {release})")
        if self.partial_hash_hits and c.swa_rejects_partial_hits:
            for g in stored:
                if isinstance(g.spec, SlidingWindowSpec) and g.spec.block_size != self.hash_block_size:
                    raise ValueError(
                        f"{release} cannot look up partial hash hits with a sliding-window group whose "
                        f"block_size ({g.spec.block_size}) is not the hash_block_size "
                        f"({self.hash_block_size}): every lookup raises there"
                    )

    def _check_sizes(self) -> None:
        hbs, sbs = self.hash_block_size, self.scheduler_block_size
        for g, grp in enumerate(self.groups):
            if grp.prefix_cacheable and grp.spec.block_size % hbs:
                raise ValueError(
                    f"groups[{g}] block_size ({grp.spec.block_size}) must be a multiple of "
                    f"hash_block_size ({hbs})"
                )
            if sbs % grp.spec.block_size:
                raise ValueError(
                    f"scheduler_block_size ({sbs}) must be a multiple of groups[{g}] block_size "
                    f"({grp.spec.block_size})"
                )

    def _namespace_rule(self, group: int) -> Dict[str, Any]:
        """How store group ``group``'s namespaces are counted (``ParallelLayout`` keywords): by
        its own spec (MLA or not; a Mamba group one per rank) where the contract has per-group
        namespaces, else by the layout alone."""
        if not self.contract.per_group_namespaces:
            return {}
        spec = self.store_groups[group].spec
        return {"mla": spec.use_mla, "per_rank": isinstance(spec, MambaSpec)}

    # ----------------------------------------------------------------------------- keys
    def key_prefix(self, group: int, namespace: Namespace) -> str:
        """The prefix of the keys of store group ``group`` in ``namespace`` (up to ``@group:<g>``)."""
        tp, pcp, dcp, pp = namespace
        md = KeyMetadata(self.model_name, tp, pcp, dcp, pp, group_id=group, cache_prefix=self.cache_prefix,
                         store_namespace=self.store_namespace)
        return PoolKey.build_prefix(md)

    def key_head(self, group: int, namespace: Namespace) -> str:
        """What stands before the hex in the keys of store group ``group`` in ``namespace``."""
        return key_head(self.key_prefix(group, namespace))

    def writer(self, group: int, rank: Namespace) -> Tuple[Namespace, int]:
        """Where the rank at ``rank`` = (tp, pcp, dcp, pp) saves store group ``group``: its
        namespace, and the put step (ranks sharing the namespace stripe their puts)."""
        rule = self._namespace_rule(group)
        return self.layout.writer_namespace(*rank, **rule), self.layout.replication_factor(**rule)

    def fill_keys(self, out: List[Any], pos: int, heads: Tuple[str, ...], hashes: BlockHashes,
                  index: array) -> int:
        """Write the keys of the hashes at ``index`` (each under every head) into ``out[pos:]``."""
        return self.core.fill_keys(out, pos, heads, hashes.blob, hashes.hash_len, index)

    def reduce(self, results: list, r: int) -> Tuple[bytearray, int]:
        """Per chunk, 1 when all its ``r`` answers (one per namespace) are present; and how many
        answers are present (keys the store holds)."""
        return self.core.reduce_presence(results, r)

    # ----------------------------------------------------------------------------- chunks
    def _unit(self, group: int) -> int:
        """Tokens per entry of a group's plan: its block size, or the hash unit (partial hits)."""
        return self.hash_block_size if self.partial_hash_hits else self.store_groups[group].spec.block_size

    def chunks_with_hash(self, group: int, token_len: int, num_hashes: int) -> int:
        """Leading chunks (hash units with partial hits) of ``group`` below ``token_len`` that
        have a hash."""
        unit = self._unit(group)
        return min(token_len // unit, num_hashes // (unit // self.hash_block_size))

    def hash_index(self, group: int, chunks: Sequence[int]) -> array:
        """Index into the request's hashes of each chunk's hash: the last sub-hash of the chunk."""
        scale = self._unit(group) // self.hash_block_size
        return array("q", [j * scale + scale - 1 for j in chunks])

    def span(self, token_len: int, num_hashes: int) -> int:
        """``token_len`` bounded by the hashes: one scheduler block past the last hashed one."""
        sbs = self.scheduler_block_size
        covered = -(-num_hashes * self.hash_block_size // sbs) * sbs
        return min(token_len, covered + sbs)

    def _chunk_table(self, g: int, num_chunks: int) -> Tuple[Optional[array], array, Optional[Stride]]:
        """Group ``g``'s lookup-mask positions (None: every chunk), their hash indices and how
        the positions repeat, covering at least chunks ``< num_chunks``; grown by doubling, so
        a plan is slices."""
        table = self._chunk_tables[g]
        if table is not None and table[3] >= num_chunks:
            return table[0], table[1], table[2]
        unit = self._unit(g)
        sbs = self.scheduler_block_size
        cap = max(num_chunks, 2 * (table[3] if table else 0), 256)
        token_len = -(-cap * unit // sbs) * sbs
        mask = self.coordinator.lookup_mask(token_len)[g]
        cap = token_len // unit
        positions = None if mask is None else array("q", [j for j in range(cap) if mask[j]])
        index = self.hash_index(g, range(cap) if positions is None else positions)
        # A masked group's answers are put in place by strided slices: a Python loop per chunk
        # was most of a warm DeepSeek-V4 lookup (16,384 hashes of 4 tokens: 4,200 masked chunks).
        stride = None if positions is None else Stride.of(positions, sbs // unit)
        self._chunk_tables[g] = (positions, index, stride, cap)
        return positions, index, stride

    def _plan(self, token_len: int, num_hashes: int, skip_tokens: int) -> LookupPlan:
        """The chunks a lookup of ``token_len`` tokens (a multiple of the alignment) asks given
        ``num_hashes`` hashes; chunks wholly below ``skip_tokens`` are presumed."""
        span = self.span(token_len, num_hashes)
        plans = []
        chunks = keys = 0
        presumes = False
        for g, heads in enumerate(self.heads):
            unit = self._unit(g)
            num_chunks = span // unit
            have = self.chunks_with_hash(g, span, num_hashes)
            skip = min(skip_tokens // unit, have)  # chunks wholly below skip_tokens
            positions, index, stride = self._chunk_table(g, num_chunks)
            if positions is None:
                plan = GroupPlan(num_chunks, range(skip, have), index[skip:have], range(skip))
            else:
                lo, hi = bisect_left(positions, skip), bisect_left(positions, have)
                plan = GroupPlan(num_chunks, positions[lo:hi], index[lo:hi], positions[:lo],
                                 None if stride is None else (stride, lo))
            plans.append(plan)
            asked = len(plan.asked)
            chunks += asked
            keys += asked * len(heads)
            presumes = presumes or len(plan.presumed) > 0
        return LookupPlan(span, tuple(plans), token_len, chunks, keys, presumes)

    # ----------------------------------------------------------------------------- hits
    def hit_length(self, presence: Sequence[Presence], max_length: int, num_hashes: int, *,
                   apply_eagle: bool = True) -> int:
        """The longest usable hit in tokens (``<= max_length``) given the plan's per-group
        presence (per chunk, or per hash unit with partial hits) of a request of
        ``num_hashes`` hashes."""
        units = None
        if self.partial_hash_hits:
            units = presence
            presence = [
                u[scale - 1::scale]
                for u, scale in ((u, g.spec.block_size // self.hash_block_size) for u, g in zip(units, self.store_groups))
            ]
        return self.coordinator.longest_hit(
            presence, max_length, units=units, peek_limit=num_hashes * self.hash_block_size,
            apply_eagle=apply_eagle,
        )

    def tail_boundaries(self, hit: int, presence: Sequence[Presence], num_hashes: int) -> Tuple[Tuple[int, int], ...]:
        """Per store group, the token boundary whose hash keys the last chunk a load of ``hit``
        tokens reads (vLLM 0.33's tail key boundaries): ``hit`` itself, except with partial hits
        when the unit ending at ``hit`` is absent in a group: then the end of the first present
        unit after it within that group's block. Empty for a hit of 0."""
        if hit <= 0:
            return ()
        if not self.partial_hash_hits:
            return tuple((g, hit) for g in range(len(self.store_groups)))
        hbs = self.hash_block_size
        k = hit // hbs - 1
        out = []
        for g, (grp, units) in enumerate(zip(self.store_groups, presence)):
            boundary = hit
            if not (k < len(units) and units[k]):
                bs = grp.spec.block_size
                end = min((-(-hit // bs)) * bs // hbs, num_hashes, len(units))
                u = units.find(1, k + 1, end) if end > k + 1 else -1
                if u >= 0:
                    boundary = (u + 1) * hbs
            out.append((g, boundary))
        return tuple(out)

