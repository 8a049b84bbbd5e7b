"""vLLM 0.33's lookup on worked examples, each first run through vLLM 0.33.0's own worker.

Every expected value here was produced by vLLM 0.33.0's ``MooncakeStoreWorker.lookup`` built
by its own ``__init__`` (only the GPU, rank and store parts replaced); the generated
comparison against the real package lives in ``tests/against_vllm/``. These are the readable cases.
Model ``test-model``. vLLM's examples used hashes ``h(i)``, whose lengths differ
past ``h9``; mooncake_keys wants hashes of one length (vLLM's wire format has one ``hash_len``),
so these use ``h(i) = f"h{i:02d}".encode()``: the same structure, other hex.
"""

from __future__ import annotations

import pytest

import mooncake_keys as mk

F, S, G = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.KVCacheGroup


def h(i):
    return f"h{i:02d}".encode()


def H(n):
    return [h(i) for i in range(n)]


def PFX(g, tp=0, pcp=0, dcp=0, pp=0, ns=""):
    return f"test-model{ns}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}@pp_rank:{pp}@group:{g}"


def key(g, hsh, **kw):
    return f"{PFX(g, **kw)}@{hsh.hex()}"


def engine(groups, store, layout=None, hbs=16, **kw):
    return mk.LookupEngine("test-model", groups, layout or mk.ParallelLayout(num_kv_heads=8),
                           hash_block_size=hbs, store=store, **kw)


def result(r):
    return (r.hit_length, tuple((b.group_id, b.num_tokens) for b in r.tail_key_boundaries))


def test_0_33_is_the_default_and_other_values_are_refused():
    assert engine([F(16)], mk.RecordingStore()).vllm_compat == "0.33"
    assert engine([F(16)], mk.RecordingStore(), vllm_compat=None).vllm_compat == "0.33"  # the signature's default
    for other in ("0.24", "0.34", "0.3", 0.33, ""):
        with pytest.raises(ValueError, match=r"vllm_compat must be one of \['0.25', '0.26', .*'0.33'\]"):
            engine([F(16)], mk.RecordingStore(), vllm_compat=other)


# ------------------------------------------------------------------------ E1: one Full(16)
A = [b"a0", b"a1", b"a2"]


def test_e1_partial_prefix():
    st = mk.RecordingStore(present={key(0, A[0]), key(0, A[1])})
    assert result(engine([F(16)], st).lookup_result(48, A)) == (32, ((0, 32),))
    assert st.calls == [[key(0, x) for x in A]]


def test_e1_a_full_hit_is_rederived_one_block_shorter():
    st = mk.RecordingStore(present={key(0, x) for x in A})
    e = engine([F(16)], st)
    assert result(e.lookup_result(48, A)) == (32, ((0, 32),))
    assert len(st.calls) == 1  # found again from the same answers: no second call
    assert e.lookup(48, A) == 32


def test_e1_num_tokens_is_aligned_down():
    st = mk.RecordingStore(present={key(0, x) for x in A})
    assert result(engine([F(16)], st).lookup_result(50, A)) == (48, ((0, 48),))
    assert st.calls == [[key(0, x) for x in A]]


def test_e1_nothing_to_look_up():
    st = mk.RecordingStore(present={key(0, x) for x in A})
    e = engine([F(16)], st)
    assert result(e.lookup_result(15, A)) == (0, ())
    assert result(e.lookup_result(48, [])) == (0, ())
    assert st.calls == []
    assert result(e.lookup_result(16, A)) == (0, ())  # usable = 0 after the full hit
    assert st.calls == [[key(0, A[0])]]


# ------------------------------------------------------------------------ E2: Full(32) + SWA(8, 8)
HYB = [F(32), S(8, 8)]
KEYS6 = [key(g, x) for g in (0, 1) for x in (h(3), h(7), h(11))]


def hyb_store(swa_chunks, full=True):
    present = {key(0, x) for x in (h(3), h(7), h(11))} if full else set()
    return mk.RecordingStore(present=present | {key(1, h(c)) for c in swa_chunks})


@pytest.mark.parametrize("swa,num_tokens,want", [
    ((11,), 96, (0, ())),  # the full hit is re-derived at 64: no SWA boundary there
    ((11,), 100, (96, ((0, 96), (1, 96)))),
    ((7, 11), 96, (64, ((0, 64), (1, 64)))),
    ((3, 11), 96, (32, ((0, 32), (1, 32)))),
])
def test_e2_hybrid(swa, num_tokens, want):
    st = hyb_store(swa)
    assert result(engine(HYB, st, hbs=8).lookup_result(num_tokens, H(12))) == want
    assert st.calls == [KEYS6]


def test_e2_hybrid_prefix_only():
    st = mk.RecordingStore(present={key(0, h(3)), key(1, h(3))})
    assert result(engine(HYB, st, hbs=8).lookup_result(96, H(12))) == (32, ((0, 32), (1, 32)))


@pytest.mark.parametrize("swa,want", [((10, 11), 0), ((6, 7, 10, 11), 64)])
def test_e2_hybrid_window_16(swa, want):
    st = hyb_store(swa)
    assert engine([F(32), S(8, 16)], st, hbs=8).lookup(96, H(12)) == want
    assert len(st.calls[0]) == 9


# ------------------------------------------------------------------------ E3: three attention groups
def test_e3_three_attention_groups():
    groups = [F(32), S(8, 8), S(16, 32)]
    full = {key(0, h(i)) for i in (3, 7, 11)}
    st = mk.RecordingStore(present=full | {key(1, h(i)) for i in (3, 7, 11)}
                  | {key(2, h(i)) for i in (1, 3, 5, 7)})
    e = engine(groups, st, hbs=8)
    assert result(e.lookup_result(100, H(12))) == (64, ((0, 64), (1, 64), (2, 64)))
    assert st.calls[0] == ([key(0, h(i)) for i in (3, 7, 11)]
                           + [key(1, h(i)) for i in (3, 7, 11)]
                           + [key(2, h(i)) for i in (1, 3, 5, 7, 9, 11)])
    st2 = mk.RecordingStore(present=full | {key(1, h(3)), key(1, h(11))} | {key(2, h(i)) for i in range(1, 12, 2)})
    assert result(engine(groups, st2, hbs=8).lookup_result(96, H(12))) == (32, ((0, 32), (1, 32), (2, 32)))


# ------------------------------------------------------------------------ E4: namespaces per group
def test_e4_namespaces():
    e = engine([F(16)], mk.RecordingStore(), mk.ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=2))
    assert e.group_namespaces == (((0, 0, 0, 0), (0, 0, 0, 1), (1, 0, 0, 0), (1, 0, 0, 1)),)
    mla = engine([F(16)], mk.RecordingStore(), mk.ParallelLayout(tp_size=4, num_kv_heads=8, use_mla=True))
    assert mla.group_namespaces == (((0, 0, 0, 0),),)
    dcp = engine([F(32)], mk.RecordingStore(), mk.ParallelLayout(tp_size=4, dcp_size=2, num_kv_heads=8, use_mla=True))
    assert dcp.group_namespaces == (((0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 0, 0), (3, 0, 1, 0)),)
    pcp = engine([F(16)], mk.RecordingStore(), mk.ParallelLayout(tp_size=2, pcp_size=2, num_kv_heads=8))
    assert pcp.group_namespaces == (((0, 0, 0, 0), (1, 0, 0, 0), (0, 1, 0, 0), (1, 1, 0, 0)),)


def test_e4_one_model_mixes_mla_and_gqa_groups():
    st = mk.RecordingStore()
    e = engine([F(16, use_mla=True), F(16)], st, mk.ParallelLayout(tp_size=4, num_kv_heads=8))
    assert e.group_namespaces == (((0, 0, 0, 0),), tuple((t, 0, 0, 0) for t in range(4)))
    e.lookup(32, [b"x0", b"x1"])
    assert st.calls[0] == ([key(0, b"x0"), key(0, b"x1")]
                           + [key(1, x, tp=t) for x in (b"x0", b"x1") for t in range(4)])
    # Before per-group namespaces (vLLM 0.25, 0.26) the layout decides for every group.
    old = engine([F(16, use_mla=True), F(16)], st, mk.ParallelLayout(tp_size=4, num_kv_heads=8),
                 vllm_compat="0.25")
    assert old.group_namespaces == (tuple((t, 0, 0, 0) for t in range(4)),) * 2
    assert len(old.coordinator.attention_groups) == 2  # an MLA spec is still another spec


# ------------------------------------------------------------------------ E5: store layouts
def test_e5_tp_sharded_store_layout():
    ns = "@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc"
    st = mk.RecordingStore()
    # vLLM TP 2 with store_tp_size 4: the store's layout, four TP shards.
    e = engine([F(16)], st, mk.ParallelLayout(tp_size=4, num_kv_heads=8), store_namespace=ns)
    e.lookup(16, [b"a0"])
    assert st.calls[0] == [key(0, b"a0", tp=t, ns=ns) for t in range(4)]
    assert st.calls[0][2] == ("test-model@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc"
                              "@tp_rank:2@pcp0@dcp0@pp_rank:0@group:0@6130")
    with pytest.raises(ValueError, match=r"vLLM 0.25 has no store_namespace \(vllm_compat='0.25'\)"):
        engine([F(16)], st, store_namespace=ns, vllm_compat="0.25")


# ------------------------------------------------------------------------ E6: dropped groups
def test_e6_dropped_groups_are_not_numbered_but_count_toward_alignment():
    groups = [G(F(16)), G(F(64), prefix_cacheable=False), G(S(16, 32)), G(F(16, head_size=4), prefix_cacheable=False)]
    present = {key(0, x) for x in H(12)} | {key(1, h(i)) for i in (2, 3, 6, 7, 10, 11)}
    st = mk.RecordingStore(present=present)
    e = engine(groups, st)
    assert e.scheduler_block_size == 64
    assert result(e.lookup_result(200, H(12))) == (192, ((0, 192), (1, 192)))
    assert st.calls[0] == [key(0, x) for x in H(12)] + [key(1, h(i)) for i in (2, 3, 6, 7, 10, 11)]
    assert result(e.lookup_result(192, H(12))) == (128, ((0, 128), (1, 128)))


def test_e6_a_lone_group_aligns_to_the_scheduler_block():
    st = mk.RecordingStore(present={key(0, x) for x in H(6)})
    e = engine([G(F(16)), G(F(64), prefix_cacheable=False)], st)
    assert result(e.lookup_result(100, H(6))) == (64, ((0, 64),))
    assert st.calls[0] == [key(0, x) for x in H(4)]
    with pytest.raises(ValueError, match=r"vLLM 0.25 has no prefix_cacheable=False groups"):
        engine([G(F(16)), G(F(64), prefix_cacheable=False)], st, vllm_compat="0.25")


# ------------------------------------------------------------------------ E8: EAGLE
def test_e8_eagle():
    st = mk.RecordingStore(present={key(0, x) for x in H(5)})
    e = engine([F(16)], st, use_eagle=True)
    assert result(e.lookup_result(64, H(4))) == (48, ((0, 48),))
    assert e.lookup(80, H(5)) == 64
    assert e.lookup(70, H(5)) == 48


def test_e8_an_eagle_flag_spreads_to_its_merged_attention_group():
    groups = [G(F(16)), G(S(16, 32)), G(F(16), is_eagle_group=True)]
    st = mk.RecordingStore(present={key(g, x) for g in range(3) for x in H(4)})
    e = engine(groups, st)
    assert result(e.lookup_result(64, H(4))) == (48, ((0, 48), (1, 48), (2, 48)))
    assert len(st.calls[0]) == 12
    assert e.coordinator.eagle_group_ids == {0, 2}


def test_e8_eagle_lookup_mask():
    e = engine(HYB, mk.RecordingStore(), hbs=8, use_eagle=True)
    assert [i for i, m in enumerate(e.coordinator.lookup_mask(96)[1]) if m] == [3, 4, 7, 8, 11]


# ------------------------------------------------------------------------ E9: retained tokens widen the window
@pytest.mark.parametrize("swa,want", [((10, 11), 96), ((11,), 0)])
def test_e9_sliding_window_plus_retained_tokens(swa, want):
    st = hyb_store(swa)
    e = engine([F(32), S(8, 8 + 8)], st, hbs=8)  # vLLM SWA(8, sw 8, extra_retained_tokens 8)
    assert e.lookup(100, H(12)) == want
    assert len(st.calls[0]) == 9


# ------------------------------------------------------------------------ E10: faults, answers, hybrid + DCP
def test_e10_store_failure_and_answers():
    e = engine([F(16)], mk.RecordingStore(fault=ConnectionError("down")), mk.ParallelLayout(tp_size=2, num_kv_heads=2))
    assert result(e.lookup_result(64, H(4))) == (0, ())
    assert engine([F(16)], mk.RecordingStore(True)).lookup(80, H(4)) == 64
    assert engine([F(16)], mk.RecordingStore(2)).lookup(80, H(4)) == 0
    assert engine([F(16)], mk.RecordingStore(-1)).lookup(80, H(4)) == 0


def test_e10_hybrid_with_dcp():
    lay = mk.ParallelLayout(tp_size=2, dcp_size=2, num_kv_heads=8)
    ranks = [dict(tp=0, dcp=0), dict(tp=1, dcp=1)]
    st = mk.RecordingStore(present={key(g, x, **r) for g in (0, 1) for x in H(6) for r in ranks})
    e = engine([F(32), S(16, 32)], st, lay)
    assert result(e.lookup_result(100, H(6))) == (96, ((0, 96), (1, 96)))
    assert st.calls[0] == ([key(0, x, **r) for x in (h(1), h(3), h(5)) for r in ranks]
                           + [key(1, x, **r) for x in H(6) for r in ranks])
    with pytest.raises(ValueError, match="PCP/DCP > 1"):
        engine([F(32), S(16, 32)], st, lay, vllm_compat="0.25")
    with pytest.raises(ValueError, match="PCP > 1"):
        engine([F(32), S(16, 32)], st, mk.ParallelLayout(tp_size=2, pcp_size=2, num_kv_heads=8))
