"""Random layouts, group mixes, hash lengths, names and existence: the compiled core, the pure
core and the plain reference (tests/support/reference.py) must agree on every key and every hit."""

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mooncake_keys as mk
from support.reference import RefEngine

SETTINGS = settings(max_examples=int(__import__("os").environ.get("MK_EXAMPLES", "300")), deadline=None, suppress_health_check=list(HealthCheck))

names = st.sampled_from(["m", "Llama-3-8B", "модель", "日本語🚀", "caf\u00e9", "a@b"])
prefixes = st.sampled_from(["", "depA", "None", "ñ", "🚀"])


@st.composite
def layouts(draw):
    tp = draw(st.integers(1, 8))
    pp = draw(st.integers(1, 4))
    mla = draw(st.booleans())
    heads = draw(st.sampled_from([h for h in (1, 2, 3, 4, 6, 8, 16) if tp % h == 0 or h % tp == 0]))
    mode = draw(st.sampled_from(["plain", "plain", "dcp", "pcp"]))
    pcp = dcp = 1
    if mode == "dcp":
        divisors = [d for d in (2, 4, 8) if tp % d == 0]
        if divisors:
            dcp = draw(st.sampled_from(divisors))
    elif mode == "pcp":
        pcp = 2
    return dict(tp=tp, pp=pp, pcp=pcp, dcp=dcp, heads=heads, mla=mla)


@st.composite
def group_mixes(draw, single):
    hash_bs = draw(st.sampled_from([4, 8, 16]))
    n = 1 if single else draw(st.integers(1, 3))
    kinds = [draw(st.sampled_from(["full", "full", "swa", "mamba", "chunked"])) for _ in range(n)]
    same_bs = "chunked" in kinds  # vLLM looks chunked local attention up on its block size only
    shared = hash_bs * draw(st.sampled_from([1, 2, 4]))
    specs = []
    for k in kinds:
        bs = shared if same_bs else hash_bs * draw(st.sampled_from([1, 2, 4]))
        if k == "full":
            specs.append(mk.FullAttentionSpec(bs))
        elif k == "swa":
            specs.append(mk.SlidingWindowSpec(bs, draw(st.integers(1, 4 * bs))))
        elif k == "mamba":
            specs.append(mk.MambaSpec(bs))
        else:
            specs.append(mk.ChunkedLocalAttentionSpec(bs, bs * draw(st.integers(1, 6))))
    flags = [draw(st.booleans()) and not same_bs for _ in specs]  # and never EAGLE with it
    return hash_bs, specs, flags


@st.composite
def cases(draw):
    lay = draw(layouts())
    single = lay["pcp"] > 1 or lay["dcp"] > 1
    hash_bs, specs, flags = draw(group_mixes(single))
    use_eagle = draw(st.booleans()) and not any(isinstance(s, mk.ChunkedLocalAttentionSpec) for s in specs)
    hash_len = draw(st.sampled_from([8, 16, 32]))
    from math import lcm
    sched = lcm(*(s.block_size for s in specs))
    token_len = sched * draw(st.integers(0, 6))
    num_hashes = draw(st.integers(0, max(0, token_len // hash_bs + 2)))
    seed = draw(st.integers(0, 2**32 - 1))
    density = draw(st.sampled_from([0.0, 0.5, 0.9, 0.97, 1.0]))
    return dict(lay=lay, hash_bs=hash_bs, specs=specs, flags=flags, use_eagle=use_eagle,
                hash_len=hash_len, token_len=token_len, num_hashes=num_hashes, seed=seed,
                density=density, model=draw(names), prefix=draw(prefixes))


def _distinct_hashes(rnd, n, hash_len):
    seen, out = set(), []
    while len(out) < n:
        h = bytes(rnd.getrandbits(8) for _ in range(hash_len))
        if h not in seen:
            seen.add(h)
            out.append(h)
    return out


def keyed_answer(seed, density):
    """A store's answer per key, a pure function of the key (same key, same answer): present
    with probability ``density``, else absent or an odd code."""
    def answer(key):
        if random.Random(f"{seed}:{key}").random() < density:
            return 1
        return random.Random(f"{key}:{seed}").choice([0, -1, -704, 2])

    return answer


def keyed_store(case):
    # Nothing recorded: a record would hold the key strings, which the compiled core then
    # could not reuse, and the reuse must be exercised here too.
    return mk.RecordingStore(present=keyed_answer(case["seed"], case["density"]), record_keys=False)


def _build(case, store, **kw):
    lay = case["lay"]
    layout = mk.ParallelLayout(tp_size=lay["tp"], pp_size=lay["pp"], pcp_size=lay["pcp"],
                               dcp_size=lay["dcp"], num_kv_heads=lay["heads"], use_mla=lay["mla"])
    groups = [mk.KVCacheGroup(s, f) for s, f in zip(case["specs"], case["flags"])]
    eng = mk.LookupEngine(case["model"], groups, layout, hash_block_size=case["hash_bs"],
                          use_eagle=case["use_eagle"], cache_prefix=case["prefix"], store=store, **kw, vllm_compat="0.25",
                          allow_ambiguous_names=True)  # "a@b" is among the names drawn
    ref = RefEngine(case["model"], case["specs"], case["flags"], tp=lay["tp"], pp=lay["pp"],
                    pcp=lay["pcp"], dcp=lay["dcp"], heads=lay["heads"], mla=lay["mla"],
                    hash_bs=case["hash_bs"], use_eagle=case["use_eagle"], cache_prefix=case["prefix"])
    return eng, ref


@SETTINGS
@given(case=cases())
def test_keys_and_hits_match_reference(impl, case):
    rnd = random.Random(case["seed"])
    hashes = _distinct_hashes(rnd, case["num_hashes"], case["hash_len"])
    store = keyed_store(case)
    eng, ref = _build(case, store)
    expected_keys = ref.candidates(case["token_len"], hashes)[0] if hashes and case["token_len"] > 0 else []
    assert eng.candidate_keys(case["token_len"], hashes) == expected_keys
    expected = ref.lookup(case["token_len"], hashes, store)
    assert eng.lookup(case["token_len"], hashes) == expected
    blob = mk.BlockHashes.from_blob(b"".join(hashes), case["hash_len"] if hashes else 0)
    assert eng.lookup(case["token_len"], blob) == expected
    # Warm: the key cache must not change a key or a result.
    assert eng.candidate_keys(case["token_len"], hashes) == expected_keys
    assert eng.lookup(case["token_len"], hashes) == expected


@SETTINGS
@given(case=cases(), cache_bytes=st.sampled_from([0, 1, 2000, 1 << 20]))
def test_key_cache_budget_never_changes_keys(impl, case, cache_bytes):
    rnd = random.Random(case["seed"])
    store = keyed_store(case)
    eng, ref = _build(case, store, key_cache_bytes=cache_bytes)
    shared = _distinct_hashes(rnd, case["num_hashes"], case["hash_len"])
    previous = []
    for _ in range(4):
        hashes = _distinct_hashes(rnd, case["num_hashes"], case["hash_len"])
        k = rnd.randrange(len(hashes) + 1)
        hashes[:k] = shared[:k]  # a shared system prompt, then the request's own tail
        if previous and rnd.random() < 0.4:
            hashes = previous  # the same request again (a waiting request)
        previous = hashes
        want = ref.candidates(case["token_len"], hashes)[0] if hashes and case["token_len"] > 0 else []
        assert eng.candidate_keys(case["token_len"], hashes) == want
        assert eng.lookup(case["token_len"], hashes) == ref.lookup(case["token_len"], hashes, store)
    stats = eng.key_cache.stats()
    assert stats.bytes <= cache_bytes
    if cache_bytes == 0:
        assert stats.requests == 0 and stats.request_hits == 0


@SETTINGS
@given(case=cases(), skip_frac=st.floats(0, 1))
def test_skip_tokens_equals_lookup_with_skipped_chunks_present(impl, case, skip_frac):
    """skip_tokens leaves chunks below it unasked and present: the same answer as a plain lookup
    against a store in which those chunks exist in every namespace."""
    rnd = random.Random(case["seed"])
    hashes = _distinct_hashes(rnd, case["num_hashes"], case["hash_len"])
    answer = keyed_answer(case["seed"], case["density"])
    eng, _ = _build(case, mk.RecordingStore(present=answer, record_keys=False))
    skip = int(case["token_len"] * skip_frac)
    below = set()
    for g, spec in enumerate(case["specs"]):
        scale = spec.block_size // case["hash_bs"]
        for j in range(skip // spec.block_size):
            if j * scale + scale - 1 < len(hashes):
                below.add((g, hashes[j * scale + scale - 1].hex()))

    def with_skipped_present(key):
        head, hx = key.rsplit("@", 1)
        g = int(head.rsplit("@group:", 1)[1])
        return 1 if (g, hx) in below else answer(key)

    plain, _ = _build(case, mk.RecordingStore(present=with_skipped_present, record_keys=False))
    sent = eng.candidate_keys(case["token_len"], hashes, skip_tokens=skip)
    all_keys = plain.candidate_keys(case["token_len"], hashes)
    assert set(sent) <= set(all_keys)
    assert all((int(k.rsplit("@", 1)[0].rsplit("@group:", 1)[1]), k.rsplit("@", 1)[1]) not in below for k in sent)
    assert eng.lookup(case["token_len"], hashes, skip_tokens=skip) == plain.lookup(case["token_len"], hashes)
