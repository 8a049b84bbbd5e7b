"""One rank of the multi-process test (tests/test_multiprocess.py): its own Mooncake client and
KV pool, driven by JSON lines on stdin, answering JSON lines on stdout.

Commands: ``save`` (the first ``chunks`` chunks of a prompt), ``evict`` (remove some of this
rank's keys of a prompt), ``load`` (the first ``tokens`` tokens into other blocks, checking every
byte), ``stop``. A block's bytes are a function of (rank, prompt, chunk), so a load can be
checked without remembering anything.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

LAYOUT = mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2)
GROUPS = [mk.FullAttentionSpec(16)]
BLOCK, MAX_CHUNKS = 128, 16


def content(rank, prompt: int, chunk: int) -> bytes:
    seed = hashlib.sha256(f"{rank}:{prompt}:{chunk}".encode()).digest()
    return (seed * (BLOCK // len(seed) + 1))[:BLOCK]


def main() -> None:
    master, rank = sys.argv[1], tuple(int(x) for x in sys.argv[2].split(","))
    store = MooncakeStore.connect(master, global_segment_size=32 << 20)
    kv = torch.zeros(2 * MAX_CHUNKS, BLOCK, dtype=torch.uint8)  # blocks 0..15 save, 16..31 load
    pool = mk.KVPool("mp-model", GROUPS, LAYOUT, rank=rank, kv_caches=kv, hash_block_size=16, store=store)
    print(json.dumps({"ready": list(pool.writer_namespace)}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        hashes = [bytes.fromhex(h) for h in cmd.get("hashes", ())]
        if op == "save":
            for j in range(cmd["chunks"]):
                kv[j].copy_(torch.frombuffer(bytearray(content(rank, cmd["prompt"], j)), dtype=torch.uint8))
            res = pool.save(cmd["chunks"] * 16, hashes, list(range(MAX_CHUNKS)))
            reply = {"ok": res.ok, "stored": res.stored}
        elif op == "evict":
            rng = random.Random(cmd["seed"])
            chunks = [j for j in range(len(hashes)) if rng.random() < cmd["fraction"]]
            keys = [mk.PoolKey.build_key_string(pool.writer_prefixes[0], hashes[j].hex()) for j in chunks]
            removed = [store.remove(k, force=True) for k in keys]
            reply = {"evicted": chunks, "codes": removed}
        elif op == "load":
            tokens = cmd["tokens"]
            kv[MAX_CHUNKS:].zero_()
            res = pool.load(tokens, hashes, list(range(MAX_CHUNKS, 2 * MAX_CHUNKS)))
            same = all(bytes(kv[MAX_CHUNKS + j].tolist()) == content(rank, cmd["prompt"], j) for j in range(tokens // 16))
            reply = {"ok": res.ok, "loaded_tokens": res.loaded_tokens, "bytes_ok": same,
                     "failed": [list(f) for f in res.failed]}
        elif op == "stop":
            break
        else:
            reply = {"error": f"unknown op {op!r}"}
        print(json.dumps(reply), flush=True)
    pool.close()
    store.close()
    print(json.dumps({"stopped": True}), flush=True)


if __name__ == "__main__":
    main()
