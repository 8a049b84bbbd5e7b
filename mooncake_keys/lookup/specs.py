"""KV-cache group specs: only what a lookup needs (attention type, block size, window).

Specs are frozen dataclasses; groups whose specs are equal form one *attention group*, as in
vLLM's hybrid coordinator. ``block_size`` is the chunk size in tokens as the store sees it
(for a single group under PCP/DCP that is vLLM's cache block size x dcp x pcp).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .._checks import MAX_TOKENS, bool_arg, int_arg

__all__ = ["FullAttentionSpec", "SlidingWindowSpec", "KVCacheGroup", "KVCacheSpec"]


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention: a hit needs every chunk from token 0. ``block_size`` in tokens."""

    block_size: int

    def __post_init__(self) -> None:
        int_arg("block_size", self.block_size, min=1, max=MAX_TOKENS)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention over ``sliding_window`` tokens; ``block_size`` in tokens."""

    block_size: int
    sliding_window: int

    def __post_init__(self) -> None:
        int_arg("block_size", self.block_size, min=1, max=MAX_TOKENS)
        int_arg("sliding_window", self.sliding_window, min=1, max=MAX_TOKENS)

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
        bool_arg("is_eagle_group", self.is_eagle_group)
