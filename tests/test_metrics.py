"""The library's own Prometheus metrics (mooncake_keys.metrics): exact values on a known store,
faults and the unavailable time; the metrics add up to the engine's stats."""

from __future__ import annotations

import time

import pytest

import mooncake_keys as mk

prom = pytest.importorskip("prometheus_client")
from mooncake_keys.metrics import LookupMetrics  # noqa: E402

F = mk.FullAttentionSpec


def value(registry, name, **labels):
    v = registry.get_sample_value(name, labels or None)
    return 0.0 if v is None else v


def test_metrics_count_every_lookup_exactly(impl):
    registry = prom.CollectorRegistry()
    hashes = [bytes([i]) * 16 for i in range(8)]
    engine = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16,
                             store=mk.RecordingStore(lambda keys: [int(i < 6) for i in range(len(keys))]), strategy="oneshot")
    LookupMetrics(engine, registry=registry, labels={"deployment": "d"})
    assert engine.lookup(128, hashes) == 48
    assert engine.lookup(128, hashes[:1]) == 16
    engine.store = mk.RecordingStore(0)
    assert engine.lookup(128, hashes) == 0
    engine.store = mk.RecordingStore(fault=ConnectionError("gone"))
    assert engine.lookup(128, hashes) == 0
    time.sleep(0.01)
    engine.store = mk.RecordingStore(1)
    assert engine.lookup(64, hashes[:4]) == 48  # the last token is recomputed (vLLM 0.33)
    d = {"deployment": "d"}
    assert value(registry, "mooncake_keys_lookups_total", outcome="hit", **d) == 3
    assert value(registry, "mooncake_keys_lookups_total", outcome="miss", **d) == 1
    assert value(registry, "mooncake_keys_lookups_total", outcome="fault", **d) == 1
    assert value(registry, "mooncake_keys_lookup_tokens_total", **d) == 128 * 4 + 64
    assert value(registry, "mooncake_keys_lookup_hit_tokens_total", **d) == 48 + 16 + 48
    assert value(registry, "mooncake_keys_lookup_keys_total", **d) == 16 + 2 + 16 + 16 + 8
    assert value(registry, "mooncake_keys_lookup_calls_total", **d) == 5
    assert value(registry, "mooncake_keys_lookup_present_keys_total", **d) == 6 + 2 + 0 + 0 + 8
    assert value(registry, "mooncake_keys_lookup_seconds_count", **d) == 5
    assert value(registry, "mooncake_keys_store_unavailable_seconds_total", **d) >= 0.01
    stats = engine.stats()  # they add up to the engine's own counters
    assert stats.hit_tokens == value(registry, "mooncake_keys_lookup_hit_tokens_total", **d)
    assert stats.present_keys == value(registry, "mooncake_keys_lookup_present_keys_total", **d)


def test_arguments_are_checked():
    with pytest.raises(TypeError, match="engine must be a LookupEngine"):
        LookupMetrics(object(), registry=prom.CollectorRegistry())
    engine = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=mk.RecordingStore())
    with pytest.raises(TypeError, match="labels must map str to str"):
        LookupMetrics(engine, registry=prom.CollectorRegistry(), labels={"a": 1})
