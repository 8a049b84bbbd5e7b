"""A batch's lease calls asked together (mooncake_keys.lookup.batch, with lease-free probes: the
store double's Mooncake 0.3.14 mode): the lookups that reach their lease step in one batch are
leased by one ``LastHitOnly`` call, the union of their hits' keys (each key once) as one
all-or-nothing candidate; each answer is the lookup's own alone. A key gone at that call: the
lookups whose hit needed it look again (a shorter hit, leased later), the others are leased by
one more call of their union, and no hit is answered with a key not leased. Both cores. With the
key-event mirror on a real 0.3.14 master: tests/test_key_events.py; the real 0.3.14 client:
tests/test_mooncake_newest.py."""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import given
from test_leases import loaded_keys
from test_rounds import SETTINGS, cases, store_for

import mooncake_keys as mk
from mooncake_keys.lookup.batch import LEASE_UNIONS, LookupBatcher
from support.batching import burst

F, S, M = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.MambaSpec
LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
SYSTEM, OWN = 96, 32  # hashes of the shared prompt and of each request's own part (16 tokens each)


def hashes_of(tag, n):
    return [f"{tag}-{i:05d}".encode().ljust(16, b".") for i in range(n)]


def engine(store, groups=(F(16),), **kw):
    return mk.LookupEngine("m", list(groups), LAYOUT, hash_block_size=16, store=store, key_cache_bytes=0, **kw)


def burst_on(e, requests, tokens=None):
    """:func:`burst` on a new batcher over engine ``e``, closed after: (the answers, the batcher,
    for its stats)."""
    batcher = LookupBatcher(e)
    try:
        return burst(batcher, requests, tokens), batcher
    finally:
        batcher.close()


def lease_calls(store):
    """``(keys, leased)`` of each LastHitOnly call, in order."""
    return [(keys, leased) for keys, policy, leased in zip(store.calls, store.probe_calls, store.leased)
            if policy == "LastHitOnly"]


def assert_every_hit_leased(eng, requests, answers, store, after=0):
    """Each hit's keys (what its load reads) were leased by one LastHitOnly call (from the
    ``after``-th on) that asked them all: no hit answered with a key not leased."""
    calls = lease_calls(store)[after:]
    for name, got in answers.items():
        if got.hit_length == 0:
            continue
        loads = loaded_keys(eng, requests[name], got.hit_length, 0)
        assert any(loads <= set(leased) for _, leased in calls), name


class GoneAtTheLeaseCall(mk.RecordingStore):
    """A 0.3.14 store double from which, right before the n-th LastHitOnly call (from 0), the
    keys ``gone[n]`` are removed (an eviction between the rounds and the lease)."""

    def __init__(self, present, gone):
        super().__init__(present=present, leases=True)
        self.stored, self.gone, self.lease_no = present, list(gone), 0

    def batch_probe_key(self, keys, policy="none", candidate_size=1):
        if policy == "LastHitOnly":
            if self.lease_no < len(self.gone):
                self.stored.difference_update(self.gone[self.lease_no])
            self.lease_no += 1
        return super().batch_probe_key(keys, policy, candidate_size)


@pytest.mark.parametrize("groups", [[F(16)], [F(16), S(16, 64)], [F(32), M(32)]], ids=["full", "swa", "mamba"])
def test_a_burst_of_hits_is_leased_by_one_call_and_each_answer_is_its_own(impl, groups):
    """32 requests on a stored shared prompt (their own parts not stored): one lease call for all
    of them, of the union of their hits' keys, all leased; every answer the lookup's alone."""
    system = hashes_of("system", SYSTEM)
    requests = {r: system + hashes_of(f"own{r}", OWN) for r in range(32)}
    present = set(engine(mk.RecordingStore(), groups).candidate_keys(SYSTEM * 16, system))
    store = mk.RecordingStore(present=present, leases=True)
    e = engine(store, groups)
    answers, batcher = burst_on(e, requests)
    for name, hashes in requests.items():
        tokens = len(hashes) * 16 + 1
        alone = engine(mk.RecordingStore(present=present, leases=True), groups).lookup_result(tokens, hashes)
        assert answers[name] == alone, name
        assert alone == engine(mk.RecordingStore(present=present), groups, strategy="oneshot").lookup_result(
            tokens, hashes)
    assert all(a.hit_length > 0 for a in answers.values())
    calls = lease_calls(store)
    assert len(calls) == 1 and batcher.stats.lease_calls == 1  # before: one per hit, 32
    (keys, leased), = calls
    union = set().union(*(loaded_keys(e, h, answers[n].hit_length, 0) for n, h in requests.items()))
    assert len(keys) == len(set(keys)) and set(keys) == union  # each key once: exactly the hits' keys
    assert leased == keys  # all of them leased, by that one call
    assert set(store.probe_calls[:-1]) == {"none"}  # the rounds before it: no lease
    assert e.stats().leased_keys == sum(len(loaded_keys(e, h, answers[n].hit_length, 0)) for n, h in requests.items())


def test_a_key_gone_at_the_lease_call_makes_only_its_lookup_look_again(impl):
    """A key of one request's own hit gone at the burst's lease call: that call leased nothing;
    the one request looks again and answers the shorter hit (its keys leased by its own next
    call), the 7 others are leased by one more call of their union and answer their hits."""
    system = hashes_of("system", SYSTEM)
    requests = {r: system + hashes_of(f"own{r}", OWN) for r in range(8)}
    builder = engine(mk.RecordingStore())
    present = set()
    for hashes in requests.values():  # every request's whole prompt stored
        present |= set(builder.candidate_keys(len(hashes) * 16, hashes))
    gone = builder.candidate_keys(len(requests[3]) * 16, requests[3])[(SYSTEM + 10) * 2 + 1]  # r3's chunk 106
    store = GoneAtTheLeaseCall(present, [{gone}])
    e = engine(store)
    answers, batcher = burst_on(e, requests)
    after = present - {gone}
    for name, hashes in requests.items():  # each as alone on the store as it is after the removal
        assert answers[name] == engine(mk.RecordingStore(present=after), strategy="oneshot").lookup_result(
            len(hashes) * 16 + 1, hashes), name
    assert answers[3].hit_length == (SYSTEM + 10) * 16
    assert all(answers[r].hit_length == (SYSTEM + OWN) * 16 for r in requests if r != 3)
    (first, none), (second, seven), (third, own3) = lease_calls(store)
    assert gone in first and none == []  # the union of all 8: a key gone, nothing leased
    assert gone not in second and seven == second  # the other 7's union: leased
    assert set(second) == set().union(*(loaded_keys(e, requests[r], answers[r].hit_length, 0)
                                        for r in requests if r != 3))
    assert set(third) == loaded_keys(e, requests[3], answers[3].hit_length, 0) and own3 == third
    assert_every_hit_leased(e, requests, answers, store, after=1)
    assert e.stats().lease_misses == 1 and batcher.stats.lease_calls == 3


def test_a_shared_key_gone_makes_every_lookup_look_again_and_one_call_lease_them_all(impl):
    system = hashes_of("system", SYSTEM)
    requests = {r: system + hashes_of(f"own{r}", OWN) for r in range(8)}
    builder = engine(mk.RecordingStore())
    present = set(builder.candidate_keys(SYSTEM * 16, system))
    gone = builder.candidate_keys(SYSTEM * 16, system)[50 * 2]  # the shared prompt's chunk 50
    store = GoneAtTheLeaseCall(present, [{gone}])
    e = engine(store)
    answers, _ = burst_on(e, requests)
    assert {a.hit_length for a in answers.values()} == {50 * 16}  # each recomputed, as alone after it
    (first, none), (second, leased) = lease_calls(store)
    assert none == [] and leased == second and set(second) == loaded_keys(e, system, 50 * 16, 0)
    assert e.stats().lease_misses == 8


def test_keys_gone_again_at_the_second_union_leave_each_lookup_its_own_call(impl):
    """Evictions at both union calls: after LEASE_UNIONS unions each lookup left asks its own,
    so a burst's lease calls stay bounded (at most the unions and one per lookup)."""
    system = hashes_of("system", SYSTEM)
    requests = {r: system + hashes_of(f"own{r}", OWN) for r in range(8)}
    builder = engine(mk.RecordingStore())
    keys = {r: builder.candidate_keys(len(h) * 16, h) for r, h in requests.items()}
    present = set().union(*map(set, keys.values()))
    store = GoneAtTheLeaseCall(present, [{keys[3][(SYSTEM + 10) * 2]}, {keys[5][(SYSTEM + 20) * 2]}])
    e = engine(store)
    answers, _ = burst_on(e, requests)
    assert LEASE_UNIONS == 2
    assert answers[3].hit_length == (SYSTEM + 10) * 16 and answers[5].hit_length == (SYSTEM + 20) * 16
    assert all(answers[r].hit_length == (SYSTEM + OWN) * 16 for r in requests if r not in (3, 5))
    calls = lease_calls(store)
    # The 8's union (r3's key gone), the 7's (r5's gone), each of the 6 left its own, then r3's
    # and r5's new hits together.
    assert [leased for _, leased in calls[:2]] == [[], []]
    assert set(calls[1][0]) == set().union(*(set(keys[r]) for r in requests if r != 3))
    assert sorted(map(sorted, (c for c, _ in calls[2:8]))) == sorted(sorted(keys[r]) for r in requests
                                                                       if r not in (3, 5))
    assert all(leased == c for c, leased in calls[2:])
    assert set(calls[8][0]) == loaded_keys(e, requests[3], answers[3].hit_length, 0) | loaded_keys(
        e, requests[5], answers[5].hit_length, 0)
    assert len(calls) == 9
    assert_every_hit_leased(e, requests, answers, store, after=2)


def test_a_failed_lease_call_answers_zero_for_each_lookup_in_it_with_one_line(impl, caplog):
    class Failing(mk.RecordingStore):
        def batch_probe_key(self, keys, policy="none", candidate_size=1):
            if policy == "LastHitOnly":
                raise ConnectionError("master gone")
            return super().batch_probe_key(keys, policy, candidate_size)

    system = hashes_of("system", SYSTEM)
    requests = {r: system + hashes_of(f"own{r}", OWN) for r in range(8)}
    store = Failing(present=set(engine(mk.RecordingStore()).candidate_keys(SYSTEM * 16, system)), leases=True)
    with caplog.at_level(logging.WARNING, "mooncake_keys.lookup"):
        answers, _ = burst_on(engine(store), requests)
    assert all(a == mk.LookupResult(0, ()) for a in answers.values())
    assert [r.getMessage() for r in caplog.records if "master gone" in r.getMessage()] == [
        f"lookup answered 0: batch_probe_key of {SYSTEM * 2} keys raised ConnectionError: master gone"]


def test_a_store_without_probes_asks_as_before(impl):
    """Mooncake 0.3.13: no batch_probe_key, no lease call (batch_is_exist leases what it finds)."""
    system = hashes_of("system", SYSTEM)
    requests = {r: system + hashes_of(f"own{r}", OWN) for r in range(8)}
    store = mk.RecordingStore(present=set(engine(mk.RecordingStore()).candidate_keys(SYSTEM * 16, system)))
    answers, batcher = burst_on(engine(store), requests)
    assert {a.hit_length for a in answers.values()} == {SYSTEM * 16}
    assert store.probe_calls == [] and batcher.stats.lease_calls == 0 and store.num_calls == batcher.stats.calls


@SETTINGS
@given(case=cases())
def test_random_bursts_answer_each_lookup_as_alone_and_lease_every_hit(impl, case):
    """Random deployments and stores (tests/test_rounds.py's), 4 requests sharing a prefix of
    random length: each answer the lookup's alone (the one-shot answer), every lease call leased
    all it asked (nothing changes here), no more lease calls than hits, and each hit's answer
    rests on the keys one of them leased (those alone give the same hit)."""
    dep, n_hashes, tokens, seed, kind = case
    rng = random.Random(seed)
    shared = [rng.randbytes(16) for _ in range(n_hashes)]
    requests = {r: shared[:rng.randint(0, n_hashes)] + [rng.randbytes(16) for _ in range(rng.randint(0, 8))]
                for r in range(4)}
    present = store_for(mk.LookupEngine("m", store=mk.RecordingStore(), **dep), shared, kind, seed)
    store = mk.RecordingStore(present=present, leases=True)
    e = mk.LookupEngine("m", store=store, **dep)
    answers, _ = burst_on(e, requests, tokens)
    oneshot = mk.LookupEngine("m", store=mk.RecordingStore(present=present), strategy="oneshot", **dep)
    for name, hashes in requests.items():
        assert answers[name] == oneshot.lookup_result(tokens, hashes), name
    if e.strategy == "oneshot":  # rounds are not exact here: vLLM's one call each
        assert "LastHitOnly" not in store.probe_calls
        return
    calls = lease_calls(store)
    assert all(leased == keys for keys, leased in calls)
    hits = [n for n, a in answers.items() if a.hit_length]
    assert len(calls) <= len(hits)
    def hit_on(keys, name):
        return mk.LookupEngine("m", store=mk.RecordingStore(present=set(keys)), strategy="oneshot", **dep
                               ).lookup_result(tokens, requests[name]).hit_length

    for name in hits:
        if hit_on((), name) == answers[name].hit_length:
            continue  # a hit that rests on no key (a chunked-local hit on an attention-chunk start)
        assert answers[name].hit_length in [hit_on(leased, name) for _, leased in calls], name
