"""The key cache: what it keeps, what it reuses, and that it stays within its budgets."""

import random
import sys

import pytest

import mooncake_keys as mk
from mooncake_keys.lookup.keycache import KeyCache

LAYOUT = mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2)


def make(cache_bytes=KeyCache().max_bytes, layout=LAYOUT):
    store = mk.MemoryStore()
    return mk.LookupEngine("m", [mk.FullAttentionSpec(16)], layout, hash_block_size=16, store=store,
                           key_cache_bytes=cache_bytes, vllm_compat="0.25")


def hashes(seed, n=8):
    rnd = random.Random(seed)
    return [rnd.randbytes(16) for _ in range(n)]


def test_a_request_is_memoised_on_second_sight(impl):
    e = make()
    hs = hashes(1)
    first = e.candidate_keys(128, hs)
    s = e.key_cache.stats()
    assert (s.requests, s.bytes, s.request_misses) == (0, 0, 1)  # seen once: nothing kept
    second = e.candidate_keys(128, hs)
    s = e.key_cache.stats()
    assert (s.requests, s.request_misses) == (1, 2) and s.bytes > 32 * 32
    third = e.candidate_keys(128, hs)
    assert first == second == third
    assert e.key_cache.stats().request_hits == 1
    third.append("x")  # the caller's list is a copy: mutating it cannot poison the cache
    assert e.candidate_keys(128, hs) == first


def test_same_fingerprint_different_hashes_is_a_miss(impl):
    e = make()
    a = hashes(1)
    b = hashes(2)
    b[-1] = a[-1]  # same last hash (the fingerprint), different earlier hashes
    for _ in range(2):
        e.candidate_keys(128, a)
    assert e.candidate_keys(128, b)[0].endswith(b[0].hex())


def test_disabled_cache_keeps_nothing(impl):
    e = make(0)
    hs = hashes(3)
    for _ in range(3):
        e.candidate_keys(128, hs)
    s = e.key_cache.stats()
    assert (s.requests, s.bytes, s.request_hits) == (0, 0, 0)


@pytest.mark.parametrize("budget", [1, 5000, 50_000])
def test_budget_is_respected(impl, budget):
    e = make(budget)
    for seed in range(30):
        hs = hashes(seed % 7, 16)
        e.candidate_keys(256, hs)
        assert e.key_cache.stats().bytes <= budget


def test_bad_budget():
    with pytest.raises(ValueError, match="key_cache_bytes"):
        make(-1)
    with pytest.raises(TypeError, match="key_cache_bytes"):
        make(1.5)


def retaining_store():
    """A store that keeps every other key list it is given (the list itself), and always its
    first string, with snapshots of their contents; its own record would hold references to the
    strings (which the core then leaves alone), so it keeps none."""
    kept, firsts = [], []

    def answer(keys):
        if len(firsts) % 2 == 0:
            kept.append((keys, [k.encode() for k in keys]))
        firsts.append((keys[0], keys[0].encode()))
        return [0] * len(keys)

    return mk.RecordingStore(answer, record_keys=False), kept, firsts


def test_rewritten_strings_are_never_visible_to_anyone_else(impl):
    """The compiled core rewrites the last lookup's key strings that nothing else references.
    A store that keeps the lists (or single strings) it was given must never see them change."""
    store, kept, firsts = retaining_store()
    e = mk.LookupEngine("m", [mk.FullAttentionSpec(16)], LAYOUT, hash_block_size=16, store=store, vllm_compat="0.25")
    held = []
    for seed in range(12):
        hs = hashes(100 + seed, 8)
        want = make(0).candidate_keys(128, hs)
        if seed % 3 == 0:
            held.append((e.candidate_keys(128, hs), list(want)))  # a caller keeping its keys
        assert e.lookup(128, hs) == 0
        assert firsts[-1][0] == want[0]
    assert len(kept) == 6 and len(firsts) == 12
    for keys, snapshot in kept:
        assert [k.encode() for k in keys] == snapshot
    for key, snapshot in firsts:
        assert key.encode() == snapshot
    for keys, want in held:
        assert keys == want


def test_recycled_strings_hash_like_fresh_ones(impl):
    store = mk.MemoryStore()
    e = mk.LookupEngine("m", [mk.FullAttentionSpec(16)], LAYOUT, hash_block_size=16, store=store, vllm_compat="0.25")
    for seed in range(6):
        hs = hashes(200 + seed, 8)
        want = make(0).candidate_keys(128, hs)
        for k in want[:5]:
            store.put(k)  # MemoryStore hashes every key it is asked about (dict lookup)
        assert e.lookup(128, hs) == 16 * 1  # chunk 0 in all 4 namespaces, then chunk 1 partly
        assert set(store.keys()) >= set(want[:5])


def test_the_compiled_core_rewrites_the_previous_lookups_strings(impl):
    seen = []

    def answer(keys):
        seen.append(([id(k) for k in keys], [k.encode() for k in keys]))  # no references kept
        return [0] * len(keys)

    store = mk.RecordingStore(answer, record_keys=False)
    e = mk.LookupEngine("m", [mk.FullAttentionSpec(16)], LAYOUT, hash_block_size=16, store=store, vllm_compat="0.25")
    e.lookup(128, hashes(300))
    spare_ids = {id(k) for k in e.key_cache._spare or ()}  # alive until the next lookup rewrites them
    e.lookup(128, hashes(301))
    reused = spare_ids & set(seen[1][0])
    assert seen[1][1] == [k.encode() for k in make(0).candidate_keys(128, hashes(301))]
    if impl.__name__.endswith("_core_c"):
        assert len(reused) == 32  # every string of the first lookup, rewritten
    else:
        assert not reused  # pure Python cannot rewrite a str


def test_concurrent_lookups_agree_with_serial_ones(impl):
    import threading

    store = mk.MemoryStore()
    e = mk.LookupEngine("m", [mk.FullAttentionSpec(16), mk.SlidingWindowSpec(16, 32)], LAYOUT,
                        hash_block_size=16, store=store, key_cache_bytes=200_000, vllm_compat="0.25")
    reqs = [hashes(400 + i % 9, 8 + i % 5) for i in range(40)]
    serial = mk.LookupEngine("m", [mk.FullAttentionSpec(16), mk.SlidingWindowSpec(16, 32)], LAYOUT,
                             hash_block_size=16, store=store, key_cache_bytes=0, vllm_compat="0.25")
    for i, hs in enumerate(reqs[:9]):  # a prefix of (i + 1) chunks, in every group and namespace
        for k in serial.candidate_keys(len(hs) * 16, hs):
            if "@group:1@" in k or k in serial.candidate_keys(16 * (i + 1), hs):
                store.put(k)
    want = [serial.lookup(len(hs) * 16, hs) for hs in reqs]
    got = {}
    errors = []

    def worker(t):
        try:
            for rep in range(5):
                for i, hs in enumerate(reqs):
                    h = e.lookup(len(hs) * 16, hs)
                    if h != want[i]:
                        errors.append((t, rep, i, h, want[i]))
                    got[(t, i)] = h
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert len(got) == 4 * len(reqs) and any(want)


# --------------------------------------------------------------------- strings never rewritten
F = mk.FullAttentionSpec


def engine(store, **kw):
    kw.setdefault("layout", mk.ParallelLayout(tp_size=2, num_kv_heads=2))
    return mk.LookupEngine("m", [F(16)], kw.pop("layout"), hash_block_size=16, store=store, **kw)

@pytest.mark.parametrize("tp", [1, 2])
def test_a_key_with_a_cached_wide_copy_is_never_rewritten(impl, tp):
    """On Python 3.11 the deprecated ``PyUnicode_AsUnicode`` (here through ``_testcapi``'s "u"
    argument format, as any extension using it would) caches a wchar_t copy inside the str;
    rewriting that str in place left the copy stale, so the key read back as the previous one."""
    if sys.version_info >= (3, 12):
        pytest.skip("no cached wchar_t copy in a str since Python 3.12")
    _testcapi = pytest.importorskip("_testcapi")
    import warnings

    seen = []

    def read_wide(keys):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            # Read through the wide copy; keep only bytes, so the strings stay rewritable.
            seen.append([(k.encode(), _testcapi.getargs_u(k).encode()) for k in keys])
        return [0] * len(keys)

    e = engine(mk.RecordingStore(read_wide, record_keys=False), layout=mk.ParallelLayout(tp_size=tp, num_kv_heads=tp))
    for seed in range(4):
        e.lookup(128, [bytes([seed, i]) * 8 for i in range(8)])
    stale = [(k, w) for batch in seen for k, w in batch if k != w]
    assert not stale, stale[:2]
    assert [k.decode() for k, _ in seen[-1]] == e.candidate_keys(128, [bytes([3, i]) * 8 for i in range(8)])


def test_a_key_whose_hash_was_computed_is_never_rewritten(impl):
    """A str caches its hash: rewritten in place after a dict lookup it would keep the old
    one, and ``hash(key)`` would disagree with an equal string's (a dict would miss it)."""
    checked = []

    def hashing(keys):
        for k in keys:
            checked.append(hash(k) == hash(k.encode().decode()))  # a fresh, equal str
        return [0] * len(keys)

    e = engine(mk.RecordingStore(hashing, record_keys=False))
    for seed in range(6):
        e.lookup(128, [bytes([seed, i]) * 8 for i in range(8)])
    assert checked and all(checked)


def test_non_ascii_heads_are_never_rewritten(impl):
    wide = mk.LookupEngine("модель", [F(16)], mk.ParallelLayout(tp_size=2, num_kv_heads=2), hash_block_size=16,
                           store=mk.RecordingStore(lambda keys: [0] * len(keys)))
    sent = []
    wide.store = mk.RecordingStore(lambda keys: sent.append([k.encode() for k in keys]) or [0] * len(keys),
                                   record_keys=False)
    for seed in range(4):
        hashes = [bytes([seed, i]) * 8 for i in range(8)]
        wide.lookup(128, hashes)
        assert [k.decode() for k in sent[-1]] == wide.candidate_keys(128, hashes)
    assert all(k.startswith("модель@".encode()) for batch in sent for k in batch)
