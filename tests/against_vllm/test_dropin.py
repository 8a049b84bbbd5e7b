"""The drop-in, with the real vLLM package: ``accelerate_worker`` against the worker's own
lookup, the connector resolved by vLLM's own factory, and deployments that must fall back.

For each random deployment, vLLM's worker is built by its own code; the same requests are asked
of its own lookup, then of the accelerated one, against the same store: results (vLLM's own
types, equal values), keys (one call, equal lists) and the ``lookup_exists`` metric records
(equal but for durations) must match, and every deployment the engine can express must be
accelerated. Accelerated with ``strategy="rounds"``, the results match too, from no more keys,
with a metric record per call.
"""

from __future__ import annotations

import logging
import os
import random
from types import SimpleNamespace

import pytest

import mooncake_keys as mk
import mooncake_keys.vllm as mv
from mooncake_keys.vllm.worker import FastLookup
from support import vllm_workers
from support.vllm_cases import Release, random_cfg, random_request, random_store, same_answers

vllm_workers.quiet(logging.CRITICAL)
RELEASE = Release.installed()
CASES = int(os.environ.get("MK_VLLM_DROPIN_CASES", "1500"))
SEED0 = int(os.environ.get("MK_VLLM_SEED0", "0"))  # a held-out run: another range of seeds
BATCHES = max(1, min(15, CASES))


def lookup_records(worker):
    stats = worker.kv_connector_stats
    return [{k: v for k, v in r.items() if k != "duration_seconds"} for r in stats.data.get("lookup_exists", [])]


def answers(worker, requests, stores):
    out = []
    for (num_tokens, hashes), store in zip(requests, stores):
        worker.store = store
        try:
            res = worker.lookup(num_tokens, hashes)
        except Exception as exc:  # noqa: BLE001 - vLLM's own crash is an outcome
            out.append(("raised", type(exc).__name__))
            continue
        out.append((type(res).__name__, repr(res)))
    return out


#: Over every batch: deployments accelerated and compared.
ACCELERATED = [0]


@pytest.mark.parametrize("batch", range(BATCHES))
def test_accelerated_worker_answers_as_vllm(batch):
    accelerated = 0
    for seed in range(SEED0 + batch * CASES // BATCHES, SEED0 + (batch + 1) * CASES // BATCHES):
        rng = random.Random(f"dropin:{seed}")
        cfg = random_cfg(rng, RELEASE)
        try:
            worker = vllm_workers.build_worker(cfg, mk.RecordingStore())
        except vllm_workers.ConfigRejected:
            continue
        try:
            requests = [random_request(rng, cfg, RELEASE) for _ in range(4)]
            plans = [random_store(rng, hashes, cfg) for _, hashes in requests]
            theirs = [same_answers(p) for p in plans]
            ours = [same_answers(p) for p in plans]
            want = answers(worker, requests, theirs)
            want_records = lookup_records(worker)
            original = worker.lookup
            # One-shot: vLLM's very keys in one call each, and its very metric records.
            worker.kv_connector_stats.reset()
            assert mv.accelerate_worker(worker, strategy="oneshot"), cfg  # every generated deployment is expressible
            assert isinstance(worker.lookup, FastLookup)
            got = answers(worker, requests, ours)
            for w, g, t, o, p in zip(want, got, theirs, ours, plans):
                if p.fault == "short":  # vLLM raises or reads part; ours is the fault answer, 0
                    assert g[1] in ("0", "MooncakeLookupResult(hit_length=0, tail_key_boundaries=())")
                    continue
                if w[0] == "raised":
                    assert g[0] != "raised"
                    continue
                assert g == w, cfg
                assert o.calls == t.calls
            if not any(p.fault == "short" for p in plans) and all(w[0] != "raised" for w in want):
                assert lookup_records(worker) == want_records
            # Rounds (here on lookups of any size): the same answers, one metric record per
            # call with that call's keys, never more keys than vLLM sends.
            worker.lookup = original
            worker.kv_connector_stats.reset()
            assert mv.accelerate_worker(worker, strategy="rounds"), cfg
            worker.lookup.engine.rounds_min_keys = 0
            in_rounds = [same_answers(p) for p in plans]
            got = answers(worker, requests, in_rounds)
            for w, g, t, o, p in zip(want, got, theirs, in_rounds, plans):
                if p.fault == "short":
                    assert g[1] in ("0", "MooncakeLookupResult(hit_length=0, tail_key_boundaries=())")
                elif w[0] == "raised":
                    assert g[0] != "raised"
                else:
                    assert g == w, cfg
                    assert sum(map(len, o.calls)) <= sum(map(len, t.calls))
            assert [r["num_keys"] for r in lookup_records(worker)] == [len(c) for s in in_rounds for c in s.calls]
            accelerated += 1
        finally:
            vllm_workers.release(worker)
    assert accelerated >= (CASES // BATCHES) // 2
    ACCELERATED[0] += accelerated


def test_the_count_of_deployments_accelerated_is_reported():
    """Every deployment vLLM accepted was accelerated (the batches assert it); the count goes to
    ``MK_VLLM_REPORT`` (JSON lines) when it is set."""
    assert ACCELERATED[0] > 0
    report = os.environ.get("MK_VLLM_REPORT")
    if report:
        import json

        from mooncake_keys.lookup import _core

        with open(report, "a", encoding="utf-8") as f:
            f.write(json.dumps({"release": vllm_workers.VLLM_VERSION, "core": "c" if _core.ACCELERATED else "py",
                                "test": "dropin", "accelerated": ACCELERATED[0]}) + "\n")


@pytest.mark.parametrize("group", [
    {"type": "mamba", "block_size": 16},
    {"type": "chunked_local", "block_size": 16, "attention_chunk_size": 64},
    {"type": "sink_full", "block_size": 16, "sink_len": 16},
    {"type": "swa_mla", "block_size": 16, "sliding_window": 40},
])
def test_every_group_kind_the_connector_accepts_is_accelerated(group, caplog):
    cfg = {"groups": [{"type": "full", "block_size": 16}, group], "reuse_model_config": True}
    worker = vllm_workers.build_worker(cfg, mk.RecordingStore(1))
    try:
        with caplog.at_level(logging.INFO, logger="mooncake_keys"):
            assert mv.accelerate_worker(worker) is True
        assert isinstance(worker.lookup, FastLookup)
        hashes = [bytes([i]) * 32 for i in range(8)]
        assert vllm_workers.hit_length(worker.lookup(128, hashes)) == vllm_workers.hit_length(
            worker.lookup.original(128, hashes))
    finally:
        vllm_workers.release(worker)


def test_a_group_kind_with_rules_of_its_own_keeps_vllms_lookup(caplog):
    """A spec whose manager changes the hit rule (here: a plugin's full-attention manager that
    never hits) cannot be reproduced: vLLM's own lookup stays, with one log line."""
    import dataclasses

    import torch
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    @dataclasses.dataclass(frozen=True)
    class PluginSpec(FullAttentionSpec):
        pass

    class PluginManager(FullAttentionManager):
        @classmethod
        def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, *args, **kwargs):
            return tuple([] for _ in kv_cache_group_ids), 0

    KVCacheSpecRegistry.register(PluginSpec, PluginManager, uniform_type_base_spec=FullAttentionSpec)
    spec = PluginSpec(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16)
    cfg = {"groups": [{"type": "full", "block_size": 16}, {"spec": spec}], "reuse_model_config": True}
    worker = vllm_workers.build_worker(cfg, mk.RecordingStore(1))
    try:
        original = worker.lookup
        with caplog.at_level(logging.INFO, logger="mooncake_keys"):
            assert mv.accelerate_worker(worker) is False
            assert mv.accelerate_worker(worker) is False
        assert worker.lookup == original
        lines = [r.getMessage() for r in caplog.records if r.name.startswith("mooncake_keys")]
        assert len(lines) == 1 and "keeping vLLM's own Mooncake lookup" in lines[0], lines
        assert "PluginSpec" in lines[0] and "PluginManager" in lines[0]
    finally:
        vllm_workers.release(worker)


def test_the_factory_resolves_the_connector_and_accelerates_rank_0():
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    cfg = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
           "tp_size": 2, "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True}
    vllm_config, _ = vllm_workers.build_configs(cfg)
    assert KVConnectorFactory.get_connector_class(vllm_config.kv_transfer_config) is mv.FastMooncakeStoreConnector
    rank0 = vllm_workers.build_worker(cfg, mk.RecordingStore(1))
    assert type(rank0._built_connector) is mv.FastMooncakeStoreConnector
    assert isinstance(rank0.lookup, FastLookup)
    other = vllm_workers.build_worker({**cfg, "tp_rank": 1}, mk.RecordingStore(1))
    assert not isinstance(other.lookup, FastLookup)  # only rank 0 answers lookups
    hashes = [bytes([i]) * 32 for i in range(4)]
    full = 48 if RELEASE.contract.rederives_full_hit else 64  # 0.27+ recompute the last block of a full hit
    assert vllm_workers.hit_length(rank0.lookup(64, hashes)) == vllm_workers.hit_length(other.lookup(64, hashes)) == full
    vllm_workers.release(rank0)
    vllm_workers.release(other)


def test_the_wire_view_of_hashes_is_read_without_a_copy():
    """On rank 0 the lookup server hands ``lookup`` vLLM's ``BlobBlockHashes`` over a ZMQ frame."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BlobBlockHashes

    from mooncake_keys.vllm.worker import block_hashes_from_vllm

    blob = bytearray(b"".join(bytes([i]) * 16 for i in range(5)) + b"xyz")  # trailing bytes ignored
    view = block_hashes_from_vllm(BlobBlockHashes(memoryview(blob), 16))
    assert len(view) == 5 and view.hash_len == 16 and view.blob.obj is blob
    assert len(block_hashes_from_vllm(BlobBlockHashes(memoryview(blob), 0))) == 0


def test_the_lookup_strategy_comes_from_the_connector_config():
    base = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
            "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True}
    default = vllm_workers.build_worker(base, mk.RecordingStore(1))
    rounds = vllm_workers.build_worker({**base, "extra_config": {"lookup_strategy": "rounds"}}, mk.RecordingStore(1))
    oneshot = vllm_workers.build_worker({**base, "extra_config": {"lookup_strategy": "oneshot"}}, mk.RecordingStore(1))
    assert oneshot.lookup.engine.strategy == "oneshot"
    vllm_workers.release(oneshot)
    assert default.lookup.engine.strategy == "rounds"  # asks least, with vLLM's answers
    assert rounds.lookup.engine.strategy == "rounds"
    vllm_workers.release(default)
    vllm_workers.release(rounds)
    with pytest.raises(ValueError, match="lookup_strategy.*must be one of"):
        vllm_workers.build_worker({**base, "extra_config": {"lookup_strategy": "fast"}}, mk.RecordingStore(1))


def test_share_loads_is_on_where_vllm_asks_asynchronously_and_loads_asynchronously(caplog):
    """The scheduler-side connector holds a SharedLoads (of vLLM's hash block size) only with
    vLLM's lookup_async and load_async, unless share_loads is false; anything but a bool is
    refused at start."""
    base = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
            "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True}
    for extra, on in (({}, False), ({"lookup_async": True}, True), ({"lookup_async": True, "load_async": False}, False),
                      ({"lookup_async": True, "share_loads": False}, False), ({"share_loads": True}, False)):
        connector = vllm_workers.build_scheduler_connector({**base, "extra_config": extra})
        try:
            shared = connector._shared_loads
            assert (shared is not None) is on, extra
            assert shared is None or shared.hash_block_tokens == connector.connector_scheduler._hash_block_size == 16
        finally:
            connector.connector_scheduler.client.close()
    # Whatever goes wrong in the policy, the scheduler goes on with vLLM's behaviour and a log line.
    connector = vllm_workers.build_scheduler_connector({**base, "extra_config": {"lookup_async": True}})
    try:
        odd = SimpleNamespace(request_id="r", block_hashes=[bytearray(16)], num_tokens=1)  # unhashable
        ours = logging.getLogger("mooncake_keys")  # it may not propagate: inside vLLM it joins vLLM's stream
        ours.addHandler(caplog.handler)
        try:
            with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
                assert connector.get_num_new_matched_tokens(odd, 0) == (0, False)
        finally:
            ours.removeHandler(caplog.handler)
        assert connector._shared_loads is None and "share_loads is off for this engine" in caplog.text
    finally:
        connector.connector_scheduler.client.close()
    with pytest.raises(ValueError, match="share_loads.*must be true or false"):
        vllm_workers.build_scheduler_connector({**base, "extra_config": {"lookup_async": True, "share_loads": "yes"}})


def test_vllms_reset_forgets_the_loads_share_loads_knew():
    """vLLM's reset (reset_cache: rank 0 removes every key with force, over vLLM's ZMQ channel)
    drops the loads the scheduler side knew of: a request held on one goes on ("dropped"), as
    its blocks are gone from the store."""
    cfg = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
           "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True, "lookup_server": True,
           "extra_config": {"lookup_async": True, "lookup_rpc_port": 43}}
    memory = mk.MemoryStore()
    worker = vllm_workers.build_worker(cfg, memory)
    connector = vllm_workers.build_scheduler_connector(cfg)
    waits = []
    try:
        shared = connector._shared_loads
        shared._on_wait = lambda seconds, outcome: waits.append(outcome)
        hashes = [bytes([i]) * 32 for i in range(4)]
        shared.loading("a", hashes, 0, 64)
        assert shared.waits("b", hashes, 0)
        memory.put("kept-until-the-reset")
        assert connector.reset_cache() is True
        assert len(memory) == 0 and len(shared) == 0
        assert not shared.waits("b", hashes, 0) and waits == ["dropped"]
    finally:
        connector.connector_scheduler.client.close()
        vllm_workers.release(worker)


def test_rank_0_answers_what_vllm_can_send_as_vllm_does_and_is_never_sent_more():
    """The library refuses a num_tokens outside 0 .. 2**32 - 1; vLLM's lookup channel carries a
    u32, so its client cannot send one (it logs and answers 0 itself), and rank 0's accelerated
    lookup answers every value it can receive as vLLM's own lookup does (or raises where it raises)."""
    cfg = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
           "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True, "lookup_server": True,
           "extra_config": {"lookup_rpc_port": 44}}
    worker = vllm_workers.build_worker(cfg, mk.RecordingStore(lambda keys: [1] * len(keys)))
    connector = vllm_workers.build_scheduler_connector(cfg)
    client = connector.connector_scheduler.client  # vLLM's own LookupKeyClient (no in-scheduler lookup)
    try:
        assert isinstance(worker.lookup, FastLookup)
        hashes = [bytes([i]) * 32 for i in range(8)]
        for n in (-1, -64, 2**32, 10**20):
            assert vllm_workers.hit_length(client.lookup(f"r{n}", n, hashes)) == 0  # never reaches rank 0
        for n in (0, 1, 15, 16, 128, 129, 2**32 - 16, 2**32 - 1):
            def outcome(lookup):
                try:
                    return repr(lookup(n, hashes))
                except Exception as exc:  # noqa: BLE001 - vLLM's own raise is an outcome
                    return f"raised {type(exc).__name__}"
            ours, vllms = outcome(worker.lookup), outcome(worker.lookup.original)
            assert ours == vllms or (ours.startswith("raised") and vllms.startswith("raised")), (n, ours, vllms)
            if not ours.startswith("raised") and n % 16 == 0:  # over vLLM's channel, too
                assert repr(client.lookup(f"w{n}", n, hashes)) == vllms
    finally:
        client.close()
        vllm_workers.release(worker)


def test_a_generic_model_folder_without_a_cache_prefix_is_warned_about(caplog):
    """vLLM names keys by the model path's last component: two models saved in folders named
    alike share keys. The drop-in keeps vLLM's keys and says so once at start."""
    base = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
            "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True}
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        for model, extra in (("/data/run-7/checkpoint-1000", {}), ("org/Llama-3-8B", {}),
                             ("/data/run-8/checkpoint-1000", {"cache_prefix": "run-8"})):
            worker = vllm_workers.build_worker({**base, "model": model, **extra}, mk.RecordingStore(1))
            assert isinstance(worker.lookup, FastLookup)
            vllm_workers.release(worker)
    lines = [r.getMessage() for r in caplog.records if "share its keys" in r.getMessage()]
    assert len(lines) == 1 and "'checkpoint-1000'" in lines[0] and "cache_prefix" in lines[0]
