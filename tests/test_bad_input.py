"""Programming errors raise at once, naming the argument; store faults answer 0 with a log line."""

import logging

import dataclasses

import pytest

import mooncake_keys as mk
from mooncake_keys.vllm.contracts import get_contract
from mooncake_keys.lookup.coordinator import Coordinator

F, S = mk.FullAttentionSpec, mk.SlidingWindowSpec


def make(store=None, groups=(F(16),), **kw):
    kw.setdefault("hash_block_size", 16)
    return mk.LookupEngine("m", list(groups), kw.pop("layout", mk.ParallelLayout()),
                           store=store or mk.MemoryStore(), **kw, vllm_compat="0.25")


HS = [b"a" * 8, b"b" * 8, b"c" * 8, b"d" * 8]


def test_empty_hashes_or_zero_token_len_is_zero_without_a_call(impl, recording_store):
    st = recording_store([])
    e = make(st)
    assert e.lookup(64, []) == 0
    assert e.lookup(0, HS) == 0
    assert e.lookup(64, mk.BlockHashes.from_blob(b"", 0)) == 0
    assert st.calls == []


ENTRY_POINTS = {
    "lookup": lambda e, n, hs, skip: e.lookup(n, hs, skip_tokens=skip),
    "lookup_result": lambda e, n, hs, skip: e.lookup_result(n, hs, skip_tokens=skip),
    "candidate_keys": lambda e, n, hs, skip: e.candidate_keys(n, hs, skip_tokens=skip),
    "steps": lambda e, n, hs, skip: next(e.steps(n, hs, skip)),
    "explain": lambda e, n, hs, skip: e.explain(n, hs, skip_tokens=skip),
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("num_tokens", [-1, -64, 2**32, 10**20])
@pytest.mark.parametrize("compat", ["0.25", "0.33"])
def test_a_negative_or_absurd_num_tokens_is_a_value_error_naming_it(impl, recording_store, entry, num_tokens, compat):
    """Not a quiet 0 (nor, past 2**32 - 1, what vLLM's lookup could never be asked): the library
    refuses it at every entry point, before asking anything."""
    st = recording_store([])
    e = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=st, vllm_compat=compat)
    name = "token_len" if entry == "candidate_keys" else "num_tokens"
    with pytest.raises(ValueError, match=rf"^{name} must be a token count, 0 \.\. 4294967295"):
        ENTRY_POINTS[entry](e, num_tokens, HS, 0)
    assert st.calls == []


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_skip_tokens_past_the_prompt_is_a_value_error_naming_it(impl, recording_store, entry):
    """skip_tokens counts tokens of the prompt held locally: more than the prompt is a mistake,
    not a full hit answered without asking the store."""
    st = recording_store(lambda keys: [0] * len(keys))
    e = make(st)
    with pytest.raises(ValueError, match=r"skip_tokens \(80\) must be <= (num_tokens|token_len) \(64\)"):
        ENTRY_POINTS[entry](e, 64, HS, 80)
    assert st.calls == []
    assert e.lookup(64, HS, skip_tokens=64) == 64  # all of it held: no call, a full hit
    assert e.lookup(2**32 - 16, HS) == 0 and len(st.calls) == 1  # the largest count vLLM can send


def test_nothing_to_ask_is_zero_without_a_call(impl, recording_store):
    st = recording_store([])
    e = make(st, groups=[F(64)])
    assert e.lookup(64, HS[:3]) == 0  # 3 hashes of 16 tokens: no full 64-token chunk
    assert st.calls == []


def test_fewer_hashes_than_token_len_counts_the_rest_absent(impl, recording_store):
    st = recording_store(lambda keys: [1] * len(keys))
    assert make(st).lookup(16 * 10, HS) == 64
    assert len(st.calls[0]) == 4
    # A sliding-window-only config (vLLM can IndexError here): chunks without a hash are absent.
    st2 = recording_store(lambda keys: [1] * len(keys))
    assert make(st2, groups=[S(16, 32)]).lookup(16 * 10, HS) == 64


def test_unaligned_token_len_is_a_value_error(impl):
    with pytest.raises(ValueError, match="num_tokens"):
        make(groups=[F(16), S(32, 64)]).lookup(48, HS)


@pytest.mark.parametrize("bad", [1.0, "64", None])
def test_token_len_type(impl, bad):
    with pytest.raises(TypeError, match="num_tokens"):
        make().lookup(bad, HS)
    with pytest.raises(TypeError, match="token_len"):
        make().candidate_keys(bad, HS)


def test_hashes_of_unequal_length(impl):
    with pytest.raises(ValueError, match=r"block_hashes\[1\]"):
        make().lookup(32, [b"aa", b"bbb"])


@pytest.mark.parametrize("bad", [["ab", "cd"], [b"ab", 3], [None]])
def test_hash_not_bytes_like(impl, bad):
    with pytest.raises(TypeError, match=r"block_hashes\[\d\]"):
        make().lookup(32, bad)


@pytest.mark.parametrize("bad", [None, "abc", 5])
def test_block_hashes_not_a_sequence(impl, bad):
    with pytest.raises(TypeError, match="block_hashes"):
        make().lookup(32, bad)


def test_negative_skip_tokens(impl):
    with pytest.raises(ValueError, match="skip_tokens"):
        make().lookup(32, HS, skip_tokens=-1)


def test_group_block_size_not_multiple_of_hash_block_size():
    with pytest.raises(ValueError, match=r"groups\[1\] block_size \(24\).*hash_block_size \(16\)"):
        make(groups=[F(16), F(24)])


def test_scheduler_block_size_not_multiple_of_group_block_size():
    with pytest.raises(ValueError, match=r"scheduler_block_size \(48\).*groups\[1\] block_size \(32\)"):
        make(groups=[F(16), F(32)], scheduler_block_size=48)


@pytest.mark.parametrize("kw,arg", [
    (dict(hash_block_size=0), "hash_block_size"),
    (dict(hash_block_size=-16), "hash_block_size"),
    (dict(scheduler_block_size=-16), "scheduler_block_size"),
])
def test_negative_sizes(kw, arg):
    with pytest.raises(ValueError, match=arg):
        make(**kw)


@pytest.mark.parametrize("ctor,arg", [
    (lambda: F(0), "block_size"),
    (lambda: F(-16), "block_size"),
    (lambda: S(16, 0), "sliding_window"),
    (lambda: mk.ParallelLayout(tp_size=0), "tp_size"),
    (lambda: mk.ParallelLayout(pp_size=-1), "pp_size"),
    (lambda: mk.ParallelLayout(num_kv_heads=0), "num_kv_heads"),
    (lambda: mk.ParallelLayout(tp_size=4, dcp_size=3), "dcp_size"),
])
def test_bad_sizes(ctor, arg):
    with pytest.raises(ValueError, match=arg):
        ctor()


def test_bad_types_in_constructors():
    with pytest.raises(TypeError, match="block_size"):
        F(16.0)
    with pytest.raises(TypeError, match="spec"):
        mk.KVCacheGroup("full")
    with pytest.raises(TypeError, match="layout"):
        mk.LookupEngine("m", [F(16)], None, hash_block_size=16, store=mk.MemoryStore(), vllm_compat="0.25")
    with pytest.raises(TypeError, match="store"):
        mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=object(), vllm_compat="0.25")
    with pytest.raises(TypeError, match="model_name"):
        mk.LookupEngine(None, [F(16)], mk.ParallelLayout(), hash_block_size=16, store=mk.MemoryStore(), vllm_compat="0.25")
    with pytest.raises(TypeError, match="cache_prefix"):
        make(cache_prefix=None)


def test_dcp_or_pcp_with_several_groups_is_rejected():
    for layout in (mk.ParallelLayout(tp_size=2, dcp_size=2), mk.ParallelLayout(pcp_size=2)):
        with pytest.raises(ValueError, match="PCP/DCP"):
            make(groups=[F(16), S(16, 32)], layout=layout)


def test_blob_errors():
    with pytest.raises(ValueError, match="multiple of hash_len"):
        mk.BlockHashes.from_blob(b"abc", 2)
    with pytest.raises(ValueError, match="hash_len"):
        mk.BlockHashes.from_blob(b"abc", 0)
    with pytest.raises(TypeError, match="blob"):
        mk.BlockHashes.from_blob("abc", 1)


@pytest.mark.parametrize("fault,cause", [
    (ConnectionError("master unreachable"), "ConnectionError: master unreachable"),
    ("short", "returned 3 results for 4 keys"),
    ("not a list", "returned NoneType"),
])
def test_store_faults_answer_zero_with_one_log_line(impl, caplog, fault, cause):
    e = make(mk.RecordingStore(1, fault=fault))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        assert e.lookup(64, HS) == 0
    records = [r for r in caplog.records if r.name.startswith("mooncake_keys")]
    assert len(records) == 1 and cause in records[0].getMessage()


def test_negative_and_unknown_codes_count_as_missing(impl, recording_store):
    for code in (0, -1, -704, -900, 2, "1", None):
        st = recording_store(lambda keys, c=code: [1, c, 1, 1][: len(keys)])
        assert make(st).lookup(64, HS) == 16


def test_non_ascii_names_are_identical_on_both_cores(recording_store):
    from support.cores import NO_C_ENGINES

    if NO_C_ENGINES:
        pytest.skip(NO_C_ENGINES)
    out = {}
    for core in ("c", "py"):
        e = mk.LookupEngine("модель-日本語-🚀", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2),
                            hash_block_size=16, cache_prefix="é\xff", store=mk.MemoryStore(), core=core, vllm_compat="0.25")
        out[core] = e.candidate_keys(64, HS)
    a, b = out.values()
    assert a == b and a[0] == "é\xff@модель-日本語-🚀@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@" + HS[0].hex()


@pytest.mark.parametrize("name", ["model_name", "cache_prefix", "store_namespace"])
def test_a_name_utf8_cannot_encode_is_refused_at_construction(name):
    """A lone surrogate made every lookup fail later (the store cannot send the key)."""
    kw = dict(model_name="m", cache_prefix="", store_namespace="")
    kw[name] = "\ud800" if name != "store_namespace" else "@store_tp:\ud800"
    with pytest.raises(ValueError, match=f"{name} must be valid text"):
        mk.LookupEngine(kw.pop("model_name"), [F(16)], mk.ParallelLayout(), hash_block_size=16,
                        store=mk.MemoryStore(), **kw)


def test_stats_count_lookups_calls_failures_keys_and_hits(impl, recording_store):
    st = recording_store(lambda keys: [1, 1, 0, 1][: len(keys)])
    e = make(st)
    assert e.lookup(64, HS) == 32
    assert e.lookup(64, []) == 0
    f = make(mk.RecordingStore(fault=ConnectionError("master unreachable")))
    f.lookup(64, HS)
    assert e.stats() == mk.LookupStats(lookups=2, store_calls=1, store_failures=0, keys_sent=4, hit_tokens=32,
                                       hits=1, present_keys=3, tokens_asked=128, leased_keys=3)
    down = f.stats()
    assert down.unavailable_seconds > 0  # the store has been unavailable since the failed call
    assert dataclasses.replace(down, unavailable_seconds=0.0) == mk.LookupStats(
        lookups=1, store_calls=1, store_failures=1, keys_sent=4, hit_tokens=0, tokens_asked=64)
    f.store = st  # answered again: the unavailable time stops growing
    f.lookup(64, HS)
    assert f.stats().unavailable_seconds == f.stats().unavailable_seconds > 0


def test_hashes_from_any_iterable_are_read_once(impl, recording_store):
    st = recording_store(lambda keys: [1] * len(keys))
    e = make(st)
    assert e.lookup(64, iter(HS)) == 64
    assert e.lookup(64, (h for h in HS)) == 64
    assert e.lookup(64, [bytearray(h) for h in HS]) == 64
    assert e.lookup(64, [memoryview(h) for h in HS]) == 64
    assert len(st.calls) == 4 and all(c == st.calls[0] for c in st.calls)
    with pytest.raises(TypeError, match="block_hashes"):
        mk.BlockHashes.from_list(None)


# --------------------------------------------------------------------- sizes and the coordinator
def test_a_huge_block_size_is_a_value_error():
    with pytest.raises(ValueError, match="block_size must be <="):
        F(2**62)
    with pytest.raises(ValueError, match="sliding_window must be <="):
        S(16, 2**62)
    with pytest.raises(ValueError, match="hash_block_size must be <="):
        mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=2**62, store=mk.MemoryStore())


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
