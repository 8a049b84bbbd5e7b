"""Lookups through an etcd stall (run by tests/test_mooncake_probe.py in its own process).

etcd + one HA master (LocalCluster); a data client given ``etcd://`` saves a prompt; three
engines look it up every 20 ms: through that client, through a lookup-only client given
``etcd://``, and through a client given the leader's address. etcd is SIGSTOPped for 1 s, then
for 2 s; each lookup's answer is counted from the stall's start until 1 s after its end. Printed
as JSON: per stall and client, ``[lookups, full hits]``.

The process ends with ``os._exit``: closing a client set up with ``etcd://`` waits out the
client's 30 s etcd watch (docs/mooncake.md); the cluster is stopped first.
"""

from __future__ import annotations

import json
import os
import time

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.local_cluster import LocalCluster  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

HASHES = [bytes([i]) * 32 for i in range(1, 9)]
TOKENS = 8 * 16 + 1


def engine(store):
    return mk.LookupEngine("stall-model", [mk.FullAttentionSpec(16)], mk.ParallelLayout(), hash_block_size=16,
                           store=store)


def main() -> None:
    out: dict = {"stalls": {}}
    cluster = LocalCluster(masters=1).start()
    try:
        data = MooncakeStore.connect(cluster.master_address)
        for key in engine(data).candidate_keys(TOKENS, HASHES):
            assert data.put(key, b"kv") == 0
        stores = {"data etcd://": data,
                  "lookup-only etcd://": MooncakeStore.connect(cluster.master_address, lookup_only=True),
                  "lookup-only direct": MooncakeStore.connect(cluster.wait_leader().master_address, lookup_only=True)}
        engines = {name: engine(store) for name, store in stores.items()}
        full = {name: e.lookup(TOKENS, HASHES) for name, e in engines.items()}
        assert set(full.values()) == {128}, full
        for stall in (1.0, 2.0):
            counts = {name: [0, 0] for name in engines}
            cluster.pause_etcd()
            start = time.monotonic()
            try:
                while time.monotonic() - start < stall + 1.0:
                    if time.monotonic() - start >= stall:
                        cluster.resume_etcd()
                    for name, e in engines.items():
                        counts[name][0] += 1
                        counts[name][1] += e.lookup(TOKENS, HASHES) == 128
                    time.sleep(0.02)
            finally:
                cluster.resume_etcd()
            out["stalls"][f"{stall:g} s"] = counts
            time.sleep(1.0)
        print(json.dumps(out), flush=True)
    finally:
        cluster.stop()
    os._exit(0)


if __name__ == "__main__":
    main()
