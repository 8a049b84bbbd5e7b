"""The work of a lookup, a save or a load is bounded by the hashes given (and one scheduler
block of at most 65,536 chunks), whatever length a caller claims. Engine items run on both
cores (the ``impl`` fixture)."""

from __future__ import annotations

import time

import pytest

import mooncake_keys as mk

F, S = mk.FullAttentionSpec, mk.SlidingWindowSpec
HS = [bytes([i]) * 16 for i in range(8)]


def engine(store, **kw):
    kw.setdefault("layout", mk.ParallelLayout(tp_size=2, num_kv_heads=2))
    return mk.LookupEngine("m", [F(16)], kw.pop("layout"), hash_block_size=16, store=store, **kw)


@pytest.mark.parametrize("groups, sbs", [([F(1)], 2**24), ([F(2**31), S(1, 2)], None)])
def test_a_scheduler_block_of_too_many_chunks_is_refused(groups, sbs):
    """One hash and scheduler_block_size 2**24 over 1-token blocks took seconds and 834 MB; the
    lcm of F(2**31) and S(1) over 1-token hashes ran for minutes."""
    with pytest.raises(ValueError, match=r"scheduler_block_size \(\d+ tokens.*at most 65536"):
        mk.LookupEngine("m", groups, mk.ParallelLayout(), hash_block_size=1, scheduler_block_size=sbs,
                        store=mk.MemoryStore())


def test_at_the_chunk_limit_a_made_up_length_costs_what_the_hashes_cost(impl):
    e = mk.LookupEngine("m", [F(1)], mk.ParallelLayout(), hash_block_size=1, scheduler_block_size=1 << 16,
                        store=mk.MemoryStore())
    t = time.perf_counter()
    for _ in range(3):
        assert e.lookup((1 << 32) - 1, [b"\x01" * 32]) == 0
    assert time.perf_counter() - t < 5  # generous: a 2**24 table took seconds per lookup


def test_kvpool_refuses_the_same_scheduler_block():
    torch = pytest.importorskip("torch")
    with pytest.raises(ValueError, match="at most 65536"):
        mk.KVPool("m", [F(1)], mk.ParallelLayout(), rank=(0, 0, 0, 0), kv_caches=torch.zeros(4, 8),
                  hash_block_size=1, scheduler_block_size=2**20, store=mk.MemoryStore())


@pytest.mark.parametrize("token_len", [(1 << 32) - 16, (1 << 32) - 1])
def test_the_largest_token_len_costs_what_the_hashes_cost(impl, token_len):
    store = mk.MemoryStore()
    e = engine(store, layout=mk.ParallelLayout(tp_size=2, num_kv_heads=2))
    for k in e.candidate_keys(128, HS):
        store.put(k)
    t = time.perf_counter()
    aligned = token_len - token_len % 16
    assert e.lookup(aligned, HS, skip_tokens=aligned) == 128
    assert e.lookup(token_len, HS) == 128
    assert len(e.candidate_keys(token_len, HS)) == 16
    hybrid = mk.LookupEngine("m", [F(64), S(16, 48)], mk.ParallelLayout(), hash_block_size=16, store=store)
    assert hybrid.lookup(token_len, HS) == 0
    assert time.perf_counter() - t < 5  # generous: unbounded work took minutes or MemoryError


@pytest.mark.parametrize("token_len", [1_600_000_000_000, 2**63, 2**64 + 16])
def test_a_made_up_token_len_is_refused_before_any_work(impl, token_len):
    e = engine(mk.MemoryStore())
    for call in (lambda: e.lookup(token_len, HS), lambda: e.candidate_keys(token_len, HS),
                 lambda: e.lookup(128, HS, skip_tokens=token_len)):
        with pytest.raises(ValueError, match="token"):
            call()


def test_kvpool_work_is_bounded_by_the_hashes():
    torch = pytest.importorskip("torch")
    store = mk.MemoryStore()
    kv = torch.arange(8 * 16, dtype=torch.uint8).reshape(8, 16)
    with mk.KVPool("m", [F(16)], mk.ParallelLayout(), rank=(0, 0, 0, 0), kv_caches=kv, hash_block_size=16,
                   store=store) as p:
        t = time.perf_counter()
        res = p.save(2**63, HS, list(range(8)))
        assert res.stored == 8
        load = p.load(2**63, HS, list(range(8)), skip_tokens=2**62)
        assert load.loaded_tokens == 128 and not load.ok
        assert time.perf_counter() - t < 5
