"""From vLLM's own objects to a :class:`~mooncake_keys.Deployment`, and proof that they agree.

The mapping reads what vLLM's worker (or scheduler) already resolved: the store groups (vLLM
0.33: prefix-cacheable ones, DCP-resolved), the coordinator's sizes and EAGLE flags, the
parallel sizes, the key metadata (model name, cache prefix, store namespace). The engine built
for that deployment is then checked against vLLM's state: the same attention groups, the same EAGLE groups, the
same lookup key prefixes (per group, in order). Anything that does not map, or maps to something
else, raises :class:`Unsupported` with the reason, and the caller keeps vLLM's own lookup.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence, Tuple

from ..lookup.deployment import Deployment
from ..lookup.engine import LookupEngine
from ..lookup.layout import ParallelLayout
from ..lookup.specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

__all__ = ["Unsupported", "deployment_of", "check_against"]


class Unsupported(Exception):
    """The vLLM deployment cannot be reproduced by the engine; the message says why."""


_MANAGERS = {"FullAttentionManager": FullAttentionSpec, "SlidingWindowManager": SlidingWindowSpec}


def _inner_specs(spec: Any) -> Tuple[Any, ...]:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return tuple(inner.values()) if isinstance(inner, dict) else (spec,)


def _is_mla(spec: Any) -> bool:
    return any(cls.__name__ in ("MLAAttentionSpec", "SlidingWindowMLASpec") for cls in type(spec).__mro__)


def _our_group(group: Any, registry: Any) -> KVCacheGroup:
    """One vLLM ``KVCacheGroupSpec`` (a store group) as ours."""
    inner = _inner_specs(group.kv_cache_spec)
    spec = inner[0]  # vLLM's coordinator unwraps a uniform group to its first spec
    if any("Mamba" in type(s).__name__ for s in inner):
        raise Unsupported("a Mamba group (mooncake_keys models attention groups only)")
    manager = registry.get_manager_class(spec) if registry is not None else None
    kind = _MANAGERS.get(getattr(manager, "__name__", ""))
    if kind is None:
        raise Unsupported(f"a {type(spec).__name__} group (its {getattr(manager, '__name__', '?')} is not "
                          "full or sliding-window attention)")
    head_size = getattr(spec, "head_size", None)
    mla = all(_is_mla(s) for s in inner)
    if kind is SlidingWindowSpec:
        window = spec.sliding_window + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        ours: Any = SlidingWindowSpec(spec.block_size, window, head_size=head_size, use_mla=mla)
    else:
        ours = FullAttentionSpec(spec.block_size, head_size=head_size, use_mla=mla)
    return KVCacheGroup(ours, is_eagle_group=bool(getattr(group, "is_eagle_group", False)))


def deployment_of(
    *,
    vllm_compat: str,
    groups: Sequence[Any],
    coord: Any,
    registry: Any,
    tp_size: int,
    pp_size: int,
    pcp_size: int,
    dcp_size: int,
    num_kv_heads: int,
    model_name: str,
    cache_prefix: str,
    store_namespace: str = "",
    store_tp_size: Optional[int] = None,
    use_mla: bool = False,
) -> Deployment:
    """The :class:`Deployment` reproducing this vLLM deployment (``ValueError`` where it cannot
    be one). ``groups`` are vLLM's store groups, ``coord`` its coordinator."""
    ours = [_our_group(g, registry) for g in groups]
    mla_everywhere = all(g.spec.use_mla for g in ours)
    if store_tp_size is not None:  # a TP-sharded store layout: keyed by the store's TP shards
        layout = ParallelLayout(tp_size=store_tp_size, pp_size=pp_size, num_kv_heads=num_kv_heads)
    else:
        try:
            layout = ParallelLayout(tp_size=tp_size, pp_size=pp_size, pcp_size=pcp_size, dcp_size=dcp_size,
                                    num_kv_heads=num_kv_heads, use_mla=use_mla or mla_everywhere)
        except ValueError as exc:
            raise Unsupported(f"the parallel layout: {exc}") from None
    v033: dict = {}
    if vllm_compat != "0.25":
        v033.update(store_namespace=store_namespace,
                    partial_hash_hits=bool(getattr(coord, "enable_partial_hash_hits", False)))
    return Deployment(
        model_name, ours, layout, hash_block_size=coord.hash_block_size,
        scheduler_block_size=coord.lcm_block_size, use_eagle=bool(coord.use_eagle), cache_prefix=cache_prefix,
        vllm_compat=vllm_compat, allow_ambiguous_names=True,  # reproduce vLLM's keys, whatever its names hold
        **v033,
    )


def _vllm_attention_groups(coord: Any) -> List[Tuple[Tuple[int, ...], bool]]:
    eagle_0_25 = getattr(coord, "eagle_attn_group_indices", None)
    out = []
    for i, ag in enumerate(coord.attention_groups):
        ids = tuple(ag[1])
        eagle = bool(ag[3]) if len(ag) > 3 else i in (eagle_0_25 or ())
        out.append((ids, eagle))
    return out


def check_against(engine: LookupEngine, coord: Any, prefixes: Sequence[Sequence[str]]) -> None:
    """Raise :class:`Unsupported` unless ``engine`` groups, flags and keys as vLLM does."""
    ours = engine.coordinator
    mine = [(ids, a in ours.eagle_attention_indices) for a, (_, ids) in enumerate(ours.attention_groups)]
    theirs = _vllm_attention_groups(coord)
    if mine != theirs:
        raise Unsupported(f"vLLM merges the groups as {theirs}, the engine as {mine} (specs differ in "
                          "fields the engine does not model)")
    if set(ours.eagle_group_ids) != set(coord.eagle_group_ids):
        raise Unsupported(f"EAGLE groups differ: vLLM {sorted(coord.eagle_group_ids)}, engine "
                          f"{sorted(ours.eagle_group_ids)}")
    want = tuple(tuple(p) for p in prefixes)
    if engine.prefixes != want:
        raise Unsupported(f"lookup key prefixes differ: vLLM {want!r:.300}, engine {engine.prefixes!r:.300}")
