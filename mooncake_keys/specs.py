"""KV-cache group specs: only what a lookup needs (attention type, block size, window).

Specs are frozen dataclasses; groups whose specs are equal form one *attention group*, as in
vLLM's hybrid coordinator. ``block_size`` is the chunk size in tokens as the store sees it
(for a single group under PCP/DCP that is vLLM's cache block size x dcp x pcp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

__all__ = ["FullAttentionSpec", "SlidingWindowSpec", "KVCacheGroup", "KVCacheSpec"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention: a hit needs every chunk from token 0. ``block_size`` in tokens."""

    block_size: int

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention over ``sliding_window`` tokens; ``block_size`` in tokens."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        _positive_int("block_size", self.block_size)
        _positive_int("sliding_window", self.sliding_window)

    def blocks_needed(self, eagle: bool) -> int:
        """Chunks a hit must end with: ceil((window - 1) / block_size), one more with EAGLE."""
        return -(-(self.sliding_window - 1) // self.block_size) + (1 if eagle else 0)


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec]


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV-cache group (vLLM's ``KVCacheGroupSpec`` without layer names)."""

    spec: KVCacheSpec
    is_eagle_group: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise TypeError(
                "spec must be a FullAttentionSpec or a SlidingWindowSpec, "
                f"got {type(self.spec).__name__}"
            )
        if not isinstance(self.is_eagle_group, bool):
            raise TypeError("is_eagle_group must be a bool")
