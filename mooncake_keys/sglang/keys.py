"""SGLang's HiCache + Mooncake key grammar, and the only place that knows it.

An object key names one object of one page (``page_size`` tokens) of one pool, as SGLang's
``MooncakeStore`` writes and asks it (SGLang 0.5.23)::

    key    = [<prefix> "_"] <page hash> <suffix>
    prefix = "_".join([tag] + [model name, "/" -> "-"]
                      + ["tp{T}_dcp{D}_page{P}_pp{S}_cp{C}" when DCP > 1])

``<page hash>`` is the page's hex digest as SGLang hands it over (64 lowercase hex characters);
the prefix is left out when it has no part. The suffix follows the hash (so a key is
``head + hex + tail``: :attr:`RankKeys.head`, then one tail per object):

* KV, MHA: ``_{r}_k``, ``_{r}_v`` with ``r`` = ``{tp}`` (``{tp}_{pp}`` with PP > 1); with split
  heads, one pair per target rank ``tp * s .. tp * s + s - 1`` (``s = tp_lcm_size / tp_size``).
* KV, MLA: ``_{m}_k`` with ``m`` = ``""`` (hence ``__k``), ``{pp}`` with PP > 1, or
  ``dcp{d}_cp{c}[_{pp}]`` with DCP > 1.
* Mamba sidecar: ``_{r}_temporal`` (dropped when the state has no elements), then
  ``_{r}_conv_{i}`` per conv state, always with the MHA rank part, even beside MLA KV.
* SWA sidecar: MHA ``_{r}_swa_k``, ``_{r}_swa_v``; MLA ``_{m}_swa``.
* The direct linker (no host tier): one packed object per page and pool, ``_{l}_k`` for KV and
  ``_{l}_{pool}`` for the others, with ``l`` = ``tp{tp}_cp{cp}_pp{pp}`` (``cp{cp}_pp{pp}`` when
  the pools are rank-replicated); it keys pages on the model path, not the served name.

``dp_rank`` is in no key: attention-DP groups share objects. Every other pool kind (draft,
indexer, DeepSeek-V4's) is not described here; a lookup that meets one keeps SGLang's own.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .._checks import bool_arg, int_arg, text_arg

__all__ = ["RankKeys", "SidecarPool", "MAMBA", "SWA", "storage_model_name"]

#: The pool names of the sidecars described here (SGLang's ``PoolName`` values).
MAMBA, SWA = "mamba", "swa"


def storage_model_name(model_name: Optional[str], format_tag: Optional[str]) -> Optional[str]:
    """The model name SGLang keys pages on: the served model name, tagged with the host pool's
    page format when it has one of its own (``<name>-<tag>``, or the tag alone)."""
    if format_tag is None:
        return model_name
    return f"{model_name}-{format_tag}" if model_name else format_tag


@dataclass(frozen=True)
class SidecarPool:
    """The objects one page of a sidecar pool is stored as (what its suffixes depend on).

    ``name``: ``"mamba"`` or ``"swa"``. Mamba: ``conv_states`` conv objects, and a temporal
    (SSM) state object unless ``temporal`` is False (a conv-only model). SWA: ``kv_pair`` when
    the pool mirrors a K/V pool (an MHA model); MLA models store one object.
    """

    name: str
    conv_states: int = 0
    temporal: bool = True
    kv_pair: bool = True

    def __post_init__(self) -> None:
        text_arg("name", self.name)
        if self.name not in (MAMBA, SWA):
            raise ValueError(f"name must be {MAMBA!r} or {SWA!r}, got {self.name!r}")
        int_arg("conv_states", self.conv_states, min=0)
        bool_arg("temporal", self.temporal)
        bool_arg("kv_pair", self.kv_pair)

    @classmethod
    def mamba(cls, conv_states: int, temporal: bool = True) -> "SidecarPool":
        return cls(MAMBA, conv_states=conv_states, temporal=temporal)

    @classmethod
    def swa(cls, kv_pair: bool = True) -> "SidecarPool":
        return cls(SWA, kv_pair=kv_pair)


@dataclass(frozen=True)
class RankKeys:
    """Where one rank's HiCache objects live in the key space: the parts of SGLang's
    ``HiCacheStorageConfig`` (and of the backend's extra config) its keys are built from.

    ``model_name``: the storage model name (:func:`storage_model_name`; the model path for the
    direct linker), or None. ``tag``: ``extra_backend_tag`` as text, or None. Ranks and sizes:
    TP (the attention TP group's under DP attention), PP, attention CP, DCP. ``page_size``
    (tokens): the logical page size, which DCP keys carry. ``mla``: the pools are
    rank-replicated (MLA, DeepSeek-V4). ``split``: MHA split heads, ``tp_lcm_size // tp_size``
    target ranks per rank (1: none). ``linker``: the direct linker's keys.
    """

    model_name: Optional[str] = None
    tag: Optional[str] = None
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1
    page_size: Optional[int] = None
    mla: bool = False
    split: int = 1
    linker: bool = False

    def __post_init__(self) -> None:
        for name in ("model_name", "tag"):
            if getattr(self, name) is not None:
                text_arg(name, getattr(self, name))
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("cp_rank", "cp_size"),
                           ("dcp_rank", "dcp_size")):
            n = int_arg(size, getattr(self, size), min=1)
            int_arg(rank, getattr(self, rank), min=0, max=n - 1)
        bool_arg("mla", self.mla)
        bool_arg("linker", self.linker)
        int_arg("split", self.split, min=1)
        if self.page_size is not None:
            int_arg("page_size", self.page_size, min=1)
        if self.split > 1 and (self.mla or self.linker):
            raise ValueError("split heads (split > 1) are MHA HiCache keys only")
        if self.dcp_size > 1:  # SGLang's HiCacheStorageConfig checks
            if not self.mla or self.linker:
                raise ValueError("DCP storage keys (dcp_size > 1) require mla=True")
            if self.tp_size % self.dcp_size or self.tp_rank % self.dcp_size != self.dcp_rank:
                raise ValueError("DCP storage requires contiguous DCP groups within TP "
                                 "(tp_size % dcp_size == 0, tp_rank % dcp_size == dcp_rank)")
            if self.page_size is None or self.page_size % self.dcp_size:
                raise ValueError("DCP storage requires a page_size that is a multiple of dcp_size")

    # ------------------------------------------------------------------ the prefix
    @property
    def prefix(self) -> Optional[str]:
        """SGLang's ``config_prefix``: tag, model name, DCP topology joined by ``_``; None
        when there is none of them."""
        parts = []
        if self.tag is not None:
            parts.append(self.tag)
        if self.model_name:
            parts.append("-".join(self.model_name.split("/")))
        if self.dcp_size > 1:
            parts.append(f"tp{self.tp_size}_dcp{self.dcp_size}_page{self.page_size}"
                         f"_pp{self.pp_size}_cp{self.cp_size}")
        return "_".join(parts) if parts else None

    @property
    def head(self) -> str:
        """What stands before the page hash in every key of this rank."""
        prefix = self.prefix
        return "" if prefix is None else prefix + "_"

    # ------------------------------------------------------------------ rank parts
    @property
    def linker_rank(self) -> str:
        """The direct linker's rank part (``tp{tp}_cp{cp}_pp{pp}``; no TP when replicated)."""
        parts = [] if self.mla else [f"tp{self.tp_rank}"]
        return "_".join(parts + [f"cp{self.cp_rank}", f"pp{self.pp_rank}"])

    @property
    def mha_ranks(self) -> Tuple[str, ...]:
        """The MHA rank part of this rank's objects: one, or one per split-heads target rank."""
        if self.linker:
            return (self.linker_rank,)
        pp = f"_{self.pp_rank}" if self.pp_size > 1 else ""
        ranks = range(self.tp_rank * self.split, (self.tp_rank + 1) * self.split)
        return tuple(f"{r}{pp}" for r in ranks)

    @property
    def mla_rank(self) -> str:
        """The rank part of rank-replicated (MLA) objects."""
        if self.linker:
            return self.linker_rank
        pp = f"{self.pp_rank}" if self.pp_size > 1 else ""
        if self.dcp_size > 1:
            return f"dcp{self.dcp_rank}_cp{self.cp_rank}" + (f"_{pp}" if pp else "")
        return pp

    # ------------------------------------------------------------------ suffixes
    @property
    def kv_suffixes(self) -> Tuple[str, ...]:
        """The suffixes of one page's KV objects, in SGLang's order (what ``batch_exists`` asks)."""
        if self.linker:
            return (f"_{self.linker_rank}_k",)
        if self.mla:
            return (f"_{self.mla_rank}_k",)
        return tuple(s for r in self.mha_ranks for s in (f"_{r}_k", f"_{r}_v"))

    def pool_suffixes(self, pool: SidecarPool) -> Tuple[str, ...]:
        """The suffixes of one page's objects of sidecar ``pool``, in SGLang's order;
        ValueError for a pool SGLang's Mooncake backend does not store."""
        if not isinstance(pool, SidecarPool):
            raise TypeError(f"pool must be a SidecarPool, got {type(pool).__name__}")
        if self.linker:
            return (f"_{self.linker_rank}_{pool.name}",)
        r = self.mha_ranks[0]  # split heads are KV's alone: SGLang's sidecars use the first
        if len(self.mha_ranks) > 1:
            raise ValueError("sidecar pools beside split heads are not reproduced")
        if pool.name == MAMBA:
            out = tuple(f"_{r}_conv_{i}" for i in range(pool.conv_states))
            out = (f"_{r}_temporal",) + out if pool.temporal else out
            if not out:
                raise ValueError("a Mamba pool with neither a temporal nor a conv state stores nothing")
            return out
        if not self.mla and pool.kv_pair:
            return (f"_{r}_{SWA}_k", f"_{r}_{SWA}_v")
        if self.mla:
            return (f"_{self.mla_rank}_{SWA}",)
        raise ValueError("an SWA pool without K/V buffers beside MHA KV is not stored by SGLang's Mooncake backend")

    # ------------------------------------------------------------------ who writes, who differs
    @property
    def is_writer(self) -> bool:
        """Whether this rank writes its pools' objects: every MHA rank; of MLA replicas, one per
        DCP shard (``tp_rank == dcp_rank``; rank 0 without DCP). The direct linker: rank 0."""
        if not self.mla:
            return True
        return self.tp_rank == (0 if self.linker else self.dcp_rank)

    def replicated(self, pool: Optional[SidecarPool] = None) -> bool:
        """Whether the objects of ``pool`` (None: KV) are the same for every TP rank of this
        rank's PP stage and DCP shard: MLA KV and MLA SWA are, Mamba states never are."""
        if not self.mla:
            return False
        return pool is None or pool.name != MAMBA

    def keys(self, page_hashes: "list[str]", suffixes: Tuple[str, ...]) -> "list[str]":
        """Every key of ``page_hashes`` under ``suffixes``, page by page (the plain builder;
        lookups build theirs with the core)."""
        head = self.head
        return [f"{head}{h}{s}" for h in page_hashes for s in suffixes]
