"""KVPool: one rank's saves and loads, checked against the lookup engine of the same deployment.

Unit tests run on MemoryStore and on both cores (the ``impl`` fixture switches the core that the
engine and the pool both call). The property test saves a prompt from every rank of a random
layout, asks the LookupEngine (no false miss), removes random keys, asks again, and has every
rank load the reported hit (no false hit: every load succeeds with the bytes the writer of each
chunk saved). It runs on MemoryStore and on a real mooncake_master.
"""

from __future__ import annotations

import ctypes
import os
import random
import uuid
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

import mooncake_keys as mk  # noqa: E402
from mooncake_keys import KeyMetadata, PoolKey  # noqa: E402
from mooncake_keys.kvpool import (  # noqa: E402
    ChunkFailure,
    ChunkStatus,
    KVPool,
    KVPoolError,
    KVPoolStoreError,
)
from support.child import run_child  # noqa: E402

F, S, G = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.KVCacheGroup
OBJECT_NOT_FOUND = -704

EXAMPLES = int(os.environ.get("MK_KVPOOL_EXAMPLES", "100"))
REAL_EXAMPLES = int(os.environ.get("MK_KVPOOL_REAL_EXAMPLES", "60"))
PROPERTY = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# --------------------------------------------------------------------------- helpers


def block_bytes(t: Any, b: int) -> bytes:
    """The raw bytes of block ``b`` of a contiguous [num_blocks, ...] tensor (any dtype)."""
    nbytes = t.numel() * t.element_size() // t.shape[0]
    return ctypes.string_at(t.data_ptr() + b * nbytes, nbytes)


def random_cache(rng: random.Random, num_blocks: int, block_nbytes: int, dtype: Any = None) -> Any:
    """A contiguous CPU tensor [num_blocks, k] of ``dtype`` holding random bytes."""
    dtype = dtype or torch.uint8
    raw = torch.tensor(list(rng.randbytes(num_blocks * block_nbytes)), dtype=torch.uint8)
    return raw.view(dtype).reshape(num_blocks, -1)


def hashes_of(n: int, hash_len: int = 16, rng: random.Random = None) -> List[bytes]:
    rng = rng or random.Random(n)
    return [rng.randbytes(hash_len) for _ in range(n)]


def key_of(model, ns, g, h, cache_prefix=""):
    """The key the grammar gives (built the slow way, through PoolKey.to_string)."""
    tp, pcp, dcp, pp = ns
    return PoolKey(KeyMetadata(model, tp, pcp, dcp, pp, group_id=g, cache_prefix=cache_prefix), h.hex()).to_string()


def pool(store, groups=(F(16),), layout=None, *, rank=(0, 0, 0, 0), kv_caches=None, hash_block_size=16, **kw):
    groups = list(groups)
    if kv_caches is None:
        kv_caches = [random_cache(random.Random(g), 16, 64) for g in range(len(groups))]
    return KVPool("m", groups, layout or mk.ParallelLayout(), rank=rank, kv_caches=kv_caches,
                  hash_block_size=hash_block_size, store=store, **kw, vllm_compat="0.25")


class FaultyIO(mk.MemoryStore):
    """A MemoryStore whose puts, gets and buffer registrations can raise or answer given codes
    (its ``batch_is_exist`` faults are ``mk.RecordingStore``'s, in front of it)."""

    def __init__(self, *, put_codes=None, get_codes=None, raise_on=(), register_rc=None):
        super().__init__()
        self.put_codes, self.get_codes, self.raise_on = put_codes, get_codes, set(raise_on)
        self.register_rc = register_rc
        self.registered: Dict[int, int] = {}
        self.unregistered: List[int] = []

    def _maybe_raise(self, name):
        if name in self.raise_on:
            raise ConnectionError(f"{name}: master unreachable")

    def register_buffer(self, ptr, size):
        rc = self.register_rc(len(self.registered)) if self.register_rc else 0
        if rc == 0:
            self.registered[ptr] = size
        return rc

    def unregister_buffer(self, ptr):
        self.unregistered.append(ptr)
        return 0 if self.registered.pop(ptr, None) is not None else -600

    def batch_put_from(self, keys, ptrs, sizes):
        self._maybe_raise("batch_put_from")
        if self.put_codes is not None:
            codes = self.put_codes(keys)
            ok = [i for i, c in enumerate(codes) if c >= 0]
            super().batch_put_from([keys[i] for i in ok], [ptrs[i] for i in ok], [sizes[i] for i in ok])
            return codes
        return super().batch_put_from(keys, ptrs, sizes)

    def batch_get_into(self, keys, ptrs, sizes):
        if "batch_get_into" in self.raise_on:
            for p, n in zip(ptrs, sizes):
                ctypes.memset(p, 0xAB, n)  # a partial transfer left bytes behind
            raise ConnectionError("batch_get_into: master unreachable")
        res = super().batch_get_into(keys, ptrs, sizes)
        return self.get_codes(keys, res) if self.get_codes else res


# --------------------------------------------------------------------------- keys and save


def test_keys_are_the_grammar_of_the_writer_namespace(impl):
    """tp 4 with 2 KV heads: put_step 2, so rank tp=3 writes namespace tp_rank:1."""
    store = mk.MemoryStore()
    lay = mk.ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=2)
    hs = hashes_of(4)
    with pool(store, layout=lay, rank=(3, 0, 0, 1), cache_prefix="depA") as p:
        assert p.writer_namespace == (1, 0, 0, 1)
        assert p.writer_prefixes == ("depA@m@tp_rank:1@pcp0@dcp0@pp_rank:1@group:0",)
        res = p.save(64, hs, [0, 1, 2, 3])
    # Stripe of tp 3 with put_step 2, group 0: chunks j with j % 2 == 1.
    assert res.chunks == ((1, 3),)
    assert set(store.keys()) == {key_of("m", (1, 0, 0, 1), 0, hs[j], "depA") for j in (1, 3)}


def test_save_round_trip_counts_and_dedup(impl):
    store = mk.MemoryStore()
    kv = random_cache(random.Random(1), 8, 128, torch.float16)
    hs = hashes_of(3)
    with pool(store, kv_caches=kv) as p:
        res = p.save(48, hs, [5, 2, 7])
        assert (res.asked, res.skipped_existing, res.stored, res.failed, res.ok) == (3, 0, 3, (), True)
        for j, b in enumerate([5, 2, 7]):
            assert store.get(key_of("m", (0, 0, 0, 0), 0, hs[j])) == block_bytes(kv, b)
        again = p.save(48, hs, [5, 2, 7])
        assert (again.asked, again.skipped_existing, again.stored) == (3, 3, 0)


def test_save_floors_token_len_and_skips_chunks_without_a_hash(impl):
    store = mk.MemoryStore()
    with pool(store, groups=[F(32)], hash_block_size=8) as p:
        # 100 tokens -> 96 (3 chunks of 32); 10 hashes of 8 tokens cover 2 chunks (hash 3 and 7).
        hs = hashes_of(10)
        res = p.save(100, hs, [0, 1])
    assert res.token_len == 96 and res.chunks == ((0, 1),)
    assert set(store.keys()) == {key_of("m", (0, 0, 0, 0), 0, hs[i]) for i in (3, 7)}


def test_save_of_nothing_calls_no_store(impl):
    st = mk.RecordingStore(FaultyIO(raise_on={"batch_put_from"}), fault=ConnectionError("master unreachable"))
    with pool(st) as p:
        assert p.save(15, hashes_of(4), []).asked == 0  # floors to 0
        assert p.save(64, [], []).asked == 0
    assert st.calls == []


def test_save_stores_exactly_what_the_lookup_asks_hybrid(impl):
    """Full(32) + SWA(8, 8), lcm 32: SWA chunks 3, 7, 11 (the lookup mask), full chunks 0..2."""
    store = mk.MemoryStore()
    groups = [F(32), S(8, 8)]
    hs = hashes_of(12)
    kv = [random_cache(random.Random(0), 4, 64), random_cache(random.Random(1), 12, 64)]
    with pool(store, groups, kv_caches=kv, hash_block_size=8) as p:
        res = p.save(96, hs, [[0, 1, 2], list(range(12))])
    assert res.chunks == ((0, 1, 2), (3, 7, 11))
    eng = mk.LookupEngine("m", groups, mk.ParallelLayout(), hash_block_size=8, store=store, vllm_compat="0.25")
    assert set(store.keys()) == set(eng.candidate_keys(96, hs))
    assert eng.lookup(96, hs) == 96


@pytest.mark.parametrize("heads", [1, 2])
def test_put_striding_covers_every_chunk_exactly_once(impl, heads):
    """tp 4: put_step 4 (1 head) or 2 (2 heads); two groups stripe with (tp + g) % step."""
    store = mk.MemoryStore()
    lay = mk.ParallelLayout(tp_size=4, num_kv_heads=heads)
    groups = [F(16), F(32)]
    hs = hashes_of(8)
    seen: Dict[Tuple[int, int, int], int] = {}
    for r in lay.ranks():
        kv = [random_cache(random.Random(1), 8, 64), random_cache(random.Random(2), 4, 64)]
        with pool(store, groups, lay, rank=r, kv_caches=kv) as p:
            res = p.save(128, hs, [list(range(8)), list(range(4))])
            assert res.skipped_existing == 0
            for g, cs in enumerate(res.chunks):
                for j in cs:
                    assert j % lay.put_step == (r[0] + g) % lay.put_step
                    assert (p.writer_namespace[0], g, j) not in seen
                    seen[(p.writer_namespace[0], g, j)] = r[0]
    assert set(seen) == {(ns, g, j) for ns in range(heads) for g, n in ((0, 8), (1, 4)) for j in range(n)}
    eng = mk.LookupEngine("m", groups, lay, hash_block_size=16, store=store, vllm_compat="0.25")
    assert set(store.keys()) == set(eng.candidate_keys(128, hs))
    assert eng.lookup(128, hs) == 128


def test_put_failures_are_reported_per_chunk(impl):
    st = FaultyIO(put_codes=lambda keys: [-200 if i == 1 else 0 for i in range(len(keys))])
    hs = hashes_of(3)
    with pool(st) as p:
        res = p.save(48, hs, [0, 1, 2])
    assert (res.asked, res.stored, res.skipped_existing) == (3, 2, 0)
    assert res.failed == (ChunkFailure(0, 1, -200),) and not res.ok
    assert key_of("m", (0, 0, 0, 0), 0, hs[1]) not in st


@pytest.mark.parametrize("method", ["batch_is_exist", "batch_put_from"])
def test_save_store_exception_raises_a_clear_error(impl, method):
    if method == "batch_is_exist":
        st = mk.RecordingStore(FaultyIO(), fault=ConnectionError("master unreachable"))
    else:
        st = FaultyIO(raise_on={method})
    with pool(st) as p:
        with pytest.raises(KVPoolStoreError, match=f"store.{method} of 2 keys raised ConnectionError"):
            p.save(32, hashes_of(2), [0, 1])


def test_malformed_store_results_raise(impl):
    st = mk.RecordingStore(mk.MemoryStore(), fault="short")
    with pool(st) as p:
        with pytest.raises(KVPoolStoreError, match="returned 1 results for 2 keys"):
            p.save(32, hashes_of(2), [0, 1])


# --------------------------------------------------------------------------- load


def test_load_round_trip_into_other_blocks(impl):
    store = mk.MemoryStore()
    kv = random_cache(random.Random(3), 8, 96, torch.int32)
    hs = hashes_of(4)
    with pool(store, kv_caches=kv) as p:
        p.save(64, hs, [0, 1, 2, 3])
        res = p.load(64, hs, [4, 5, 6, 7])
    assert res.ok and res.loaded_tokens == 64 and res.failed == ()
    assert res.chunks == ((ChunkStatus(0, True, 96), ChunkStatus(1, True, 96),
                           ChunkStatus(2, True, 96), ChunkStatus(3, True, 96)),)
    for j in range(4):
        assert block_bytes(kv, 4 + j) == block_bytes(kv, j)


def test_load_missing_chunk_is_reported_and_its_block_zeroed(impl):
    store = mk.MemoryStore()
    kv = random_cache(random.Random(4), 8, 64)
    hs = hashes_of(4)
    with pool(store, kv_caches=kv) as p:
        p.save(64, hs, [0, 1, 2, 3])
        assert store.remove(key_of("m", (0, 0, 0, 0), 0, hs[2])) == 0
        res = p.load(64, hs, [4, 5, 6, 7])
    assert not res.ok and res.loaded_tokens == 32
    assert [c.ok for c in res.chunks[0]] == [True, True, False, True]
    assert res.chunks[0][2] == ChunkStatus(2, False, OBJECT_NOT_FOUND)
    assert res.failed == (ChunkFailure(0, 2, OBJECT_NOT_FOUND),)
    assert block_bytes(kv, 6) == bytes(64)  # never garbage in a failed block
    assert block_bytes(kv, 7) == block_bytes(kv, 3)


def test_load_short_read_is_a_failure_and_zeroed(impl):
    store = mk.MemoryStore()
    kv = random_cache(random.Random(5), 4, 64)
    hs = hashes_of(2)
    store.put(key_of("m", (0, 0, 0, 0), 0, hs[0]), b"x" * 10)  # a foreign, shorter value
    with pool(store, kv_caches=kv) as p:
        p.save(32, hs, [0, 1])  # chunk 0 exists already: skipped
        res = p.load(32, hs, [2, 3])
    assert res.chunks[0][0] == ChunkStatus(0, False, 10)
    assert res.loaded_tokens == 0 and not res.ok
    assert block_bytes(kv, 2) == bytes(64)
    assert block_bytes(kv, 3) == block_bytes(kv, 1)


def test_load_store_exception_zeroes_every_destination(impl):
    st = FaultyIO(raise_on={"batch_get_into"})
    kv = random_cache(random.Random(6), 4, 64)
    with pool(st, kv_caches=kv) as p:
        with pytest.raises(KVPoolStoreError, match="batch_get_into of 2 keys raised ConnectionError"):
            p.load(32, hashes_of(2), [2, 3])
    assert block_bytes(kv, 2) == block_bytes(kv, 3) == bytes(64)


def test_load_sliding_window_reads_only_the_window_before_the_end(impl):
    """Full(32) + SWA(8, 8): a load of 96 needs full chunks 0..2 and SWA chunk 11 only; the SWA
    keys of earlier boundaries may be gone (a lookup still reports 96)."""
    store = mk.MemoryStore()
    groups = [F(32), S(8, 8)]
    hs = hashes_of(12)
    kv = [random_cache(random.Random(0), 6, 64), random_cache(random.Random(1), 24, 64)]
    with pool(store, groups, kv_caches=kv, hash_block_size=8) as p:
        p.save(96, hs, [[0, 1, 2], list(range(12))])
        for j in (3, 7):
            store.remove(key_of("m", (0, 0, 0, 0), 1, hs[j]))
        eng = mk.LookupEngine("m", groups, mk.ParallelLayout(), hash_block_size=8, store=store, vllm_compat="0.25")
        assert eng.lookup(96, hs) == 96
        res = p.load(96, hs, [[3, 4, 5], list(range(12, 24))])
    assert res.ok and res.loaded_tokens == 96
    assert [c.chunk_id for c in res.chunks[0]] == [0, 1, 2]
    assert [c.chunk_id for c in res.chunks[1]] == [11]
    assert block_bytes(kv[1], 23) == block_bytes(kv[1], 11)


def test_load_sliding_window_failure_limits_loaded_tokens(impl):
    """SWA(16, 48) alone (need 3): if the window's first chunk fails nothing shorter is usable."""
    store = mk.MemoryStore()
    hs = hashes_of(5)
    kv = random_cache(random.Random(7), 10, 64)
    with pool(store, [S(16, 48)], kv_caches=kv) as p:
        p.save(80, hs, list(range(5)))
        store.remove(key_of("m", (0, 0, 0, 0), 0, hs[2]))
        res = p.load(80, hs, list(range(5, 10)))
    assert [c.chunk_id for c in res.chunks[0]] == [2, 3, 4]
    assert res.loaded_tokens == 0 and not res.ok


def test_load_skip_tokens_are_held_not_read(impl):
    store = mk.MemoryStore()
    groups = [F(32), S(8, 8)]
    hs = hashes_of(12)
    kv = [random_cache(random.Random(0), 6, 64), random_cache(random.Random(1), 24, 64)]
    with pool(store, groups, kv_caches=kv, hash_block_size=8) as p:
        p.save(96, hs, [[0, 1, 2], list(range(12))])
        store.remove(key_of("m", (0, 0, 0, 0), 0, hs[3]))  # full chunk 0: held locally
        res = p.load(96, hs, [[3, 4, 5], list(range(12, 24))], skip_tokens=40)  # floors to 32 / 40
    assert [c.chunk_id for c in res.chunks[0]] == [1, 2]
    assert [c.chunk_id for c in res.chunks[1]] == [11]
    assert res.ok and res.loaded_tokens == 96
    with pool(mk.MemoryStore(), groups, kv_caches=[random_cache(random.Random(0), 6, 64),
                                                   random_cache(random.Random(1), 24, 64)],
              hash_block_size=8) as p2:
        everything_held = p2.load(64, hs, [[0, 1], list(range(8))], skip_tokens=64)
    assert everything_held.chunks == ((), ()) and everything_held.ok and everything_held.loaded_tokens == 64


def test_load_floors_to_the_lcm_of_group_block_sizes(impl):
    store = mk.MemoryStore()
    groups = [F(32), S(8, 8)]
    hs = hashes_of(12)
    kv = [random_cache(random.Random(0), 6, 64), random_cache(random.Random(1), 24, 64)]
    with pool(store, groups, kv_caches=kv, hash_block_size=8) as p:
        assert p.scheduler_block_size == 32
        p.save(96, hs, [[0, 1, 2], list(range(12))])
        res = p.load(70, hs, [[3, 4, 5], list(range(12, 24))])
    assert res.token_len == 64 and res.ok
    assert [c.chunk_id for c in res.chunks[1]] == [7]


def test_load_with_too_few_hashes_is_not_ok(impl):
    store = mk.MemoryStore()
    with pool(store) as p:
        hs = hashes_of(2)
        p.save(32, hs, [0, 1])
        res = p.load(64, hs, [2, 3])
    assert all(c.ok for c in res.chunks[0]) and res.loaded_tokens == 32 and not res.ok


# --------------------------------------------------------------------------- registration


def test_registers_once_per_memory_range_and_unregisters_on_close(impl):
    st = FaultyIO()
    shared = random_cache(random.Random(0), 8, 64)
    other = random_cache(random.Random(1), 4, 32)
    with pool(st, [F(16), S(16, 32), F(32)], kv_caches=[shared, shared[2:], other]) as p:
        assert st.registered == {shared.data_ptr(): shared.nbytes, other.data_ptr(): other.nbytes}
        assert not p.closed
    assert p.closed and st.registered == {} and sorted(st.unregistered) == sorted([shared.data_ptr(), other.data_ptr()])
    p.close()  # idempotent
    assert len(st.unregistered) == 2
    with pytest.raises(KVPoolError, match="closed"):
        p.save(16, hashes_of(1), [0])
    with pytest.raises(KVPoolError, match="closed"):
        p.load(16, hashes_of(1), [0])


def test_register_failure_is_a_clear_error_and_undoes_the_rest(impl):
    st = FaultyIO(register_rc=lambda n: -600 if n == 1 else 0)
    kv = [random_cache(random.Random(0), 4, 64), random_cache(random.Random(1), 4, 64)]
    with pytest.raises(KVPoolError, match=r"register_buffer\(0x[0-9a-f]+, 256\).*returned -600"):
        pool(st, [F(16), F(32)], kv_caches=kv)
    assert st.registered == {} and len(st.unregistered) == 1


def test_cuda_is_never_touched(impl, monkeypatch):
    """Nothing assumes CUDA: with every torch.cuda entry point broken, save and load work."""
    def boom(*a, **k):
        raise AssertionError("torch.cuda must not be used")

    for name in ("is_available", "current_device", "synchronize", "device_count", "current_stream", "Stream"):
        monkeypatch.setattr(torch.cuda, name, boom, raising=False)
    store = mk.MemoryStore()
    kv = random_cache(random.Random(8), 4, 64, torch.bfloat16)
    hs = hashes_of(2)
    with pool(store, kv_caches=kv) as p:
        assert p.save(32, hs, [0, 1]).stored == 2
        assert p.load(32, hs, [2, 3]).ok
    assert block_bytes(kv, 2) == block_bytes(kv, 0)


# --------------------------------------------------------------------------- bad input


def test_bad_kv_caches():
    store = mk.MemoryStore()
    t = random_cache(random.Random(0), 8, 64)
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must be contiguous"):
        pool(store, kv_caches=[t.t()])
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must be contiguous"):
        pool(store, kv_caches=[t[::2]])
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must be a CPU tensor.*meta"):
        pool(store, kv_caches=[torch.empty(8, 64, device="meta")])
    with pytest.raises(TypeError, match=r"kv_caches\[1\] must be a torch.Tensor"):
        pool(store, [F(16), F(32)], kv_caches=[t, bytearray(8 * 64)])
    with pytest.raises(ValueError, match="one tensor per KV-cache group \\(2\\), got 1"):
        pool(store, [F(16), F(32)], kv_caches=[t])
    with pytest.raises(TypeError, match="kv_caches must be a sequence"):
        pool(store, [F(16), F(32)], kv_caches=t)
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must have shape \[num_blocks, ...\]"):
        pool(store, kv_caches=[torch.zeros(0, 4)])
    with pytest.raises(ValueError, match=r"kv_caches\[0\] has empty blocks"):
        pool(store, kv_caches=[torch.zeros(4, 0)])
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must have shape"):
        pool(store, kv_caches=[torch.tensor(3)])
    with pytest.raises(ValueError, match=r"kv_caches\[0\] must be a dense"):
        pool(store, kv_caches=[t.to_sparse()])
    with pool(store, kv_caches=t) as p:  # one group: a bare tensor is fine
        assert p._caches[0].block_nbytes == 64


def test_bad_rank():
    store = mk.MemoryStore()
    lay = mk.ParallelLayout(tp_size=4, dcp_size=2, num_kv_heads=8)
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, 4\)"):
        pool(store, layout=lay, rank=(4, 0, 0, 0))
    with pytest.raises(ValueError, match=r"pp_rank must be in \[0, 1\)"):
        pool(store, layout=lay, rank=(0, 0, 0, 1))
    with pytest.raises(ValueError, match=r"tp_rank % dcp_size"):
        pool(store, layout=lay, rank=(1, 0, 0, 0))  # dcp rank of tp 1 is 1
    with pytest.raises(TypeError, match="tp_rank must be an int"):
        pool(store, layout=lay, rank=(0.0, 0, 0, 0))
    with pytest.raises(TypeError, match=r"rank must be a \(tp, pcp, dcp, pp\) tuple"):
        pool(store, layout=lay, rank=(0, 0))
    with pytest.raises(TypeError, match=r"rank must be a \(tp, pcp, dcp, pp\) tuple"):
        pool(store, layout=lay, rank=0)
    with pool(store, layout=lay, rank=[3, 0, 1, 0]) as p:
        assert p.writer_namespace == (3, 0, 1, 0)


def test_bad_deployment_and_store():
    with pytest.raises(TypeError, match="store lacks the method.*batch_get_into"):
        pool(object())

    class NoGet(mk.MemoryStore):
        batch_get_into = None

    with pytest.raises(TypeError, match="store lacks the method.*batch_get_into"):
        pool(NoGet())
    with pytest.raises(ValueError, match="hash_block_size"):
        pool(mk.MemoryStore(), [F(16)], hash_block_size=32)
    with pytest.raises(ValueError, match="PCP/DCP"):
        pool(mk.MemoryStore(), [F(16), F(32)], mk.ParallelLayout(pcp_size=2))
    with pytest.raises(TypeError, match="model_name"):
        KVPool(b"m", [F(16)], mk.ParallelLayout(), rank=(0, 0, 0, 0), kv_caches=[torch.zeros(2, 4)],
               hash_block_size=16, store=mk.MemoryStore(), vllm_compat="0.25")


def test_bad_block_ids_and_lengths(impl):
    store = mk.MemoryStore()
    hs = hashes_of(4)
    with pool(store, [F(16), F(32)]) as p:
        with pytest.raises(ValueError, match=r"block_ids must hold one list per KV-cache group \(2\), got 3"):
            p.save(64, hs, [[0, 1, 2, 3], [0, 1], [0]])
        with pytest.raises(ValueError, match=r"block_ids must hold one list per KV-cache group \(2\), got 4"):
            p.save(64, hs, [0, 1, 2, 3])  # a flat list is only accepted for one group
        with pytest.raises(ValueError, match=r"block_ids\[1\] has 1 entries, fewer than the 2 chunks"):
            p.save(64, hs, [[0, 1, 2, 3], [0]])
        with pytest.raises(ValueError, match=r"block_ids\[0\]\[2\] = 16 is out of range for kv_caches\[0\] \(16 blocks\)"):
            p.save(64, hs, [[0, 1, 16, 3], [0, 1]])
        with pytest.raises(ValueError, match=r"block_ids\[0\]\[0\] = -1 is out of range"):
            p.load(64, hs, [[-1, 1, 2, 3], [0, 1]])
        with pytest.raises(TypeError, match=r"block_ids\[1\]\[0\] must be an int, got float"):
            p.load(64, hs, [[0, 1, 2, 3], [0.0, 1]])
        with pytest.raises(TypeError, match=r"block_ids\[1\]\[1\] must be an int, got bool"):
            p.load(64, hs, [[0, 1, 2, 3], [0, True]])
        with pytest.raises(TypeError, match=r"block_ids\[0\] must be a list"):
            p.load(64, hs, ["abcd", [0, 1]])
        with pytest.raises(TypeError, match="block_ids must be a list"):
            p.load(64, hs, None)
        with pytest.raises(ValueError, match=r"destination blocks of group 0 chunk 0 and group 0 chunk 1 overlap"):
            p.load(64, hs, [[5, 5, 6, 7], [0, 1]])
        with pytest.raises(TypeError, match="token_len must be an int"):
            p.save(64.0, hs, [[0, 1, 2, 3], [0, 1]])
        with pytest.raises(ValueError, match="token_len must be >= 0"):
            p.load(-16, hs, [[], []])
        with pytest.raises(ValueError, match="skip_tokens must be >= 0"):
            p.load(64, hs, [[0, 1, 2, 3], [0, 1]], skip_tokens=-1)
        with pytest.raises(TypeError, match="block_hashes"):
            p.save(64, "abcd", [[0, 1, 2, 3], [0, 1]])
        with pytest.raises(ValueError, match=r"block_hashes\[1\]"):
            p.save(64, [b"aa", b"bbb"], [[0, 1, 2, 3], [0, 1]])
        # numpy / torch block tables are fine
        np = pytest.importorskip("numpy")
        assert p.save(64, hs, [np.arange(4), torch.arange(2)]).stored == 6
        assert p.load(64, hs, [np.arange(8, 12), torch.arange(4, 6)]).ok


def test_groups_sharing_a_tensor_must_not_load_into_one_block(impl):
    store = mk.MemoryStore()
    shared = random_cache(random.Random(0), 16, 64)
    hs = hashes_of(2)
    with pool(store, [F(16), S(16, 16)], kv_caches=[shared, shared]) as p:
        p.save(32, hs, [[0, 1], [2, 3]])
        with pytest.raises(ValueError, match="group 0 chunk 1 and group 1 chunk 1 overlap"):
            p.load(32, hs, [[4, 5], [6, 5]])


# --------------------------------------------------------------------------- property: round trip

HYBRIDS = [
    (8, [F(32), S(8, 8)]),
    (8, [F(32), S(8, 16)]),
    (16, [F(16), S(16, 32)]),
    (8, [F(32), S(8, 8), S(16, 32)]),
    (8, [G(F(32)), G(S(8, 24), is_eagle_group=True)]),
    (16, [F(16), F(32)]),
    (16, [S(16, 48)]),
]


@dataclass
class Case:
    layout: mk.ParallelLayout
    hash_block_size: int
    groups: list
    use_eagle: bool
    hash_len: int
    lcm_blocks: int
    extra_tokens: int
    n_remove: int
    seed: int


@st.composite
def cases(draw):
    kind = draw(st.sampled_from(["gqa", "mla", "dcp", "pcp", "hybrid"]))
    pp = draw(st.integers(1, 2))
    pcp = dcp = 1
    if kind == "dcp":
        dcp = draw(st.sampled_from([2, 3, 4]))
        tp = dcp * draw(st.sampled_from([1, 2]))
    else:
        tp = draw(st.integers(1, 4 if kind == "pcp" else 8))
        pcp = 2 if kind == "pcp" else 1
    below = [d for d in range(1, tp) if tp % d == 0]  # replicated heads: vLLM needs heads | tp
    if kind == "gqa":
        heads = draw(st.sampled_from(below or [1]))
    else:
        heads = draw(st.sampled_from(below + [tp, 2 * tp]))
    mla = kind == "mla" or (kind != "gqa" and draw(st.booleans()))
    layout = mk.ParallelLayout(tp_size=tp, pp_size=pp, pcp_size=pcp, dcp_size=dcp, num_kv_heads=heads, use_mla=mla)
    if kind == "hybrid":
        hash_bs, groups = draw(st.sampled_from(HYBRIDS))
        use_eagle = draw(st.booleans())
    else:
        bs = draw(st.sampled_from([16, 32]))
        hash_bs, groups, use_eagle = draw(st.sampled_from([bs, bs // 4])), [F(bs)], False
    return Case(layout, hash_bs, groups, use_eagle, draw(st.sampled_from([16, 32])), draw(st.integers(1, 3)),
                draw(st.integers(0, 31)), draw(st.integers(0, 4)), draw(st.integers(0, 2**32 - 1)))


@dataclass
class Rank:
    pool: KVPool
    caches: list
    src: list  # block ids the prompt is saved from, per group
    dst: list  # where the hit is loaded to
    dst_all: list  # where the whole prompt is loaded to (after removals)
    saved: dict  # (g, j) -> the bytes of chunk j of group g this rank holds


def run_round_trip(store: Any, case: Case, remove_key, *, clean_up: bool = False) -> None:
    rng = random.Random(case.seed)
    prefix = f"kvp-{uuid.uuid4().hex[:12]}"  # examples never see each other's keys
    lay = case.layout
    deploy = dict(hash_block_size=case.hash_block_size, use_eagle=case.use_eagle, cache_prefix=prefix, store=store)
    engine = mk.LookupEngine("Model-X", case.groups, lay, **deploy, vllm_compat="0.25")
    sched = engine.scheduler_block_size
    T = sched * case.lcm_blocks
    hs = [rng.randbytes(case.hash_len) for _ in range((T + case.extra_tokens % sched) // case.hash_block_size)]
    cands = engine.candidate_keys(T, hs)
    assert len(set(cands)) == len(cands)
    try:
        _round_trip(store, case, remove_key, rng, engine, T, hs, cands, deploy)
    finally:
        if clean_up:  # a shared store: leave no keys behind (removing a missing key is fine)
            for key in cands:
                remove_key(key)


def _round_trip(store, case, remove_key, rng, engine, T, hs, cands, deploy) -> None:
    lay, groups, sched, prefix = case.layout, engine.groups, engine.scheduler_block_size, deploy["cache_prefix"]
    n = [T // grp.spec.block_size for grp in groups]
    with ExitStack() as stack:
        # Every rank's blocks of a group have one size and dtype; the bytes differ per rank.
        shapes = [(rng.choice([64, 128, 192, 256]), rng.choice([torch.uint8, torch.float16, torch.int32, torch.bfloat16]))
                  for _ in groups]
        ranks: Dict[tuple, Rank] = {}
        for r in lay.ranks():
            caches, src, dst, dst_all = [], [], [], []
            for g, (nbytes, dtype) in enumerate(shapes):
                caches.append(random_cache(rng, 3 * n[g] + 1, nbytes, dtype))
                ids = rng.sample(range(3 * n[g] + 1), 3 * n[g])
                src.append(ids[: n[g]])
                dst.append(ids[n[g]: 2 * n[g]])
                dst_all.append(ids[2 * n[g]:])
            p = stack.enter_context(KVPool("Model-X", case.groups, lay, rank=r, kv_caches=caches, **deploy, vllm_compat="0.25"))
            saved = {(g, j): block_bytes(caches[g], src[g][j]) for g in range(len(groups)) for j in range(n[g])}
            ranks[r] = Rank(p, caches, src, dst, dst_all, saved)

        # Every rank saves the prompt; together they store each asked key exactly once.
        results = [rk.pool.save(T + case.extra_tokens % sched, hs, rk.src) for rk in ranks.values()]
        assert all(res.ok and res.token_len == T and res.skipped_existing == 0 for res in results)
        assert sum(res.stored for res in results) == len(cands)
        assert store.batch_is_exist(cands) == [1] * len(cands)

        # No false miss: every aligned prefix is a full hit (EAGLE: what an all-present store gives).
        for t in range(sched, T + 1, sched):
            full = engine.coordinator.longest_hit(
                [b"\x01" * (t // grp.spec.block_size) for grp in groups], t)
            assert engine.lookup(t, hs) == full
            if not (case.use_eagle or any(getattr(g, "is_eagle_group", False) for g in case.groups)):
                assert full == t

        removed = rng.sample(cands, min(case.n_remove, len(cands)))
        for key in removed:
            assert remove_key(key) == 0
        assert store.batch_is_exist(removed) == [0] * len(removed)
        h = engine.lookup(T, hs)

        ps = lay.put_step
        for r, rk in ranks.items():
            _, pcp, dcp, pp = r

            def expected(g: int, j: int) -> bytes:  # the writer of the chunk under the A+ stripe
                writer = (rk.pool.writer_namespace[0] * ps + (j - g) % ps, pcp, dcp, pp)
                return ranks[writer].saved[(g, j)]

            # No false hit: the hit loads on every rank, with the writer's bytes.
            res = rk.pool.load(h, hs, rk.dst)
            assert res.ok and res.loaded_tokens == h, (r, res)
            for g, grp in enumerate(groups):
                end = h // grp.spec.block_size
                start = max(0, end - grp.spec.blocks_needed(False)) if isinstance(grp.spec, S) else 0
                assert [c.chunk_id for c in res.chunks[g]] == list(range(start, end))
                for j in range(start, end):
                    assert block_bytes(rk.caches[g], rk.dst[g][j]) == expected(g, j), (r, g, j)

            # The whole prompt: what is there loads right, what was removed fails and is zeroed.
            res = rk.pool.load(T, hs, rk.dst_all)
            assert res.ok == (res.loaded_tokens == T)
            if h == T:
                assert res.ok
            for g in range(len(groups)):
                for c in res.chunks[g]:
                    got = block_bytes(rk.caches[g], rk.dst_all[g][c.chunk_id])
                    if c.ok:
                        assert got == expected(g, c.chunk_id)
                    else:
                        assert c.code == OBJECT_NOT_FOUND and got == bytes(len(got))
                        assert key_of("Model-X", rk.pool.writer_namespace, g, hs[
                            (c.chunk_id + 1) * groups[g].spec.block_size // case.hash_block_size - 1], prefix) in removed


@settings(max_examples=EXAMPLES, **PROPERTY)
@given(case=cases())
def test_round_trip_memory_store(impl, case):
    store = mk.MemoryStore()
    run_round_trip(store, case, store.remove)


# --------------------------------------------------------------------------- a real mooncake_master


@pytest.fixture
def real_store(request):
    """The session's holder client of a real mooncake_master (tests/support/mooncake_fixtures.py)."""
    pytest.importorskip("mooncake.store")
    try:
        return request.getfixturevalue("mooncake_store")
    except pytest.FixtureLookupError:
        pytest.skip("the mooncake fixtures (tests/support/mooncake_fixtures.py) are not available")


@pytest.mark.mooncake
@settings(max_examples=REAL_EXAMPLES, **PROPERTY)
@given(case=cases())
def test_round_trip_real_master(impl, real_store, case):
    # force: a lookup leases every key it finds, and a leased key refuses a plain remove.
    run_round_trip(real_store, case, lambda key: real_store.remove(key, force=True), clean_up=True)


@pytest.mark.mooncake
def test_real_master_load_failures_and_registration(real_store):
    prefix = f"kvp-{uuid.uuid4().hex[:12]}"
    kv = random_cache(random.Random(9), 8, 128)
    hs = hashes_of(4, rng=random.Random(9))
    with pool(real_store, kv_caches=kv, cache_prefix=prefix) as p:
        assert p.save(64, hs, [0, 1, 2, 3]).stored == 4
        assert real_store.remove(key_of("m", (0, 0, 0, 0), 0, hs[1], prefix), True) == 0
        res = p.load(64, hs, [4, 5, 6, 7])
        assert [c.code for c in res.chunks[0]] == [128, OBJECT_NOT_FOUND, 128, 128]
        assert res.loaded_tokens == 16 and block_bytes(kv, 5) == bytes(128)
        assert block_bytes(kv, 4) == block_bytes(kv, 0) and block_bytes(kv, 7) == block_bytes(kv, 3)
        # Mooncake refuses to register memory twice: a second pool over the same tensor says so.
        with pytest.raises(KVPoolError, match="returned -600"):
            pool(real_store, kv_caches=kv, cache_prefix=prefix)
    # close() unregistered it: the same memory registers again.
    with pool(real_store, kv_caches=kv, cache_prefix=prefix) as p:
        short = key_of("m", (0, 0, 0, 0), 0, hs[1], prefix)
        assert real_store.put(short, b"x" * 10) == 0  # a foreign, shorter value
        res = p.load(32, hs, [4, 5])
        assert res.chunks[0][1] == ChunkStatus(1, False, 10) and block_bytes(kv, 5) == bytes(128)
    for h in hs:
        real_store.remove(key_of("m", (0, 0, 0, 0), 0, h, prefix), True)


# --------------------------------------------------------------------- reallocated memory
def test_a_resized_kv_cache_is_refused_not_read():
    pytest.importorskip("torch")
    out = run_child("""
        import torch, mooncake_keys as mk
        kv = torch.zeros(4, 64, dtype=torch.uint8)
        store = mk.MemoryStore()
        pool = mk.KVPool("m", [mk.FullAttentionSpec(16)], mk.ParallelLayout(), rank=(0, 0, 0, 0),
                         kv_caches=kv, hash_block_size=16, store=store)
        kv.resize_(4096, 4096)  # reallocates the storage the pool registered
        for call in (lambda: pool.save(32, [b"a" * 16, b"b" * 16], [0, 1]),
                     lambda: pool.load(32, [b"a" * 16, b"b" * 16], [0, 1])):
            try:
                call()
            except mk.KVPoolError as exc:
                print("REFUSED", "reallocated" in str(exc))
        print("stored", len(store))
        pool.close()
    """)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["REFUSED", "True", "REFUSED", "True", "stored", "0"]
