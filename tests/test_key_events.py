"""Key events, so a miss asks nothing: the mirror of one deployment's keys, kept from a real
Mooncake 0.3.14 master's events (the installed 0.3.13.post1 client saves and asks), both cores.

A miss is answered with no master call; a hit with one call of exactly the keys it loads
(verified, and leased); anything that can make the mirror wrong (a restart, lost events, a
failover, events off, too many keys) drops it, and lookups ask the master meanwhile; a key
evicted without an event is found gone by that verify call and forgotten."""

from __future__ import annotations

import hashlib
import struct
import time

import pytest

import mooncake_keys as mk

pytest.importorskip("mooncake.store")
pytest.importorskip("zmq")
pytestmark = pytest.mark.mooncake

from mooncake_keys.events import EventSource, KeyMirror  # noqa: E402
from mooncake_keys.events.mirror import sources_of  # noqa: E402
from mooncake_keys.events.wire import REMOVED, STORED, WireError, decode  # noqa: E402
from mooncake_keys.store.local_master import LocalMaster, http_json  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore, MooncakeStoreUnavailable  # noqa: E402
from support.batching import burst  # noqa: E402
from support.mooncake_fixtures import INSTALLED, NEWEST, master_executable  # noqa: E402

F = mk.FullAttentionSpec
LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
N = 512  # chunks of 16 tokens: 1,024 keys


def hashes_of(tag: str, n: int = N) -> list:
    return [f"{tag}-{i:05d}".encode().ljust(16, b".") for i in range(n)]


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def answered(call):
    """The call's answer, or None while the store is unavailable."""
    try:
        return call()
    except MooncakeStoreUnavailable:
        return None


def source(master: LocalMaster) -> dict:
    return {"endpoint": master.events_endpoint, "http": master.http_address}


def engine(store, model, events, **kw):
    return mk.LookupEngine(model, [F(16)], LAYOUT, hash_block_size=16, store=store, key_events=events,
                           key_cache_bytes=0, **kw)


def oneshot(store, model):
    return mk.LookupEngine(model, [F(16)], LAYOUT, hash_block_size=16, store=store, strategy="oneshot")


def put(store, keys):
    for k in keys:
        assert store.put(k, b"kv") == 0, k


# ------------------------------------------------------------------ the wire and the arguments
def test_the_wire_format_is_read_and_anything_else_refused():
    import msgpack

    payload = msgpack.packb([1, [{"event_type": "stored", "object_key": "a"}, {"type": "BlockRemoved",
                                                                                 "object_key": "b"},
                                 {"event_type": "stored"}, "odd"], 0])
    assert decode([b"", struct.pack(">Q", 7), payload], msgpack.unpackb) == (7, [(STORED, "a"), (REMOVED, "b")])
    for frames in ([b"", b"\x00" * 7, payload], [b"", struct.pack(">Q", 1)], [b"", struct.pack(">Q", 1), b"\xc1"],
                   [b"", struct.pack(">Q", 1), msgpack.packb({"a": 1})]):
        with pytest.raises(WireError):
            decode(frames, msgpack.unpackb)


def test_where_to_read_events_is_checked_and_named():
    assert sources_of({"endpoint": "tcp://h:1", "http": "http://h:2"}) == (EventSource("tcp://h:1", "http://h:2"),)
    with pytest.raises(ValueError, match="key_events endpoint"):
        sources_of({"endpoint": "h:1", "http": "http://h:2"})
    with pytest.raises(ValueError, match="exactly the keys"):
        sources_of({"endpoint": "tcp://h:1"})
    with pytest.raises(TypeError, match="key_events must be"):
        sources_of("tcp://h:1")
    with pytest.raises(ValueError, match="at least one master"):
        sources_of([])
    with pytest.raises(ValueError, match="strategy 'rounds'"):
        mk.LookupEngine("m", [F(16)], LAYOUT, hash_block_size=16, store=mk.RecordingStore(), strategy="oneshot",
                        key_events={"endpoint": "tcp://127.0.0.1:1", "http": "http://127.0.0.1:1"})


def test_where_rounds_are_not_exact_the_events_are_not_used_and_it_says_so(caplog):
    with caplog.at_level("WARNING", "mooncake_keys.lookup"):
        e = mk.LookupEngine("m", [F(32)], LAYOUT, hash_block_size=16, store=mk.RecordingStore(),
                            partial_hash_hits=True, key_events={"endpoint": "tcp://127.0.0.1:1",
                                                                "http": "http://127.0.0.1:1"})
    assert e.strategy == "oneshot" and e.mirror is None
    assert any("key_events is not used" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ on the session's 0.3.14 master
def test_a_miss_asks_nothing_a_hit_asks_its_own_keys_once_and_they_are_leased(impl, newest_master, newest_store):
    model = f"events-{impl.__name__[-1]}"
    recorded = mk.RecordingStore(newest_store)
    e = engine(recorded, model, source(newest_master))
    try:
        wait_for(lambda: e.mirror.ready, what="the mirror")
        hashes = hashes_of(model)
        tokens = N * 16 + 1
        assert e.lookup(tokens, hashes) == 0
        assert recorded.num_calls == 0 and e.stats().answered_without_call == 1
        keys = e.candidate_keys(N * 16, hashes)
        put(newest_store, keys[:300 * 2])
        wait_for(lambda: e.mirror.stats().keys == 600, what="600 keys mirrored")
        assert e.lookup(tokens, hashes) == 300 * 16
        assert recorded.calls == [keys[:300 * 2]]  # one call: exactly the keys the hit loads
        assert newest_store.remove(keys[0]) == -706  # and they are leased
        assert e.stats().leased_keys == 600
        # Another deployment's keys are not kept (but counted as messages).
        before = e.mirror.stats()
        other = engine(mk.RecordingStore(), model + "-other", None).candidate_keys(64 * 16, hashes_of("other", 64))
        put(newest_store, other)
        published = http_json(newest_master.http_address + "/kv_events/status")["published_batches"]
        wait_for(lambda: e.mirror.stats().events_seen >= before.events_seen + len(other), 30,
                 what=f"the other keys' events ({before}, {e.mirror.stats()}, {published} published)")
        assert e.mirror.stats().keys == 600 and e.mirror.stats().events == before.events
        assert e.mirror.stats().messages > before.messages  # (a batch of puts can come in fewer messages)
    finally:
        e.close()


class LeaseFree(mk.RecordingStore):
    """The store double's Mooncake 0.3.14 mode over the real master (lease-free probes; the real
    0.3.14 client: tests/test_mooncake_newest.py); ``before_lease`` runs before the first
    LastHitOnly call."""

    def __init__(self, store, before_lease=None):
        super().__init__(store, leases=True)
        self.before_lease = before_lease

    def batch_probe_key(self, keys, policy="none", candidate_size=1):
        if policy == "LastHitOnly" and self.before_lease is not None:
            hook, self.before_lease = self.before_lease, None
            hook()
        return super().batch_probe_key(keys, policy, candidate_size)


def digests(tag: str, n: int) -> list:
    """``n`` hashes of 16 bytes, whatever the length of ``tag``."""
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).digest() for i in range(n)]


def burst_of(batcher, requests, seconds=20.0):
    """Every request submitted in one batch, each answered: its hit length (tokens)."""
    return {name: got.hit_length for name, got in burst(batcher, requests, seconds=seconds).items()}


def test_a_bursts_hits_are_verified_and_leased_by_one_call_with_lease_free_probes(impl, newest_master,
                                                                                   newest_store):
    """Through a LookupBatcher, with a 0.3.14 client's lease calls: the mirror answers every
    round and the burst's hits are verified and leased by ONE LastHitOnly call, the union of
    their keys (before: one call per hit). A key removed right before that call: only the lookup
    whose hit needed it looks again (what that call found is the master's answer: its shorter hit
    is decided, and leased by its own call), the others are leased by one more call of their
    union."""
    from mooncake_keys.lookup.batch import LookupBatcher

    model = f"events-burst-{impl.__name__[-1]}"
    store = LeaseFree(newest_store)
    e = engine(store, model, source(newest_master))
    batcher = LookupBatcher(e)
    try:
        wait_for(lambda: e.mirror.ready, what="the mirror")
        system = digests(model + "-system", 64)
        requests = {r: system + digests(f"{model}-own{r}", 32) for r in range(8)}
        shared = e.candidate_keys(64 * 16, system)
        put(newest_store, shared)
        wait_for(lambda: e.mirror.stats().keys == len(shared), what="the shared prompt mirrored")
        assert burst_of(batcher, requests) == {r: 64 * 16 for r in requests}
        assert store.probe_calls == ["LastHitOnly"] and store.calls == [shared]  # 128 keys, not 8 x 128
        assert store.leased == [shared] and batcher.stats.lease_calls == 1

        # Every request's whole prompt stored; one key of request 3's own part removed right
        # before the lease call (the mirror took it for present).
        requests = {r: digests(f"{model}-2-system", 64) + digests(f"{model}-2-own{r}", 32) for r in range(8)}
        keys = {r: e.candidate_keys(96 * 16, h) for r, h in requests.items()}
        for r in requests:
            put(newest_store, keys[r][128:] if r else keys[r])
        wait_for(lambda: e.mirror.stats().keys == len(shared) + 128 + 8 * 64, what="the prompts mirrored")
        gone = keys[3][70 * 2 + 1]
        store.before_lease = lambda: newest_store.remove(gone)
        store.calls.clear(), store.probe_calls.clear(), store.leased.clear()
        got = burst_of(batcher, requests)
        assert got == {r: 70 * 16 if r == 3 else 96 * 16 for r in requests}
        assert got[3] == oneshot(newest_store, model).lookup(96 * 16 + 1, requests[3])
        leases = [(c, l) for c, p, l in zip(store.calls, store.probe_calls, store.leased) if p == "LastHitOnly"]
        assert gone in leases[0][0] and leases[0][1] == []  # the union of all 8: nothing leased
        assert set(leases[1][0]) == {k for r in requests if r != 3 for k in keys[r]} and leases[1][1] == leases[1][0]
        assert leases[-1][0] == keys[3][:70 * 2] == leases[-1][1]  # request 3's shorter hit, leased
        assert len(leases) == 3 and batcher.stats.lease_calls == 4
    finally:
        batcher.close()
        e.close()


def test_a_key_evicted_without_an_event_is_found_by_the_verify_call_and_forgotten(impl, tmp_path):
    """A full segment evicts (Mooncake publishes nothing): the mirror still holds the keys, the
    verify call finds them gone, the lookup answers as the master's one-shot does, and the
    mirror forgets them (the next lookup trusts no stale key)."""
    with LocalMaster(executable=master_executable(NEWEST), kv_events=True, log_path=tmp_path / "m.log") as master:
        store = MooncakeStore.connect(master.master_address, global_segment_size=16 << 20)
        recorded = mk.RecordingStore(store)
        e = engine(recorded, "evicted", source(master))
        try:
            wait_for(lambda: e.mirror.ready, what="the mirror")
            hashes = hashes_of("evicted")
            keys = e.candidate_keys(N * 16, hashes)
            big = b"x" * (900 << 10)
            for k in keys[:12]:
                assert store.put(k, big) == 0
            # 6 chunks of 2 namespaces, 10.8 MB of the 16 MB segment
            wait_for(lambda: e.mirror.stats().keys == 12, what="their events")
            def gone():  # asked over HTTP: no lease, no LRU touch (batch_is_exist would keep a key)
                data = http_json(f"{master.http_address}/batch_query_keys?keys={','.join(keys[:12])}")["data"]
                return [k for k in keys[:12] if not data[k]["ok"]]

            for i in range(80):  # then another deployment's keys: the segment fills and evicts
                store.put(f"filler-{i}", big)
                if i >= 6 and gone():
                    break
            assert gone(), "nothing of ours was evicted"
            assert e.mirror.stats().keys == 12  # the mirror holds keys that are gone
            want = oneshot(store, "evicted").lookup(N * 16 + 1, hashes)
            assert e.lookup(N * 16 + 1, hashes) == want
            assert e.stats().lease_misses >= 1 and e.mirror.stats().forgotten >= 1
            calls = recorded.num_calls
            assert e.lookup(N * 16 + 1, hashes) == want
            if want == 0:  # the first chunk is gone, and forgotten: a miss that asks nothing
                assert recorded.num_calls == calls
        finally:
            e.close()
            store.close()


# ------------------------------------------------------------------ masters of their own
def test_a_restart_drops_the_mirror_rounds_answer_meanwhile_and_it_is_built_again(impl, tmp_path):
    exe = master_executable(NEWEST)
    with LocalMaster(executable=exe, kv_events=True, log_path=tmp_path / "m.log") as master:
        store = MooncakeStore.connect(master.master_address)
        e = engine(store, "restart", source(master))
        try:
            wait_for(lambda: e.mirror.ready, what="the mirror")
            hashes = hashes_of("restart")
            keys = e.candidate_keys(N * 16, hashes)
            put(store, keys[:100 * 2])
            wait_for(lambda: e.mirror.stats().keys == 200, what="keys mirrored")
            assert e.lookup(N * 16 + 1, hashes) == 100 * 16
            master.restart()  # the master is in memory: every key is gone
            wait_for(lambda: store.health_check() == 0, 15, "the client back")
            wait_for(lambda: e.mirror.stats().rebuilds >= 2 and e.mirror.ready, 15, "the mirror built again")
            stats = e.mirror.stats()
            assert stats.gaps >= 1 and stats.keys == 0
            assert e.lookup(N * 16 + 1, hashes) == 0
            wait_for(lambda: answered(lambda: store.put(keys[0], b"kv")) in (0, -705), 5, "puts again")
            put(store, keys[1:50 * 2])
            wait_for(lambda: e.mirror.stats().keys == 100, what="new keys mirrored")
            assert e.lookup(N * 16 + 1, hashes) == 50 * 16
        finally:
            e.close()
            store.close()


def test_events_lost_at_the_master_drop_the_mirror(impl, tmp_path):
    """A master whose event queue overflows drops events before they are numbered (no gap is
    seen): its own count of dropped events makes the mirror be built again."""
    exe = master_executable(NEWEST)
    with LocalMaster(executable=exe, kv_events=True, log_path=tmp_path / "m.log",
                     extra_args=["--kv_events_queue_capacity=1"]) as master:
        store = MooncakeStore.connect(master.master_address)
        e = engine(store, "lost", source(master))
        try:
            wait_for(lambda: e.mirror.ready, what="the mirror")
            keys = e.candidate_keys(N * 16, hashes_of("lost"))
            assert store.client.put_batch(keys, [b"kv"] * len(keys)) == 0  # 1,024 events at once
            status = http_json(master.http_address + "/kv_events/status")
            if not status["dropped_events"]:
                pytest.skip("the master dropped no event this time")
            wait_for(lambda: e.mirror.stats().gaps >= 1, 10, "the mirror dropped")
            wait_for(lambda: e.mirror.ready, 10, "built again")
            assert e.mirror.stats().keys == len(keys)  # the snapshot has them all
            assert e.lookup(N * 16 + 1, hashes_of("lost")) == N * 16
        finally:
            e.close()
            store.close()


def test_events_off_means_lookups_ask_the_master(impl, tmp_path):
    """0.3.13.post1's master accepts the flags and publishes nothing: the mirror says so, and
    every lookup is answered in rounds by the master, as without events."""
    with LocalMaster(kv_events=True, executable=master_executable(INSTALLED), log_path=tmp_path / "m.log") as master:
        store = MooncakeStore.connect(master.master_address)
        e = engine(store, "off", source(master))
        try:
            wait_for(lambda: e.mirror.stats().state == "events off", what="events off")
            keys = e.candidate_keys(N * 16, hashes_of("off"))
            put(store, keys[:10 * 2])
            assert e.lookup(N * 16 + 1, hashes_of("off")) == 10 * 16
            assert e.stats().store_calls >= 1 and e.stats().mirror_keys == 0
            assert "--enable_kv_events" in e.mirror.stats().reason
        finally:
            e.close()
            store.close()


def test_more_keys_than_max_keys_turn_the_mirror_off(impl, newest_master, newest_store):
    model = f"capacity-{impl.__name__[-1]}"
    recorded = mk.RecordingStore(newest_store)
    dep = mk.LookupEngine(model, [F(16)], LAYOUT, hash_block_size=16, store=recorded)
    mirror = KeyMirror(source(newest_master), prefixes=[p for ps in dep.prefixes for p in ps], max_keys=50)
    e = engine(recorded, model, mirror)
    try:
        wait_for(lambda: mirror.ready, what="the mirror")
        keys = e.candidate_keys(N * 16, hashes_of(model))
        put(newest_store, keys[:40 * 2])
        wait_for(lambda: mirror.stats().state == "over capacity", what="over capacity")
        assert not mirror.ready and "max_keys" in mirror.stats().reason
        assert e.lookup(N * 16 + 1, hashes_of(model)) == 40 * 16  # from the master
        assert recorded.num_calls >= 1
    finally:
        mirror.close()
        newest_store.remove_all(force=True)


# A failover (the leader killed, the standby serving): tests/test_failover.py's 0.3.14 run.


def test_the_mirror_is_on_the_librarys_metrics(impl, newest_master, newest_store):
    prom = pytest.importorskip("prometheus_client")
    from mooncake_keys.metrics import LookupMetrics

    registry = prom.CollectorRegistry()
    model = f"metrics-{impl.__name__[-1]}"
    e = engine(newest_store, model, source(newest_master))
    LookupMetrics(e, registry=registry, labels={"deployment": model})
    try:
        wait_for(lambda: e.mirror.ready, what="the mirror")
        hashes = hashes_of(model)
        keys = e.candidate_keys(N * 16, hashes)
        put(newest_store, keys[:10 * 2])
        wait_for(lambda: e.mirror.stats().keys == 20, what="keys mirrored")
        assert e.lookup(N * 16 + 1, hashes) == 10 * 16
        assert e.lookup(N * 16 + 1, hashes_of(model + "-miss")) == 0

        def value(name):
            return registry.get_sample_value(name, {"deployment": model}) or 0.0

        assert value("mooncake_keys_lookups_without_call_total") == 1
        assert value("mooncake_keys_lookup_leased_keys_total") == 20
        assert value("mooncake_keys_key_mirror_keys") == 20
        assert value("mooncake_keys_key_mirror_complete") == 1
        assert value("mooncake_keys_key_events_total") == 20
        assert value("mooncake_keys_key_event_messages_total") >= 20
        assert value("mooncake_keys_key_mirror_rebuilds_total") == 1
        assert value("mooncake_keys_key_event_gaps_total") == 0
        assert value("mooncake_keys_lookup_mirror_keys_total") == e.stats().mirror_keys > 0
    finally:
        e.close()
        newest_store.remove_all(force=True)
