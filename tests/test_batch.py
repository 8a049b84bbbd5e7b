"""Lookups run together (mooncake_keys.lookup.batch): each answer exactly its own lookup's, the
store asked once per round for all of them, each key once; discarded lookups ask nothing more;
a failed call answers 0 for every lookup in it."""

from __future__ import annotations

import random
import threading
import time

import pytest

import mooncake_keys as mk
from mooncake_keys.lookup.batch import LookupBatcher
from support.batching import answers_of

F, S, M = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.MambaSpec


class SlowStore(mk.RecordingStore):
    """Answers after a pause, so that lookups submitted meanwhile pile up for the next call."""

    def batch_is_exist(self, keys):
        time.sleep(0.01)
        return super().batch_is_exist(keys)


@pytest.mark.parametrize("groups", [[F(16)], [F(16), S(16, 64)], [F(32), M(32)]], ids=["full", "swa", "mamba"])
def test_every_answer_is_its_own_lookups_and_shared_keys_are_asked_once(impl, groups):
    rng = random.Random(len(groups))
    layout = mk.ParallelLayout(tp_size=4, num_kv_heads=4)
    builder = mk.LookupEngine("m", groups, layout, hash_block_size=16, store=mk.RecordingStore())
    system = [rng.randbytes(32) for _ in range(128)]
    requests = {f"r{i}": system[: rng.randint(0, 128)] + [rng.randbytes(32) for _ in range(rng.randint(0, 64))]
                for i in range(40)}
    stored = set(builder.candidate_keys(128 * 16, system))
    stored |= {k for k in builder.candidate_keys(192 * 16, requests["r1"]) if rng.random() < 0.9}
    store = SlowStore(present=stored)
    batcher = LookupBatcher(mk.LookupEngine("m", groups, layout, hash_block_size=16, store=store))
    try:
        for name, hashes in requests.items():
            batcher.submit(name, len(hashes) * 16 + 5, hashes)
        got = answers_of(batcher, list(requests))
        solo = mk.LookupEngine("m", groups, layout, hash_block_size=16, store=mk.RecordingStore(present=stored))
        for name, hashes in requests.items():
            assert got[name] == solo.lookup_result(len(hashes) * 16 + 5, hashes), name
        assert sum(r.hit_length > 0 for r in got.values()) > 10
        assert store.num_calls == batcher.stats.calls < len(requests)  # rounds shared by many lookups
        for keys in store.calls:
            assert len(keys) == len(set(keys))  # each key once per call
        assert batcher.stats.keys_asked < batcher.stats.keys_wanted
    finally:
        batcher.close()


def test_a_failed_call_answers_zero_for_each_lookup_in_it(caplog):
    store = mk.RecordingStore(1, fault=ConnectionError("master gone"))
    batcher = LookupBatcher(mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store))
    try:
        names = [f"r{i}" for i in range(8)]
        for n in names:
            batcher.submit(n, 64, [bytes([i]) * 16 for i in range(4)])
        got = answers_of(batcher, names)
        assert all(r == mk.LookupResult(0, ()) for r in got.values()) and len(got) == 8
        assert "master gone" in caplog.text
    finally:
        batcher.close()


def test_a_discarded_lookup_asks_nothing_more():
    release = threading.Event()

    class Gate(mk.RecordingStore):
        def batch_is_exist(self, keys):
            release.wait(5)
            return super().batch_is_exist(keys)

    store = Gate(1)
    engine = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(tp_size=8, num_kv_heads=8), hash_block_size=16,
                             store=store)
    batcher = LookupBatcher(engine)
    try:
        hashes = [bytes([i % 256, i // 256]) * 16 for i in range(600)]
        batcher.submit("a", 600 * 16, hashes)  # asks in rounds: a first call, then more
        time.sleep(0.05)
        batcher.discard("a")  # while its first call is in flight
        release.set()
        time.sleep(0.2)
        assert store.num_calls == 1 and batcher.poll("a") is None and not batcher.pending("a")
        assert batcher.stats.discarded == 1
    finally:
        batcher.close()


def test_bad_arguments_answer_zero_with_a_log_line(caplog):
    batcher = LookupBatcher(mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16,
                                            store=mk.RecordingStore(1)))
    try:
        batcher.submit("bad", "many", [b"x" * 16])
        batcher.submit("odd", 64, [b"x" * 16, b"y" * 8])
        got = answers_of(batcher, ["bad", "odd"])
        assert got == {"bad": mk.LookupResult(0, ()), "odd": mk.LookupResult(0, ())}
        assert "num_tokens" in caplog.text
    finally:
        batcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        batcher.submit("late", 64, [b"x" * 16])
    with pytest.raises(TypeError, match="engine must be a LookupEngine"):
        LookupBatcher(object())


def test_the_last_calls_answers_serve_the_next_lookups_within_the_lease_only(monkeypatch):
    """A burst that came in two parts asks its shared keys once: a key the last call answered
    is answered from there for a tenth of the master's lease (at most REUSE_S), counted from
    when that call was sent; later it is asked again. With the lease unknown, never."""
    from mooncake_keys.lookup import batch as batch_mod

    hashes = [bytes([i]) * 16 for i in range(8)]
    layout = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
    store = mk.RecordingStore(1)
    now = [100.0]
    batcher = LookupBatcher(mk.LookupEngine("m", [F(16)], layout, hash_block_size=16, store=store), lease_s=10.0,
                            clock=lambda: now[0])
    try:
        assert batcher.reuse_s == batch_mod.REUSE_S == 1.0
        batcher.submit("first", 128, hashes)
        first = answers_of(batcher, ["first"])["first"]
        asked = store.keys_asked
        batcher.submit("second", 128, hashes[:6])  # every key answered by the last call
        assert answers_of(batcher, ["second"])["second"].hit_length == 96
        assert store.keys_asked == asked and first.hit_length == 112
        assert batcher.stats.keys_reused >= 12  # the second lookup's 12 keys, each round's
        now[0] += 1.0  # the window is over
        batcher.submit("third", 128, hashes[:6])
        assert answers_of(batcher, ["third"])["third"].hit_length == 96
        assert store.keys_asked == asked + 12  # asked again
    finally:
        batcher.close()
    assert LookupBatcher(batcher.engine, lease_s=0.2).reuse_s == pytest.approx(0.02)
    unknown = LookupBatcher(mk.LookupEngine("m", [F(16)], layout, hash_block_size=16, store=store))
    try:
        assert unknown.reuse_s == 0.0
        asked = store.keys_asked
        for name in ("a", "b"):
            unknown.submit(name, 128, hashes[:6])
            answers_of(unknown, [name])
        assert store.keys_asked == asked + 24  # nothing reused
    finally:
        unknown.close()
    for bad, error in ((0, ValueError), (-1.0, ValueError), ("10", TypeError), (float("inf"), ValueError)):
        with pytest.raises(error, match="lease_s"):
            LookupBatcher(batcher.engine, lease_s=bad)


def test_each_present_answer_is_reused_for_its_own_window():
    """Requests that interleave two system prompts: each prompt's keys are reused from whichever
    call answered them, until their own call's window ends (the reuse of the last call alone
    asked A's prompt again after a lookup of B's). An answer served from reuse keeps its call's
    time: it took no lease of its own."""
    layout = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
    store = mk.RecordingStore(1)
    now = [50.0]
    batcher = LookupBatcher(mk.LookupEngine("m", [F(16)], layout, hash_block_size=16, store=store), lease_s=10.0,
                            clock=lambda: now[0])
    prompt_a = [bytes([1, i]) * 8 for i in range(6)]
    prompt_b = [bytes([2, i]) * 8 for i in range(6)]
    try:
        for name, hashes in (("a1", prompt_a), ("b1", prompt_b)):
            batcher.submit(name, 96, hashes)
            assert answers_of(batcher, [name])[name].hit_length == 80
        asked = store.keys_asked
        now[0] += 0.5
        for name, hashes in (("a2", prompt_a), ("b2", prompt_b), ("a3", prompt_a)):
            batcher.submit(name, 96, hashes)
            assert answers_of(batcher, [name])[name].hit_length == 80
        assert store.keys_asked == asked  # both prompts' keys answered from their own calls
        assert batcher.sizes()["reused_answers"] == 24
        now[0] += 0.6  # 1.1 s after the first calls: their window is over, though reused since
        batcher.submit("a4", 96, prompt_a)
        assert answers_of(batcher, ["a4"])["a4"].hit_length == 80
        assert store.keys_asked == asked + 12  # asked again
    finally:
        batcher.close()


def test_a_key_answered_absent_is_asked_again_and_one_answered_present_is_reused():
    """A present key holds the lease its call took: reused. An absent one may be saved any
    moment (vLLM saves every request's KV): asked again, so a prefix saved just after a call is
    found by the next lookup, as a lookup alone would find it."""
    memory = mk.MemoryStore()
    hashes = [bytes([i]) * 16 for i in range(8)]
    builder = mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=mk.RecordingStore())
    keys = builder.candidate_keys(128, hashes)
    for k in keys[:4]:
        memory.put(k)
    store = mk.RecordingStore(memory)
    batcher = LookupBatcher(mk.LookupEngine("m", [F(16)], mk.ParallelLayout(), hash_block_size=16, store=store),
                            lease_s=10.0)
    try:
        batcher.submit("first", 129, hashes)
        assert answers_of(batcher, ["first"])["first"].hit_length == 64
        for k in keys[4:]:
            memory.put(k)  # saved right after
        batcher.submit("second", 129, hashes)
        assert answers_of(batcher, ["second"])["second"].hit_length == 128
        asked_again = [k for call in store.calls[1:] for k in call]
        assert not set(asked_again) & set(keys[:4]) and keys[4] in asked_again
        assert batcher.stats.keys_reused >= 4
    finally:
        batcher.close()
