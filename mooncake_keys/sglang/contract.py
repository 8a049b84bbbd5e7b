"""Which SGLang release's HiCache + Mooncake lookup is reproduced: its rules, one row per release.

A row is proven against that release's own code (``tests/against_sglang``: its wheel unpacked,
its ``MooncakeStore`` and ``HybridCacheController`` query functions run against a real
``mooncake_master``, its rank reduction under real gloo ranks). SGLang 0.5.23 is the one row
today; the fields name the rules the code reads, so a release that changes one is a new row,
and a release without a row keeps SGLang's own lookup (the plugin says so in one log line).
The key grammar itself is :mod:`.keys`' (it has not changed between rows yet).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Tuple

__all__ = ["Contract", "CONTRACTS", "DEFAULT_SGLANG", "get_contract"]


@dataclass(frozen=True)
class Contract:
    """The rules of one SGLang release's storage lookup (see the module docstring)."""

    name: str
    #: A prefetch span shorter than this (tokens) is not asked, by default
    #: (``prefetch_threshold`` in ``--hicache-storage-backend-extra-config``; never below a page).
    prefetch_threshold: int
    #: The span ends one token short of the input (the last token is computed: logprobs).
    span_leaves_last_token: bool
    #: With a trailing-pages pool (SWA, Mamba) ranks intersect their sets of restorable stop
    #: points (a MIN of one 0/1 flag per prefix length), not their longest hits.
    trailing_stop_points: bool
    #: The sidecar pools ``batch_exists_v2`` reproduces here (SGLang's ``PoolName`` values).
    sidecar_pools: Tuple[str, ...]
    #: MLA replicas write once per DCP shard: the rank with ``tp_rank == dcp_rank``.
    writer_per_dcp_shard: bool
    #: Pool verdicts ride in the rank reduction; -1 is "no verdict" (MIN lets any rank veto).
    no_verdict: int = -1


#: One row per SGLang release reproduced.
CONTRACTS: Dict[str, Contract] = {
    "0.5.23": Contract(
        name="0.5.23",
        prefetch_threshold=256,
        span_leaves_last_token=True,
        trailing_stop_points=True,
        sidecar_pools=("mamba", "swa"),
        writer_per_dcp_shard=True,
    ),
}

DEFAULT_SGLANG = "0.5.23"


def get_contract(release: str = DEFAULT_SGLANG) -> Contract:
    """The row of SGLang ``release`` (``"0.5.23"``); ValueError naming the supported ones."""
    if not isinstance(release, str):
        raise TypeError(f"release must be a str, got {type(release).__name__}")
    try:
        return CONTRACTS[release]
    except KeyError:
        raise ValueError(f"SGLang {release!r} is not reproduced here; supported: {', '.join(CONTRACTS)}") from None
