"""explain: every answer of a lookup's keys, the steps of its rules, and the very hit of the lookup.

Random deployments (full attention, sliding window, Mamba, chunked local; EAGLE; every contract;
partial hash hits; DCP/PCP, MLA) and random stores (a prefix, namespaces short of keys, holes,
error codes, odd answers, faults), both cores: explain's hit and tail key boundaries are
lookup_result's, asking once with the one-shot keys. Then what it names (namespaces, codes,
rules), the heat map, and ``mooncake_keys explain`` end to end on a real mooncake_master.
"""

from __future__ import annotations

import json
import logging
import os
import random
import struct
import subprocess
import sys
import zlib

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

import mooncake_keys as mk
from mooncake_keys import cli
from mooncake_keys.lookup.explain import ABSENT, ERROR, PRESENT, Explanation
from mooncake_keys.report import text

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
    store = dict(cut=draw(st.one_of(st.just(n_hashes), st.integers(0, n_hashes))),
                 short_cut=draw(st.integers(0, n_hashes)),
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
    text(x)
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
            want = PRESENT if type(a) in (int, bool) and a == 1 else ERROR if type(a) is int and a < 0 else ABSENT
            assert s == want
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
    printed = text(x)
    assert "first missing: chunk 25 (token 1600): absent in tp1 pcp0 dcp0 pp0, tp1 pcp0 dcp0 pp1; " \
           "error -900 in tp3 pcp0 dcp0 pp1" in printed
    assert "full attention (group 0): 1600 tokens present in every namespace" in printed
    assert printed.endswith("hit: 1600 tokens (tail key boundaries: group 0 at 1600, group 1 at 1600)")


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
    assert "EAGLE drops one block (groups 0, 1): 800 -> 768" in text(x)
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
    assert f"store fault: {x.fault}" in text(x)
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
    engine = mk.LookupEngine("m", store=mk.RecordingStore(answer=1), **_tp4_pp2())
    x = engine.explain(640, [bytes([i]) * 8 for i in range(10)])
    assert isinstance(x, Explanation)
    with pytest.raises(AttributeError):
        x.hit_length = 1
    with pytest.raises(AttributeError):
        x.groups[0].run_tokens = 1


# ------------------------------------------------------------------------------- the heat map
def png_chunks(data):
    """(type, body) of every chunk of a PNG file."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, out = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + length]
        assert zlib.crc32(kind + body) == struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]
        out.append((kind, body))
        pos += 12 + length
    return out


def assert_matplotlib_png(path):
    with open(path, "rb") as f:
        chunks = png_chunks(f.read())
    text = b"".join(body for kind, body in chunks if kind in (b"tEXt", b"iTXt"))
    assert b"Software" in text and b"matplotlib" in text.lower()  # drawn by matplotlib, not a stub
    width, height = struct.unpack(">II", chunks[0][1][:8])
    assert width > 600 and height > 200


def test_the_heat_map(impl, tmp_path):
    pytest.importorskip("matplotlib")
    from mooncake_keys.report import heat_map

    rng = random.Random(3)
    hashes = [rng.randbytes(16) for _ in range(1000)]  # more chunks than columns: aggregated
    answers = {}
    engine = mk.LookupEngine("m", store=mk.RecordingStore(present=answers), **_tp4_pp2(use_eagle=True))
    for k in engine.candidate_keys(64000, hashes):
        answers[k] = 1 if "@tp_rank:2@" not in k or k.rsplit("@", 1)[1] in {h.hex() for h in hashes[:600]} else 0
    answers[engine.candidate_keys(64000, hashes)[-1]] = -704
    x = engine.explain(64000, hashes, skip_tokens=640)
    path = heat_map(x, str(tmp_path / "map.png"))
    assert path == str(tmp_path / "map.png")
    assert_matplotlib_png(path)


def test_the_heat_map_of_many_namespaces_and_tokens_is_bounded(tmp_path):
    """4,096 namespaces and a num_tokens far past the hashes: at most MAX_ROWS rows and
    MAX_COLUMNS columns per group (a cell the worst of its namespaces and chunks)."""
    pytest.importorskip("matplotlib")
    from mooncake_keys import report

    layout = mk.ParallelLayout(tp_size=4096, num_kv_heads=4096)
    engine = mk.LookupEngine("m", [F(16)], layout, hash_block_size=16,
                             store=mk.RecordingStore(answer=lambda keys: [0 if "@tp_rank:7@" in k else 1 for k in keys]))
    hashes = [bytes([i]) * 16 for i in range(8)]
    x = engine.explain(1 << 31, hashes)
    assert x.hit_length == 0 and x.groups[0].first_missing.absent == ("tp7 pcp0 dcp0 pp0",)
    path = report.heat_map(x, str(tmp_path / "wide.png"))
    with open(path, "rb") as f:
        width, height = struct.unpack(">II", png_chunks(f.read())[0][1][:8])
    assert height <= (1.6 + 0.22 * report.MAX_ROWS) * 110 and width <= 11 * 110


# ------------------------------------------------------------------------------- the command line
def run_cli(*argv, **kw):
    return subprocess.run([sys.executable, "-m", "mooncake_keys", "explain", *argv], capture_output=True, text=True,
                          timeout=120, **kw)


DEPLOYMENT = ["--model", "org/Model-7B", "--tp", "2", "--pp", "2", "--num-kv-heads", "2", "--group", "full:16",
              "--group", "swa:16:64"]


def test_end_to_end_on_a_real_master(clean_mooncake_store, mooncake_master, tmp_path):
    """Keys missing in one namespace of a stored prefix: the table names it and the hit, the
    plot is a PNG matplotlib drew."""
    pytest.importorskip("matplotlib")
    holder = clean_mooncake_store
    rng = random.Random(11)
    hashes = [rng.randbytes(32) for _ in range(40)]
    engine = mk.LookupEngine("Model-7B", [F(16), S(16, 64)], mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2),
                             hash_block_size=16, store=mk.RecordingStore())
    late = {h.hex() for h in hashes[24:]}
    for key in engine.candidate_keys(640, hashes):
        if not ("@tp_rank:1@" in key and "@pp_rank:0@" in key and key.rsplit("@", 1)[1] in late):
            assert holder.put(key, b"kv") == 0
    prompt = tmp_path / "prompt.hashes"
    prompt.write_text("# the request's block hashes\n" + "\n".join(h.hex() for h in hashes) + "\n")
    plot = tmp_path / "out" / "explain.png"
    out = run_cli(*DEPLOYMENT, "--hashes", str(prompt), "--master", mooncake_master.master_address, "--plot", str(plot))
    assert out.returncode == 0, out.stderr
    assert "first missing: chunk 24 (token 384): absent in tp1 pcp0 dcp0 pp0" in out.stdout
    assert "  tp1 pcp0 dcp0 pp0       24      16      0  chunk 24 (token 384)" in out.stdout
    assert "hit: 384 tokens (tail key boundaries: group 0 at 384, group 1 at 384)" in out.stdout
    assert f"plot: {plot}" in out.stdout
    assert_matplotlib_png(plot)
    # The same from standard input, with a shorter length and the vLLM config's cache prefix: nothing stored.
    config = json.dumps({"kv_connector": "MooncakeStoreConnector", "kv_connector_extra_config": {"cache_prefix": "t"}})
    out = run_cli(*DEPLOYMENT, "--hashes", "-", "--num-tokens", "200", "--kv-transfer-config", config,
                  "--master", mooncake_master.master_address, input=prompt.read_text())
    assert out.returncode == 0, out.stderr
    assert "lookup of 200 tokens, model 'Model-7B'" in out.stdout and out.stdout.endswith("hit: 0 tokens\n")
    assert "absent in tp0 pcp0 dcp0 pp0, tp0 pcp0 dcp0 pp1, tp1 pcp0 dcp0 pp0, tp1 pcp0 dcp0 pp1" in out.stdout


def test_a_lookup_too_large_to_explain_is_refused_before_a_key_is_built(impl):
    """Issue 22's L4: 10,000 hashes on 4,096 namespaces are 41 million keys; explain built them all
    and died of a MemoryError. It now refuses them up front, naming the arguments; the lookup
    itself (which asks in rounds, and keeps no answer) still serves them."""
    from mooncake_keys.lookup import explain as explanation

    def never(keys):
        raise AssertionError(f"the store was asked {len(keys)} keys")

    store = mk.RecordingStore(answer=never)
    layout = mk.ParallelLayout(tp_size=4096, num_kv_heads=4096)
    engine = mk.LookupEngine("m", [F(16)], layout, hash_block_size=16, store=store)
    hashes = mk.BlockHashes.from_blob(bytes(range(256)) * 625, 16)  # 10,000 hashes, one buffer
    with pytest.raises(explanation.ExplanationTooLarge,
                       match=r"num_tokens 160000 over 10000 block_hashes asks 40,960,000 keys .*more than "
                             r"1,048,576: explain a shorter prefix") as exc:
        engine.explain(160_000, hashes)
    assert isinstance(exc.value, ValueError) and store.calls == []
    shorter = explanation.MAX_KEYS // 4096 * 16  # the longest prefix it explains here: 256 chunks
    assert engine.plan_of(shorter, hashes).num_keys == explanation.MAX_KEYS
    x = mk.LookupEngine.for_deployment(engine.deployment, store=mk.RecordingStore(answer=1)).explain(shorter, hashes)
    assert x.keys_asked == explanation.MAX_KEYS and x.hit_length == shorter - 16


def test_the_command_refuses_a_lookup_too_large_to_explain(never_connects, tmp_path, capsys):
    path = tmp_path / "p.hashes"
    path.write_text("".join(f"{i:032x}\n" for i in range(10_000)))
    assert cli.main(["explain", "--model", "m", "--group", "full:16", "--tp", "4096", "--num-kv-heads", "4096",
                     "--hashes", str(path), "--master", "127.0.0.1:1"]) == 3
    err = capsys.readouterr().err
    assert err.startswith("mooncake_keys explain: error: too large to explain (--num-tokens, the prompt, the "
                          "--tp/--pp/--pcp/--dcp sizes): ") and "40,960,000 keys" in err, err


@pytest.fixture
def never_connects(monkeypatch):
    """Connecting fails the test: every refusal below comes before the master is asked."""
    from mooncake_keys.store.mooncake import MooncakeStore

    def refuse(*a, **k):
        raise AssertionError("connected before checking the arguments")

    monkeypatch.setattr(MooncakeStore, "connect", refuse)
    monkeypatch.setattr(MooncakeStore, "lookup_client", refuse)
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    monkeypatch.delenv("MOONCAKE_KEYS_MASTER", raising=False)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "p.hashes"
    path.write_text("\n".join((bytes([i]) * 16).hex() for i in range(8)) + "\n")
    return str(path)


@pytest.mark.parametrize("argv, message", [
    (["--group", "full:16"], "the following arguments are required: --model"),
    (["--model", "m"], "the following arguments are required: --group"),
    (["--model", "m", "--group", "full"], "argument --group: 'full': expected full:BLOCK with whole numbers > 0"),
    (["--model", "m", "--group", "swa:16"], "argument --group: 'swa:16': expected swa:BLOCK:SIZE"),
    (["--model", "m", "--group", "lstm:16"], "argument --group: 'lstm:16': the kind must be one of"),
    (["--model", "m", "--group", "full:16:eagle:eagle"], "only eagle and dropped may follow, once each"),
    (["--model", "m", "--group", "full:16", "--tp", "0"], "argument --tp: must be from 1 to 4096, got 0"),
    (["--model", "m", "--group", "full:16", "--vllm-compat", "0.99"], "argument --vllm-compat: invalid choice"),
    (["--model", "m", "--group", "full:16", "--master", "nowhere"], "argument --master: master_address must be"),
    (["--model", "m", "--group", "full:16", "--kv-transfer-config", "{"], "argument --kv-transfer-config: not JSON"),
    (["--model", "m", "--group", "full:16", "--plot", "x.txt"], "argument --plot: the plot is written as PNG"),
    (["--model", "m", "--group", "full:16", "--plot", "/proc/x.png"], "argument --plot: cannot write the plot there"),
])
def test_bad_arguments_are_refused_by_argparse(never_connects, prompt_file, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        cli.main(["explain", *argv, "--hashes", prompt_file])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--group", "full:16", "--group", "swa:24:64", "--hash-block-size", "16"],
     "the deployment (--model, --group, --tp ... flags): groups[1] block_size (24) must be a multiple of "
     "hash_block_size (16)"),
    (["--group", "full:16", "--tp", "4", "--num-kv-heads", "3"], "num_kv_heads (3) must divide tp_size (4)"),
    (["--group", "full:16", "--group", "full:32", "--pcp", "2"], "PCP > 1 supports a single KV-cache group only"),
    (["--group", "full:16", "--kv-transfer-config", '{"kv_connector_extra_config": {"store_tp_size": 8}}'],
     "argument --kv-transfer-config: store_tp_size put the keys in a store layout"),
    (["--group", "full:16", "--kv-transfer-config", '{"kv_connector_extra_config": {"cache_prefix": 3}}'],
     "cache_prefix must be a string"),
    (["--group", "full:16", "--vllm-compat", "0.25", "--num-tokens", "100"],
     "the lookup (--num-tokens, --skip-tokens, the prompt): num_tokens (100) must be a multiple of the scheduler"),
    (["--group", "full:16", "--hashes", "/nonexistent/p"], "argument --hashes: cannot read '/nonexistent/p'"),
    (["--group", "full:16", "--config", "/nonexistent.json"], "argument --config: Mooncake config '/nonexistent.json'"),
    (["--group", "full:16"], "no master: give --master or --config (or set MOONCAKE_KEYS_MASTER or MOONCAKE_CONFIG_PATH)"),
])
def test_bad_arguments_are_refused_before_connecting(never_connects, prompt_file, capsys, argv, message):
    argv = ["--model", "m", *argv]
    if "--hashes" not in argv:
        argv += ["--hashes", prompt_file]
    if "--config" not in argv and "no master" not in message:
        argv += ["--master", "127.0.0.1:1"]
    assert cli.main(["explain", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mooncake_keys explain: error: ") and message in err, err


@pytest.mark.parametrize("text, message", [
    ("zz\n", "line 1 is not a hex hash: 'zz'"),
    ("00ff\n00\n", "line 2: every hash must have the same length (2 bytes), got 1"),
    ("# nothing\n\n", "no hash in it"),
])
def test_bad_hash_files_are_refused_before_connecting(never_connects, tmp_path, capsys, text, message):
    path = tmp_path / "h"
    path.write_text(text)
    assert cli.main(["explain", "--model", "m", "--group", "full:16", "--hashes", str(path), "--master",
                     "127.0.0.1:1"]) == 2
    assert f"argument --hashes: {message}" in capsys.readouterr().err


def test_token_ids_need_vllm_else_a_pointer_to_hashes(never_connects, tmp_path, capsys):
    ids = tmp_path / "ids"
    ids.write_text("[1, 2, 3,\n4 5]")
    try:
        import vllm  # noqa: F401
    except ImportError:
        assert cli.main(["explain", "--model", "m", "--group", "full:2", "--token-ids", str(ids), "--master",
                         "127.0.0.1:1"]) == 2
        err = capsys.readouterr().err
        assert "argument --token-ids: hashing token ids needs vLLM" in err and "(--hashes)" in err
    ids.write_text("1 2 x")
    assert cli.main(["explain", "--model", "m", "--group", "full:2", "--token-ids", str(ids), "--master",
                     "127.0.0.1:1"]) == 2
    assert "argument --token-ids: 'x' is not a token id" in capsys.readouterr().err


def test_without_matplotlib_plot_is_refused_before_connecting(never_connects, prompt_file, tmp_path, capsys,
                                                               monkeypatch):
    from mooncake_keys import report

    monkeypatch.setattr(report, "matplotlib_missing", lambda: "the heat map needs matplotlib: pip install x")
    assert cli.main(["explain", "--model", "m", "--group", "full:16", "--hashes", prompt_file, "--master",
                     "127.0.0.1:1", "--plot", str(tmp_path / "a.png")]) == 2
    assert "argument --plot: the heat map needs matplotlib" in capsys.readouterr().err
    assert not (tmp_path / "a.png").exists()


def test_the_deployment_the_flags_describe():
    from mooncake_keys.cli.explain import deployment_from

    parser = cli_parser()
    args = parser.parse_args([
        "--model", "/models/deepseek-ai/DeepSeek-V4/", "--tp", "8", "--mla", "--group", "full:64",
        "--group", "swa:64:4096:eagle", "--group", "mamba:128:dropped", "--hashes", "-", "--vllm-compat", "0.29",
        "--kv-transfer-config",
        '{"kv_connector_extra_config": {"cache_prefix": "tenantA", "lookup_strategy": "rounds"}}'])
    dep = deployment_from(args)
    assert dep.model_name == "DeepSeek-V4" and dep.cache_prefix == "tenantA" and dep.contract.name == "0.29"
    assert dep.hash_block_size == 64 and dep.scheduler_block_size == 128
    assert [type(g.spec) for g in dep.groups] == [F, S, M] and dep.groups[1].is_eagle_group
    assert len(dep.store_groups) == 2
    assert dep.prefixes[0] == ("tenantA@DeepSeek-V4@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0",)
    args = parser.parse_args(["--model", "m", "--group", "full:16", "--hashes", "-", "--cache-prefix", "b",
                              "--store-namespace", "@store_tp:4@store_pp:1", "--kv-transfer-config",
                              '{"kv_connector_extra_config": {"cache_prefix": "a", "store_tp_size": 4}}'])
    dep = deployment_from(args)
    assert dep.prefixes[0][0] == "b@m@store_tp:4@store_pp:1@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0"


def cli_parser():
    import argparse

    from mooncake_keys.cli import explain as cli_explain

    parser = argparse.ArgumentParser()
    cli_explain.add_cli_args(parser)
    return parser


# ------------------------------------------------------------------------------- the docs
def test_the_docs_show_what_the_code_prints(capsys):
    """docs/seeing.md: its Python example prints the text after it, and its command's output is
    what the report of that store state reads (the doc's run: a sha256 chain of 2,048 hashes, TP
    rank 2's keys stored up to 40 %)."""
    import hashlib
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "seeing.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```(\w+)\n(.*?)```", doc, re.S)
    kinds = [kind for kind, _ in blocks]
    python = kinds.index("python")
    exec(compile(blocks[python][1], "docs/seeing.md", "exec"), {})
    assert capsys.readouterr().out == blocks[python + 1][1]
    hashes, h = [], b""
    for i in range(2048):
        h = hashlib.sha256(h + i.to_bytes(4, "little")).digest()
        hashes.append(h)
    stored = set()
    layout = mk.ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=8)
    engine = mk.LookupEngine("Hybrid-32B", [F(64), S(64, 4096)], layout, hash_block_size=64,
                             store=mk.RecordingStore(present=stored))
    late = {x.hex() for x in hashes[int(0.4 * 2048):]}
    stored.update(k for k in engine.candidate_keys(2048 * 64, hashes)
                  if not ("@tp_rank:2@" in k and k.rsplit("@", 1)[1] in late))
    printed = blocks[kinds.index("text")][1]
    assert printed == text(engine.explain(2048 * 64, hashes)) + "\nplot: docs/explain.png\n"
