"""Rank layouts: which key namespaces a lookup must find a chunk in, and where a rank writes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .._checks import bool_arg, int_arg

__all__ = ["ParallelLayout", "Namespace"]

#: (tp_rank, pcp_rank, dcp_rank, pp_rank) as it appears in a key.
Namespace = Tuple[int, int, int, int]

#: The most ranks (tp x pp x pcp) one layout may have, and the largest head count: a lookup
#: asks one key per namespace, so a made-up size must not make it build millions of prefixes.
MAX_RANKS = 4096


@dataclass(frozen=True)
class ParallelLayout:
    """Tensor / pipeline / prefill- and decode-context parallel sizes of one deployment.

    ``num_kv_heads`` is the model-wide KV head count; with ``use_mla`` it counts as 1.
    """

    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    num_kv_heads: int = 1
    use_mla: bool = False

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "pcp_size", "dcp_size", "num_kv_heads"):
            int_arg(name, getattr(self, name), min=1, max=MAX_RANKS)
        bool_arg("use_mla", self.use_mla)
        if self.tp_size * self.pp_size * self.pcp_size > MAX_RANKS:
            raise ValueError(
                f"tp_size x pp_size x pcp_size ({self.tp_size * self.pp_size * self.pcp_size}) "
                f"must be <= {MAX_RANKS}"
            )
        if self.tp_size % self.dcp_size:
            raise ValueError(f"dcp_size ({self.dcp_size}) must divide tp_size ({self.tp_size})")
        heads, tp = self.heads, self.tp_size
        if tp % heads and heads % tp:
            # vLLM rejects these too; here the last TP ranks would write namespaces no lookup asks.
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide tp_size ({tp}) or be a multiple of it"
            )

    @property
    def heads(self) -> int:
        """KV heads that differ across TP ranks: 1 under MLA."""
        return 1 if self.use_mla else self.num_kv_heads

    def replication_factor(self, mla: Optional[bool] = None, *, per_rank: bool = False) -> int:
        """TP ranks that hold byte-identical KV of a group, and so share one namespace.

        1 under DCP > 1 (vLLM #45371: each rank its own ``@dcpN`` namespace) and for a group whose
        state is each rank's own (``per_rank``: Mamba); ``tp_size`` for an MLA group; else
        ``max(1, tp_size // num_kv_heads)`` (replicated GQA heads). ``mla`` defaults to the
        layout's ``use_mla``.
        """
        mla = self.use_mla if mla is None else mla
        if self.dcp_size > 1 or per_rank:
            return 1
        if mla:
            return self.tp_size
        return max(1, self.tp_size // self.num_kv_heads)

    @property
    def put_step(self) -> int:
        """The layout's :meth:`replication_factor`: ranks sharing a namespace stripe their puts."""
        return self.replication_factor()

    def lookup_namespaces(self, mla: Optional[bool] = None, *, per_rank: bool = False) -> Tuple[Namespace, ...]:
        """Every namespace some rank loads a group from, PCP outer, then TP, then PP inner.

        Under DCP > 1 every TP rank is its own namespace with ``dcp = tp % dcp_size`` (vLLM
        #46855); otherwise ``tp_size // replication_factor(mla, per_rank=per_rank)`` TP namespaces.
        """
        pcps, pps = range(self.pcp_size), range(self.pp_size)
        if self.dcp_size > 1:
            return tuple((tp, pcp, tp % self.dcp_size, pp) for pcp in pcps for tp in range(self.tp_size) for pp in pps)
        tps = range(self.tp_size // self.replication_factor(mla, per_rank=per_rank))
        return tuple((tp, pcp, 0, pp) for pcp in pcps for tp in tps for pp in pps)

    def writer_namespace(self, tp_rank: int, pcp_rank: int = 0, dcp_rank: int = 0, pp_rank: int = 0,
                         *, mla: Optional[bool] = None, per_rank: bool = False) -> Namespace:
        """The namespace the rank at these coordinates saves a group to and loads it from."""
        for name, value, size in (
            ("tp_rank", tp_rank, self.tp_size),
            ("pcp_rank", pcp_rank, self.pcp_size),
            ("dcp_rank", dcp_rank, self.dcp_size),
            ("pp_rank", pp_rank, self.pp_size),
        ):
            int_arg(name, value)
            if not 0 <= value < size:
                raise ValueError(f"{name} must be in [0, {size}), got {value}")
        return (tp_rank // self.replication_factor(mla, per_rank=per_rank), pcp_rank, dcp_rank, pp_rank)

    def check_rank(self, rank: object) -> Namespace:
        """``rank`` as a (tp, pcp, dcp, pp) tuple of a rank of this layout; else TypeError/ValueError."""
        if isinstance(rank, (str, bytes)) or not isinstance(rank, (tuple, list)) or len(rank) != 4:
            raise TypeError(f"rank must be a (tp, pcp, dcp, pp) tuple of 4 ints, got {rank!r}")
        coords = tuple(rank)
        self.writer_namespace(*coords)  # TypeError / ValueError naming the coordinate out of range
        tp, _, dcp, _ = coords
        if dcp != (tp % self.dcp_size if self.dcp_size > 1 else 0):
            raise ValueError(
                f"rank {coords} is not a rank of the layout: under DCP the dcp rank must be "
                f"tp_rank % dcp_size ({self.dcp_size})"
            )
        return coords  # type: ignore[return-value]

    def ranks(self) -> Tuple[Namespace, ...]:
        """Coordinates (tp, pcp, dcp, pp) of every rank; under DCP, dcp = tp % dcp_size."""
        return tuple(
            (tp, pcp, tp % self.dcp_size if self.dcp_size > 1 else 0, pp)
            for pcp in range(self.pcp_size)
            for tp in range(self.tp_size)
            for pp in range(self.pp_size)
        )
