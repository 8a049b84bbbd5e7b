"""Rank 1 of the gloo reduction test (test_reduction_gloo.py; rank 0 is the pytest process).

``python gloo_peer.py <master address> <gloo port>``: imports SGLang, runs SGLang's own plugin
loader (mooncake_keys' hooks applied, as in a scheduler process), joins the 2-rank gloo group on
loopback, then per JSON line on stdin (a case and the lookup options to run it with) builds this
rank's SGLang stores, runs SGLang's own query and rank reduction on each (the collectives
paired with rank 0's, in the same order) and answers one JSON line. ``"stop"`` ends it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")


def main() -> None:
    master, port = sys.argv[1], int(sys.argv[2])
    from sglang.srt.plugins import load_plugins

    load_plugins()
    import torch

    import harness
    from mooncake_keys.store.mooncake import MooncakeStore

    client = MooncakeStore.connect(master, global_segment_size=16 << 20)
    harness.OracleStore.client = client.client
    torch.distributed.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2,
                                         timeout=datetime.timedelta(seconds=60))
    print(json.dumps({"ready": True}), flush=True)
    world = [torch.distributed.group.WORLD]
    for line in sys.stdin:
        msg = json.loads(line)
        if msg == "stop":
            break
        try:
            case = harness.Case.from_json(msg["case"])
            rank = case.ranks()[1]
            hashes = harness.page_hashes(case)
            out = []
            for opts in [None] + msg["options"]:
                store = harness.build_store(case, rank, master, opts)
                out.append(harness.synced(store, case, hashes, world))
            print(json.dumps({"results": out}), flush=True)
        except Exception:  # reported, not fatal: rank 0 fails the test with it
            print(json.dumps({"error": traceback.format_exc()}), flush=True)
    torch.distributed.destroy_process_group()
    client.close()


if __name__ == "__main__":
    main()
