"""The real deployment shape: four rank processes (TP 2 x PP 2), each with its own Mooncake
client saving its own namespace, and a scheduler (this process) looking up through a
lookup-only client, all against one real mooncake_master; random saves and evictions.

Every hit the scheduler reports must load on every rank, byte for byte; a prompt saved in full
on every rank and not evicted since must hit in full.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store")
pytest.importorskip("torch")
pytestmark = pytest.mark.mooncake

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
RANKS = [(tp, 0, 0, pp) for tp in range(2) for pp in range(2)]
ROUNDS = int(os.environ.get("MK_MP_ROUNDS", "120"))


class Rank:
    def __init__(self, master: str, rank: tuple) -> None:
        self.rank = rank
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO_ROOT / "tests" / "support" / "rank_worker.py"), master, ",".join(map(str, rank))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.stderr, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), MC_LOG_LEVEL="ERROR"),
        )
        self.ready = self.read()

    def read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.stderr.seek(0)
            raise AssertionError(f"rank {self.rank} died (rc {self.proc.poll()}):\n{self.stderr.read()[-3000:]}")
        return json.loads(line)

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send(op="stop")
                self.read()
                self.proc.wait(15)
            except (OSError, AssertionError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


def ask_all(ranks, **cmd):
    for r in ranks:
        r.send(**cmd)
    return [r.read() for r in ranks]


def test_every_reported_hit_loads_on_every_rank(mooncake_master):
    ranks = [Rank(mooncake_master.master_address, r) for r in RANKS]
    lookup_store = MooncakeStore.connect(mooncake_master.master_address, lookup_only=True)
    try:
        assert sorted(tuple(r.ready["ready"]) for r in ranks) == sorted(RANKS)
        engine = mk.LookupEngine("mp-model", [mk.FullAttentionSpec(16)],
                                 mk.ParallelLayout(tp_size=2, pp_size=2, num_kv_heads=2),
                                 hash_block_size=16, store=lookup_store)
        rng = random.Random(11)
        prompts: dict = {}  # id -> (hashes, chunks saved in full on every rank and not evicted)
        full_hits = partial = loads = 0
        for rnd in range(ROUNDS):
            pid = rng.randrange(25)
            if pid not in prompts:
                prompts[pid] = ([rng.randbytes(32) for _ in range(rng.randint(1, 16))], 0)
            hashes, intact = prompts[pid]
            hx = [h.hex() for h in hashes]
            action = rng.random()
            if action < 0.45:  # save the whole prompt on every rank
                assert all(r["ok"] for r in ask_all(ranks, op="save", prompt=pid, hashes=hx, chunks=len(hashes)))
                intact = len(hashes)
            elif action < 0.65:  # one rank saves only a prefix
                k = rng.randint(1, len(hashes))
                who = rng.choice(ranks)
                who.send(op="save", prompt=pid, hashes=hx, chunks=k)
                assert who.read()["ok"]
            elif action < 0.85:  # one rank loses some of its keys
                who = rng.choice(ranks)
                who.send(op="evict", prompt=pid, hashes=hx, fraction=rng.choice([0.1, 0.5, 1.0]), seed=rnd)
                if who.read()["evicted"]:
                    intact = 0
            prompts[pid] = (hashes, intact)
            num_tokens = len(hashes) * 16 + 1
            hit = engine.lookup(num_tokens, hashes)
            if intact == len(hashes):
                assert hit == len(hashes) * 16, (rnd, pid, hit)
                full_hits += 1
            elif hit:
                partial += 1
            if hit:
                results = ask_all(ranks, op="load", prompt=pid, hashes=hx, tokens=hit)
                for rank, res in zip(RANKS, results):
                    assert res["ok"] and res["loaded_tokens"] == hit and res["bytes_ok"], (rnd, rank, hit, res)
                loads += 1
        assert full_hits >= 10 and partial >= 3 and loads >= 20, (full_hits, partial, loads)
    finally:
        for r in ranks:
            r.stop()
        lookup_store.close()
