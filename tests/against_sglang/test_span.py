"""The span a storage query asks, against the pieces of SGLang 0.5.23 that decide it and run on a
CPU: ``Req._compute_max_prefix_len`` (the input's end minus one, ``logprob_start_len``),
``RadixKey.page_aligned``, ``HybridCacheController.parse_storage_backend_extra_config`` (the
prefetch threshold and its default). The comparison with the threshold itself is
``UnifiedRadixCache.prefetch_from_storage``'s (``len(prefetch_key) < self.prefetch_threshold``:
nothing is asked), a method of the GPU-built tree: read, not run."""

from __future__ import annotations

import json
import random
from array import array

from mooncake_keys.sglang import prefetch_span


def test_the_span_is_sglangs():
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController
    from sglang.srt.mem_cache.radix_cache import RadixKey

    class MiniReq:  # the request fields the span reads
        _compute_max_prefix_len = Req._compute_max_prefix_len
        is_dllm = Req.is_dllm

        def __init__(self, return_logprob, logprob_start_len):
            self.dllm_config = None
            self.return_logprob, self.logprob_start_len = return_logprob, logprob_start_len

    rnd = random.Random(5)
    for _ in range(3000):
        input_len = rnd.choice([0, 1, 2, 255, 256, 257, 1000, 4097, rnd.randrange(20_000)])
        matched = rnd.choice([0, 0, rnd.randrange(input_len + 2)])
        page = rnd.choice([1, 4, 16, 64])
        logprob = rnd.choice([None, None, -1, rnd.randrange(input_len + 1)])
        config = rnd.choice([None, {}, {"prefetch_threshold": rnd.choice([0, 1, 64, 256, 1000])}])
        _, threshold, *_ = HybridCacheController.parse_storage_backend_extra_config(
            None if config is None else json.dumps(config))
        req = MiniReq(logprob is not None, -1 if logprob is None else logprob)
        fill_ids = list(range(input_len))
        key = RadixKey(array("q", fill_ids[matched:req._compute_max_prefix_len(input_len)])).page_aligned(page)
        want = 0 if len(key) < threshold else len(key)
        got = prefetch_span(input_len, matched, page, logprob_start_len=logprob,
                            threshold=None if not config else config["prefetch_threshold"])
        assert got == want, (input_len, matched, page, logprob, config)
