"""The batcher held for a long time (mooncake_keys.lookup.batch): its tables bounded whatever the
number of requests, no moment in which a submitted lookup is in no table (so a scheduler never
submits it twice and a discard always lands), no answer reused after a removal it was told of
nor past a tenth of the master's lease, and a stream of requests with aborts and resets on a
real master answered as the synchronous lookup answers. Both cores."""

from __future__ import annotations

import random
import threading
import time

import pytest

import mooncake_keys as mk
from mooncake_keys.lookup import batch as batch_mod
from mooncake_keys.lookup.batch import RECENT_HASHES, RECENT_REQUESTS, LookupBatcher

F = mk.FullAttentionSpec
LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)


def engine(store, **kw):
    return mk.LookupEngine("m", [F(16)], LAYOUT, hash_block_size=16, store=store, **kw)


def answer_of(batcher, key, seconds=20.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        got = batcher.poll(key)
        if got is not None:
            return got
        time.sleep(0.001)
    raise AssertionError(f"lookup {key!r} not answered in {seconds} s")


def idle(batcher, seconds=20.0):
    """Wait until the batcher's thread has nothing queued or waiting for a call."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with batcher._cond:
            if not batcher._queued and not batcher._waiting:
                break
        time.sleep(0.002)
    time.sleep(0.05)  # a call it had taken ends


def test_the_recent_hash_tables_are_bounded_by_requests_and_hashes_not_by_time(impl):
    """H1: 2,000 distinct requests of 64 hashes each (128,000 distinct hashes) leave at most
    RECENT_REQUESTS x 64 counted; a request of more than RECENT_HASHES hashes counts its first
    RECENT_HASHES."""
    store = mk.RecordingStore(0, record_keys=False)
    batcher = LookupBatcher(engine(store))
    rng = random.Random(1)
    system = [rng.randbytes(32) for _ in range(16)]
    try:
        most = 0
        for i in range(2000):
            batcher.submit(i, 80 * 16, system + [rng.randbytes(32) for _ in range(64)])
            if i % 50 == 49:
                for j in range(i - 49, i + 1):
                    answer_of(batcher, j)
                most = max(most, len(batcher._seen))
        assert len(batcher._recent) == RECENT_REQUESTS
        assert most <= 16 + RECENT_REQUESTS * 64 < 2000 * 64
        long = [rng.randbytes(32) for _ in range(RECENT_HASHES + 500)]
        batcher.submit("long", len(long) * 16, long)
        answer_of(batcher, "long")
        sizes = batcher.sizes()
        assert len(batcher._recent["long"]) == RECENT_HASHES
        assert sizes["distinct_hashes"] <= RECENT_REQUESTS * RECENT_HASHES
        assert sizes["lookups"] == 0 and sizes["reused_answers"] == 0  # no lease given: nothing reused
    finally:
        batcher.close()


class StartGate:
    """Holds the batcher's thread while it reads a burst's hashes (building its first keys):
    the moment at which, before the fix, a submitted lookup was in no table."""

    def __init__(self, monkeypatch):
        self.entered, self.release = threading.Event(), threading.Event()
        real = batch_mod.as_block_hashes

        def slow(block_hashes):
            if threading.current_thread().name == "gated":
                self.entered.set()
                assert self.release.wait(10)
            return real(block_hashes)

        monkeypatch.setattr(batch_mod, "as_block_hashes", slow)


def test_a_lookup_being_started_is_pending_and_a_scheduler_submits_it_once(impl, monkeypatch):
    """M2: pending() is True from submit on, also while the thread builds the first keys; a
    scheduler that submits whatever is neither answered nor pending submits each request once."""
    gate = StartGate(monkeypatch)
    store = mk.RecordingStore(1)
    batcher = LookupBatcher(engine(store), name="gated")
    hashes = [bytes([i]) * 32 for i in range(8)]
    submits = 0

    def schedule(key):  # the in-scheduler client's step (vllm/scheduler.py)
        nonlocal submits
        got = batcher.poll(key)
        if got is None and not batcher.pending(key):
            batcher.submit(key, 128, hashes)
            submits += 1
        return got

    try:
        assert schedule("a") is None
        assert gate.entered.wait(10)
        for _ in range(20):
            assert schedule("a") is None and batcher.pending("a")
        gate.release.set()
        deadline = time.monotonic() + 20
        got = None
        while got is None and time.monotonic() < deadline:
            got = schedule("a")
            time.sleep(0.001)
        assert got == engine(mk.RecordingStore(1)).lookup_result(128, hashes)
        assert submits == 1 and batcher.stats.submitted == 1 and batcher.stats.replaced == 0
        assert not batcher.pending("a") and batcher.sizes()["lookups"] == 0
    finally:
        batcher.close()


def test_a_discard_while_the_first_keys_are_built_is_honoured(impl, monkeypatch):
    """M2: discarded while the thread builds its first keys, a lookup asks nothing and leaves no
    answer behind (before the fix it asked the master and its answer stayed for good)."""
    gate = StartGate(monkeypatch)
    store = mk.RecordingStore(1)
    batcher = LookupBatcher(engine(store), name="gated")
    requests = {f"r{n}": [bytes([i, n]) * 16 for i in range(8)] for n in range(16)}
    try:
        for name, hashes in requests.items():
            batcher.submit(name, 128, hashes)
        assert gate.entered.wait(10)
        gone = list(requests)[::2]
        for name in gone:
            batcher.discard(name)  # aborted while being started
        gate.release.set()
        kept = {n: answer_of(batcher, n) for n in list(requests)[1::2]}
        idle(batcher)
        assert all(r.hit_length == 112 for r in kept.values())
        assert batcher.stats.discarded == 8 and batcher.stats.answered == 8
        asked = {k for call in store.calls for k in call}
        builder = engine(mk.RecordingStore())
        assert not asked & {k for n in gone for k in builder.candidate_keys(128, requests[n])}
        assert all(batcher.poll(n) is None and not batcher.pending(n) for n in requests)
        assert batcher.sizes()["lookups"] == 0 and not batcher._lookups
    finally:
        batcher.close()


def test_a_discarded_lookup_leaves_no_answer_whenever_it_is_discarded(impl):
    """Discards at random moments of 400 lookups: none of them is answered later, every other
    one is, and the table ends empty."""
    store = mk.RecordingStore(1)
    batcher = LookupBatcher(engine(store))
    rng = random.Random(7)
    try:
        live, gone = set(), set()
        for i in range(400):
            batcher.submit(i, 64 * 16, [rng.randbytes(32) for _ in range(rng.randint(1, 64))])
            live.add(i)
            if rng.random() < 0.3:
                victim = rng.choice(sorted(live))
                batcher.discard(victim)
                live.discard(victim)
                gone.add(victim)
            if i % 20 == 0:
                time.sleep(0.002)
        got = {i: answer_of(batcher, i) for i in sorted(live)}
        idle(batcher)
        assert len(got) == len(live) and all(batcher.poll(i) is None for i in gone)
        assert batcher.sizes()["lookups"] == 0 and batcher.stats.answered >= len(live)
    finally:
        batcher.close()


def test_forget_answers_restarts_a_lookup_between_its_rounds(impl):
    """M1: a lookup whose first round found the prefix, then the store emptied with force (vLLM's
    reset) and forget_answers(): it starts again and answers 0, not the chunks of its first round."""
    memory = mk.MemoryStore()
    hashes = [bytes([i % 256, i // 256]) * 16 for i in range(600)]
    for k in engine(mk.RecordingStore()).candidate_keys(600 * 16, hashes):
        memory.put(k)
    second_call, release = threading.Event(), threading.Event()

    class Gate(mk.RecordingStore):
        def batch_is_exist(self, keys):
            if self.num_calls == 1:
                second_call.set()
                assert release.wait(10)
            return super().batch_is_exist(keys)

    store = Gate(memory)
    batcher = LookupBatcher(engine(store), lease_s=10.0)
    try:
        batcher.submit("a", 600 * 16 + 1, hashes)
        assert second_call.wait(10)  # round 1 answered every probe present; round 2 in flight
        memory.remove_all(force=True)
        batcher.forget_answers()
        release.set()
        assert answer_of(batcher, "a") == mk.LookupResult(0, ())
        assert batcher.stats.restarted == 1
        batcher.submit("b", 600 * 16 + 1, hashes)  # nothing of before is reused either
        assert answer_of(batcher, "b") == mk.LookupResult(0, ())
    finally:
        release.set()
        batcher.close()


# ---------------------------------------------------------------- on a real master (lease 200 ms)


@pytest.fixture
def holder(clean_mooncake_store):
    return clean_mooncake_store


@pytest.fixture
def lookup_client(mooncake_master):
    store = mk.MooncakeStore.connect(mooncake_master.master_address, lookup_only=True)
    yield store
    store.close()


def store_prefix(holder, keys):
    for k in keys:
        assert holder.put(k, b"kv") == 0, k


@pytest.mark.mooncake
def test_no_reused_answer_after_a_reset_on_a_real_master(impl, holder, lookup_client, mooncake_master):
    """M1 as vLLM's reset does it: remove_all(force=True) right after a hit, then forget_answers;
    the next lookup, well inside the reuse window, answers 0 from the master itself, and so does
    a lookup answered before the reset whose answer was not yet taken."""
    hashes = [bytes([i]) * 32 for i in range(32)]
    keys = engine(mk.RecordingStore()).candidate_keys(32 * 16, hashes)
    store_prefix(holder, keys)
    lease_s = mooncake_master.default_kv_lease_ttl / 1000
    batcher = LookupBatcher(engine(lookup_client), lease_s=lease_s)
    try:
        batcher.submit("a", 32 * 16, hashes)
        assert answer_of(batcher, "a").hit_length == 496
        batcher.submit("c", 32 * 16, hashes)
        deadline = time.monotonic() + 10
        while batcher._lookups["c"].state != batch_mod._DONE:  # answered, not yet taken
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert holder.remove_all(force=True) >= len(keys)
        batcher.forget_answers()
        batcher.submit("b", 32 * 16, hashes)
        assert answer_of(batcher, "b").hit_length == 0
        assert answer_of(batcher, "c").hit_length == 0
        assert batcher.stats.restarted == 1
    finally:
        batcher.close()


@pytest.mark.mooncake
def test_answers_are_not_reused_once_the_lease_they_took_can_have_ended(impl, holder, lookup_client,
                                                                       mooncake_master):
    """L1: a key answered present, its lease (200 ms) over, removed without force: the next
    lookup asks the master again (reuse lasts a tenth of the lease) and answers 0."""
    hashes = [bytes([i]) * 32 for i in range(32)]
    keys = engine(mk.RecordingStore()).candidate_keys(32 * 16, hashes)
    store_prefix(holder, keys)
    lease_s = mooncake_master.default_kv_lease_ttl / 1000
    batcher = LookupBatcher(engine(lookup_client), lease_s=lease_s)
    try:
        assert batcher.reuse_s == pytest.approx(lease_s / 10)
        batcher.submit("a", 32 * 16, hashes)
        assert answer_of(batcher, "a").hit_length == 496
        deadline = time.monotonic() + 10
        while holder.remove(keys[0]) != 0:  # refused (-706) while the lookup's lease lasts
            assert time.monotonic() < deadline
            time.sleep(0.01)
        batcher.submit("b", 32 * 16, hashes)
        assert answer_of(batcher, "b").hit_length == 0
        assert batcher.stats.keys_reused == 0
    finally:
        batcher.close()


@pytest.mark.mooncake
def test_a_stream_with_aborts_and_resets_on_a_real_master(impl, holder, lookup_client, mooncake_master):
    """The soak, short (docs/benchmarks.md has the long one): 600 distinct requests sharing 4
    system prompts arrive in bursts; 15 % are aborted while pending; the store is reset (removed
    with force, forget_answers) 4 times while lookups are pending. Every answer equals the
    synchronous lookup's on the store as it is; no request is submitted twice; no answer is left
    behind; every table stays within its bound."""
    rng = random.Random(11)
    systems = [[rng.randbytes(32) for _ in range(rng.randint(24, 64))] for _ in range(4)]
    builder = engine(mk.RecordingStore())
    prompt_keys = [k for s in systems for k in builder.candidate_keys(len(s) * 16, s)]
    lease_s = mooncake_master.default_kv_lease_ttl / 1000
    batcher = LookupBatcher(engine(lookup_client), lease_s=lease_s)
    sync = engine(lookup_client)
    store_prefix(holder, prompt_keys)
    pending, submitted, answered, aborted, resets, compared_hits, most_pending = {}, 0, 0, 0, 0, 0, 0
    most = {}

    def ask(key, hs, abort_p=0.0):
        """The in-scheduler client's step for one waiting request; True once it is answered."""
        nonlocal submitted, answered, aborted, compared_hits
        got = batcher.poll(key)
        if got is None:
            if not batcher.pending(key):
                batcher.submit(key, len(hs) * 16, hs)
                submitted += 1
            if rng.random() < abort_p:  # aborted while pending (vLLM: discard)
                batcher.discard(key)
                aborted += 1
                return True
            return False
        assert got == sync.lookup_result(len(hs) * 16, hs), key  # the store has not changed since it was asked
        compared_hits += got.hit_length > 0
        answered += 1
        return True

    def drain():
        while pending:
            for key, hs in list(pending.items()):
                if ask(key, hs):
                    del pending[key]
            time.sleep(0.001)

    try:
        for i in range(600):
            system = rng.choice(systems)
            own = [rng.randbytes(32) for _ in range(rng.randint(1, 16))]
            hashes = system + own
            pending[i] = hashes
            if i % 3 == 0:  # some of its own part stored before it is asked (no pending lookup needs it)
                mine = builder.candidate_keys(len(hashes) * 16, hashes)[len(system) * 2:]
                store_prefix(holder, mine[: 2 * rng.randrange(len(own) + 1)])
            if i % 150 == 149:  # a reset while lookups are pending (some answered, not yet taken)
                assert holder.remove_all(force=True) >= 0
                batcher.forget_answers()
                resets += 1
            if i % 8 == 7 or i % 150 == 149:  # a scheduler step: every waiting request asked, some aborted
                most_pending = max(most_pending, len(pending))
                for key, hs in list(pending.items()):
                    if ask(key, hs, abort_p=0.15):
                        del pending[key]
                for name, size in batcher.sizes().items():
                    most[name] = max(most.get(name, 0), size)
            if i % 150 == 149:  # everything pending answered on the emptied store, then it is stored again
                drain()
                store_prefix(holder, prompt_keys)
        drain()
        idle(batcher)
        stats = batcher.stats
        assert resets == 4 and aborted > 30 and compared_hits > 100, (resets, aborted, compared_hits)
        assert stats.replaced == 0 and stats.submitted == submitted == answered + aborted  # each submitted once
        assert stats.discarded == aborted
        assert batcher.sizes()["lookups"] == 0  # no answer left behind
        assert most["lookups"] <= most_pending and most["recent_requests"] <= RECENT_REQUESTS
        assert most["distinct_hashes"] <= sum(len(s) for s in systems) + RECENT_REQUESTS * 16
    finally:
        batcher.close()
