"""Which engine release's lookup a deployment reproduces: the rules where releases differ, as the
fields of one :class:`Contract`.

The lookup core reads these fields and nothing else of a release; it names no engine. Each
engine's rows, one :class:`Contract` per release, live in that engine's folder and are collected
in a :class:`Contracts` table: vLLM's are ``mooncake_keys/vllm/contracts.py`` (0.25 ... 0.33). A
:class:`~mooncake_keys.Deployment` takes a ``Contract`` itself (``contract=``, any engine's), or
names a row of the table registered for one of its arguments (``vllm_compat="0.33"``, the
public keyword for vLLM's table; :func:`register`, done by the package when it is imported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterator, Mapping, Optional

__all__ = ["Contract", "Contracts", "named", "register"]


@dataclass(frozen=True)
class Contract:
    """The rules of one release's lookup (docs/vllm.md explains each rule for vLLM's releases).

    ``engine`` is the engine's name as people write it ("vLLM"), ``argument`` the
    :class:`~mooncake_keys.Deployment` argument that names its releases (``"vllm_compat"``) and
    ``name`` this release there (``"0.33"``): error messages say ``f"{engine} {name}"``."""

    name: str
    engine: str
    argument: str
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


    @property
    def release(self) -> str:
        """The release as people write it: ``"vLLM 0.33"``."""
        return f"{self.engine} {self.name}"


class Contracts(Mapping[str, Contract]):
    """One engine's releases: their :class:`Contract` by name, and the one followed by default.
    ``argument`` is the :class:`~mooncake_keys.Deployment` argument that names them."""

    def __init__(self, argument: str, rows: Mapping[str, Contract], default: str) -> None:
        if default not in rows or any(c.argument != argument or c.name != n for n, c in rows.items()):
            raise ValueError(f"the rows of {argument} must be named as their contracts, the default among them")
        self.argument, self.default = argument, default
        self._rows: Dict[str, Contract] = dict(rows)

    def __getitem__(self, name: str) -> Contract:
        return self._rows[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._rows)

    def __len__(self) -> int:
        return len(self._rows)

    def get_contract(self, name: object = None) -> Contract:
        """The contract named ``name`` (None: the default); ValueError naming the argument and the
        supported names otherwise."""
        if name is None:
            return self._rows[self.default]
        contract = self._rows.get(name) if isinstance(name, str) else None
        if contract is None:
            raise ValueError(f"{self.argument} must be one of {sorted(self._rows)}, got {name!r}")
        return contract


#: argument -> the table whose rows it names.
_TABLES: Dict[str, Contracts] = {}


def register(table: Contracts) -> Contracts:
    """Make ``table`` the one its argument names (an engine's folder registers its own)."""
    _TABLES[table.argument] = table
    return table


def named(argument: str, name: Optional[str]) -> Contract:
    """The contract ``argument=name`` names (None: its table's default)."""
    table = _TABLES.get(argument)
    if table is None:  # pragma: no cover - mooncake_keys/__init__.py registers every engine's table
        raise LookupError(f"no contracts are registered for {argument}")
    return table.get_contract(name)
