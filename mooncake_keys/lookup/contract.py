"""Which vLLM release's lookup an engine reproduces: every rule that differs between them, here.

mooncake_keys gives the answers of a given vLLM release's ``MooncakeStoreWorker.lookup``, byte
for byte and hit for hit, for every release from 0.25 to 0.33 (``vllm_compat``: ``"0.25"`` ..
``"0.33"``; ``"0.33"`` is the default). The releases differ in a few rules, each a field of
:class:`Contract`; :data:`CONTRACTS` is the one table of them (docs/vllm.md explains each rule
and shows where each release's code has it). Nothing else in the engine tests a release number.

Several releases share rules: 0.27 and 0.28 have the same lookup, as do 0.30 and 0.31; 0.26
differs from 0.25 only in a rule that cannot change an answer (the hybrid loop's cap), kept
faithful to its code anyway.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict

__all__ = ["Contract", "CONTRACTS", "DEFAULT_VLLM_COMPAT", "get_contract"]


@dataclass(frozen=True)
class Contract:
    """The rules of one vLLM release's lookup (see the module docstring)."""

    name: str
    #: ``lookup(num_tokens)`` floors ``num_tokens`` to the alignment (else: must be aligned).
    aligns_lookup_length: bool
    #: A hit covering all of ``num_tokens`` is re-derived at ``align(num_tokens - 1)``.
    rederives_full_hit: bool
    #: The answer carries a tail key boundary per store group.
    tail_key_boundaries: bool
    #: Namespaces come from each group's spec (MLA or not), not from the layout alone.
    per_group_namespaces: bool
    #: A lone attention group aligns its hit to the scheduler block size (else its own).
    single_group_scheduler_alignment: bool
    #: In the hybrid loop a computed full-attention hit caps ``cur`` (else ``cur`` is floored).
    full_hit_caps_later_passes: bool
    #: The EAGLE look-ahead may reach the end of the hashes (else only ``max_length``).
    eagle_peek_to_hashes: bool
    #: Lookup masks use the merged attention group's EAGLE flag (else each group's own).
    merged_eagle_masks: bool
    #: More than one KV-cache group is allowed with DCP > 1 (PCP > 1 never).
    hybrid_dcp: bool
    #: Groups may be marked not prefix-cacheable (dropped before numbering).
    dropped_groups: bool
    #: Keys may carry a ``store_namespace`` (store layouts).
    store_namespaces: bool
    #: Hits may land on the hash unit inside a block (keys per hash unit; in vLLM, turned on by
    #: a Mamba group whose block is larger than the hash unit).
    partial_hash_hits: bool
    #: A sliding-window group covers ``sliding_window + extra_retained_tokens`` (else the window
    #: alone). Applied where vLLM's specs become ours (the vLLM mapping).
    window_adds_extra_retained: bool
    #: An EAGLE pass widens a Mamba group's bound by its block size like any other group's
    #: (else a Mamba group gets no look-ahead: its finder never drops a block).
    mamba_eagle_margin: bool
    #: vLLM raises on every lookup of a deployment with partial hash hits and a sliding-window
    #: group whose block is not the hash unit: such a deployment is refused.
    swa_rejects_partial_hits: bool


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

CONTRACTS: Dict[str, Contract] = {
    name: Contract(name, **rules)
    for name, rules in (
        ("0.25", _R025), ("0.26", _R026), ("0.27", _R027), ("0.28", _R027), ("0.29", _R029),
        ("0.30", _R030), ("0.31", _R030), ("0.32", _R032), ("0.33", _R033),
    )
}

#: The contract a :class:`~mooncake_keys.LookupEngine` follows unless told otherwise.
DEFAULT_VLLM_COMPAT = "0.33"


def get_contract(name: object) -> Contract:
    """The contract named ``name``; ValueError naming the supported ones otherwise."""
    contract = CONTRACTS.get(name) if isinstance(name, str) else None
    if contract is None:
        raise ValueError(f"vllm_compat must be one of {sorted(CONTRACTS)}, got {name!r}")
    return contract
