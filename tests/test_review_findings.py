"""Reproducers of defects a second adversarial review found, each a regression test.

Each one failed before its fix: work that grew with a block-size ratio, a store namespace that
let two deployments share keys, error codes answered with no log line, arguments of the store
layer, the key types and the exported Coordinator that raised the wrong error or none.
Engine items run on both cores (the ``impl`` fixture).
"""

from __future__ import annotations

import logging
import os
import tempfile
import time

import pytest

import mooncake_keys as mk
from mooncake_keys.lookup.contract import get_contract
from mooncake_keys.lookup.coordinator import Coordinator
from mooncake_keys.store.config import MooncakeStoreConfig, parse_size

F, S = mk.FullAttentionSpec, mk.SlidingWindowSpec
HS = [bytes([i]) * 16 for i in range(8)]


# ------------------------------------------------------------ work bounded by the hashes
@pytest.mark.parametrize("groups, sbs", [([F(1)], 2**24), ([F(2**31), S(1, 2)], None)])
def test_a_scheduler_block_of_too_many_chunks_is_refused(groups, sbs):
    """One hash and scheduler_block_size 2**24 over 1-token blocks took seconds and 834 MB; the
    lcm of F(2**31) and S(1) over 1-token hashes ran for minutes."""
    with pytest.raises(ValueError, match=r"scheduler_block_size \(\d+ tokens.*at most 65536"):
        mk.LookupEngine("m", groups, mk.ParallelLayout(), hash_block_size=1, scheduler_block_size=sbs,
                        store=mk.MemoryStore())


def test_at_the_chunk_limit_a_made_up_length_costs_what_the_hashes_cost(impl):
    e = mk.LookupEngine("m", [F(1)], mk.ParallelLayout(), hash_block_size=1, scheduler_block_size=1 << 16,
                        store=mk.MemoryStore())
    t = time.perf_counter()
    for _ in range(3):
        assert e.lookup((1 << 32) - 1, [b"\x01" * 32]) == 0
    assert time.perf_counter() - t < 5  # generous: a 2**24 table took seconds per lookup


def test_kvpool_refuses_the_same_scheduler_block():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="at most 65536"):
        mk.KVPool("m", [F(1)], mk.ParallelLayout(), rank=(0, 0, 0, 0), kv_caches=torch.zeros(4, 8),
                  hash_block_size=1, scheduler_block_size=2**20, store=mk.MemoryStore())


# ------------------------------------------------------------ names that collide
def test_a_free_form_store_namespace_cannot_reach_another_deployments_keys():
    store = mk.MemoryStore()
    tenant = mk.LookupEngine("x", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store, cache_prefix="c")
    with pytest.raises(ValueError, match="store_namespace '@x' is not vLLM's store namespace"):
        mk.LookupEngine("c", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store, store_namespace="@x")
    # opted in, the collision is real: the very keys of the other tenant
    other = mk.LookupEngine("c", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                            store_namespace="@x", allow_ambiguous_names=True)
    assert tenant.candidate_keys(64, HS) == other.candidate_keys(64, HS)


def test_a_model_name_that_reads_as_a_namespace_tag_is_refused():
    store = mk.MemoryStore()
    tagged = mk.LookupEngine("c", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                             store_namespace="@store_tp:4")
    with pytest.raises(ValueError, match="model_name 'store_tp:4' reads as a store namespace tag"):
        mk.LookupEngine("store_tp:4", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                        cache_prefix="c")
    other = mk.LookupEngine("store_tp:4", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store,
                            cache_prefix="c", allow_ambiguous_names=True)
    assert tagged.candidate_keys(64, HS) == other.candidate_keys(64, HS)


def test_vllms_own_store_namespaces_are_accepted():
    for ns in ("@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc", "@store_pp:2@store_format:tp_shared_mqa",
               "@store_pp:1@store_format:rank_local_tp4_layout_HND"):
        e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=mk.MemoryStore(),
                            store_namespace=ns)
        assert e.candidate_keys(16, HS)[0].startswith(f"m{ns}@tp_rank:0@")


# ------------------------------------------------------------ error codes say why
def test_error_codes_that_end_the_hit_get_one_line(impl, caplog):
    e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16,
                        store=mk.RecordingStore(-900))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert e.lookup(128, HS) == 0
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("mooncake_keys")]
    assert len(lines) == 1 and "error code [-900]" in lines[0], lines
    caplog.clear()
    # A code past the first absent chunk does not end the hit there: no line.
    e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16,
                        store=mk.RecordingStore(lambda keys: [1, 1, 0, 1] + [-900] * (len(keys) - 4)))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert e.lookup(128, HS) == 16
    assert not [r for r in caplog.records if r.name.startswith("mooncake_keys")]


# ------------------------------------------------------------ store-layer arguments
@pytest.mark.parametrize("value", ["9" * 400, float("inf"), 2**70])
def test_an_enormous_size_is_a_value_error(value):
    with pytest.raises(ValueError, match="larger than"):
        parse_size(value)
    with pytest.raises(ValueError, match="global_segment_size"):
        MooncakeStoreConfig(global_segment_size=value)


@pytest.mark.parametrize("path", [1, True])
def test_a_config_path_that_is_an_int_is_refused_and_no_descriptor_closed(path):
    fd, name = tempfile.mkstemp()
    try:
        with pytest.raises(TypeError, match="must be a str or os.PathLike"):
            MooncakeStoreConfig.from_file(path)
        os.fstat(1)  # stdout is still open
    finally:
        os.close(fd)
        os.unlink(name)


def test_a_deeply_nested_config_is_a_value_error(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="nested too deeply"):
        MooncakeStoreConfig.from_file(p)


@pytest.mark.parametrize("kw, exc, message", [
    (dict(call_timeout_s=float("nan")), ValueError, "call_timeout_s must be > 0"),
    (dict(call_timeout_s=10**30), ValueError, "call_timeout_s must be > 0"),
    (dict(call_timeout_s=None), TypeError, "call_timeout_s must be a number"),
    (dict(probe_interval_s=float("inf")), ValueError, "probe_interval_s must be > 0"),
    (dict(probe_interval_s=float("nan")), ValueError, "probe_interval_s must be > 0"),
    (dict(rpc_timeout_ms="abc"), TypeError, "rpc_timeout_ms must be an int"),
    (dict(rpc_timeout_ms=0), ValueError, "rpc_timeout_ms must be >= 1"),
    (dict(setup_retries=-1), ValueError, "setup_retries must be >= 0"),
    (dict(local_hostname=None), TypeError, "local_hostname must be a str"),
    (dict(metadata_server="\ud800"), ValueError, "metadata_server must be valid text"),
    (dict(device_name=None), TypeError, "device_name must be a str"),
    (dict(global_segment_size=2**70), ValueError, "larger than"),
    (dict(lookup_only=1), TypeError, "lookup_only must be a bool"),
])
def test_connect_checks_every_argument_before_a_client_exists(kw, exc, message):
    from mooncake_keys.store.mooncake import MooncakeStore

    t = time.monotonic()
    with pytest.raises(exc, match=message):
        MooncakeStore.connect("127.0.0.1:1", **kw)  # no master there: a setup would take seconds
    assert time.monotonic() - t < 1


@pytest.mark.parametrize("address", ["h:²", "h:" + "9" * 5000, "h:١٢٣", "\ud800:1", "h:0", "h:65536"])
def test_a_master_address_port_must_be_ascii_digits_in_range(address):
    from mooncake_keys.store.mooncake import MooncakeStore

    with pytest.raises(ValueError, match="master_address must be"):
        MooncakeStore.connect(address)


@pytest.mark.parametrize("kw, exc, message", [
    (dict(rpc_port=-1), ValueError, "rpc_port must be >= 1"),
    (dict(rpc_port=70000), ValueError, "rpc_port must be <= 65535"),
    (dict(rpc_port=True), TypeError, "rpc_port must be an int"),
    (dict(metrics_port=-5), ValueError, "metrics_port must be >= 1"),
    (dict(ready_timeout=float("nan")), ValueError, "ready_timeout must be > 0"),  # hung forever
    (dict(ready_timeout=None), TypeError, "ready_timeout must be a number"),
    (dict(default_kv_lease_ttl=float("inf")), TypeError, "default_kv_lease_ttl must be an int"),
])
def test_local_master_checks_its_arguments_before_starting(kw, exc, message):
    from mooncake_keys.store.local_master import LocalMaster

    with pytest.raises(exc, match=message):
        LocalMaster(**kw)


def test_local_cluster_checks_its_arguments():
    from mooncake_keys.store.local_cluster import LocalCluster

    with pytest.raises(ValueError, match="masters must be >= 1"):
        LocalCluster(0)
    with pytest.raises(TypeError, match="masters must be an int"):
        LocalCluster(2.0)
    with pytest.raises(ValueError, match="ready_timeout must be > 0"):
        LocalCluster(2, ready_timeout=-1)


# ------------------------------------------------------------ key types, Coordinator
def test_pool_key_names_its_bad_fields():
    md = mk.KeyMetadata("m", 0, 0, 0, 0)
    for bad in (None, "x"):
        with pytest.raises(TypeError, match="key_metadata must be a KeyMetadata"):
            mk.PoolKey(bad, "ab")
    with pytest.raises(TypeError, match="key_metadata must be a KeyMetadata"):
        mk.PoolKey.build_prefix(None)
    with pytest.raises(TypeError, match="chunk_hash must be a str"):
        mk.PoolKey(md, None)
    assert mk.PoolKey(md, "ab").to_string() == "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@ab"


def test_the_coordinator_checks_its_arguments():
    c033 = get_contract("0.33")
    grp = mk.KVCacheGroup(F(16))
    with pytest.raises(ValueError, match="scheduler_block_size must be >= 1"):
        Coordinator([grp], 0, contract=c033, hash_block_size=16)
    with pytest.raises(TypeError, match="contract must be a Contract"):
        Coordinator([grp], 16, contract="0.33", hash_block_size=16)
    with pytest.raises(TypeError, match="groups must be a non-empty sequence of KVCacheGroup"):
        Coordinator([F(16)], 16, contract=c033, hash_block_size=16)
    co = Coordinator([grp], 16, contract=c033, hash_block_size=16)
    with pytest.raises(ValueError, match="max_length .* is far past the presence"):
        co.check_presence([b"\x01"], 10**9)  # was a MemoryError at 10**12
    with pytest.raises(ValueError, match="max_length must be <="):
        co.check_presence([b"\x01"], 10**12)
    with pytest.raises(TypeError, match="presence must hold one bytes or bytearray per group"):
        co.check_presence([], 16)
    with pytest.raises(TypeError, match="presence must hold one bytes or bytearray per group"):
        co.check_presence([[1]], 16)
    co.check_presence([b"\x01\x01\x00"], 48)
    assert co.longest_hit([b"\x01\x01\x00"], 48) == 32


def test_key_metadata_refuses_text_utf8_cannot_encode():
    for kw in (dict(model_name="\ud800"), dict(model_name="m", cache_prefix="\udcff"),
               dict(model_name="m", store_namespace="@store_tp:\ud800")):
        name = next(k for k, v in kw.items() if not v.isascii() or "\ud800" in v or "\udcff" in v)
        with pytest.raises(ValueError, match=f"{name} must be valid text"):
            mk.KeyMetadata(kw.pop("model_name"), 0, 0, 0, 0, **kw)
