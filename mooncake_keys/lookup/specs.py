"""KV-cache group specs: only what a lookup needs (the kind of group, block size, window).

Four kinds, each with its own hit rule (``coordinator``):

* :class:`FullAttentionSpec`: a hit needs every chunk from token 0 (MLA, and vLLM's full-attention
  variants whose manager keeps that rule: sink, reference-SWA, hidden-state caches);
* :class:`SlidingWindowSpec`: a hit needs the chunks of one window before its end;
* :class:`ChunkedLocalAttentionSpec`: a hit needs the chunks from the start of the last attention
  chunk below its end (the chunks before it are never read);
* :class:`MambaSpec`: recurrent state (Mamba in vLLM's ``align`` cache mode): a hit ends at the
  last stored state, whatever lies below it.

Specs are frozen dataclasses; groups whose specs are equal (every field) form one *attention
group*, as in vLLM's hybrid coordinator. ``block_size`` is the chunk size in tokens as the store
sees it (vLLM's, resolved for DCP/PCP: see docs/architecture.md). ``sliding_window`` is the
window the coordinator covers (vLLM 0.33 adds ``extra_retained_tokens`` to it; earlier releases
do not).

``head_size``, ``use_mla`` and ``variant`` (keyword-only) tell specs apart the way vLLM's
dataclass equality does: ``use_mla=None`` inherits from the layout; ``variant`` is anything
hashable that stands for what else vLLM compares (its spec class, dtype, sink length...), so two
groups merge here exactly when they merge in vLLM. Where the contract has per-group namespaces,
a spec's ``use_mla`` decides its group's namespaces, and a Mamba group has one per rank.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional, Union

from .._checks import MAX_TOKENS, bool_arg, int_arg

__all__ = [
    "FullAttentionSpec", "SlidingWindowSpec", "ChunkedLocalAttentionSpec", "MambaSpec", "KVCacheGroup",
    "KVCacheSpec", "SPEC_KINDS",
]


def _check_common(spec: "KVCacheSpec") -> None:
    int_arg("block_size", spec.block_size, min=1, max=MAX_TOKENS)
    if spec.head_size is not None:
        int_arg("head_size", spec.head_size, min=1)
    if spec.use_mla is not None:
        bool_arg("use_mla", spec.use_mla)
    try:
        hash(spec.variant)
    except TypeError:
        raise TypeError(f"variant must be hashable, got {type(spec.variant).__name__}") from None


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention (MLA included): a hit needs every chunk from token 0. Sizes in tokens."""

    block_size: int
    head_size: Optional[int] = field(default=None, kw_only=True)
    use_mla: Optional[bool] = field(default=None, kw_only=True)
    variant: Hashable = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_common(self)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """Sliding-window attention over ``sliding_window`` tokens; ``block_size`` in tokens."""

    block_size: int
    sliding_window: int
    head_size: Optional[int] = field(default=None, kw_only=True)
    use_mla: Optional[bool] = field(default=None, kw_only=True)
    variant: Hashable = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_common(self)
        int_arg("sliding_window", self.sliding_window, min=1, max=MAX_TOKENS)

    def blocks_needed(self, eagle: bool) -> int:
        """Chunks a hit must end with: ceil((window - 1) / block_size), one more with EAGLE."""
        return -(-(self.sliding_window - 1) // self.block_size) + (1 if eagle else 0)


@dataclass(frozen=True)
class ChunkedLocalAttentionSpec:
    """Chunked local attention (Llama 4's local layers): a token attends to the tokens of its own
    ``attention_chunk_size``-token chunk. A hit of ``L`` tokens needs the chunks of
    ``block_size`` tokens from ``L // attention_chunk_size * attention_chunk_size`` on; those
    below are never read. vLLM asks every chunk anyway, and allows the group neither EAGLE nor
    a hit alignment other than its block size."""

    block_size: int
    attention_chunk_size: int
    head_size: Optional[int] = field(default=None, kw_only=True)
    use_mla: Optional[bool] = field(default=None, kw_only=True)
    variant: Hashable = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        _check_common(self)
        int_arg("attention_chunk_size", self.attention_chunk_size, min=1, max=MAX_TOKENS)


@dataclass(frozen=True)
class MambaSpec:
    """Recurrent state (Mamba and other state-space layers, vLLM's ``align`` cache mode): chunk
    ``j`` holds the state after ``(j + 1) * block_size`` tokens, so a hit ends at the last stored
    state the alignment allows, whatever is stored below it. Each TP rank holds its own state
    (one namespace per rank where namespaces are per group). No EAGLE drop: a state is exact."""

    block_size: int
    variant: Hashable = field(default=None, kw_only=True)
    #: A Mamba state is never MLA; present so every spec answers the same questions.
    head_size: None = field(default=None, init=False)
    use_mla: Optional[bool] = field(default=False, init=False)

    def __post_init__(self) -> None:
        _check_common(self)


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec]
#: Every spec class a group may have.
SPEC_KINDS = (FullAttentionSpec, SlidingWindowSpec, ChunkedLocalAttentionSpec, MambaSpec)


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
        if not isinstance(self.spec, SPEC_KINDS):
            raise TypeError(
                "spec must be one of " + ", ".join(k.__name__ for k in SPEC_KINDS)
                + f", got {type(self.spec).__name__}"
            )
        bool_arg("is_eagle_group", self.is_eagle_group)
        bool_arg("prefix_cacheable", self.prefix_cacheable)
