"""The lookup in the scheduler (vLLM 0.33): the scheduler-side FastMooncakeStoreConnector answers
in-process through its own lookup-only Mooncake client, and gives the answers rank 0 gives over
vLLM's ZMQ channel; on a real mooncake_master."""

from __future__ import annotations

import json
import logging
import random

import pytest

pytest.importorskip("mooncake.store")

import mooncake_keys.vllm as mv  # noqa: E402
from mooncake_keys.bench import vllm_workers  # noqa: E402
from mooncake_keys.store.local_master import LocalMaster  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402
from mooncake_keys.vllm.scheduler import SchedulerLookupClient  # noqa: E402

vllm_workers.quiet(logging.CRITICAL)

CFG = {
    "kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
    "tp_size": 2, "pp_size": 2, "num_kv_heads": 2, "reuse_model_config": True, "lookup_server": True,
    "groups": [{"type": "full", "block_size": 16}, {"type": "swa", "block_size": 16, "sliding_window": 32}],
    "extra_config": {"lookup_in_scheduler": True, "lookup_rpc_port": 7},
}


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with LocalMaster(log_path=tmp_path_factory.mktemp("sched") / "master.log") as m:
        yield m


@pytest.fixture
def deployment(master, tmp_path, monkeypatch):
    config = tmp_path / "mooncake.json"
    config.write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "master_server_address": master.master_address,
                                  "protocol": "tcp", "device_name": "", "global_segment_size": 64 << 20,
                                  "local_buffer_size": 16 << 20}))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(config))
    holder = MooncakeStore.connect(master.master_address)
    worker = vllm_workers.build_worker(CFG, holder)
    try:
        yield holder, worker
    finally:
        vllm_workers.release(worker)
        holder.remove_all(force=True)
        holder.close()


def test_scheduler_answers_as_rank_0_does(deployment):
    holder, worker = deployment
    assert isinstance(worker.lookup, mv.worker.FastLookup)  # rank 0, accelerated
    connector = vllm_workers.build_scheduler_connector(CFG)
    sched = connector.connector_scheduler
    try:
        assert isinstance(sched.client, SchedulerLookupClient) and sched.client.verified
        engine = worker.lookup.engine
        rng = random.Random(3)
        asked = 0
        for i in range(40):
            n = rng.randint(1, 24)
            hashes = [rng.randbytes(32) for _ in range(n)]
            stored = rng.randint(0, n) * 16
            for k in engine.candidate_keys(max(stored, 16) if stored else 0, hashes) if stored else []:
                holder.put(k, b"kv")
            num_tokens = n * 16 + rng.choice([0, 1, 7])
            in_process = sched.client.lookup(f"r{i}", num_tokens, hashes)
            over_zmq = sched.client.zmq.lookup(f"z{i}", num_tokens, hashes)
            vllm_own = worker.lookup.original(num_tokens, hashes)
            assert in_process == over_zmq == vllm_own, (i, in_process, over_zmq, vllm_own)
            asked += bool(in_process.hit_length)
        assert asked >= 10
    finally:
        sched.client.close()


def test_without_a_store_config_the_zmq_path_stays(deployment, monkeypatch, caplog):
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH")
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        connector = vllm_workers.build_scheduler_connector(CFG)
    client = connector.connector_scheduler.client
    try:
        assert not isinstance(client, SchedulerLookupClient)
        assert any("lookups stay on the ZMQ path" in r.getMessage() for r in caplog.records)
        _, worker = deployment
        hashes = [bytes([i]) * 32 for i in range(4)]
        assert client.lookup("r", 64, hashes) == worker.lookup(64, hashes)
    finally:
        client.close()


def test_keys_that_differ_from_rank_0s_keep_the_zmq_path(deployment, tmp_path):
    """The scheduler answers only once rank 0's published prefixes confirm its own."""
    _, worker = deployment
    connector = vllm_workers.build_scheduler_connector(CFG)
    client = connector.connector_scheduler.client
    try:
        path = client.path
        good = open(path).read()
        data = json.loads(good)
        data["prefixes"][0][0] = "someone-else@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"
        with open(path, "w") as f:
            json.dump(data, f)
        other = SchedulerLookupClient(client.zmq, client.engine, client.store, path)
        assert not other.verified
        hashes = [bytes([i]) * 32 for i in range(4)]
        assert other.lookup("r", 64, hashes) == worker.lookup(64, hashes)  # answered over ZMQ
        with open(path, "w") as f:
            f.write(good)
    finally:
        client.close()
