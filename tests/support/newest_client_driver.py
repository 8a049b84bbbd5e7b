"""Mooncake 0.3.14's own client, end to end (run by tests/test_mooncake_newest.py in a child
process whose path puts the unpacked 0.3.14 wheel first: tests/support/no_device_driver.py).

Against a 0.3.14 master: ``lease_probes()`` is found true, lookups in rounds ask
``batch_probe_key`` and lease exactly the keys their hit loads (checked key by key: a removal
right after the lookup is refused, -706, exactly for those); with key events on, a miss asks
nothing and a hit is verified in its one lease call. Then a burst through a ``LookupBatcher``:
its hits leased by one ``LastHitOnly`` call of the union of their keys, and, with a key of one
request removed right before that call, that request's shorter hit and the others' leased by
one more call (checked key by key too). Against a 0.3.13.post1 master the same client is found
without probes (-900 for every key) and asks ``batch_is_exist``. Printed as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import mooncake  # noqa: E402

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.local_master import LocalMaster, master_version  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

F = mk.FullAttentionSpec
LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
N = 1024
HASHES = [f"newest-{i:05d}".encode().ljust(16, b".") for i in range(N)]


def leases(store: MooncakeStore, keys: list) -> list:
    """Which of ``keys`` hold a read lease now (a removal is refused: -706); the others are removed."""
    return [k for k in keys if store.remove(k) == -706]


class RemovedAtTheLease(mk.RecordingStore):
    """The recorded store, removing ``gone`` from the master right before the first LastHitOnly
    call (an eviction between the rounds and the lease)."""

    gone = None

    def batch_probe_key(self, keys, policy="none", candidate_size=1):
        if policy == "LastHitOnly" and self.gone is not None:
            gone, self.gone = self.gone, None
            assert self.answer.remove(gone) == 0, gone  # not leased by the rounds' probes
        return super().batch_probe_key(keys, policy, candidate_size)


def submit_all(batcher, requests: dict) -> dict:
    with batcher._cond:  # one batch: the thread takes them all at once (the lock is reentrant)
        for r, hashes in requests.items():
            batcher.submit(r, len(hashes) * 16 + 1, hashes)
    out: dict = {}
    deadline = time.monotonic() + 30
    while len(out) < len(requests) and time.monotonic() < deadline:
        for r in requests:
            if r not in out and (got := batcher.poll(r)) is not None:
                out[r] = got.hit_length
        time.sleep(0.001)
    return out


def burst(store: MooncakeStore, engine, events: bool) -> dict:
    """8 requests sharing a stored 200-chunk prompt through a LookupBatcher; then 8 whose whole
    prompts are stored, one key of request 3's own part (chunk 210) removed right before the
    first lease call."""
    from mooncake_keys.lookup.batch import LookupBatcher

    recorded = RemovedAtTheLease(store)
    engine.store = recorded
    out: dict = {}
    batcher = LookupBatcher(engine)
    try:
        system = [f"bsys-{i:05d}".encode().ljust(16, b".") for i in range(200)]
        requests = {r: system + [f"bown{r}-{i:04d}".encode().ljust(16, b".") for i in range(32)] for r in range(8)}
        shared = engine.candidate_keys(200 * 16, system)
        for k in shared:
            assert store.put(k, b"kv") == 0, k
        if events:
            wait(lambda: engine.mirror.stats().keys >= len(shared))
        out["hits"] = submit_all(batcher, requests)
        out["lease_calls"] = [len(c) for c, p in zip(recorded.calls, recorded.probe_calls) if p == "LastHitOnly"]
        out["calls"], out["keys_asked"] = recorded.num_calls, recorded.keys_asked
        out["leased_are_the_shared_prompt"] = leases(store, shared) == shared

        system = [f"bsys2-{i:05d}".encode().ljust(16, b".") for i in range(200)]
        requests = {r: system + [f"bown2{r}-{i:04d}".encode().ljust(16, b".") for i in range(32)] for r in range(8)}
        keys = {r: engine.candidate_keys(232 * 16, h) for r, h in requests.items()}
        stored = list(dict.fromkeys(k for r in requests for k in keys[r]))
        for k in stored:
            assert store.put(k, b"kv") == 0, k
        if events:
            wait(lambda: engine.mirror.stats().keys >= len(shared) + len(stored))
        recorded.calls.clear(), recorded.probe_calls.clear(), recorded.leased.clear()
        gone = keys[3][210 * 2 + 1]
        probes = store.lease_probes()  # a 0.3.13.post1 master: batch_is_exist, no lease call to remove it at
        recorded.gone = gone if probes else None
        out["gone_hits"] = submit_all(batcher, requests)
        out["gone_lease_calls"] = [len(c) for c, p in zip(recorded.calls, recorded.probe_calls) if p == "LastHitOnly"]
        want = {k for r, hit in out["gone_hits"].items() for k in keys[r][:hit // 16 * 2]}
        left = [k for k in stored if not (probes and k == gone)]
        out["gone_leased_are_the_hits"] = set(leases(store, left)) == want
        out["batch_stats"] = batcher.stats.as_dict()
    finally:
        batcher.close()
    return out


def wait(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)


def run(master_exe: str, events: bool) -> dict:
    out: dict = {"master": master_version(master_exe)}
    with LocalMaster(executable=master_exe, default_kv_lease_ttl=10_000, kv_events=events) as master:
        store = MooncakeStore.connect(master.master_address)
        recorded = mk.RecordingStore(store)
        kw = {"key_events": {"endpoint": master.events_endpoint, "http": master.http_address}} if events else {}
        engine = mk.LookupEngine("newest", [F(16)], LAYOUT, hash_block_size=16, store=recorded, key_cache_bytes=0, **kw)
        try:
            out["lease_probes"] = store.lease_probes()
            keys = engine.candidate_keys(N * 16, HASHES)
            stored = keys[:300 * 2] + keys[310 * 2:400 * 2]  # a prefix, a hole, more behind it
            for k in stored:
                assert store.put(k, b"kv") == 0, k
            if events:
                deadline = time.monotonic() + 10
                while engine.mirror.stats().keys < len(stored) and time.monotonic() < deadline:
                    time.sleep(0.01)
                miss = [f"miss-{i:05d}".encode().ljust(16, b".") for i in range(N)]
                out["miss"] = engine.lookup(N * 16 + 1, miss)
                out["miss_calls"] = recorded.num_calls
            recorded.calls.clear()
            calls_before = recorded.num_calls
            out["hit"] = engine.lookup(N * 16 + 1, HASHES)
            out["calls"] = recorded.num_calls - calls_before
            out["keys_asked"] = sum(map(len, recorded.calls))
            out["last_call_is_the_hit"] = recorded.calls[-1] == keys[:300 * 2] if recorded.calls else False
            leased = leases(store, stored)
            out["leased"] = len(leased)
            out["leased_are_the_hit"] = leased == keys[:300 * 2]
            out["stats"] = engine.stats().__dict__
            out["mirror"] = engine.mirror.stats().__dict__ if engine.mirror is not None else None
            out["burst"] = burst(store, engine, events)
        finally:
            engine.close()
            store.close()
    return out


def main() -> None:
    newest, installed = sys.argv[1], sys.argv[2]
    out = {"client": mooncake.__file__, "version": getattr(mooncake, "__version__", "")}
    out["newest"] = run(newest, events=False)
    out["newest_events"] = run(newest, events=True)
    out["installed"] = run(installed, events=False)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
