"""vLLM 0.25's lookup on its own tests and worked examples (``vllm_compat="0.25"``): the worker's
lookup tests, the order of the keys, and scenarios of hybrid, multi-group and EAGLE deployments.

vLLM's tests use hashes of unequal length (``h0`` .. ``h11``); mooncake_keys rejects those
(``ValueError``), so the same scenarios use ``h00`` .. ``h11`` here: the hit lengths are the same.
"""

import pytest

import mooncake_keys as mk

F, S = mk.FullAttentionSpec, mk.SlidingWindowSpec
G = mk.KVCacheGroup
P0 = "test-model@tp_rank:0@pcp0@dcp0@pp_rank:0"
H = [f"h{i:02d}".encode() for i in range(12)]


def engine(groups, store, layout=None, hash_bs=None, **kw):
    groups = [g if isinstance(g, mk.KVCacheGroup) else G(g) for g in groups]
    if hash_bs is None:
        hash_bs = min(g.spec.block_size for g in groups)
    return mk.LookupEngine("test-model", groups, layout or mk.ParallelLayout(), hash_block_size=hash_bs,
                           store=store, **kw, vllm_compat="0.25")


# --------------------------------------------------------------------- the worker's lookup tests
def test_lookup_partial_prefix_returns_first_hit_length(impl, recording_store):
    st = recording_store([1, 1, 0])
    assert engine([F(16)], st).lookup(48, [b"a0", b"a1", b"a2"]) == 32


def test_lookup_swa_single_group_returns_full_when_tail_window_present(impl, recording_store):
    st = recording_store([0, 0, 1, 1])
    assert engine([S(16, 32)], st).lookup(64, [b"h0", b"h1", b"h2", b"h3"]) == 64
    assert len(st.calls[0]) == 4  # mask None: need 2 >= per 1


def test_lookup_checks_all_potential_swa_hit_boundaries(impl, recording_store):
    st = recording_store([1, 0, 0, 1, 0, 0])
    e = engine([F(32), S(8, 8)], st, hash_bs=8)
    assert e.lookup(96, H) == 32
    (keys,) = st.calls
    assert keys == [f"{P0}@group:0@{H[i].hex()}" for i in (3, 7, 11)] + [
        f"{P0}@group:1@{H[i].hex()}" for i in (3, 7, 11)]
    assert e.coordinator.lookup_mask(96)[1] == [i % 4 == 3 for i in range(12)]


def test_lookup_key_prefixes_cover_dcp_rank_namespaces(impl, recording_store):
    e = engine([F(16)], recording_store([]), mk.ParallelLayout(tp_size=4, num_kv_heads=1, dcp_size=4))
    assert len(e.group_namespaces[0]) == 4
    assert e.prefixes[0] == tuple(f"test-model@tp_rank:{k}@pcp0@dcp{k}@pp_rank:0@group:0" for k in range(4))


def test_lookup_key_prefixes_cover_pcp_rank_namespaces(impl, recording_store):
    e = engine([F(16)], recording_store([]), mk.ParallelLayout(tp_size=4, num_kv_heads=1, pcp_size=2))
    assert len(e.group_namespaces[0]) == 2
    assert e.prefixes[0] == ("test-model@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",
                             "test-model@tp_rank:0@pcp1@dcp0@pp_rank:0@group:0")


def test_lookup_requires_all_dcp_rank_namespaces(impl, recording_store):
    st = recording_store([1, 1, 0, 1])
    e = engine([F(16)], st, mk.ParallelLayout(tp_size=4, num_kv_heads=1, dcp_size=4))
    assert e.lookup(16, [b"a0"]) == 0
    assert st.calls == [[f"test-model@tp_rank:{k}@pcp0@dcp{k}@pp_rank:0@group:0@6130" for k in range(4)]]


def test_lookup_sends_one_rpc_with_every_key(impl, recording_store):
    st = recording_store([1, 1])
    assert engine([F(16)], st).lookup(32, [b"a0", b"a1"]) == 32
    assert len(st.calls) == 1 and len(st.calls[0]) == 2


def test_blob_block_hashes_wire_roundtrip():
    hs = [bytes([i]) * 16 for i in range(5)]
    bh = mk.BlockHashes.from_blob(memoryview(b"".join(hs)), 16)
    assert len(bh) == 5 and list(bh) == hs and bh[-1] == hs[4] and bh[2] == hs[2]
    assert list(bh[1:3]) == hs[1:3] and list(bh[::2]) == hs[::2]
    with pytest.raises(IndexError):
        bh[5]
    assert len(mk.BlockHashes.from_blob(b"", 0)) == 0


def test_blob_and_list_give_the_same_keys_and_hits(impl, recording_store):
    hs = [bytes([i]) * 32 for i in range(1, 9)]
    st = recording_store(lambda keys: [1] * len(keys))
    e = engine([F(32), S(16, 32)], st, hash_bs=16)
    blob = mk.BlockHashes.from_blob(bytearray(b"".join(hs)), 32)
    view = mk.BlockHashes.from_blob(memoryview(b"".join(hs)), 32)
    assert e.candidate_keys(128, hs) == e.candidate_keys(128, blob) == e.candidate_keys(128, view)
    assert e.lookup(128, blob) == e.lookup(128, hs) == 128


# --------------------------------------------------------------------- coordinator tests
def _all(keys):
    return [1] * len(keys)


def _hs(n):
    return [bytes([i + 1]) * 4 for i in range(n)]


@pytest.mark.parametrize("present,expected", [(4, 64), (2, 32), (0, 0)])
def test_single_full_group(impl, recording_store, present, expected):
    st = recording_store(lambda keys: [1 if i < present else 0 for i in range(len(keys))])
    assert engine([F(16)], st).lookup(64, _hs(4)) == expected


def test_single_swa_group_all_present(impl, recording_store):
    assert engine([S(16, 32)], recording_store(_all)).lookup(64, _hs(4)) == 64


def test_hybrid_full_swa(impl, recording_store):
    assert engine([F(16), S(16, 32)], recording_store(_all)).lookup(64, _hs(4)) == 64
    # Full attention missing chunk 1 -> 16.
    st = recording_store(lambda keys: [0 if i == 1 else 1 for i in range(len(keys))])
    assert engine([F(16), S(16, 32)], st).lookup(64, _hs(4)) == 16


def test_two_full_groups_with_compact_hashes(impl, recording_store):
    assert engine([F(16), F(32)], recording_store(_all), hash_bs=16).lookup(64, _hs(4)) == 64


def test_eagle_full_drops_one_block(impl, recording_store):
    assert engine([F(16)], recording_store(_all), use_eagle=True).lookup(64, _hs(4)) == 48


def test_eagle_hybrid(impl, recording_store):
    assert engine([F(16), S(16, 32)], recording_store(_all), use_eagle=True).lookup(64, _hs(4)) == 48


def test_hma_e2e_swa_pre_window_keys_may_be_missing(impl):
    store = mk.MemoryStore()
    e = engine([F(16), S(16, 32)], store)
    hs = _hs(4)
    for k in e.candidate_keys(64, hs):
        store.put(k)
    assert e.lookup(64, hs) == 64
    for j in (0, 1):
        store.remove(f"{P0}@group:1@{hs[j].hex()}")
    assert e.lookup(64, hs) == 64


# --------------------------------------------------------------------- the order of the keys
def test_candidate_order_tp2_pp2(impl, recording_store):
    e = engine([F(16)], recording_store([]), mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2))
    hs = [b"c0", b"c1", b"c2"]
    prefixes = [f"test-model@tp_rank:{t}@pcp0@dcp0@pp_rank:{p}@group:0" for t in (0, 1) for p in (0, 1)]
    assert e.candidate_keys(48, hs) == [f"{p}@{h.hex()}" for h in hs for p in prefixes]


def test_namespaces_examples():
    assert mk.ParallelLayout(tp_size=4, dcp_size=2, use_mla=True).lookup_namespaces() == (
        (0, 0, 0, 0), (1, 0, 1, 0), (2, 0, 0, 0), (3, 0, 1, 0))
    assert mk.ParallelLayout(tp_size=4, num_kv_heads=1, pcp_size=2).lookup_namespaces() == (
        (0, 0, 0, 0), (0, 1, 0, 0))


def test_hybrid_candidate_order(impl, recording_store):
    e = engine([F(32), S(8, 32)], recording_store([]), hash_bs=8)  # SWA mask None (need 4 >= per 4)
    keys = e.candidate_keys(32 * 3, H)
    assert [k.rsplit("@", 2)[1:] for k in keys[:3]] == [["group:0", H[i].hex()] for i in (3, 7, 11)]
    assert [k.rsplit("@", 1)[1] for k in keys[3:]] == [h.hex() for h in H]


# --------------------------------------------------------------------- scenarios
def _swa_answer(full_ok, swa_chunks):
    """Full group (3 keys first) all present; SWA keys present for the given chunk ids."""
    def answer(keys):
        out = []
        for k in keys:
            group, hx = k.rsplit("@", 2)[1:]
            chunk = [h.hex() for h in H].index(hx)
            out.append(int(full_ok if group == "group:0" else chunk in swa_chunks))
        return out
    return answer


@pytest.mark.parametrize("swa_present,expected", [({7}, 64), ({11}, 96)])
def test_scenario_1(impl, recording_store, swa_present, expected):
    e = engine([F(32), S(8, 8)], recording_store(_swa_answer(True, swa_present)), hash_bs=8)
    assert e.lookup(96, H) == expected


@pytest.mark.parametrize("swa_present,expected", [({10, 11}, 96), ({11}, 0), ({6, 7, 11}, 64)])
def test_scenario_2(impl, recording_store, swa_present, expected):
    st = recording_store(_swa_answer(True, swa_present))
    e = engine([F(32), S(8, 16)], st, hash_bs=8)
    assert e.lookup(96, H) == expected
    assert [k.rsplit("@", 1)[1] for k in st.calls[0][3:]] == [H[i].hex() for i in (2, 3, 6, 7, 10, 11)]


def test_scenario_3_three_attention_groups(impl, recording_store):
    def answer(keys):
        out = []
        for k in keys:
            group, hx = k.rsplit("@", 2)[1:]
            idx = [h.hex() for h in H].index(hx)
            # group 2 is SWA(16, 32): its chunk j uses hash 2j+1; present for chunks 0-3 only.
            out.append(int(group != "group:2" or (idx - 1) // 2 <= 3))
        return out
    st = recording_store(answer)
    e = engine([F(32), S(8, 8), S(16, 32)], st, hash_bs=8)
    assert e.lookup(96, H) == 64
    assert len(st.calls[0]) == 12


def test_scenario_4_tp2_pp2_one_namespace_missing(impl, recording_store):
    hs = [b"k0", b"k1", b"k2"]
    missing = f"test-model@tp_rank:1@pcp0@dcp0@pp_rank:1@group:0@{hs[1].hex()}"
    st = recording_store(lambda keys: [0 if k == missing else 1 for k in keys])
    e = engine([F(16)], st, mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2))
    assert e.lookup(48, hs) == 16


@pytest.mark.parametrize("groups", [[F(16), S(16, 32)], [S(16, 32)], [F(16)]])
def test_scenario_5_eagle(impl, recording_store, groups):
    assert engine(groups, recording_store(_all), use_eagle=True).lookup(64, _hs(4)) == 48


def test_scenario_5_eagle_six_chunks(impl, recording_store):
    assert engine([F(16)], recording_store(_all), use_eagle=True).lookup(96, _hs(6)) == 80


def test_scenario_6_eagle_swa_mask(impl, recording_store):
    e = engine([F(32), S(8, 8)], recording_store([]), hash_bs=8, use_eagle=True)
    assert [i for i, m in enumerate(e.coordinator.lookup_mask(96)[1]) if m] == [3, 4, 7, 8, 11]
