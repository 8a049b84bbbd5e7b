"""explain: every answer of a lookup's keys, the steps of its rules, and the very hit of the lookup.

Random deployments (full attention, sliding window, Mamba, chunked local; EAGLE; every contract;
partial hash hits; DCP/PCP, MLA) and random stores (a prefix, namespaces short of keys, holes,
error codes, odd answers, faults), both cores: explain's hit and tail key boundaries are
lookup_result's, asking once with the one-shot keys. Then what it names (namespaces, codes,
rules).
"""

from __future__ import annotations

import logging
import os
import random

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import mooncake_keys as mk
from mooncake_keys.lookup.explain import ABSENT, ERROR, PRESENT, Explanation

F, S, G, M, C = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.KVCacheGroup, mk.MambaSpec, mk.ChunkedLocalAttentionSpec
#: Random cases per core (the property below); MK_EXPLAIN_EXAMPLES moves it.
EXAMPLES = int(os.environ.get("MK_EXPLAIN_EXAMPLES", "2000"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
COMPATS = ["0.25", "0.26", "0.27", "0.29", "0.30", "0.32", "0.33"]


@st.composite
def deployments(draw):
    compat = draw(st.sampled_from(COMPATS))
    hbs = draw(st.sampled_from([8, 16]))
    n = draw(st.integers(1, 3))
    kinds = [draw(st.sampled_from(["full", "full", "swa", "mamba", "chunked"])) for _ in range(n)]
    chunked = "chunked" in kinds  # one block size, no EAGLE: vLLM looks chunked local attention up so only
    shared = hbs * draw(st.sampled_from([1, 2, 4]))
    groups = []
    for kind in kinds:
        bs = shared if chunked else hbs * draw(st.sampled_from([1, 2, 4]))
        spec = (F(bs) if kind == "full" else S(bs, draw(st.integers(1, 4 * bs))) if kind == "swa"
                else M(bs) if kind == "mamba" else C(bs, bs * draw(st.integers(1, 5))))
        cacheable = compat < "0.29" or not groups or draw(st.integers(0, 9)) > 0
        groups.append(G(spec, is_eagle_group=not chunked and draw(st.integers(0, 5)) == 0, prefix_cacheable=cacheable))
    tp = draw(st.sampled_from([1, 2, 4]))
    mode = draw(st.sampled_from(["plain", "plain", "plain", "dcp", "pcp"])) if n == 1 else "plain"
    layout = mk.ParallelLayout(
        tp_size=tp, pp_size=draw(st.sampled_from([1, 2])), num_kv_heads=draw(st.sampled_from([1, 2, 4])),
        use_mla=draw(st.integers(0, 4)) == 0, dcp_size=2 if mode == "dcp" and tp % 2 == 0 else 1,
        pcp_size=2 if mode == "pcp" else 1)
    dep = dict(groups=groups, layout=layout, hash_block_size=hbs, vllm_compat=compat,
               use_eagle=not chunked and draw(st.booleans()))
    if compat >= "0.27" and draw(st.integers(0, 4)) == 0:
        dep["partial_hash_hits"] = True
    return dep


def answer_of(seed, hashes, cut, short_cut, short_heads, hole_p):
    """A store's answer per key, a pure function of the key: present below ``cut`` (a hash
    index), in ``short_heads`` only below ``short_cut``; a hole (absent, an error code or an
    odd answer) with probability ``hole_p``."""
    index = {h.hex(): i for i, h in enumerate(hashes)}

    def answer(key):
        head, hx = key.rsplit("@", 1)
        i = index[hx]
        rng = random.Random(f"{seed}:{key}")
        if i >= cut or (head in short_heads and i >= short_cut):
            return rng.choice([0, 0, 0, -704])
        if rng.random() < hole_p:
            return rng.choice([0, -900, -704, 2, None, True])
        return 1

    return answer


@st.composite
def cases(draw):
    dep = draw(deployments())
    try:
        probe = mk.LookupEngine("m", store=mk.RecordingStore(), **dep)
    except ValueError:  # a combination the contract refuses (e.g. partial hits + a sliding window)
        assume(False)
    sbs = probe.scheduler_block_size
    n_hashes = draw(st.one_of(st.integers(0, 48), st.integers(100, 300)))
    whole = st.one_of(st.just(n_hashes), st.integers(n_hashes // 2, n_hashes + 2), st.integers(0, n_hashes + 2))
    tokens = draw(whole) * dep["hash_block_size"]
    if dep["vllm_compat"] < "0.27":
        tokens -= tokens % sbs
    else:
        tokens += draw(st.sampled_from([0, 0, 1]))
    heads = [h for hs in probe.deployment.heads for h in hs]
    short = draw(st.lists(st.sampled_from(heads), max_size=2)) if heads else []
    store = dict(cut=draw(st.one_of(st.just(n_hashes), st.integers(0, n_hashes))), short_cut=draw(st.integers(0, n_hashes)),
                 short_heads={h[:-1] for h in short}, hole_p=draw(st.sampled_from([0.0, 0.0, 0.02, 0.2])))
    fault = draw(st.sampled_from([None] * 6 + [ConnectionError("master unreachable"), "short", "not a list", -900]))
    skip = draw(st.sampled_from([0, 0, 0, 1, tokens // 2, tokens])) if tokens > 0 else 0
    strategy = draw(st.sampled_from(["oneshot", "rounds"]))
    return dep, n_hashes, tokens, store, fault, skip, strategy, draw(st.integers(0, 2**32))


@SETTINGS
@given(case=cases())
def test_explain_hits_what_the_lookup_hits(impl, case):
    dep, n_hashes, tokens, shape, fault, skip, strategy, seed = case
    rng = random.Random(seed)
    hashes = [rng.randbytes(16) for _ in range(n_hashes)]
    answer = answer_of(seed, hashes, **shape)
    looked = mk.LookupEngine("m", store=mk.RecordingStore(present=answer, fault=fault), strategy=strategy,
                             rounds_min_keys=0, **dep)
    store = mk.RecordingStore(present=answer, fault=fault)
    engine = mk.LookupEngine("m", store=store, strategy=strategy, rounds_min_keys=0, **dep)
    want = looked.lookup_result(tokens, hashes, skip_tokens=skip)
    x = engine.explain(tokens, hashes, skip_tokens=skip)
    faulty = fault is not None and not isinstance(fault, int)  # an int fault is an error code for every key
    keys = engine.candidate_keys(tokens, hashes, skip_tokens=skip)
    if faulty and keys and looked.store.num_calls == 0:
        # Rounds decided the hit without a call (no key could move it): explain asks one-shot, and
        # the store's fault answers 0.
        assert x.hit_length == 0 and x.fault
    else:
        assert (x.hit_length, x.tail_key_boundaries) == (want.hit_length, want.tail_key_boundaries)
    # One call, with exactly the keys a one-shot lookup asks; not counted as a lookup served.
    assert store.calls == ([keys] if keys else []) and x.keys_asked == len(keys)
    assert engine.stats().lookups == 0
    assert x.cuts[-1].tokens == x.hit_length and x.cuts[-1].rule in ("hit", "fault", "nothing")
    assert (x.fault is not None) == (faulty and bool(keys))
    if x.fault is not None:
        assert x.hit_length == 0 and all(not g.answers for g in x.groups)
    x.format()
    event("a hit" if x.hit_length else "a fault" if x.fault else "no hit")
    for cut in x.cuts:
        event(f"step: {cut.rule}")  # --hypothesis-show-statistics: every rule is met
    for g in x.groups:
        check_group(g, answer, x.fault is None and bool(keys))


def check_group(g, answer, answered):
    """What a group's explanation says agrees with the answers themselves."""
    r = len(g.namespaces)
    if not answered or not g.asked_chunks:
        return
    assert len(g.answers) == r and all(len(a) == len(g.asked_chunks) for a in g.answers)
    for k, prefix in enumerate(g.prefixes):
        for i in range(0, len(g.asked_chunks), 7):  # a sample: the answer kept is the store's
            s = g.status[k][i]
            a = g.answers[k][i]
            assert s == (PRESENT if type(a) in (int, bool) and a == 1 else ERROR if type(a) is int and a < 0 else ABSENT)
    everywhere = [all(g.status[k][i] == PRESENT for k in range(r)) for i in range(len(g.asked_chunks))]
    assert g.present_chunks == sum(everywhere)
    assert g.present_chunks + g.absent_chunks + g.error_chunks == len(g.asked_chunks)
    first = next((i for i, ok in enumerate(everywhere) if not ok), None)
    if first is None:
        assert g.first_missing is None
        return
    miss = g.first_missing
    assert miss.chunk == g.asked_chunks[first] and miss.start_tokens == miss.chunk * g.chunk_tokens
    assert set(miss.absent) == {g.namespaces[k] for k in range(r) if g.status[k][first] == ABSENT}
    assert dict(miss.errors) == {g.namespaces[k]: g.answers[k][first] for k in range(r) if g.status[k][first] == ERROR}
    assert g.run_chunks == len(g.presumed_chunks) + first and g.run_tokens == miss.start_tokens


# ------------------------------------------------------------------------------- what it names
def _tp4_pp2(**kw):
    return dict(groups=[F(64), S(64, 1024)], layout=mk.ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=4),
                hash_block_size=64, **kw)


def test_it_names_the_namespaces_short_of_the_first_missing_chunk_and_the_codes(impl):
    rng = random.Random(7)
    hashes = [rng.randbytes(32) for _ in range(64)]
    answers = {}
    engine = mk.LookupEngine("m", store=mk.RecordingStore(present=answers), **_tp4_pp2())
    for k in engine.candidate_keys(4096, hashes):
        late = k.endswith(tuple(h.hex() for h in hashes[25:]))
        answers[k] = 0 if late and "@tp_rank:1@" in k else 1
    code_key = f"m@tp_rank:3@pcp0@dcp0@pp_rank:1@group:0@{hashes[25].hex()}"
    answers[code_key] = -900
    x = engine.explain(4096, hashes)
    assert x.hit_length == engine.lookup(4096, hashes) == 1600
    full = x.groups[0]
    assert full.first_missing.chunk == 25 and full.first_missing.start_tokens == 1600
    assert full.first_missing.absent == ("tp1 pcp0 dcp0 pp0", "tp1 pcp0 dcp0 pp1")
    assert full.first_missing.errors == (("tp3 pcp0 dcp0 pp1", -900),)
    assert (full.present_chunks, full.absent_chunks, full.error_chunks) == (25, 38, 1)
    rows = {r.namespace: r for r in full.namespace_rows()}
    assert rows["tp1 pcp0 dcp0 pp0"] == ("tp1 pcp0 dcp0 pp0", 25, 39, 0, 25)
    assert rows["tp3 pcp0 dcp0 pp1"] == ("tp3 pcp0 dcp0 pp1", 63, 0, 1, 25)
    assert rows["tp0 pcp0 dcp0 pp0"].first_not_present is None
    text = x.format()
    assert "first missing: chunk 25 (token 1600): absent in tp1 pcp0 dcp0 pp0, tp1 pcp0 dcp0 pp1; " \
           "error -900 in tp3 pcp0 dcp0 pp1" in text
    assert "full attention (group 0): 1600 tokens present in every namespace" in text
    assert text.endswith("hit: 1600 tokens (tail key boundaries: group 0 at 1600, group 1 at 1600)")


def _prefix_store(engine, hashes, tokens, upto):
    """Every key of the first ``upto`` hashes."""
    kept = {h.hex() for h in hashes[:upto]}
    return {k for k in engine.candidate_keys(tokens, hashes) if k.rsplit("@", 1)[1] in kept}


def test_the_steps_give_each_rule_its_figures(impl):
    """Alignment, EAGLE, a window at the hit, and the last-token rule: each step with the
    coordinator's figures."""
    hashes = [bytes([i]) * 16 for i in range(64)]
    stored = set()
    dep = dict(groups=[F(16), S(32, 64)], layout=mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16)
    engine = mk.LookupEngine("m", store=mk.RecordingStore(present=stored), **dep)
    stored |= _prefix_store(engine, hashes, 1024, 51)  # 816 tokens
    x = engine.explain(1024, hashes)
    steps = [(c.rule, c.tokens) for c in x.cuts]
    assert steps == [("present", 816), ("alignment", 800), ("window", 800), ("at-hit", None), ("hit", 800)]
    assert x.cuts[1].text == "full attention (group 0): aligned to the scheduler block size (32 tokens): 816 -> 800"
    assert x.cuts[3].text == "sliding window (group 1) needs 2 chunks ending at the hit: the window at 800 is complete"
    eagle = mk.LookupEngine("m", store=mk.RecordingStore(present=stored), use_eagle=True, **dep)
    x = eagle.explain(1024, hashes)
    assert x.hit_length == eagle.lookup(1024, hashes) == 768
    assert [(c.rule, c.tokens) for c in x.cuts if c.rule == "eagle"] == [("eagle", 768)]
    assert "EAGLE drops one block (groups 0, 1): 800 -> 768" in x.format()
    stored |= _prefix_store(engine, hashes, 1024, 64)  # every key
    x = engine.explain(1024, hashes)
    assert x.hit_length == 992 and x.cuts[-2].rule == "last-token"
    assert x.cuts[-2].text == ("the last token is computed (vllm_compat 0.33): a hit of all 1024 tokens is looked "
                               "up again below them: 1024 -> 992")
    old = mk.LookupEngine("m", store=mk.RecordingStore(present=stored), vllm_compat="0.25", **dep).explain(1024, hashes)
    assert old.hit_length == 1024 and "last-token" not in [c.rule for c in old.cuts]


def test_a_window_that_is_incomplete_at_the_full_attention_hit(impl):
    """The hybrid fixed point: the window's missing chunk pulls the hit below full attention's."""
    hashes = [bytes([i]) * 16 for i in range(32)]
    stored = set()
    dep = dict(groups=[F(16), S(16, 64)], layout=mk.ParallelLayout(), hash_block_size=16)
    engine = mk.LookupEngine("m", store=mk.RecordingStore(present=stored), **dep)
    stored |= _prefix_store(engine, hashes, 512, 20)
    stored.discard(f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:1@{hashes[18].hex()}")
    x = engine.explain(512, hashes)
    assert x.hit_length == engine.lookup(512, hashes) == 288
    window = x.groups[1]
    assert window.first_missing.chunk == 18 and window.first_missing.absent == ("tp0 pcp0 dcp0 pp0",)
    assert window.alone_hit_tokens == 288 and x.groups[0].alone_hit_tokens == 320
    assert [c.tokens for c in x.cuts if c.rule in ("present", "window")] == [320, 288]


@pytest.mark.parametrize("fault, reason", [
    (ConnectionError("master unreachable"), "raised ConnectionError: master unreachable"),
    ("short", "returned 511 results for 512 keys"),
    ("not a list", "returned NoneType, not a list"),
])
def test_a_store_fault_gives_no_hit_and_its_reason(impl, caplog, fault, reason):
    hashes = [bytes([i]) * 16 for i in range(32)]
    engine = mk.LookupEngine("m", store=mk.RecordingStore(answer=1, fault=fault), **_tp4_pp2(vllm_compat="0.33"))
    with caplog.at_level(logging.WARNING, logger="mooncake_keys"):
        x = engine.explain(2048, hashes)
    assert x.hit_length == 0 and x.tail_key_boundaries == ()
    assert x.fault is not None and reason in x.fault
    assert [c.rule for c in x.cuts] == ["fault"] and x.cuts[0].tokens == 0
    assert f"store fault: {x.fault}" in x.format()
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("mooncake_keys")]
    assert lines == [x.fault]  # the engine's one log line, and it is the reason
    assert engine.stats().store_failures == 0  # the call was the engine's; no lookup was counted


def test_error_codes_everywhere_are_absent_not_a_fault(impl):
    hashes = [bytes([i]) * 16 for i in range(32)]
    x = mk.LookupEngine("m", store=mk.RecordingStore(answer=-900), **_tp4_pp2()).explain(2048, hashes)
    assert x.fault is None and x.hit_length == 0
    assert x.groups[0].first_missing.errors == tuple((ns, -900) for ns in x.groups[0].namespaces)
    assert x.groups[0].error_chunks == 32


def test_arguments_are_checked_as_by_a_lookup(impl):
    engine = mk.LookupEngine("m", store=mk.RecordingStore(), **_tp4_pp2(vllm_compat="0.25"))
    with pytest.raises(ValueError, match="num_tokens .100. must be a multiple of the scheduler block size"):
        engine.explain(100, [b"x" * 16])
    with pytest.raises(TypeError, match="num_tokens must be an int"):
        engine.explain("64", [b"x" * 16])
    with pytest.raises(ValueError, match="skip_tokens must be >= 0"):
        engine.explain(64, [b"x" * 16], skip_tokens=-1)
    assert engine.store.calls == []
    nothing = engine.explain(64, [])
    assert nothing.hit_length == 0 and nothing.cuts[0].text == "no hashes: nothing is asked -> 0"


def test_explanations_are_frozen(impl):
    x = mk.LookupEngine("m", store=mk.RecordingStore(answer=1), **_tp4_pp2()).explain(640, [bytes([i]) * 8 for i in range(10)])
    assert isinstance(x, Explanation)
    with pytest.raises(AttributeError):
        x.hit_length = 1
    with pytest.raises(AttributeError):
        x.groups[0].run_tokens = 1
