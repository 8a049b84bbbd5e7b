"""Leases = keys loaded: with a store that probes without leases (Mooncake 0.3.14's
``batch_probe_key``), a lookup in rounds asks with policy ``none`` and ends with one
``LastHitOnly`` call of exactly the keys its hit loads; a key gone at that call makes it look
again, never answer a hit whose keys are not leased. Random deployments and stores, both cores
(the store double's 0.3.14 mode; the real client: tests/test_mooncake_newest.py; a batch's lease
calls asked together: tests/test_batch_leases.py)."""

from __future__ import annotations

import logging
import random

from hypothesis import given
from test_rounds import SETTINGS, cases, store_for

import mooncake_keys as mk
from mooncake_keys.lookup.engine import MAX_LEASE_CALLS

F, S, G = mk.FullAttentionSpec, mk.SlidingWindowSpec, mk.KVCacheGroup
LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
HASHES = [bytes([i % 256, i // 256]) * 16 for i in range(1024)]


def loaded_keys(engine, hashes, hit, skip_tokens):
    """Every key a load of ``hit`` tokens reads (vLLM's load mask), from the group kinds alone."""
    dep = engine.deployment
    out = set()
    for g, grp in enumerate(dep.store_groups):
        spec, bs = grp.spec, grp.spec.block_size
        n = hit // bs
        if isinstance(spec, S):
            first = n - spec.blocks_needed(False)
        elif isinstance(spec, mk.MambaSpec):
            first = n - 1
        elif isinstance(spec, mk.ChunkedLocalAttentionSpec):
            first = hit // spec.attention_chunk_size * spec.attention_chunk_size // bs
        else:
            first = 0
        scale = bs // dep.hash_block_size
        for j in range(max(first, 0, skip_tokens // bs), n):  # chunks wholly below skip_tokens are held
            out.update(head + hashes[j * scale + scale - 1].hex() for head in dep.heads[g])
    return out


def _heads_of(engine, key):
    """The key heads of ``key``'s group (every namespace of its chunk)."""
    head = key.rsplit("@", 1)[0] + "@"
    return next(hs for hs in engine.deployment.heads if head in hs)


@SETTINGS
@given(case=cases())
def test_a_hit_leases_the_keys_it_loads_and_nothing_else(impl, case):
    dep, n_hashes, tokens, seed, kind = case
    rng = random.Random(seed)
    hashes = [rng.randbytes(16) for _ in range(n_hashes)]
    present = store_for(mk.LookupEngine("m", store=mk.RecordingStore(), **dep), hashes, kind, seed)
    skip = rng.choice([0, 0, rng.randrange(tokens + 1)]) if tokens > 0 else 0
    one = mk.LookupEngine("m", store=mk.RecordingStore(present=present), strategy="oneshot", **dep)
    expected = one.lookup_result(tokens, hashes, skip_tokens=skip)
    store = mk.RecordingStore(present=present, leases=True)
    engine = mk.LookupEngine("m", store=store, rounds_min_keys=rng.choice([0, 2048]), **dep)
    got = engine.lookup_result(tokens, hashes, skip_tokens=skip)
    assert got == expected
    if engine.strategy == "oneshot":  # rounds are not exact here: vLLM's one call, leases and all
        assert store.probe_calls in ([], ["none"])
        return
    leased = [k for keys in store.leased for k in keys]
    loads = loaded_keys(engine, hashes, got.hit_length, skip)
    eagle = dep["use_eagle"] or any(g.is_eagle_group for g in dep["groups"])
    # Every key the answer rests on is leased: the leased keys alone give the same hit ...
    only = mk.LookupEngine("m", store=mk.RecordingStore(present=set(leased)), strategy="oneshot", **dep)
    assert only.lookup_result(tokens, hashes, skip_tokens=skip).hit_length == got.hit_length
    if got.hit_length == 0 or not leased:  # a miss, or a hit that rests on no key (held below skip_tokens)
        assert leased == [] and "LastHitOnly" not in store.probe_calls
        assert not loads or got.hit_length == 0
        return
    *probes, last = store.probe_calls
    assert set(probes) <= {"none"} and last == "LastHitOnly"
    assert leased == store.calls[-1]  # the lease call leased every key it asked, and nothing else did
    # ... and they are exactly the keys the load reads (with EAGLE, a hit also rests on the chunk
    # it drops, which is leased too; and a hybrid's EAGLE hit can reach past what is stored, as
    # vLLM's does: those keys cannot be leased).
    if not eagle:
        assert set(leased) == loads
    else:  # those of its chunks that exist in every namespace (a chunk missing in one cannot load)
        whole = {k for k in loads if all(h + k.rsplit("@", 1)[1] in present for h in _heads_of(engine, k))}
        assert whole <= set(leased)
    assert engine.stats().leased_keys == len(leased)


class GoneAtTheLeaseCall:
    """A 0.3.14 store double from which ``gone(keys)`` removes keys right before each of the
    first ``times`` lease calls (an eviction between the rounds and the lease call)."""

    def __init__(self, present, gone, times=1):
        self.present = present
        self.store = mk.RecordingStore(present=present, leases=True)
        self.gone, self.times = gone, times

    def lease_probes(self):
        return True

    def batch_is_exist(self, keys):
        return self.store.batch_is_exist(keys)

    def batch_probe_key(self, keys, policy="none", candidate_size=1):
        if policy == "LastHitOnly" and self.times > 0:
            self.times -= 1
            self.present.difference_update(self.gone(keys))
        return self.store.batch_probe_key(keys, policy, candidate_size)


def engine(store, **kw):
    return mk.LookupEngine("m", [F(16)], LAYOUT, hash_block_size=16, store=store, rounds_min_keys=0,
                           key_cache_bytes=0, **kw)


def test_a_key_gone_at_the_lease_call_is_looked_for_again_and_the_shorter_hit_leased(impl):
    keys = engine(mk.RecordingStore()).candidate_keys(1024 * 16, HASHES)
    present = set(keys[:300 * 2])
    store = GoneAtTheLeaseCall(present, lambda asked: [asked[200 * 2 + 1]])  # chunk 200, namespace 1
    e = engine(store)
    assert e.lookup(1024 * 16, HASHES) == 200 * 16
    assert store.store.probe_calls.count("LastHitOnly") == 2
    assert store.store.leased[-1] == keys[:200 * 2]  # the second lease call: the new hit's keys, leased
    assert e.stats().lease_misses == 1
    assert e.lookup(1024 * 16, HASHES) == engine(mk.RecordingStore(present=present), strategy="oneshot").lookup(
        1024 * 16, HASHES)


def test_keys_that_keep_vanishing_answer_0_with_one_line(impl, caplog):
    keys = engine(mk.RecordingStore()).candidate_keys(1024 * 16, HASHES)
    present = set(keys[:300 * 2])
    store = GoneAtTheLeaseCall(present, lambda asked: [asked[-1]], times=100)
    with caplog.at_level(logging.WARNING, "mooncake_keys.lookup"):
        assert engine(store).lookup(1024 * 16, HASHES) == 0
    assert store.store.probe_calls.count("LastHitOnly") == MAX_LEASE_CALLS
    assert [r.getMessage() for r in caplog.records if "kept vanishing" in r.getMessage()] != []


def test_a_short_lookup_asks_once_without_leases_then_leases_its_hit(impl):
    keys = engine(mk.RecordingStore()).candidate_keys(64 * 16, HASHES)
    store = mk.RecordingStore(present=set(keys[:20 * 2]), leases=True)
    e = mk.LookupEngine("m", [F(16)], LAYOUT, hash_block_size=16, store=store)  # 128 keys < rounds_min_keys
    assert e.lookup(64 * 16, HASHES[:64]) == 20 * 16
    assert store.probe_calls == ["none", "LastHitOnly"] and store.calls[0] == keys
    assert store.leased == [[], keys[:20 * 2]]
    miss = mk.RecordingStore(leases=True)
    assert mk.LookupEngine("m", [F(16)], LAYOUT, hash_block_size=16, store=miss).lookup(64 * 16, HASHES[:64]) == 0
    assert miss.probe_calls == ["none"] and miss.leased == [[]]  # a miss: one call, no lease


def test_a_store_without_probes_asks_as_before(impl):
    """Mooncake 0.3.13 (or a master older than the 0.3.14 client): batch_is_exist, no lease call."""
    keys = engine(mk.RecordingStore()).candidate_keys(1024 * 16, HASHES)
    store = mk.RecordingStore(present=set(keys[:300 * 2]))
    e = engine(store)
    assert e.lookup(1024 * 16, HASHES) == 300 * 16
    assert e.stats().leased_keys == e.stats().present_keys == store.keys_present
