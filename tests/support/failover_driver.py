"""A Mooncake master failover, end to end (run by tests/test_failover.py in its own process).

etcd + two HA masters with an oplog (LocalCluster); two ranks (TP 2) save prompts through one
client holding a segment (``etcd://``); two lookup engines ask, one through that client, one
through a lookup-only client (which follows the leader itself). The leader is SIGKILLed while
both engines keep looking up every 20 ms. Printed as JSON: the latency of every lookup during
the failover, when hits came back, and whether every prompt saved before still hits in full,
loads byte-identical, and new saves work. With ``MK_KEY_EVENTS=1`` every master is started to
publish its key events (0.3.14's do; 0.3.13.post1's accept the flags and publish nothing) and a
third engine answers from a key-event mirror of both: dropped at the failover, built again from
the new leader.

The process ends with ``os._exit``: closing a client set up with ``etcd://`` waits out the
client's 30 s etcd watch (docs/mooncake.md), and nothing here needs a clean close.
"""

from __future__ import annotations

import json
import logging
import os
import random
import sys
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.local_cluster import LocalCluster  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

LAYOUT = mk.ParallelLayout(tp_size=2, num_kv_heads=2)
GROUPS = [mk.FullAttentionSpec(16)]
PROMPTS, CHUNKS, BLOCK = 12, 8, 256  # prompts, chunks (16 tokens) per prompt, bytes per block


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    records = Records()
    logging.getLogger("mooncake_keys").addHandler(records)
    rng = random.Random(7)
    out: dict = {}
    # The masters' binary: MK_MASTER_EXECUTABLE (tests/test_failover.py runs each release's).
    events = os.environ.get("MK_KEY_EVENTS") == "1"
    with LocalCluster(masters=2, executable=os.environ.get("MK_MASTER_EXECUTABLE") or None, kv_events=events) as cluster:
        holder = MooncakeStore.connect(cluster.master_address, global_segment_size=64 << 20)
        lookup_only = MooncakeStore.connect(cluster.master_address, lookup_only=True)
        kv = [torch.tensor(list(rng.randbytes(PROMPTS * CHUNKS * BLOCK)), dtype=torch.uint8).reshape(-1, BLOCK)
              for _ in range(2)]
        pools = [mk.KVPool("ha-model", GROUPS, LAYOUT, rank=(tp, 0, 0, 0), kv_caches=kv[tp], hash_block_size=16,
                           store=holder) for tp in range(2)]
        engines = {name: mk.LookupEngine("ha-model", GROUPS, LAYOUT, hash_block_size=16, store=store)
                   for name, store in (("holder", holder), ("lookup_only", lookup_only))}
        if events:
            sources = [{"endpoint": m.events_endpoint, "http": m.http_address} for m in cluster.masters]
            engines["mirror"] = mk.LookupEngine("ha-model", GROUPS, LAYOUT, hash_block_size=16, store=lookup_only,
                                                key_events=sources)
            deadline = time.monotonic() + 15
            mirror = engines["mirror"].mirror
            while not mirror.ready and mirror.stats().state != "events off" and time.monotonic() < deadline:
                time.sleep(0.01)
        prompts = [[rng.randbytes(32) for _ in range(CHUNKS)] for _ in range(PROMPTS)]
        tokens = CHUNKS * 16
        for i, hashes in enumerate(prompts):
            for pool in pools:
                res = pool.save(tokens, hashes, list(range(i * CHUNKS, (i + 1) * CHUNKS)))
                assert res.ok, res
        full = tokens + 1  # num_tokens one past the prefix: a full hit is not shortened
        if events:  # the mirror has every saved key before the lookups start
            want = PROMPTS * CHUNKS * 2
            deadline = time.monotonic() + 10
            while engines["mirror"].mirror.ready and engines["mirror"].mirror.stats().keys < want \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            out["mirror_before"] = engines["mirror"].mirror.stats().__dict__
            out["mirror_calls_before"] = engines["mirror"].stats().store_calls
        out["before"] = {n: [e.lookup(full, h) for h in prompts] for n, e in engines.items()}

        leader = cluster.kill_leader()
        t0 = time.monotonic()
        samples = {n: [] for n in engines}
        recovered = {n: None for n in engines}
        while time.monotonic() - t0 < 45 and not all(recovered.values()):
            for name, engine in engines.items():
                hashes = prompts[rng.randrange(PROMPTS)]
                start = time.monotonic()
                hit = engine.lookup(full, hashes)
                samples[name].append((round(start - t0, 3), round(time.monotonic() - start, 4), hit))
                if recovered[name] is None and hit == tokens and all(engine.lookup(full, h) == tokens for h in prompts):
                    recovered[name] = round(time.monotonic() - t0, 3)
            time.sleep(0.02)
        out["killed_leader_pid"] = leader.pid
        out["new_leader_serving"] = cluster.leader() is not None
        out["recovered_s"] = recovered
        out["worst_call_s"] = {n: max(s[1] for s in v) for n, v in samples.items()}
        out["calls"] = {n: len(v) for n, v in samples.items()}
        out["zero_answers"] = {n: sum(1 for s in v if s[2] == 0) for n, v in samples.items()}
        out["samples"] = samples
        out["after"] = {n: [e.lookup(full, h) for h in prompts] for n, e in engines.items()}
        # Every rank loads every prompt into fresh memory: the bytes must be the ones it saved.
        checks = []
        for tp in range(2):
            fresh = torch.zeros_like(kv[tp])
            with mk.KVPool("ha-model", GROUPS, LAYOUT, rank=(tp, 0, 0, 0), kv_caches=fresh, hash_block_size=16,
                           store=holder) as reader:
                for i, hashes in enumerate(prompts):
                    ids = list(range(i * CHUNKS, (i + 1) * CHUNKS))
                    res = reader.load(tokens, hashes, ids)
                    checks.append(res.ok and res.loaded_tokens == tokens
                                  and torch.equal(fresh[ids[0]:ids[-1] + 1], kv[tp][ids[0]:ids[-1] + 1]))
        out["loads_byte_identical"] = all(checks) and len(checks) == 2 * PROMPTS
        new = [rng.randbytes(32) for _ in range(CHUNKS)]
        saves = [pool.save(tokens, new, list(range(CHUNKS))) for pool in pools]
        out["saves_after"] = all(r.ok and r.stored == r.asked for r in saves)
        if events:  # the new keys' events reach the mirror a moment after the saves
            deadline = time.monotonic() + 5
            while engines["mirror"].lookup(full, new) != tokens and time.monotonic() < deadline:
                time.sleep(0.02)
            # The mirror looks for the serving leader again once a second: on a loaded machine its
            # next look may come after the saves. Wait for it to settle (complete, or events off).
            deadline = time.monotonic() + 30
            while engines["mirror"].mirror.stats().state in ("no leader", "building") \
                    and time.monotonic() < deadline:
                time.sleep(0.05)
            out["mirror_after"] = engines["mirror"].mirror.stats().__dict__
            misses = [rng.randbytes(32) for _ in range(CHUNKS)]
            calls = engines["mirror"].stats().store_calls
            out["mirror_miss_calls"] = (engines["mirror"].lookup(full, misses), engines["mirror"].stats().store_calls - calls)
        out["new_prompt_hit"] = {n: e.lookup(full, new) for n, e in engines.items()}
        out["log_lines"] = records.lines[:20]
        out["log_line_count"] = len(records.lines)
        print(json.dumps(out), flush=True)
        for pool in pools:
            pool.close()
        lookup_only.close()
        sys.stdout.flush()
        cluster.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
