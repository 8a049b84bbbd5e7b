"""mooncake_keys.sglang without SGLang: the key grammar on SGLang's measured examples, the lookup
against a plain reference of SGLang's rules (both cores, one-shot and in rounds), the single
querier, the negative cache, store faults and bad input. Against SGLang's own code:
tests/against_sglang."""

from __future__ import annotations

import hashlib
import logging
import random
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import mooncake_keys as mk
from mooncake_keys.sglang import PoolQuery, RankKeys, RankLookup, SidecarPool, StoreFault, prefetch_span
from mooncake_keys.sglang.hits import RankResult, pool_answer, reduce_ranks, trailing_stop_points

from support.cores import NO_C_ENGINES

CORES = [pytest.param("c", marks=[pytest.mark.c_extension,
                                  pytest.mark.skipif(NO_C_ENGINES is not None, reason=str(NO_C_ENGINES))], id="c"),
         pytest.param("py", id="py")]

H1 = "1d533aec2cd826f8f398589c20e169718d95dc7b123918889d58e0d09b7960c7"
H2 = "2be5b730d7617a19b1b69dac4c2006c6e7bfd529c18f7580d47ab872f44b17bb"
LLAMA = "meta-llama/Llama-3.1-8B-Instruct"


def page_hashes(n, seed=0):
    return [hashlib.sha256(f"{seed}:{i}".encode()).hexdigest() for i in range(n)]


# ------------------------------------------------------------------ the grammar
def test_keys_are_the_ones_sglang_sent_to_a_real_master():
    """The worked example of docs/sglang.md: the keys SGLang 0.5.23's own batch_exists sent
    (tokens 1000..1007, page 4), measured; tests/against_sglang checks every deployment."""
    assert RankKeys(LLAMA, tp_rank=1, tp_size=2).keys([H1, H2], RankKeys(LLAMA, tp_rank=1, tp_size=2).kv_suffixes) == [
        f"meta-llama-Llama-3.1-8B-Instruct_{H1}_1_k", f"meta-llama-Llama-3.1-8B-Instruct_{H1}_1_v",
        f"meta-llama-Llama-3.1-8B-Instruct_{H2}_1_k", f"meta-llama-Llama-3.1-8B-Instruct_{H2}_1_v"]
    pp = RankKeys(LLAMA, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    assert pp.kv_suffixes == ("_1_1_k", "_1_1_v")
    mla = RankKeys("deepseek-ai/DeepSeek-V3", mla=True, tp_rank=3, tp_size=8)
    assert mla.keys([H1], mla.kv_suffixes) == [f"deepseek-ai-DeepSeek-V3_{H1}__k"]
    assert RankKeys("deepseek-ai/DeepSeek-V3", mla=True, pp_rank=1, pp_size=2).kv_suffixes == ("_1_k",)
    assert RankKeys(LLAMA, tag="prodA").head == "prodA_meta-llama-Llama-3.1-8B-Instruct_"
    assert RankKeys(LLAMA).pool_suffixes(SidecarPool.mamba(1)) == ("_0_temporal", "_0_conv_0")
    linker = RankKeys(LLAMA, tp_rank=1, tp_size=2, linker=True)
    assert linker.kv_suffixes == ("_tp1_cp0_pp0_k",) and linker.pool_suffixes(SidecarPool.swa()) == ("_tp1_cp0_pp0_swa",)


def test_dcp_split_heads_and_sidecars():
    dcp = RankKeys("m", mla=True, tp_rank=3, tp_size=4, dcp_rank=1, dcp_size=2, page_size=64, pp_rank=1, pp_size=2)
    assert dcp.head == "m_tp4_dcp2_page64_pp2_cp1_" and dcp.kv_suffixes == ("_dcp1_cp0_1_k",)
    assert dcp.is_writer is False and RankKeys("m", mla=True, tp_rank=1, tp_size=4, dcp_rank=1, dcp_size=2,
                                               page_size=64).is_writer
    split = RankKeys("m", tp_rank=1, tp_size=2, split=2)
    assert split.kv_suffixes == ("_2_k", "_2_v", "_3_k", "_3_v")
    assert RankKeys("m", tp_rank=1, tp_size=2, pp_rank=1, pp_size=2, split=2).kv_suffixes[0] == "_2_1_k"
    assert RankKeys("m", mla=True).pool_suffixes(SidecarPool.swa()) == ("__swa",)
    assert RankKeys("m").pool_suffixes(SidecarPool.swa()) == ("_0_swa_k", "_0_swa_v")
    assert RankKeys("m", mla=True, tp_rank=2, tp_size=4).pool_suffixes(SidecarPool.mamba(2, temporal=False)) == (
        "_2_conv_0", "_2_conv_1")  # Mamba keeps the TP rank beside MLA KV
    assert RankKeys(None).head == "" and RankKeys("a/b/c", tag="").head == "_a-b-c_"
    assert mk.sglang.storage_model_name("m", "fmt") == "m-fmt" and mk.sglang.storage_model_name(None, "fmt") == "fmt"


@pytest.mark.parametrize("kwargs, match", [
    (dict(tp_rank=2, tp_size=2), "tp_rank"),
    (dict(dcp_size=2, dcp_rank=0, tp_size=2, page_size=64), "mla"),
    (dict(mla=True, dcp_size=2, dcp_rank=0, tp_size=3, page_size=64), "contiguous"),
    (dict(mla=True, dcp_size=2, dcp_rank=1, tp_size=2, tp_rank=0, page_size=64), "contiguous"),
    (dict(mla=True, dcp_size=2, dcp_rank=0, tp_size=2, page_size=63), "page_size"),
    (dict(mla=True, split=2), "split"),
    (dict(split=0), "split"),
    (dict(tp_size=True), "tp_size"),
    (dict(model_name="bad\udcff"), "model_name"),
])
def test_bad_rank_keys_are_refused_naming_the_argument(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        RankKeys(**kwargs)


def test_sidecars_sglang_does_not_store_are_refused():
    with pytest.raises(ValueError, match="split"):
        RankKeys("m", tp_size=2, split=2).pool_suffixes(SidecarPool.mamba(1))
    with pytest.raises(ValueError, match="K/V"):
        RankKeys("m").pool_suffixes(SidecarPool.swa(kv_pair=False))
    with pytest.raises(ValueError, match="nothing"):
        RankKeys("m").pool_suffixes(SidecarPool.mamba(0, temporal=False))
    with pytest.raises(ValueError, match="name"):
        SidecarPool("indexer")


# ------------------------------------------------------------------ a plain reference of SGLang's rules
def ref_keys(rank, hashes, suffixes):
    return [f"{rank.head}{h}{s}" for h in hashes for s in suffixes]


def ref_kv(rank, store, hashes):
    """SGLang's batch_exists, read literally: every key, the first not answered 1."""
    keys = ref_keys(rank, hashes, rank.kv_suffixes)
    answers = store.batch_is_exist(keys) if keys else []
    for i, a in enumerate(answers):
        if a != 1:
            return i // len(rank.kv_suffixes)
    return len(hashes)


def ref_v2(rank, store, hashes, queries):
    """SGLang's batch_exists_v2, read literally: KV, then every pool's keys of every page."""
    kv = ref_kv(rank, store, hashes)
    hit = {"kv": kv} if kv else {}
    restorable = list(range(1, kv + 1))
    if not restorable:
        return 0, hit, []
    for q in queries:
        if not restorable:
            break
        sfx = rank.pool_suffixes(q.pool)
        ex = store.batch_is_exist(ref_keys(rank, hashes, sfx))
        page = [all(r == 1 for r in ex[i * len(sfx):(i + 1) * len(sfx)]) for i in range(kv)]
        mine, boundary = [], 0
        if q.policy == "all_pages":
            boundary = page.index(False) if False in page else kv
            mine = list(range(1, boundary + 1))
        else:
            for p in range(kv, 0, -1):
                if all(page[i] for i in range(max(0, p - q.window), p)):
                    mine.append(p)
                    boundary = boundary or p
        if boundary:
            hit[q.name] = boundary
        restorable = [p for p in restorable if p in set(mine)]
    return (restorable[-1] if restorable else 0), hit, restorable


def random_rank(rnd):
    mla = rnd.random() < 0.4
    tp = rnd.choice([1, 2, 4])
    return RankKeys(rnd.choice([None, "m", "org/model-x"]), tag=rnd.choice([None, None, "prodA"]),
                    tp_rank=rnd.randrange(tp), tp_size=tp, pp_size=(pp := rnd.choice([1, 1, 2])),
                    pp_rank=rnd.randrange(pp), mla=mla, split=1 if mla or rnd.random() < 0.7 else 2)


def holed_store(rnd, keys):
    """A store holding a prefix of ``keys`` and random others (holes past the prefix)."""
    cut = rnd.randrange(len(keys) + 1)
    p = rnd.choice([0.0, 0.5, 0.95, 1.0])
    store = mk.MemoryStore()
    for i, k in enumerate(keys):
        if i < cut or rnd.random() < p:
            store.put(k)
    return store


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 1500), strategy=st.sampled_from(["rounds", "oneshot"]),
       min_keys=st.sampled_from([0, 256]))
@pytest.mark.parametrize("core", CORES)
def test_kv_pages_equal_sglang_rules(core, seed, n, strategy, min_keys):
    rnd = random.Random(seed)
    rank = random_rank(rnd)
    hashes = page_hashes(n, seed)
    store = holed_store(rnd, ref_keys(rank, hashes, rank.kv_suffixes))
    rec = mk.RecordingStore(store, check_keys=True)
    lookup = RankLookup(rank, rec, strategy=strategy, rounds_min_keys=min_keys, single_querier=False, core=core)
    assert lookup.kv_pages(hashes) == ref_kv(rank, store, hashes)
    asked = [k for call in rec.calls for k in call]
    assert len(asked) == len(set(asked)) and set(asked) <= set(ref_keys(rank, hashes, rank.kv_suffixes))
    if strategy == "oneshot" and n:
        assert rec.calls == [ref_keys(rank, hashes, rank.kv_suffixes)]  # SGLang's very call


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32), n=st.integers(0, 400))
@pytest.mark.parametrize("core", CORES)
def test_pool_answers_equal_sglang_rules(core, seed, n):
    rnd = random.Random(seed)
    rank = random_rank(rnd)
    if rank.split > 1:
        rank = RankKeys(rank.model_name, tp_rank=rank.tp_rank, tp_size=rank.tp_size)
    queries = []
    for _ in range(rnd.randrange(3)):
        if rnd.random() < 0.5:
            pool = SidecarPool.mamba(rnd.randrange(3), temporal=rnd.random() < 0.8)
            if not pool.temporal and not pool.conv_states:
                continue
            queries.append(PoolQuery("mamba", pool, "trailing_pages", 1))
        else:
            queries.append(PoolQuery("swa", SidecarPool.swa(), rnd.choice(["trailing_pages", "all_pages"]),
                                     rnd.randrange(1, 6)))
    hashes = page_hashes(n, seed)
    keys = ref_keys(rank, hashes, rank.kv_suffixes)
    for q in queries:
        keys += ref_keys(rank, hashes, rank.pool_suffixes(q.pool))
    store = holed_store(rnd, keys)
    lookup = RankLookup(rank, mk.RecordingStore(store, check_keys=True), single_querier=False,
                        rounds_min_keys=rnd.choice([0, 256]), core=core)
    got = lookup.pool_answer(hashes, queries)
    assert (got.pages, got.boundaries, got.restorable) == ref_v2(rank, store, hashes, queries)


# ------------------------------------------------------------------ the single querier
def test_only_the_writing_mla_rank_asks_and_the_others_answer_a_bound():
    hashes = page_hashes(40)
    writer = RankKeys("ds", mla=True, tp_rank=0, tp_size=4)
    store = mk.MemoryStore()
    for k in ref_keys(writer, hashes[:25], writer.kv_suffixes):
        store.put(k)
    answers = []
    for r in range(4):
        rec = mk.RecordingStore(store)
        lookup = RankLookup(RankKeys("ds", mla=True, tp_rank=r, tp_size=4), rec)
        answers.append(lookup.kv_pages(hashes))
        assert rec.num_calls == (1 if r == 0 else 0)
        assert lookup.stats().bound_answers == (0 if r == 0 else 1)
    assert answers == [25, 40, 40, 40] and min(answers) == ref_kv(writer, store, hashes)


def test_the_single_querier_is_off_where_a_rank_has_keys_of_its_own():
    hashes = page_hashes(8)
    mamba = [PoolQuery("mamba", SidecarPool.mamba(1), "trailing_pages")]
    swa = [PoolQuery("swa", SidecarPool.swa(), "trailing_pages", 2)]
    cases = [
        (RankKeys("ds", mla=True, tp_rank=1, tp_size=2), mamba, True),  # Mamba keys carry the TP rank
        (RankKeys("ds", mla=True, tp_rank=1, tp_size=2), swa, False),
        (RankKeys("ds", mla=True, tp_rank=1, tp_size=2, pp_size=2), (), True),  # PP allocates before the MIN
        (RankKeys("ds", tp_rank=1, tp_size=2), (), True),  # MHA
        (RankKeys("ds", mla=True, tp_rank=3, tp_size=4, dcp_rank=1, dcp_size=2, page_size=64), (), False),
        (RankKeys("ds", mla=True, tp_rank=1, tp_size=4, dcp_rank=1, dcp_size=2, page_size=64), (), True),  # a writer
    ]
    for rank, pools, asks in cases:
        rec = mk.RecordingStore()
        lookup = RankLookup(rank, rec)
        assert lookup.asks(pools) is asks, rank
        answer = lookup.pool_answer(hashes, pools)
        assert (rec.num_calls > 0) is asks
        if not asks:  # the bound: every page, every stop point, every pool at the span
            assert answer == (8, {"kv": 8, **{q.name: 8 for q in pools}}, list(range(1, 9)))
    off = RankLookup(RankKeys("ds", mla=True, tp_rank=1, tp_size=2), mk.RecordingStore(), single_querier=False)
    assert off.asks() and off.kv_pages(hashes) == 0


# ------------------------------------------------------------------ the negative cache
class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_miss_re_polled_within_the_ttl_asks_nothing_past_the_absent_page():
    rank = RankKeys("m", tp_rank=0, tp_size=1)
    hashes = page_hashes(600)
    store = mk.MemoryStore()
    for k in ref_keys(rank, hashes[:300], rank.kv_suffixes):
        store.put(k)
    rec, clock = mk.RecordingStore(store), Clock()
    lookup = RankLookup(rank, rec, negative_ttl=1.0, clock=clock, strategy="oneshot")
    assert lookup.kv_pages(hashes) == 300 and rec.keys_asked == 1200
    assert lookup.kv_pages(hashes) == 300 and rec.keys_asked == 1200 + 600  # only the 300 pages below
    assert lookup.stats().negative_hits == 1 and lookup.stats().negative_pages == 300
    miss = page_hashes(600, seed=7)
    assert lookup.kv_pages(miss) == 0
    calls = rec.num_calls
    assert lookup.kv_pages(miss) == 0 and rec.num_calls == calls  # a total miss: nothing asked
    clock.now += 1.5  # expired: asked again
    assert lookup.kv_pages(miss) == 0 and rec.num_calls == calls + 1
    for k in ref_keys(rank, miss, rank.kv_suffixes):  # another writer stores the pages ...
        store.put(k)
    assert lookup.kv_pages(miss) == 0 and rec.num_calls == calls + 1  # ... unseen until the entry expires
    lookup.written(ref_keys(rank, miss[:1], rank.kv_suffixes))  # this process stores: forgotten at once
    assert lookup.kv_pages(miss) == 600


def test_the_negative_cache_is_bounded_and_can_be_off():
    rank = RankKeys("m")
    lookup = RankLookup(rank, mk.RecordingStore(), negative_capacity=3, clock=Clock())
    for seed in range(10):
        lookup.kv_pages(page_hashes(2, seed))
    assert len(lookup._negative) == 3
    off = RankLookup(rank, rec := mk.RecordingStore(), negative_ttl=0)
    off.kv_pages(page_hashes(2))
    off.kv_pages(page_hashes(2))
    assert rec.num_calls == 2


# ------------------------------------------------------------------ faults and bad input
@pytest.mark.parametrize("fault", [ConnectionError("master unreachable"), "short", "not a list"])
def test_a_store_fault_raises_for_sglang_with_one_warning_line(caplog, fault):
    lookup = RankLookup(RankKeys("m"), mk.RecordingStore(fault=fault))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"), pytest.raises(StoreFault):
        lookup.kv_pages(page_hashes(4))
    assert len([r for r in caplog.records if r.name.startswith("mooncake_keys")]) == 1
    assert lookup.stats().store_failures == 1


def test_error_codes_count_absent_as_in_sglang():
    lookup = RankLookup(RankKeys("m"), mk.RecordingStore(lambda keys: [1, 1, -900, 1] + [1] * (len(keys) - 4)))
    assert lookup.kv_pages(page_hashes(4)) == 1


@pytest.mark.parametrize("hashes", [
    [H1.upper()], [H1, H2[:-2]], [H1[:-1]], ["zz" * 32], [H1[:30] + "  " + H1[32:]], [b"\x00" * 32], [H1, 7],
])
def test_page_hashes_our_keys_could_not_spell_are_refused_before_asking(hashes):
    rec = mk.RecordingStore()
    with pytest.raises(ValueError, match="page_hashes"):
        RankLookup(RankKeys("m"), rec).kv_pages(hashes)
    assert rec.num_calls == 0


@pytest.mark.parametrize("query, match", [
    (PoolQuery("kv", SidecarPool.swa(), "all_pages"), "sidecar"),
    (PoolQuery("swa", SidecarPool.swa(), "block_groups"), "policy"),
    (PoolQuery("swa", SidecarPool.swa(), "trailing_pages", 0), "window"),
    ("swa", "PoolQuery"),
])
def test_bad_pool_queries_are_refused(query, match):
    with pytest.raises((TypeError, ValueError), match=match):
        RankLookup(RankKeys("m"), mk.RecordingStore()).pool_answer(page_hashes(2), [query])


@pytest.mark.parametrize("kwargs, match", [
    (dict(strategy="fast"), "strategy"), (dict(negative_ttl=-1), "negative_ttl"), (dict(negative_ttl=True), "negative_ttl"),
    (dict(rounds_min_keys=-1), "rounds_min_keys"), (dict(single_querier=1), "single_querier"), (dict(core="go"), "core"),
    (dict(release="0.4.0"), "0.4.0"),
])
def test_bad_lookup_options_are_refused_naming_them(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        RankLookup(RankKeys("m"), mk.RecordingStore(), **kwargs)


# ------------------------------------------------------------------ the hit rules and the span
def test_the_ranks_intersect_their_stop_points():
    """The measured case of docs/sglang.md (2 gloo ranks, page 4): rank 0 has KV to page 5 and
    Mamba states at {2, 3, 5}, rank 1 KV to page 4 and states at {2, 4}: KV alone gives 16
    tokens, KV and Mamba 8 (a MIN of the ranks' longest hits would say 16)."""
    def rank(kv, states):
        flags = bytes(int(p + 1 in states) for p in range(6))
        return pool_answer(kv, [("mamba", "trailing_pages", 1, flags)])
    a, b = rank(5, {2, 3, 5}), rank(4, {2, 4})
    assert a.restorable == [2, 3, 5] and b.restorable == [2, 4]
    results = [RankResult(x.pages * 4, x.restorable, {"kv": x.boundaries["kv"], "mamba": x.boundaries["mamba"]})
               for x in (a, b)]
    assert reduce_ranks(results, 4, 6, trailing=True) == (8, {"kv": 4, "mamba": 4})
    assert reduce_ranks([RankResult(20, None, {"kv": 5}), RankResult(16, None, {"kv": 4})], 4, 6, False) == (
        16, {"kv": 4})
    assert reduce_ranks([RankResult(0, [], {"kv": 0}), RankResult(16, [1, 2, 3, 4], {"kv": 4, "swa": 4})], 4, 6,
                        True) == (0, {"kv": 0})  # a rank without a verdict vetoes it


@settings(max_examples=200, deadline=None)
@given(flags=st.lists(st.booleans(), max_size=30), window=st.integers(1, 6), data=st.data())
def test_trailing_stop_points_are_the_windows_that_exist(flags, window, data):
    pages = data.draw(st.integers(0, len(flags)))
    got = trailing_stop_points(bytes(flags), pages, window)
    assert got == [p for p in range(1, pages + 1) if all(flags[max(0, p - window):p])]


def test_the_span_a_query_asks():
    assert prefetch_span(1000, 0, 64) == 960  # input - 1, floored to pages
    assert prefetch_span(1025, 0, 64) == 1024
    assert prefetch_span(1000, 512, 64) == 448
    assert prefetch_span(300, 0, 64) == 256 and prefetch_span(256, 0, 64) == 0  # below the threshold: nothing
    assert prefetch_span(1000, 0, 64, threshold=1024) == 0
    assert prefetch_span(1000, 0, 64, logprob_start_len=500) == 448
    assert prefetch_span(1000, 0, 64, logprob_start_len=-1) == 960
    assert prefetch_span(10, 0, 1, threshold=0) == 9 and prefetch_span(0, 0, 1, threshold=0) == 0
    with pytest.raises(ValueError, match="page_size"):
        prefetch_span(10, 0, 0)


def test_importing_the_sglang_room_imports_neither_sglang_nor_torch():
    code = ("import sys, mooncake_keys, mooncake_keys.sglang, mooncake_keys.sglang.plugin, "
            "mooncake_keys.sglang.mapping; print(sorted(m for m in ('torch', 'sglang') if m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
