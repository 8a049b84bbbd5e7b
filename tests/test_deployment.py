"""One description of a deployment: the engine and the KV pool built from the same Deployment
agree by construction, and each word means one thing on both."""

from __future__ import annotations

import pytest

import mooncake_keys as mk

F, S, G = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.KVCacheGroup
HASHES = [bytes([i]) * 16 for i in range(24)]


def deployment(**kw):
    """Full(32) + a scratch group vLLM 0.33 drops from the keys + SWA(16, 32), TP 4 over 2 KV heads."""
    kw.setdefault("hash_block_size", 16)
    return mk.Deployment("m", [G(F(32)), G(F(16), prefix_cacheable=False), G(S(16, 32))],
                         mk.ParallelLayout(tp_size=4, num_kv_heads=2), cache_prefix="dep", **kw)


def test_a_pool_writes_exactly_the_keys_the_engine_asks(impl):
    torch = pytest.importorskip("torch")
    dep = deployment()
    memory = mk.MemoryStore()
    token_len = 24 * 16
    for rank in dep.layout.ranks():
        caches = [torch.zeros(token_len // g.spec.block_size, 8, dtype=torch.uint8) for g in dep.store_groups]
        ids = [list(range(c.shape[0])) for c in caches]
        with mk.KVPool.for_deployment(dep, rank=rank, kv_caches=caches, store=memory) as pool:
            assert pool.save(token_len, HASHES, ids).ok
    asked = mk.RecordingStore(memory)
    engine = mk.LookupEngine.for_deployment(dep, store=asked, strategy="oneshot")
    hit = engine.lookup(token_len + 1, HASHES)
    assert sorted(memory.keys()) == sorted(asked.calls[0]) == sorted(engine.candidate_keys(token_len, HASHES))
    assert hit == token_len


def test_groups_and_prefixes_mean_one_thing_on_the_engine_and_the_pool():
    torch = pytest.importorskip("torch")
    dep = deployment()
    engine = mk.LookupEngine.for_deployment(dep, store=mk.MemoryStore())
    caches = [torch.zeros(4, 8, dtype=torch.uint8) for _ in dep.store_groups]
    with mk.KVPool.for_deployment(dep, rank=(3, 0, 0, 0), kv_caches=caches, store=mk.MemoryStore()) as pool:
        assert engine.groups == pool.groups == dep.groups and len(dep.groups) == 3  # as given
        assert engine.store_groups == pool.store_groups == dep.store_groups and len(dep.store_groups) == 2
        assert engine.prefixes == pool.prefixes == dep.prefixes  # per store group, every namespace
        assert engine.group_namespaces == pool.group_namespaces
        for g, prefix in enumerate(pool.writer_prefixes):  # this rank's own, one per store group
            assert prefix in engine.prefixes[g] and prefix.endswith(f"@group:{g}")
        assert pool.writer_namespace == (1, 0, 0, 0)  # TP 4 over 2 heads: rank 3 writes namespace 1


def test_the_keyword_constructors_build_the_same_deployment(impl):
    torch = pytest.importorskip("torch")
    dep = deployment(vllm_compat="0.33", scheduler_block_size=64)
    by_keywords = mk.LookupEngine("m", dep.groups, dep.layout, hash_block_size=16, cache_prefix="dep",
                                  scheduler_block_size=64, store=mk.MemoryStore(), strategy="oneshot")
    built = mk.LookupEngine.for_deployment(dep, store=mk.MemoryStore(), strategy="oneshot")
    assert by_keywords.candidate_keys(384, HASHES) == built.candidate_keys(384, HASHES)
    assert (by_keywords.strategy, by_keywords.scheduler_block_size) == ("oneshot", 64)
    caches = [torch.zeros(16, 8, dtype=torch.uint8) for _ in dep.store_groups]
    with mk.KVPool("m", dep.groups, dep.layout, rank=(0, 0, 0, 0), kv_caches=caches, store=mk.MemoryStore(),
                   hash_block_size=16, cache_prefix="dep", scheduler_block_size=64) as pool:
        assert pool.prefixes == built.prefixes and pool.scheduler_block_size == 64


def test_what_is_not_a_deployment_or_an_option_is_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(TypeError, match="hash_blok_size"):
        mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, hash_blok_size=16,
                        store=mk.MemoryStore())
    with pytest.raises(TypeError, match="deployment must be a Deployment"):
        mk.LookupEngine.for_deployment("m", store=mk.MemoryStore())
    with pytest.raises(TypeError, match="deployment must be a Deployment"):
        mk.KVPool.for_deployment(None, rank=(0, 0, 0, 0), kv_caches=torch.zeros(4, 8), store=mk.MemoryStore())
    partial = mk.Deployment("m", [F(32)], mk.ParallelLayout(), hash_block_size=16, partial_hash_hits=True)
    with pytest.raises(ValueError, match="partial_hash_hits is not supported"):
        mk.KVPool.for_deployment(partial, rank=(0, 0, 0, 0), kv_caches=torch.zeros(4, 8), store=mk.MemoryStore())


def test_a_masked_groups_answers_land_by_strided_slices_as_chunk_by_chunk():
    """A sliding-window group's lookup mask repeats every scheduler block: its answers are put in
    place by one strided slice per masked position (``Stride``), the cut ends chunk by chunk.
    The presence equals the chunk-by-chunk scatter for every window, EAGLE shift, skip and
    number of answers (rounds hand over the first answers only)."""
    import random

    from mooncake_keys.lookup.deployment import Stride

    rng = random.Random(7)
    checked = 0
    for _ in range(300):
        bs = rng.choice([4, 8, 16])
        per = rng.choice([2, 4, 8, 32])
        eagle = rng.random() < 0.3
        swa = G(S(bs, rng.randint(1, (per - 1) * bs)), is_eagle_group=eagle)
        groups = [G(F(bs * per)), swa] if rng.random() < 0.5 else [swa, G(F(bs * per))]
        dep = mk.Deployment("m", groups, mk.ParallelLayout(tp_size=1), hash_block_size=bs, use_eagle=eagle)
        g = groups.index(swa)
        n_hashes = rng.randint(0, 40 * per)
        token_len = n_hashes * bs // (bs * per) * (bs * per)
        if token_len == 0:
            continue
        skip = rng.choice([0, 0, rng.randint(0, token_len)])
        plan = dep.plan(token_len, n_hashes, skip)
        group = plan.groups[g]
        if group.stride is None:
            continue
        for n in {len(group.asked), rng.randint(0, len(group.asked))}:
            flags = bytes(rng.randint(0, 1) for _ in range(n))
            want = bytearray(group.num_chunks)
            for j in group.presumed:
                want[j] = 1
            for j, f in zip(group.asked, flags):
                want[j] = f
            assert plan.presence_of(g, flags) == want, (bs, per, eagle, token_len, skip, n)
            checked += 1
    assert checked > 100
    assert Stride.of(__import__("array").array("q", [1, 2, 5, 6, 9]), 4) is None  # too short to repeat
