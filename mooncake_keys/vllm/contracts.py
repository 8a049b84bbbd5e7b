"""Which vLLM release's lookup is reproduced: one :class:`~mooncake_keys.lookup.contract.Contract`
per release, the rows of vLLM's table.

mooncake_keys gives the answers of a given vLLM release's ``MooncakeStoreWorker.lookup``, byte
for byte and hit for hit, for every release from 0.25 to 0.33 (``vllm_compat``: ``"0.25"`` ..
``"0.33"``; ``"0.33"`` is the default). The releases differ in a few rules, each a field of
``Contract``; :data:`CONTRACTS` is the one table of them (docs/vllm.md explains each rule and
shows where each release's code has it). Nothing else tests a vLLM release number.

Several releases share rules: 0.27 and 0.28 have the same lookup, as do 0.30 and 0.31; 0.26
differs from 0.25 only in a rule that cannot change an answer (the hybrid loop's cap), kept
faithful to its code anyway.

This module imports no vLLM (``mooncake_keys`` registers the table when it is imported); a second
engine's rows would sit in its own folder, beside this one.
"""

from __future__ import annotations

from ..lookup.contract import Contract, Contracts, register

__all__ = ["CONTRACTS", "DEFAULT_VLLM_COMPAT", "get_contract"]

_R025 = dict(
    aligns_lookup_length=False, rederives_full_hit=False, tail_key_boundaries=False,
    per_group_namespaces=False, single_group_scheduler_alignment=False, full_hit_caps_later_passes=False,
    eagle_peek_to_hashes=False, merged_eagle_masks=False, hybrid_dcp=False, dropped_groups=False,
    store_namespaces=False, partial_hash_hits=False, window_adds_extra_retained=False,
    mamba_eagle_margin=True, swa_rejects_partial_hits=False,
)
#: 0.26: the hybrid loop caps later passes by a computed full-attention hit (inert: same answers).
_R026 = dict(_R025, full_hit_caps_later_passes=True)
#: 0.27 (= 0.28): lookups align and re-derive a full hit, per-group namespaces (MLA, GQA, one per
#: rank for Mamba), merged EAGLE flags, partial hash hits from a Mamba group; answers an int.
_R027 = dict(
    _R026, aligns_lookup_length=True, rederives_full_hit=True, per_group_namespaces=True,
    single_group_scheduler_alignment=True, merged_eagle_masks=True, partial_hash_hits=True,
    mamba_eagle_margin=False, swa_rejects_partial_hits=True,
)
#: 0.29: the result object with tail key boundaries, hybrid + DCP, groups dropped from transfer.
_R029 = dict(_R027, tail_key_boundaries=True, hybrid_dcp=True, dropped_groups=True)
#: 0.30 (= 0.31): store namespaces and layouts; a sliding-window group takes partial hash hits.
_R030 = dict(_R029, store_namespaces=True, swa_rejects_partial_hits=False)
#: 0.32: the EAGLE look-ahead may reach the end of the hashes.
_R032 = dict(_R030, eagle_peek_to_hashes=True)
#: 0.33: the sliding window covers the extra retained tokens too.
_R033 = dict(_R032, window_adds_extra_retained=True)

#: The contract a :class:`~mooncake_keys.LookupEngine` follows unless told otherwise.
DEFAULT_VLLM_COMPAT = "0.33"

#: vLLM's releases, by the ``vllm_compat`` that names them.
CONTRACTS: Contracts = register(Contracts("vllm_compat", {
    name: Contract(name, "vLLM", "vllm_compat", **rules)
    for name, rules in (
        ("0.25", _R025), ("0.26", _R026), ("0.27", _R027), ("0.28", _R027), ("0.29", _R029),
        ("0.30", _R030), ("0.31", _R030), ("0.32", _R032), ("0.33", _R033),
    )
}, default=DEFAULT_VLLM_COMPAT))


def get_contract(name: object) -> Contract:
    """The contract of vLLM release ``name`` ("0.33"); ValueError naming the supported ones otherwise."""
    return CONTRACTS.get_contract(name)
