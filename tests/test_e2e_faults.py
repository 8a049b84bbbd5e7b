"""A lookup engine and KV pools on a real mooncake_master that dies and comes back.

The scheduler must never crash or stall on a store fault: with the master killed, lookups
answer 0 quickly with a log line; after a restart they work again (the master is in-memory,
so hits are 0 until the prompt is saved again).
"""

from __future__ import annotations

import logging
import time

import pytest

pytest.importorskip("mooncake.store")
torch = pytest.importorskip("torch")

import mooncake_keys as mk  # noqa: E402

pytestmark = pytest.mark.mooncake

F, S = mk.FullAttentionSpec, mk.SlidingWindowSpec
GROUPS = [mk.KVCacheGroup(F(32)), mk.KVCacheGroup(S(16, 32))]
LAYOUT = mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2)


def _holds(cond):
    try:
        return cond()
    except mk.MooncakeStoreError:  # unavailable while the client reconnects
        return False


def _wait(cond, timeout, what):
    deadline = time.monotonic() + timeout
    while not _holds(cond):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def master(tmp_path_factory):
    with mk.LocalMaster(log_path=tmp_path_factory.mktemp("e2e-fault") / "master.log") as m:
        yield m


@pytest.fixture(scope="module")
def store(master):
    s = mk.MooncakeStore.connect(master.master_address)
    yield s
    if not master.is_running():
        master.start()
        _wait(lambda: s.health_check() == 0, 10, "reconnect before close")
    s.close()


def _save_everywhere(store, hashes, token_len):
    ranks = LAYOUT.ranks()
    caches = [[torch.full((token_len // g.spec.block_size, 32), r, dtype=torch.uint8) for g in GROUPS]
              for r in range(len(ranks))]
    ids = [list(range(token_len // g.spec.block_size)) for g in GROUPS]
    for rank, cache in zip(ranks, caches):
        with mk.KVPool("e2e", GROUPS, LAYOUT, rank=rank, kv_caches=cache, hash_block_size=16,
                       store=store, vllm_compat="0.25") as pool:
            assert pool.save(token_len, hashes, ids).ok


def test_dead_master_answers_zero_fast_then_restart_recovers(master, store, caplog):
    engine = mk.LookupEngine("e2e", GROUPS, LAYOUT, hash_block_size=16, store=store, vllm_compat="0.25")
    hashes = [bytes([i]) * 32 for i in range(1, 9)]  # 8 hashes of 16 tokens = 128 tokens
    _save_everywhere(store, hashes, 128)
    assert engine.lookup(128, hashes) == 128

    master.kill()
    _wait(lambda: engine.lookup(128, hashes) == 0, 3, "lookups to answer 0 after the kill")
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        for _ in range(20):
            start = time.monotonic()
            assert engine.lookup(128, hashes) == 0
            assert time.monotonic() - start < 2.5  # refused without a call (~1 ms); a raw call stalls ~4.3 s here, so a loaded machine's margin stays below that
    lines = [r.getMessage() for r in caplog.records if r.name == "mooncake_keys.lookup"]
    assert len(lines) == 20 and all("unavailable" in line for line in lines), lines[:2]

    master.start()  # same ports; every key is gone
    _wait(lambda: store.health_check() == 0 and not store._probe.down, 15, "the client to reconnect")
    _wait(lambda: store.batch_is_exist(["x"]) == [0], 5, "batch_is_exist to work again")
    calls = engine.stats().store_failures
    assert engine.lookup(128, hashes) == 0  # asked, answered, nothing there: the master forgot
    assert engine.stats().store_failures == calls
    _wait(lambda: store.put("e2e-ready", b"1") == 0, 5, "puts to work again")
    _save_everywhere(store, hashes, 128)
    assert engine.lookup(128, hashes) == 128


def test_lookup_engine_on_a_closed_store_answers_zero(master, caplog):
    s = mk.MooncakeStore.connect(master.master_address if master.is_running() else master.start().master_address)
    engine = mk.LookupEngine("e2e", GROUPS, LAYOUT, hash_block_size=16, store=s, vllm_compat="0.25")
    s.close()
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert engine.lookup(128, [b"\x01" * 32] * 8) == 0
    assert any("store is closed" in r.getMessage() for r in caplog.records)
