"""The plugin inside SGLang 0.5.23: found by SGLang's own plugin loader through the entry point
pyproject.toml declares, its hooks applied by SGLang's HookRegistry, SGLang's own query path
(``HybridCacheController._storage_hit_query``) answered by ours with SGLang's answers; what it
cannot reproduce keeps SGLang's lookup with one log line; the negative cache across re-polls,
forgotten by SGLang's own writes; spans SGLang assumes stored never reach it. Also the direct
linker's key grammar and the storage model name, against SGLang's own functions."""

from __future__ import annotations

import importlib.metadata
import logging
import random
from types import SimpleNamespace

import pytest

from harness import Case, Pool, page_hashes


def stored_prefix(oracle, holder, store, case, hashes, pages):
    kv, _ = oracle.sglang_keys(store, case, hashes)
    per = len(kv) // len(hashes)
    keys = kv[: pages * per]
    if keys:
        assert holder.put_batch(keys, [b"x"] * len(keys)) == 0
    return keys


def sglang_warnings(caplog):
    return [r for r in caplog.records if r.name.startswith("mooncake_keys") and r.levelno >= logging.WARNING]


def test_sglang_finds_the_entry_point_and_hooks_its_mooncake_store(plugins):
    cls, plugin = plugins
    from sglang.srt.plugins.hook_registry import HookRegistry

    eps = [ep for ep in importlib.metadata.entry_points(group="sglang.srt.plugins") if ep.name == "mooncake_keys"]
    assert [ep.value for ep in eps] == ["mooncake_keys.sglang.plugin:register"]
    assert eps[0].dist.name == "mooncake-keys"
    for name in ("batch_exists", "batch_exists_v2", "_put_batch_zero_copy_impl"):
        assert f"{plugin.TARGET}.{name}" in HookRegistry._patched


def test_a_store_not_turned_on_runs_sglangs_own_lookup(oracle, holder, master_address):
    from mooncake_keys.sglang import plugin

    case = Case(seed=11, tp=2, page=4, pages=40)
    hashes = page_hashes(case)
    store = oracle.build_store(case, (1, 0, 0), master_address)
    stored_prefix(oracle, holder, store, case, hashes, 17)
    assert plugin.lookup_of(store) is None
    before = len(store.calls)
    assert oracle.result_of(store, case, hashes)["hit_tokens"] == 17 * 4
    assert [len(c) for c in store.calls[before:]] == [80]  # SGLang's one call of every key


def test_sglangs_query_path_is_answered_by_ours_with_its_answers(oracle, holder, master_address, caplog):
    from mooncake_keys.sglang import plugin

    case = Case(seed=12, tp=2, page=16, pages=2000, model="meta-llama/Llama-3.1-8B-Instruct")
    hashes = page_hashes(case)
    theirs = oracle.build_store(case, (0, 0, 0), master_address)
    stored_prefix(oracle, holder, theirs, case, hashes, 600)
    with caplog.at_level(logging.INFO, logger="mooncake_keys"):
        ours = oracle.build_store(case, (0, 0, 0), master_address, True)
        want, got = oracle.result_of(theirs, case, hashes), oracle.result_of(ours, case, hashes)
    assert got["hit_tokens"] == want["hit_tokens"] == 600 * 16 and got["hash_value"] == want["hash_value"]
    assert got["verdicts"] == want["verdicts"]
    lookup = plugin.lookup_of(ours)
    assert lookup.stats().queries == 1 and lookup.strategy == "rounds"
    sent, sglang_sent = sum(map(len, got["calls"])), sum(map(len, want["calls"]))
    assert sglang_sent == 4000 and sent < 1400, (sent, sglang_sent)  # 1,200 below the hit, a probe gap past it
    info = [r.getMessage() for r in caplog.records if r.name == "mooncake_keys.sglang"]
    assert len(info) == 1 and "answered by mooncake_keys" in info[0] and not sglang_warnings(caplog)


def test_a_miss_re_polled_asks_nothing_until_the_ttl_or_a_write_of_this_process(oracle, holder, master_address):
    from mooncake_keys.sglang import plugin

    case = Case(seed=13, page=4, pages=64)
    hashes = page_hashes(case)
    theirs = oracle.build_store(case, (0, 0, 0), master_address)
    ours = oracle.build_store(case, (0, 0, 0), master_address, {"negative_ttl": 30})
    for _ in range(3):  # SGLang re-polls a miss
        assert oracle.result_of(theirs, case, hashes)["hit_tokens"] == 0
        assert oracle.result_of(ours, case, hashes)["hit_tokens"] == 0
    assert len(theirs.calls) == 3 and len(ours.calls) == 1
    assert plugin.lookup_of(ours).stats().negative_hits == 2
    # This process stores the span's objects through SGLang's own put (the write path's, hooked).
    import torch

    kv, _ = oracle.sglang_keys(theirs, case, hashes)
    buf = torch.zeros(len(kv), dtype=torch.uint8)
    assert holder.register_buffer(buf.data_ptr(), buf.numel()) == 0
    try:
        codes = ours._put_batch_zero_copy_impl(kv, [buf.data_ptr() + i for i in range(len(kv))], [1] * len(kv))
    finally:
        holder.unregister_buffer(buf.data_ptr())
    assert codes == [0] * len(kv)
    assert oracle.result_of(ours, case, hashes)["hit_tokens"] == oracle.result_of(theirs, case, hashes)["hit_tokens"] == 256


def test_spans_sglang_assumes_stored_never_reach_the_lookup(oracle, master_address):
    from mooncake_keys.sglang import plugin

    case = Case(seed=14, page=4, pages=20)
    hashes = page_hashes(case)
    ours = oracle.build_store(case, (0, 0, 0), master_address, {"negative_ttl": 30})
    oracle.result_of(ours, case, hashes)  # a miss: remembered
    op = oracle.operation(case, hashes)
    op.assume_stored = True
    got, hit = oracle.MiniController(ours, case.page)._storage_hit_query(op)
    assert hit == 80 and got == hashes and len(ours.calls) == 1
    assert plugin.lookup_of(ours).stats().queries == 1


def test_what_cannot_be_reproduced_keeps_sglangs_lookup_with_one_log_line(oracle, holder, master_address, caplog,
                                                                           monkeypatch):
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_direct_linker import _storage_suffix

    from mooncake_keys.sglang import plugin

    case = Case(seed=15, mla=True, tp=2, page=4, pages=30, model="deepseek-ai/DeepSeek-V3")
    hashes = page_hashes(case)
    theirs = oracle.build_store(case, (0, 0, 0), master_address)
    stored_prefix(oracle, holder, theirs, case, hashes, 9)
    want = oracle.result_of(theirs, case, hashes)["hit_tokens"]
    assert want == 36

    def fresh(options=True):  # None: SGLang's own lookup
        return oracle.build_store(case, (0, 0, 0), master_address, options)

    linker = fresh()
    linker.mla_suffix = linker.mha_suffix = _storage_suffix(rank_replicated=True, tp_rank=0, attn_cp_rank=0, pp_rank=0)
    import sglang

    cases = {"bad option": (fresh({"fast": True}), "0.5.23"), "direct linker": (linker, "0.5.23"),
             "another release": (fresh(), "0.5.99")}
    for what, (store, release) in cases.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
            monkeypatch.setattr(sglang, "__version__", release)
            assert plugin.lookup_of(store) is None, what  # decided here, on first use
            monkeypatch.undo()
            for _ in range(2):  # the answer of SGLang's own batch_exists on that store
                expected = oracle.sglang_batch_exists(store, hashes) * case.page
                assert oracle.result_of(store, case, hashes)["hit_tokens"] == expected, what
        assert len(sglang_warnings(caplog)) == 1, (what, [r.getMessage() for r in caplog.records])
        assert expected == (0 if what == "direct linker" else want)
        assert len(sglang_warnings(caplog)) == 1, (what, [r.getMessage() for r in caplog.records])
    # A pool kind not described (DSA's indexer): SGLang's own v2 for it, one line over queries,
    # on the writing rank and on the other (whose KV answer SGLang's v2 reads: asked, no bound).
    for rank in ((0, 0, 0), (1, 0, 0)):
        store = oracle.build_store(case, rank, master_address, True)
        ref = oracle.build_store(case, rank, master_address)
        for st in (store, ref):
            st.register_mem_host_pool_v2(SimpleNamespace(get_hybrid_pool_buffer=lambda: [], page_size=1),
                                         PoolName.INDEXER)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
            for _ in range(3):
                t = [PoolTransfer(name=PoolName.INDEXER, hit_policy=PoolHitPolicy.ALL_PAGES)]
                got, exp = store.batch_exists_v2(hashes, t), ref.batch_exists_v2(hashes, t)
                assert (got.kv_hit_pages, got.extra_pool_hit_pages, got.restorable_prefix_pages) == (
                    exp.kv_hit_pages, exp.extra_pool_hit_pages, exp.restorable_prefix_pages) == (0, {PoolName.KV: 9}, [])
        assert len(sglang_warnings(caplog)) == 1 and "indexer" in sglang_warnings(caplog)[0].getMessage()
        assert plugin.lookup_of(store).stats().bound_answers == 0
    # Page hashes that are not hex digests (another backend's keys): SGLang's own answer.
    caplog.clear()
    ours = fresh()
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert ours.batch_exists(["not-a-digest"]) == 0
    assert len(sglang_warnings(caplog)) == 1


def test_a_store_fault_is_one_log_line_and_sglangs_error_path(oracle, master_address, caplog):
    case = Case(seed=16, page=4, pages=600)
    hashes = page_hashes(case)
    ours = oracle.build_store(case, (0, 0, 0), master_address, True)

    def down(keys):
        raise RuntimeError("master unreachable")

    ours._batch_exist = down
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"), pytest.raises(Exception):
        oracle.MiniController(ours, case.page)._storage_hit_query(oracle.operation(case, hashes))
    assert len(sglang_warnings(caplog)) == 1


def test_the_direct_linkers_keys_are_sglangs(oracle, master_address):
    """The linker form of the grammar: SGLang's own ``_storage_suffix`` set on its store as the
    linker's constructor does, and its own builder on linker device pools."""
    import torch
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import DevicePoolEntry
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_direct_linker import _storage_suffix

    from mooncake_keys.sglang.keys import RankKeys, SidecarPool

    rnd = random.Random(3)
    for _ in range(20):
        replicated = rnd.random() < 0.5
        tp, pp, cp = rnd.choice([1, 2, 4]), rnd.choice([1, 2]), rnd.choice([1, 2])
        tp_rank, pp_rank, cp_rank = rnd.randrange(tp), rnd.randrange(pp), rnd.randrange(cp)
        case = Case(seed=rnd.randrange(1000), mla=replicated, tp=tp, pp=pp, cp=cp, page=4, pages=3)
        hashes = page_hashes(case)
        store = oracle.build_store(case, (tp_rank, pp_rank, cp_rank), master_address)
        store.mla_suffix = store.mha_suffix = _storage_suffix(rank_replicated=replicated, tp_rank=tp_rank,
                                                              attn_cp_rank=cp_rank, pp_rank=pp_rank)
        ours = RankKeys(case.model, tp_rank=tp_rank, tp_size=tp, pp_rank=pp_rank, pp_size=pp, cp_rank=cp_rank,
                        cp_size=cp, mla=replicated, linker=True)
        for name in (PoolName.KV, PoolName.SWA, PoolName.MAMBA):
            store.registered_pools[name] = DevicePoolEntry(
                name=name, indices_from_pool=PoolName.KV, device_pool=None, components=[[torch.zeros(8, 2)]],
                layer_mapping={0: 0}, page_size=4, rows_are_pages=True)
            theirs, _ = store._get_hybrid_page_component_keys(hashes, PoolTransfer(name=name))
            sfx = ours.kv_suffixes if name == PoolName.KV else ours.pool_suffixes(SidecarPool(str(name.value)))
            assert theirs == [f"{h}{s}" for h in hashes for s in sfx], (name, theirs)


def test_the_storage_model_name_is_sglangs():
    from sglang.srt.managers.cache_controller import storage_model_name as theirs

    from mooncake_keys.sglang.keys import storage_model_name

    for name in (None, "", "m", "org/m"):
        for tag in (None, "", "lbhnc"):
            assert storage_model_name(name, tag) == theirs(name, SimpleNamespace(storage_format_tag=tag)), (name, tag)


def test_the_measurement_of_docs_benchmarks_runs(oracle, holder, master_address):
    """measure.py (docs/benchmarks.md's SGLang figures), on one small configuration: its answers
    are SGLang's (it checks them), a miss asks far fewer keys, and a re-poll none."""
    import measure

    name, fields, _ = measure.DEPLOYMENTS[0]
    rows = measure.measure(master_address, holder, repeats=1, deployments=[(name, fields, (65536,))],
                           fractions=(0.0, 0.5))
    assert len(rows) == 4 and "SGLang keys" in measure.table(rows)
    miss = rows[0]
    assert miss["sglang_keys"] == 2048 and miss["ours_keys"] < 100 and miss["repoll_keys"] == 0


def test_sglangs_prefetch_thread_gets_sglangs_answers_and_its_fault_path(oracle, holder, master_address, caplog):
    """SGLang's own prefetch thread (``HiCacheController.prefetch_thread_func``, on a thread as in
    the scheduler process): a query ours answers comes out of SGLang's hit queue as SGLang's does;
    a store that fails makes ours raise, and SGLang's thread turns that into 0 hits (its own log
    line, beside our one) and goes on."""
    import queue
    import threading

    from sglang.srt.managers.cache_controller import HiCacheController

    class ThreadController(oracle.MiniController):
        prefetch_thread_func = HiCacheController.prefetch_thread_func

        def __init__(self, backend, page_size):
            super().__init__(backend, page_size)
            self.storage_stop_event = threading.Event()
            self.prefetch_queue, self.prefetch_hit_queue = queue.Queue(), queue.Queue()

    case = Case(seed=17, tp=2, page=16, pages=2100)
    hashes = page_hashes(case)
    theirs = oracle.build_store(case, (1, 0, 0), master_address)
    stored_prefix(oracle, holder, theirs, case, hashes, 700)
    ours = oracle.build_store(case, (1, 0, 0), master_address, True)
    failing = oracle.build_store(case, (1, 0, 0), master_address, True)

    def down(keys):
        raise ConnectionError("master unreachable")

    failing._batch_exist = down
    got = {}
    with caplog.at_level(logging.WARNING):
        for name, store in (("sglang", theirs), ("ours", ours), ("fault", failing)):
            ctl = ThreadController(store, case.page)
            thread = threading.Thread(target=ctl.prefetch_thread_func, daemon=True)
            thread.start()
            ctl.prefetch_queue.put(oracle.operation(case, hashes, rid=name))
            op = ctl.prefetch_hit_queue.get(timeout=60)
            ctl.storage_stop_event.set()
            thread.join(timeout=10)
            assert not thread.is_alive()
            got[name] = (op.storage_hit_count, op.hash_value)
    assert got["ours"] == got["sglang"] and got["sglang"][0] == 700 * 16
    assert got["fault"] == (0, [])
    ours_lines = [r for r in caplog.records if r.name.startswith("mooncake_keys") and r.levelno >= logging.WARNING]
    assert len(ours_lines) == 1 and "master unreachable" in ours_lines[0].getMessage()
    assert any("HiCache storage query failed" in r.getMessage() for r in caplog.records if r.name.startswith("sglang"))
