"""SGLang's HiCache + Mooncake prefix lookup, exact and asking only the keys its answer needs.

The room of the second serving engine, beside ``mooncake_keys.vllm``: ``contract`` (the SGLang
releases reproduced, as data), ``keys`` (SGLang's key grammar: the only place that knows it),
``span`` (which tokens a storage query asks), ``hits`` (one rank's hit rules and the ranks'
reduction), ``lookup`` (:class:`RankLookup`: one rank's ``batch_exists`` / ``batch_exists_v2``
answers, in rounds, with the MLA single querier and a negative cache), ``mapping`` (SGLang's
objects to ours, checked against SGLang's own) and ``plugin`` (the ``sglang.srt.plugins`` entry
point, hooking SGLang's ``MooncakeStore``; docs/sglang.md). Importing this package imports
neither SGLang nor torch: only the plugin's hooks touch SGLang, when SGLang calls them.
"""

from .contract import CONTRACTS, Contract, get_contract
from .keys import RankKeys, SidecarPool, storage_model_name
from .lookup import PoolQuery, RankLookup, RankLookupStats, StoreFault
from .span import prefetch_span

__all__ = ["CONTRACTS", "Contract", "PoolQuery", "RankKeys", "RankLookup", "RankLookupStats", "SidecarPool",
           "StoreFault", "get_contract", "prefetch_span", "storage_model_name"]
