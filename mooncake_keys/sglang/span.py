"""The span a storage query asks: which tokens of a request SGLang looks up in the store.

From the end of what the device and the host tiers already hold (``matched_len``, tokens) to the
input's end minus one token (the last token is computed; a request returning logprobs stops at
``logprob_start_len``), floored to whole pages. A span shorter than the prefetch threshold
(256 tokens by default, never below a page) is not asked at all. SGLang hashes the span's pages
from the host tier's last page hash and hands them to the backend: that list is what
:class:`~mooncake_keys.sglang.lookup.RankLookup` takes.
"""

from __future__ import annotations

from typing import Optional

from .._checks import int_arg
from .contract import DEFAULT_SGLANG, get_contract

__all__ = ["prefetch_span"]


def prefetch_span(input_len: int, matched_len: int, page_size: int, *, logprob_start_len: Optional[int] = None,
                  threshold: Optional[int] = None, release: str = DEFAULT_SGLANG) -> int:
    """Tokens a storage query asks, starting at ``matched_len`` (0: none is asked).

    ``input_len``: the request's tokens; ``matched_len``: tokens already held on the device and
    the host; ``page_size``: tokens per page; ``logprob_start_len``: where a request that returns
    logprobs starts them (None: it does not); ``threshold``: the configured prefetch threshold
    in tokens (None: the release's default).
    """
    contract = get_contract(release)
    input_len = int_arg("input_len", input_len, min=0)
    matched_len = int_arg("matched_len", matched_len, min=0)
    page_size = int_arg("page_size", page_size, min=1)
    threshold = contract.prefetch_threshold if threshold is None else int_arg("threshold", threshold, min=0)
    end = input_len - 1 if contract.span_leaves_last_token else input_len
    if logprob_start_len is not None and int_arg("logprob_start_len", logprob_start_len) >= 0:
        end = min(end, logprob_start_len)
    length = max(0, max(end, 0) - matched_len)
    length -= length % page_size
    return length if length >= max(threshold, page_size) else 0
