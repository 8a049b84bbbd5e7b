"""The ranks' reduced hit under real gloo ranks (torch.distributed, 2 processes on loopback):
SGLang 0.5.23's own ``_storage_hit_query`` then ``_sync_prefetch_hit_query`` on each rank, on
SGLang's stores and on ours, for random 2-rank deployments (TP 2, PP 2 or attention-CP 2; MHA
and MLA, DCP, split heads, SWA and Mamba sidecars, tags, salts) over stores with holes.

Per case and rank: the reduced hit, the hash list cut to it and the reduced pool verdicts equal
SGLang's, with exactly as many collective calls; and :func:`mooncake_keys.sglang.hits.reduce_ranks`
of the two ranks' unreduced answers equals SGLang's gloo-reduced one (the model of the reduction
the single-process tests use for deployments of more ranks).
"""

from __future__ import annotations

import datetime
import json
import os
import random
import socket
import subprocess
import sys

import pytest

from mooncake_keys.sglang.hits import reduce_ranks

CASES = int(os.environ.get("MK_SGLANG_GLOO_CASES", "40"))
SEED0 = int(os.environ.get("MK_SGLANG_SEED0", "0"))
HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def peer(oracle, master_address):
    """Rank 1 in its own process (it dies with this one), rank 0 here; the gloo group on loopback."""
    import torch

    from mooncake_keys.store.process import spawn

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE] + sys.path[1:]))
    proc = spawn([sys.executable, os.path.join(HERE, "gloo_peer.py"), master_address, str(port)],
                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, text=True)
    try:
        torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                             timeout=datetime.timedelta(seconds=300))
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        yield proc
        proc.stdin.write(json.dumps("stop") + "\n")
        proc.stdin.flush()
        proc.wait(timeout=60)
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_two_gloo_ranks_reduce_ours_as_they_reduce_sglangs(oracle, holder, master_address, peer):
    import torch

    from test_keys_and_hits import store_with_holes

    world = [torch.distributed.group.WORLD]
    seen = {"mla_bound": 0, "trailing": 0, "hit": 0}
    for i in range(CASES):
        rnd = random.Random(SEED0 + 10_000 + i)
        case = oracle.random_case(rnd, two_ranks=True)
        hashes = oracle.page_hashes(case)
        ranks = case.ranks()
        theirs = {r: oracle.build_store(case, r, master_address) for r in ranks}
        store_with_holes(oracle, holder, case, theirs, hashes)
        unreduced = [oracle.rank_result(oracle.result_of(theirs[r], case, hashes)) for r in ranks]
        options = [dict(core="c", negative_ttl=0, rounds_min_keys=0), dict(core="py", negative_ttl=0),
                   dict(core="c", strategy="oneshot", negative_ttl=0)]  # in rounds at any size; as deployed; one-shot
        peer.stdin.write(json.dumps({"case": case.to_json(), "options": options}) + "\n")
        peer.stdin.flush()
        mine = [oracle.synced(oracle.build_store(case, ranks[0], master_address, opts), case, hashes, world)
                for opts in [None] + options]
        reply = json.loads(peer.stdout.readline())
        assert "error" not in reply, reply.get("error")
        for rank_results in (mine, reply["results"]):
            sglang, ours = rank_results[0], rank_results[1:]
            for got in ours:
                assert got == sglang, (case, got, sglang)
        want = (mine[0]["hit_tokens"], mine[0]["verdicts"])
        assert reduce_ranks(unreduced, case.page, case.pages, oracle.trailing(case)) == want, case
        seen["hit"] += want[0] > 0
        seen["trailing"] += oracle.trailing(case)
        seen["mla_bound"] += case.mla and case.tp == 2 and case.dcp == 1
    print("gloo cases:", seen)
    if CASES >= 20:
        assert all(seen.values()), seen
