"""From vLLM's own objects to a :class:`~mooncake_keys.Deployment`, and proof that they agree.

The mapping reads what vLLM's worker (or scheduler) already resolved: the store groups (vLLM
0.33: prefix-cacheable ones, DCP-resolved), the coordinator's sizes and EAGLE flags, the
parallel sizes, the key metadata (model name, cache prefix, store namespace). The engine built
for that deployment is then checked against vLLM's state: the same attention groups, the same EAGLE groups, the
same lookup key prefixes (per group, in order). Anything that does not map, or maps to something
else, raises :class:`Unsupported` with the reason, and the caller keeps vLLM's own lookup.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple

from ..lookup.contract import Contract
from ..lookup.deployment import Deployment
from ..lookup.engine import LookupEngine
from ..lookup.layout import ParallelLayout
from ..lookup.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec
from .contracts import get_contract

__all__ = ["Unsupported", "deployment_of", "check_against", "spec_kind"]


class Unsupported(Exception):
    """The vLLM deployment cannot be reproduced by the engine; the message says why."""


#: vLLM's manager class name -> our spec kind. A manager counts as one of these when it is the
#: class or a subclass that keeps its lookup rules (the hit, the lookup mask, hash-unit lookups):
#: vLLM's sink and reference-SWA full-attention managers are full attention here.
_KINDS = {
    "FullAttentionManager": FullAttentionSpec,
    "SlidingWindowManager": SlidingWindowSpec,
    "MambaManager": MambaSpec,
    "ChunkedLocalAttentionManager": ChunkedLocalAttentionSpec,
}
_RULES = ("find_longest_cache_hit", "reachable_block_mask", "supports_fine_grained_hash_lookup")


def _rule(cls: type, name: str) -> Any:
    value = getattr(cls, name, None)
    return getattr(value, "__func__", value)  # a classmethod: the function, whichever class holds it


def spec_kind(manager: Any) -> Optional[type]:
    """Our spec class for vLLM's manager class ``manager`` (None: a manager with other rules)."""
    for base in getattr(manager, "__mro__", ()):
        kind = _KINDS.get(base.__name__)
        if kind is not None:
            return kind if all(_rule(manager, r) is _rule(base, r) for r in _RULES) else None
    return None


def _inner_specs(spec: Any) -> Tuple[Any, ...]:
    inner = getattr(spec, "kv_cache_specs", None)  # UniformTypeKVCacheSpecs
    return tuple(inner.values()) if isinstance(inner, dict) else (spec,)


def _is_mla(spec: Any) -> bool:
    return any(cls.__name__ in ("MLAAttentionSpec", "SlidingWindowMLASpec") for cls in type(spec).__mro__)


def _hashable(value: Any) -> Hashable:
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _hashable(v)) for k, v in value.items()))
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value


def _variant(spec: Any) -> Hashable:
    """What vLLM compares when it merges groups (its dataclass equality: the class and every
    compared field), so that ours merge exactly when vLLM's do."""
    fields = dataclasses.fields(spec) if dataclasses.is_dataclass(spec) else ()
    return (type(spec).__qualname__,) + tuple(
        (f.name, _hashable(getattr(spec, f.name))) for f in fields if f.compare
    )


def _window(spec: Any, contract: Contract) -> int:
    """The window a sliding-window group covers in the contract's release."""
    extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
    return spec.sliding_window + (extra if contract.window_adds_extra_retained else 0)


def _our_group(group: Any, registry: Any, contract: Contract) -> KVCacheGroup:
    """One vLLM ``KVCacheGroupSpec`` (a store group) as ours."""
    inner = _inner_specs(group.kv_cache_spec)
    spec = inner[0]  # vLLM's coordinator unwraps a uniform group to its first spec
    manager = registry.get_manager_class(spec) if registry is not None else None
    kind = spec_kind(manager)
    if kind is None:
        raise Unsupported(f"a {type(spec).__name__} group (its {getattr(manager, '__name__', '?')} has lookup "
                          "rules of its own)")
    eagle = bool(getattr(group, "is_eagle_group", False))
    if kind is MambaSpec:
        return KVCacheGroup(MambaSpec(spec.block_size, variant=_variant(spec)), is_eagle_group=eagle)
    if kind is SlidingWindowSpec:
        window = _window(spec, contract)
        # vLLM merges 0.33's groups by the window they cover (extra retained tokens folded in).
        compared = dataclasses.replace(spec, sliding_window=window, extra_retained_tokens=0) \
            if window != spec.sliding_window else spec
        fields: Dict[str, Any] = dict(sliding_window=window)
    else:
        compared, fields = spec, {}
        if kind is ChunkedLocalAttentionSpec:
            fields["attention_chunk_size"] = spec.attention_chunk_size
    ours = kind(spec.block_size, **fields, head_size=getattr(spec, "head_size", None),
                use_mla=all(_is_mla(s) for s in inner), variant=_variant(compared))
    return KVCacheGroup(ours, is_eagle_group=eagle)


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
    be one). ``groups`` are vLLM's store groups, ``coord`` its coordinator, ``vllm_compat`` the
    contract of its release."""
    contract = get_contract(vllm_compat)
    ours = [_our_group(g, registry, contract) for g in groups]
    # Without per-group namespaces the model's own use_mla decides every group's (vLLM 0.25, 0.26).
    layout_mla = use_mla or (contract.per_group_namespaces and all(g.spec.use_mla for g in ours))
    if store_tp_size is not None:  # a TP-sharded store layout: keyed by the store's TP shards
        layout = ParallelLayout(tp_size=store_tp_size, pp_size=pp_size, num_kv_heads=num_kv_heads)
    else:
        try:
            layout = ParallelLayout(tp_size=tp_size, pp_size=pp_size, pcp_size=pcp_size, dcp_size=dcp_size,
                                    num_kv_heads=num_kv_heads, use_mla=layout_mla)
        except ValueError as exc:
            raise Unsupported(f"the parallel layout: {exc}") from None
    release: Dict[str, Any] = {}  # what only some releases have
    if contract.store_namespaces:
        release["store_namespace"] = store_namespace
    if contract.partial_hash_hits:
        release["partial_hash_hits"] = bool(getattr(coord, "enable_partial_hash_hits", False))
    return Deployment(
        model_name, ours, layout, hash_block_size=coord.hash_block_size,
        scheduler_block_size=coord.lcm_block_size, use_eagle=bool(coord.use_eagle), cache_prefix=cache_prefix,
        vllm_compat=vllm_compat, allow_ambiguous_names=True,  # reproduce vLLM's keys, whatever its names hold
        **release,
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
