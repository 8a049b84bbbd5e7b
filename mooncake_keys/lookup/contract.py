"""Which vLLM release's lookup an engine reproduces: every rule that differs between them, here.

mooncake_keys gives the answers of a given vLLM release's ``MooncakeStoreWorker.lookup``, byte
for byte and hit for hit. Two releases are supported:

* ``"0.25"``: vLLM 0.25.x's contract (#46188 with the PCP/DCP namespaces of #46855).
* ``"0.33"``: vLLM 0.33.x, the default. Its differences, each a field of :class:`Contract`:
  the lookup aligns ``num_tokens`` down instead of requiring it aligned, and re-derives a hit
  that covers all of ``num_tokens`` at one alignment step less (so the last token is
  recomputed); namespaces are per group (an MLA group needs one TP namespace, a GQA group
  ``tp // (tp // heads)``); groups that are not prefix-cacheable are dropped before numbering
  but still count toward the scheduler block size; a single attention group aligns to the
  scheduler block size, not its own; hybrids with DCP are allowed; EAGLE flags spread to every
  group of a merged attention group; a computed full-attention hit caps later passes of the
  hybrid loop (``min``) instead of being re-floored; the EAGLE look-ahead is capped by the
  hashes, not by the lookup length; keys may carry a ``store_namespace``; partial hash hits.
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
    #: ``store_namespace`` and ``partial_hash_hits`` are known.
    store_namespaces: bool
    partial_hash_hits: bool


CONTRACTS: Dict[str, Contract] = {
    "0.25": Contract(
        "0.25", aligns_lookup_length=False, rederives_full_hit=False, tail_key_boundaries=False, per_group_namespaces=False,
        single_group_scheduler_alignment=False, full_hit_caps_later_passes=False,
        eagle_peek_to_hashes=False, merged_eagle_masks=False, hybrid_dcp=False,
        dropped_groups=False, store_namespaces=False, partial_hash_hits=False,
    ),
    "0.33": Contract(
        "0.33", aligns_lookup_length=True, rederives_full_hit=True, tail_key_boundaries=True, per_group_namespaces=True,
        single_group_scheduler_alignment=True, full_hit_caps_later_passes=True,
        eagle_peek_to_hashes=True, merged_eagle_masks=True, hybrid_dcp=True,
        dropped_groups=True, store_namespaces=True, partial_hash_hits=True,
    ),
}

#: The contract a :class:`~mooncake_keys.LookupEngine` follows unless told otherwise.
DEFAULT_VLLM_COMPAT = "0.33"


def get_contract(name: object) -> Contract:
    """The contract named ``name``; ValueError naming the supported ones otherwise."""
    contract = CONTRACTS.get(name) if isinstance(name, str) else None
    if contract is None:
        raise ValueError(f"vllm_compat must be one of {sorted(CONTRACTS)}, got {name!r}")
    return contract
