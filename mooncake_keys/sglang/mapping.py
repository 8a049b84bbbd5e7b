"""From SGLang's own objects to our description of a rank's keys, and proof that they agree.

:func:`rank_keys_of` reads a ``MooncakeStore``'s ``HiCacheStorageConfig`` (ranks, sizes, MLA, split
heads, DCP, the model name) and the backend tag of its extra config, then checks what the store
itself resolved from them: its ``config_prefix``, its MLA flag, its MHA and MLA rank suffixes.
:func:`pool_query_of` does the same for one sidecar ``PoolTransfer`` of a ``batch_exists_v2``
query: the pool's objects from its registered host pool, checked against the suffixes SGLang's
own ``_get_hybrid_page_component_keys`` names. Anything that does not map, or maps to other
keys, raises :class:`Unsupported` with the reason, and the caller keeps SGLang's own lookup.

Nothing here imports SGLang: it reads the attributes of the objects it is handed.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .contract import Contract
from .hits import ALL_PAGES, TRAILING_PAGES
from .keys import MAMBA, SWA, RankKeys, SidecarPool
from .lookup import PoolQuery

__all__ = ["Unsupported", "rank_keys_of", "pool_query_of", "value_of"]


class Unsupported(Exception):
    """SGLang's lookup on this store cannot be reproduced; the message says why."""


def value_of(name: Any) -> str:
    """The text of one of SGLang's ``str`` enums (``PoolName``, ``PoolHitPolicy``), or of a str."""
    return str(getattr(name, "value", name))


def rank_keys_of(store: Any) -> RankKeys:
    """The keys of the rank a ``MooncakeStore`` serves, checked against what it resolved."""
    cfg = getattr(store, "storage_config", None)
    if cfg is None:
        raise Unsupported("the store was built without a HiCacheStorageConfig")
    extra = getattr(cfg, "extra_config", None) or {}
    tag = extra.get("extra_backend_tag")
    split = 1
    if getattr(cfg, "should_split_heads", False):
        split = cfg.tp_lcm_size // cfg.tp_size
    try:
        rank = RankKeys(
            model_name=cfg.model_name or None, tag=None if tag is None else str(tag),
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, pp_rank=cfg.pp_rank, pp_size=cfg.pp_size,
            cp_rank=cfg.attn_cp_rank, cp_size=cfg.attn_cp_size, dcp_rank=getattr(cfg, "dcp_rank", 0),
            dcp_size=getattr(cfg, "dcp_size", 1), page_size=getattr(cfg, "logical_page_size", None),
            mla=bool(cfg.is_mla_model), split=split,
        )
    except (TypeError, ValueError) as exc:
        raise Unsupported(f"its storage config does not describe keys mooncake_keys builds: {exc}") from None
    want_mha: Any = list(rank.mha_ranks) if split > 1 else rank.mha_ranks[0]
    checks = (
        ("config_prefix", rank.prefix),
        ("is_mla_backend", rank.mla),
        ("mla_suffix", rank.mla_rank),
        ("mha_suffix", want_mha),
        ("should_split_heads", split > 1),
    )
    for attr, want in checks:
        got = getattr(store, attr, None)
        if got != want:
            raise Unsupported(f"its {attr} is {got!r} where mooncake_keys' keys have {want!r} "
                              "(a store whose keys SGLang builds otherwise, such as the direct linker's)")
    if split > 1 and getattr(store, "split_factor", None) != split:
        raise Unsupported(f"its split_factor is {getattr(store, 'split_factor', None)!r}, not {split}")
    return rank


def pool_query_of(store: Any, transfer: Any, rank: RankKeys, contract: Contract,
                  checked: Optional[Dict[str, SidecarPool]] = None) -> PoolQuery:
    """The :class:`PoolQuery` of one sidecar ``PoolTransfer`` of a ``batch_exists_v2`` on
    ``store``; the pool's suffixes are checked against SGLang's own builder the first time
    (``checked``: the pools checked so far on this store, by name, updated)."""
    name = value_of(transfer.name)
    policy = value_of(transfer.hit_policy)
    if policy not in (ALL_PAGES, TRAILING_PAGES):
        raise Unsupported(f"pool {name!r} has hit policy {policy!r}")
    keys = getattr(transfer, "keys", None)
    window = max(1, len(keys) if keys else 1)
    pool = None if checked is None else checked.get(name)
    if pool is None:
        pool = _checked_pool(store, transfer, name, rank, contract)
        if checked is not None:
            checked[name] = pool
    return PoolQuery(name, pool, policy, window)


def _checked_pool(store: Any, transfer: Any, name: str, rank: RankKeys, contract: Contract) -> SidecarPool:
    if name not in contract.sidecar_pools:
        raise Unsupported(f"pool {name!r} is not reproduced (only {', '.join(contract.sidecar_pools)})")
    host = (getattr(store, "registered_pools", None) or {}).get(transfer.name)
    if host is None:
        raise Unsupported(f"pool {name!r} is not registered with the store")
    if any(cls.__name__ == "DevicePoolEntry" for cls in type(host).__mro__):
        raise Unsupported(f"pool {name!r} is a direct-linker device pool")
    if name == MAMBA:
        pool = SidecarPool.mamba(len(getattr(host, "conv_buffer", None) or []),
                                 temporal=getattr(host, "temporal_state_elem_size", 1) > 0)
    else:
        pool = SidecarPool(SWA, kv_pair=hasattr(host, "v_buffer"))
    try:
        ours: Tuple[str, ...] = rank.pool_suffixes(pool)
    except ValueError as exc:
        raise Unsupported(f"pool {name!r}: {exc}") from None
    try:
        theirs, _ = store._get_hybrid_page_component_keys([""], transfer)
    except Exception as exc:  # SGLang refuses the pool itself: its own lookup raises the same
        raise Unsupported(f"SGLang's own key builder refuses pool {name!r}: {type(exc).__name__}: {exc}") from None
    if tuple(theirs) != ours:
        raise Unsupported(f"pool {name!r}'s suffixes are {list(theirs)} in SGLang, {list(ours)} here")
    return pool
