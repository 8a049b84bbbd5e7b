"""The models people serve, against vLLM 0.33's own lookup.

``support.vllm_zoo`` builds the KV-cache layouts of DeepSeek-V4-Flash, DeepSeek-V3.2,
DeepSeek-V3, Kimi-K2, Qwen3-Next-80B, gpt-oss-120b, Gemma-3-27B, Llama-4-Scout, MiniMax-M2,
Llama-3.1-70B and Qwen3-235B, at TP 1 and 8, with vLLM's own layer classes, block-size rules,
``get_kv_cache_spec`` and engine-core planning, as a CUDA (Hopper) deployment gets them. For
each deployment, the rank-0 worker built by vLLM's connector factory with the drop-in
(``FastMooncakeStoreConnector``) must be accelerated as it is built; while the drop-in answers,
vLLM's own lookup (the worker's method and its coordinator's hit rule) raises if anything calls
it; and on random stores with holes and odd codes, its answers, keys and wire replies
(``encode_lookup_response``, the bytes rank 0 sends the scheduler) equal vLLM's own lookup's,
one-shot (vLLM's very keys in one call, vLLM's very ``lookup_exists`` records) and in rounds
(the same answers from no more keys), on this run's core. On Llama 4, vLLM's lookup raises
``AssertionError`` where a chunked-local hit ends on an attention-chunk start whose previous
chunk is absent, and ours answers (the documented difference, docs/architecture.md).

Collected under vLLM 0.33 only (the layouts are 0.33's code); ``MK_VLLM_ZOO_REQUESTS`` sets the
requests per deployment.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random

import pytest

import mooncake_keys as mk
import mooncake_keys.vllm as mv
from mooncake_keys.vllm.worker import FastLookup
from support import vllm_workers
from support.vllm_cases import ERROR_CODES

vllm_workers.quiet(logging.CRITICAL)
zoo = vllm_workers.model_zoo()
REQUESTS = int(os.environ.get("MK_VLLM_ZOO_REQUESTS", "16"))
DEPLOYMENTS = [(name, tp) for name in zoo.ARCHITECTURES for tp in zoo.TP_SIZES]
#: Deployments on which vLLM's lookup may raise where ours answers (docs/architecture.md).
RAISES_WHERE_WE_ANSWER = {"Llama-4-Scout"}


def wire(result):
    """The reply rank 0's lookup server sends for ``result`` (vLLM's own encoder)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.protocol import encode_lookup_response

    return encode_lookup_response(result)


def blob(hashes):
    """The hashes as vLLM's lookup server hands them to ``lookup`` (one buffer, its view)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BlobBlockHashes

    hash_len = len(hashes[0]) if hashes else 32
    return BlobBlockHashes(memoryview(b"".join(hashes)), hash_len)


@contextlib.contextmanager
def vllm_lookup_forbidden(worker):
    """vLLM's own lookup cannot run: the worker's method, the class's and its coordinator's hit
    rule raise while the body runs."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import MooncakeStoreWorker

    def forbidden(*args, **kwargs):
        raise AssertionError("vLLM's own lookup ran")

    fast = worker.lookup
    saved = (fast.original, MooncakeStoreWorker.lookup, worker.coord.find_longest_cache_hit)
    fast.original = forbidden
    MooncakeStoreWorker.lookup = forbidden
    worker.coord.find_longest_cache_hit = forbidden
    try:
        yield
    finally:
        fast.original, MooncakeStoreWorker.lookup = saved[0], saved[1]
        del worker.coord.find_longest_cache_hit  # the instance attribute set above
        assert worker.coord.find_longest_cache_hit == saved[2]


def lookup_records(worker):
    stats = worker.kv_connector_stats
    return [{k: v for k, v in r.items() if k != "duration_seconds"} for r in stats.data.get("lookup_exists", [])]


def request(rng, worker):
    """(num_tokens, hashes) as vLLM's scheduler sends them: a few scheduler blocks, or up to
    three of Llama 4's 8,192-token attention chunks; hashes covering the tokens (one in ten
    fewer), unaligned lengths."""
    sbs, hbs = worker.coord.lcm_block_size, worker.hash_block_size
    if rng.random() < 0.3:
        tokens = rng.randint(0, 3 * 8192 + sbs)
    else:
        tokens = rng.choice([0, 1, 2, 3, 5, 8, 13, 21, 34, 128]) * sbs + rng.choice([0, 0, 1, hbs - 1, sbs - 1])
    n = tokens // hbs
    if rng.random() < 0.1:
        n = rng.randrange(n + 1)
    hash_len = rng.choice([32, 32, 16])
    return tokens, [rng.randbytes(hash_len) for _ in range(n)]


def random_store(rng, hashes, n_groups):
    """A store holding a prefix of the request, as a save writes it (every group the same
    chunks, most of the time; now and then a group cut elsewhere), with random holes and odd
    codes (Mooncake's error codes, other integers)."""
    index = {h.hex(): i for i, h in enumerate(hashes)}
    common = rng.randint(0, len(hashes) + 1)
    cut = {g: common if rng.random() < 0.8 else rng.randint(0, len(hashes) + 1) for g in range(n_groups)}
    hole_rate = rng.choice([0.0, 0.0, 0.002, 0.02, 0.2])
    code_rate = rng.choice([0.0, 0.0, 0.01])
    salt = rng.random()

    def present(key):
        head, hx = key.rsplit("@", 1)
        g = int(head.rsplit("@group:", 1)[1])
        r = random.Random(f"{salt}:{key}").random()
        if r < code_rate:
            return ERROR_CODES[int(r * 1000) % len(ERROR_CODES)]
        return int(index.get(hx, len(hashes)) < cut[g] and r >= hole_rate)

    return present


def answer(lookup, num_tokens, hashes):
    try:
        return lookup(num_tokens, blob(hashes))
    except AssertionError as exc:
        if "vLLM's own lookup ran" in str(exc):
            raise
        return exc


def accelerated(worker, strategy):
    """The worker's lookup, accelerated again with ``strategy`` (vLLM's own kept as original)."""
    worker.lookup = worker.lookup.original
    assert mv.accelerate_worker(worker, strategy=strategy)
    worker.lookup.engine.rounds_min_keys = 0  # rounds at any size
    return worker.lookup


@pytest.mark.parametrize("name,tp", DEPLOYMENTS, ids=[f"{n}-tp{t}" for n, t in DEPLOYMENTS])
def test_the_served_model_is_accelerated_and_answers_as_vllm(name, tp):
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import MooncakeLookupResult

    worker = zoo.build_worker(name, tp, mk.RecordingStore())
    try:
        assert type(worker._built_connector) is mv.FastMooncakeStoreConnector
        assert isinstance(worker.lookup, FastLookup), name  # accelerated as vLLM's factory built it
        vllm_lookup = worker.lookup.original
        rng = random.Random(f"zoo:{name}:{tp}")
        raised = compared = hits = 0
        for _ in range(REQUESTS):
            num_tokens, hashes = request(rng, worker)
            present = random_store(rng, hashes, len(worker._kv_cache_groups))
            stores = [mk.RecordingStore(present=present) for _ in range(3)]  # vLLM, one-shot, rounds
            worker.store = stores[0]
            worker.kv_connector_stats.reset()
            want = answer(vllm_lookup, num_tokens, hashes)
            want_records = lookup_records(worker)
            got = {}
            for strategy, store in zip(("oneshot", "rounds"), stores[1:]):
                lookup = accelerated(worker, strategy)
                worker.store = store
                worker.kv_connector_stats.reset()
                with vllm_lookup_forbidden(worker):
                    got[strategy] = answer(lookup, num_tokens, hashes)
                assert isinstance(got[strategy], MooncakeLookupResult), (name, got[strategy])
                if strategy == "oneshot" and not isinstance(want, Exception):
                    assert lookup_records(worker) == want_records
            if isinstance(want, Exception):
                # Only where docs/architecture.md says vLLM raises and we answer.
                assert name in RAISES_WHERE_WE_ANSWER and isinstance(want, AssertionError), (name, want)
                assert got["oneshot"] == got["rounds"]
                raised += 1
                continue
            for strategy in ("oneshot", "rounds"):
                assert got[strategy] == want, (name, tp, strategy, num_tokens, len(hashes), got[strategy], want)
                assert wire(got[strategy]) == wire(want)
            assert stores[1].calls == stores[0].calls  # vLLM's very keys, one call
            assert sum(map(len, stores[2].calls)) <= sum(map(len, stores[0].calls))
            compared += 1
            hits += want.hit_length > 0
        print(f"{name} tp{tp}: compared {compared}, hits {hits}, vLLM raised {raised}")
        assert compared >= REQUESTS // 2 and hits > 0, (compared, raised, hits)
    finally:
        vllm_workers.release(worker)


def test_llama4_vllm_raises_where_a_chunked_local_hit_ends_on_a_chunk_start_and_ours_answers():
    """Full attention stored through three attention chunks, the chunked-local groups nowhere:
    the hit is the start of the last chunk (16,384 tokens), which needs none of the chunked
    groups' blocks; vLLM 0.33's tail check reads the absent block before it and raises
    ``AssertionError``; ours answers the hit, each chunked group's tail boundary at the hit."""
    worker = zoo.build_worker("Llama-4-Scout", 1, mk.RecordingStore())
    try:
        chunk = 8192
        full = [g for g, grp in enumerate(worker._kv_cache_groups)
                if type(grp.kv_cache_spec).__name__ == "FullAttentionSpec"]
        assert len(worker._kv_cache_groups) == 4 and len(full) == 1
        hbs = worker.hash_block_size
        hashes = [bytes([i % 256, i // 256]) * 16 for i in range(3 * chunk // hbs)]

        def present(key):
            return int(f"@group:{full[0]}@" in key)

        worker.store = mk.RecordingStore(present=present)
        with pytest.raises(AssertionError):
            worker.lookup.original(3 * chunk, blob(hashes))
        worker.store = mk.RecordingStore(present=present)
        with vllm_lookup_forbidden(worker):
            got = worker.lookup(3 * chunk, blob(hashes))
        assert got.hit_length == 2 * chunk
        assert {(b.group_id, b.num_tokens) for b in got.tail_key_boundaries} == {
            (g, 2 * chunk) for g in range(4)}
    finally:
        vllm_workers.release(worker)


def test_deepseek_v4_flash_is_laid_out_as_vllm_serves_it():
    """Five groups: the compressed MLA states (4 and 128 tokens a state, one group of 62 layers,
    256-token blocks) and sliding-window MLA groups (the 128-token window of every layer, split
    in two; the ratio-4 compressors' states, window 8; the ratio-128 ones', window 128);
    hashes of 4 tokens, scheduler block 256."""
    for tp in zoo.TP_SIZES:
        lay = zoo.layout("DeepSeek-V4-Flash", tp)
        assert (lay.scheduler_block_size, lay.hash_block_size) == (256, 4)
        groups = [(g["spec"], g["block_size"], g.get("sliding_window"), g["layers"]) for g in zoo.describe_layout(lay)]
        assert groups == [("SlidingWindowMLASpec", 64, 128, 22), ("SlidingWindowMLASpec", 64, 128, 21),
                          ("MLAAttentionSpec", 256, None, 62), ("SlidingWindowMLASpec", 4, 8, 42),
                          ("SlidingWindowMLASpec", 8, 128, 20)]
        mla = lay.kv_cache_configs[0].kv_cache_groups[2].kv_cache_spec  # the worker's: every layer's spec
        assert sorted({s.tokens_per_state for s in mla.kv_cache_specs.values()}) == [4, 128]
        assert all(type(g.kv_cache_spec).__name__ == "UniformTypeKVCacheSpecs"
                   for g in lay.kv_cache_configs[0].kv_cache_groups)


def test_hybrid_models_keep_their_groups_as_on_a_gpu():
    """On this machine vLLM's platform turns the hybrid KV-cache manager off (a CUDA GPU keeps
    it on) and would collapse a sliding-window or Mamba model into one group; the zoo builds
    layouts as a CUDA deployment gets them: gpt-oss keeps its sliding-window and full groups,
    Qwen3-Next its Gated DeltaNet (Mamba, align mode) groups beside full attention."""
    from vllm.platforms import current_platform

    assert current_platform.support_hybrid_kv_cache() is False
    gpt_oss = zoo.layout("gpt-oss-120b", 8)
    assert gpt_oss.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert [(g["spec"], g.get("sliding_window")) for g in zoo.describe_layout(gpt_oss)] == [
        ("SlidingWindowSpec", 128), ("FullAttentionSpec", None)]
    qwen = [g["spec"] for g in zoo.describe_layout(zoo.layout("Qwen3-Next-80B", 8))]
    assert qwen == ["MambaSpec"] * 3 + ["FullAttentionSpec"]


def test_the_engine_core_resolves_hit_alignment_on_the_schedulers_copy():
    """DeepSeek-V4's worker config holds only uniform-type groups: vLLM's alignment rule, asked
    of it, finds no manager for them (the harness's old pitfall); asked of the scheduler's copy,
    as the engine core asks, it answers, and every config carries the answer."""
    from vllm.v1.core import kv_cache_utils as kvu

    lay = zoo.layout("DeepSeek-V4-Flash", 1)
    worker_config = lay.kv_cache_configs[0]
    sched_bs, hash_bs = kvu.resolve_kv_cache_block_sizes(lay.scheduler_kv_cache_config, lay.vllm_config)
    with pytest.raises(Exception):
        kvu.resolve_cache_hit_alignment_tokens(worker_config, lay.vllm_config, sched_bs, hash_bs)
    assert kvu.resolve_cache_hit_alignment_tokens(lay.scheduler_kv_cache_config, lay.vllm_config,
                                                  sched_bs, hash_bs) == 256
    assert worker_config.cache_hit_alignment_tokens == lay.scheduler_kv_cache_config.cache_hit_alignment_tokens == 256
    assert worker_config.hash_block_size == 4


def test_the_flagship_benchmark_scenarios_are_vllms_layouts():
    """``mooncake_keys bench``'s DeepSeek-V4-Flash and Qwen3-Next scenarios (data in the package,
    so that a plain install measures them) are the deployments vLLM's own code builds: the bench
    builds vLLM's worker from the model zoo and refuses a scenario that is not its layout; the
    engine of the scenario and vLLM's worker answer alike."""
    import dataclasses

    from mooncake_keys.bench import vllm_baseline
    from mooncake_keys.bench.scenarios import FLAGSHIP, make_request, membership_answer, stub_store

    assert vllm_baseline.unavailable() is None
    for sc in FLAGSHIP.values():
        req = make_request(sc, 0)
        store = stub_store(membership_answer(sc, req))
        theirs = vllm_baseline.VllmLookup(sc, store)
        try:
            engine = mk.LookupEngine.for_deployment(sc.deployment(), store=store, strategy="oneshot")
            ours = engine.lookup(req.token_len, mk.BlockHashes.from_blob(req.blob, req.hash_len))
            assert ours == theirs.lookup(req.token_len, req.blob, req.hash_len) > 0
            assert vllm_baseline.layout_difference(sc, theirs.worker) is None
            other = dataclasses.replace(sc, layout=mk.ParallelLayout(tp_size=4, num_kv_heads=sc.layout.num_kv_heads,
                                                                     use_mla=sc.layout.use_mla))
            assert "lays it out as" in vllm_baseline.layout_difference(other, theirs.worker)
        finally:
            vllm_workers.release(theirs.worker)
