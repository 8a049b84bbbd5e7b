"""KV-cache group specs: only what a lookup needs (attention type, block size, window).

Specs are frozen dataclasses; groups whose specs are equal (every field) form one *attention
group*, as in vLLM's hybrid coordinator. ``block_size`` is the chunk size in tokens as the store
sees it: vLLM 0.33 multiplies a DCP-sharded spec's block size by ``dcp_size``; vLLM 0.25
multiplied a single group's by ``dcp_size x pcp_size``. ``sliding_window`` is the window the
coordinator covers: vLLM's ``sliding_window`` plus its ``extra_retained_tokens``.

``head_size`` and ``use_mla`` (keyword-only) tell specs apart the way vLLM's dataclass equality
does; ``None`` inherits from the layout (``use_mla``) or matches other ``None`` (``head_size``).
Under vLLM 0.33 a spec's ``use_mla`` decides its group's namespaces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from .._checks import MAX_TOKENS, bool_arg, int_arg

__all__ = ["FullAttentionSpec", "SlidingWindowSpec", "KVCacheGroup", "KVCacheSpec"]


def _check_common(spec: "KVCacheSpec") -> None:
    int_arg("block_size", spec.block_size, min=1, max=MAX_TOKENS)
    if spec.head_size is not None:
        int_arg("head_size", spec.head_size, min=1)
    if spec.use_mla is not None:
        bool_arg("use_mla", spec.use_mla)


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention (MLA included): a hit needs every chunk from token 0. Sizes in tokens."""

    block_size: int
    head_size: Optional[int] = field(default=None, kw_only=True)
    use_mla: Optional[bool] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_common(self)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention over ``sliding_window`` tokens; ``block_size`` in tokens."""

    block_size: int
    sliding_window: int
    head_size: Optional[int] = field(default=None, kw_only=True)
    use_mla: Optional[bool] = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_common(self)
        int_arg("sliding_window", self.sliding_window, min=1, max=MAX_TOKENS)

    def blocks_needed(self, eagle: bool) -> int:
        """Chunks a hit must end with: ceil((window - 1) / block_size), one more with EAGLE."""
        return -(-(self.sliding_window - 1) // self.block_size) + (1 if eagle else 0)


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec]


@dataclass(frozen=True)
class KVCacheGroup:
    """One KV-cache group (vLLM's ``KVCacheGroupSpec`` without layer names).

    ``is_eagle_group``: the group holds draft layers. ``prefix_cacheable=False`` (vLLM 0.33):
    a scratch or non-transferred group; it is dropped before numbering (keys and tail
    boundaries count only the others) but its block size still counts toward the scheduler
    block size.
    """

    spec: KVCacheSpec
    is_eagle_group: bool = False
    prefix_cacheable: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.spec, (FullAttentionSpec, SlidingWindowSpec)):
            raise TypeError(
                "spec must be a FullAttentionSpec or a SlidingWindowSpec, "
                f"got {type(self.spec).__name__} (other kinds, such as Mamba, cannot be expressed)"
            )
        bool_arg("is_eagle_group", self.is_eagle_group)
        bool_arg("prefix_cacheable", self.prefix_cacheable)
