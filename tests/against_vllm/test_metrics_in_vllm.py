"""The drop-in's metrics through vLLM's own metrics path, on each release: the rows rank 0's
worker records travel as vLLM carries them (rebuilt by the connector class's
``build_kv_connector_stats``), its "KV Transfer metrics" summary (``reduce``) and vLLM's
``KVConnectorProm``, which builds the connector class's Prometheus metrics through vLLM's own
factory. On a known store, with a fault among the lookups, every value is exact: hits equal
vLLM's own lookup's, keys and calls those the store saw, present keys those it answered 1.
(tests/engine reads them from vLLM's real engine's /metrics.)"""

from __future__ import annotations

import copy
import logging

import pytest

import mooncake_keys as mk
from support import vllm_workers
from mooncake_keys.vllm.metrics import LOOKUP, SHARED_WAIT, add_row, shared_wait_row
from mooncake_keys.vllm.worker import FastLookup

vllm_workers.quiet(logging.CRITICAL)

CFG = {
    "kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
    "tp_size": 2, "num_kv_heads": 2, "groups": [{"type": "full", "block_size": 16}],
}
LABELS = {"model_name": "metrics-test", "engine": "0"}


def hit_of(answer):
    return vllm_workers.hit_length(answer)


def test_the_metrics_are_exact_through_vllms_own_path():
    prometheus_client = pytest.importorskip("prometheus_client")
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    present = set()
    store = mk.RecordingStore(present=present)
    worker = vllm_workers.build_worker(CFG, store)
    try:
        assert isinstance(worker.lookup, FastLookup)
        engine = worker.lookup.engine
        requests = []
        for r, stored_chunks in enumerate((6, 0, 256, 40)):
            hashes = [bytes([r, i % 256, i // 256]) * 8 for i in range(300)]  # 300 x 16 tokens
            present.update(engine.candidate_keys(stored_chunks * 16, hashes) if stored_chunks else [])
            requests.append((300 * 16, hashes))
        # vLLM's own lookup first, on the same store (its records dropped afterwards).
        expected_hits = [hit_of(worker.lookup.original(n, h)) for n, h in requests]
        worker.kv_connector_stats.data.clear()
        store.calls.clear()

        for n, h in requests[:2]:
            worker.lookup(n, h)
        store.fault = ConnectionError("master unreachable")
        assert hit_of(worker.lookup(*requests[2])) == 0  # a fault: 0, with a log line
        store.fault = None
        for n, h in requests[3:]:
            worker.lookup(n, h)
        answered = [k for call in store.calls[:2] + store.calls[3:] for k in call]  # the faulty call answered nothing

        # As vLLM carries them: plain data rebuilt by the connector class in the front end.
        connector_cls = mk.vllm.FastMooncakeStoreConnector
        rows = worker.kv_connector_stats.data[LOOKUP]
        assert len(rows) == 4 and {r["side"] for r in rows} == {"worker"}
        data = copy.deepcopy(worker.kv_connector_stats.data)
        # The scheduler side's rows of share_loads: two requests waited for a load that landed, one
        # for a load that did not land, one waited 1 s; the last two loaded themselves.
        for seconds, outcome in ((0.25, "landed"), (0.5, "landed"), (0.125, "dropped"), (1.0, "expired")):
            add_row(data, SHARED_WAIT, shared_wait_row(seconds, outcome))
        stats = connector_cls.build_kv_connector_stats(data=data)
        summary = stats.reduce()
        assert summary["mooncake_keys_lookups"] == 4 and summary["mooncake_keys_faults"] == 1
        assert summary["mooncake_keys_shared_load_waits"] == 4 and summary["mooncake_keys_shared_load_wait_ms"] == 468.8

        vllm_config, _ = vllm_workers.build_configs(CFG)
        prom = KVConnectorProm(vllm_config, list(LABELS), {0: list(LABELS.values())})
        prom.observe(stats.data, 0)

        def value(name, **labels):
            v = prometheus_client.REGISTRY.get_sample_value(name, {**LABELS, **labels})
            return 0.0 if v is None else v

        outcomes = {o: value("vllm:mooncake_keys_lookups_total", outcome=o, side="worker")
                    for o in ("hit", "miss", "fault")}
        hits = [expected_hits[0], expected_hits[1], 0, expected_hits[3]]
        assert outcomes == {"hit": sum(h > 0 for h in hits), "miss": sum(h == 0 for h in hits) - 1, "fault": 1}
        assert expected_hits[0] > 0 and expected_hits[1] == 0 and expected_hits[3] > 0
        assert value("vllm:mooncake_keys_lookup_hit_tokens_total", side="worker") == sum(hits)
        assert value("vllm:mooncake_keys_lookup_tokens_total", side="worker") == sum(n for n, _ in requests)
        assert value("vllm:mooncake_keys_lookup_keys_total", side="worker") == sum(len(c) for c in store.calls)
        assert value("vllm:mooncake_keys_lookup_calls_total", side="worker") == len(store.calls)
        assert value("vllm:mooncake_keys_lookup_present_keys_total", side="worker") == sum(k in present for k in answered)
        assert value("vllm:mooncake_keys_lookup_seconds_count", side="worker") == 4
        assert value("vllm:mooncake_keys_store_unavailable_seconds_total", side="worker") > 0  # from the fault on
        assert value("vllm:mooncake_keys_shared_load_waits_total", outcome="landed") == 2
        assert value("vllm:mooncake_keys_shared_load_waits_total", outcome="dropped") == 1
        assert value("vllm:mooncake_keys_shared_load_waits_total", outcome="expired") == 1
        assert value("vllm:mooncake_keys_shared_load_wait_seconds_total") == pytest.approx(1.875)
        with pytest.raises(ValueError, match="outcome"):
            shared_wait_row(0.5, True)
        # vLLM's own record of each store call is kept beside ours.
        assert len(stats.data["lookup_exists"]) == len(store.calls)
    finally:
        vllm_workers.release(worker)
