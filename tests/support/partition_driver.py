"""The lookup host of tests/test_partitions.py: lookups (and loads) across hosts, streamed.

Two Mooncake clients of the cluster (``MK_MASTER``, ``etcd://HOST:PORT``), each behind a lookup
engine: ``lookup_only`` (no memory; it follows the HA leader itself) and ``loader`` (no segment,
a 16 MiB buffer: it loads the holder host's bytes over TCP). It prints JSON lines:

* ``{"event": "ready", "before": {...}, "loads_ok": bool}``: every prompt looked up by both
  engines, and loaded by ``loader``, byte for byte against :mod:`partition_data`;
* then, until a ``stop`` line on stdin, one line per lookup, ``{"s": ENGINE, "t": START,
  "dt": SECONDS, "hit": TOKENS}`` (``t`` is ``time.monotonic()``, one clock for every process
  of the machine, so the test can set it against when it cut the link), one lookup per engine
  every 20 ms, round robin over the prompts;
* on a ``raw`` line, one bare client call per client (see :data:`PROBE_KEY`);
* ``{"event": "done", "after": {...}, "loads_ok": bool, "log_lines": [...], "log_line_count": N}``.

It ends with ``os._exit`` (closing an ``etcd://`` client waits out its 30 s etcd watch).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any, Dict

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ["MC_TCP_BIND_ADDRESS"] = os.environ["MK_HOST"]

import torch  # noqa: E402

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

import partition_data as data  # noqa: E402

#: Seconds between rounds of lookups (one per engine).
PERIOD_S = 0.02
#: The key a bare client call asks (a ``raw`` line on stdin: one call per client, in threads of
#: their own, each answered by ``{"raw": CLIENT, "t": START, "dt": SECONDS, "result": [...]}``).
PROBE_KEY = "netns-probe-key"


class Records(logging.Handler):
    """The warnings of mooncake_keys (why a lookup answered 0)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.created:.3f} {record.getMessage()}")


def emit(obj: Dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def loads_ok(loader: MooncakeStore) -> bool:
    """Every prompt loaded into fresh memory through ``loader``, equal to what the holder saved."""
    want = torch.frombuffer(bytearray(data.kv_bytes()), dtype=torch.uint8).reshape(-1, data.BLOCK)
    fresh = torch.zeros_like(want)
    ok = True
    with mk.KVPool(data.MODEL, data.GROUPS, data.LAYOUT, rank=(0, 0, 0, 0), kv_caches=fresh,
                   hash_block_size=data.HASH_BLOCK, store=loader) as pool:
        for i, hashes in enumerate(data.prompts()):
            ids = data.block_ids(i)
            res = pool.load(data.TOKENS, hashes, ids)
            ok = ok and res.ok and res.loaded_tokens == data.TOKENS and torch.equal(
                fresh[ids[0]:ids[-1] + 1], want[ids[0]:ids[-1] + 1])
    return ok


def main() -> None:
    records = Records()
    logging.getLogger("mooncake_keys").addHandler(records)
    master, host = os.environ["MK_MASTER"], os.environ["MK_HOST"]
    stores = {"lookup_only": MooncakeStore.connect(master, local_hostname=host, lookup_only=True),
              "loader": MooncakeStore.connect(master, local_hostname=host, global_segment_size=0)}
    engines = {name: mk.LookupEngine(data.MODEL, data.GROUPS, data.LAYOUT, hash_block_size=data.HASH_BLOCK,
                                     store=store) for name, store in stores.items()}
    prompts = data.prompts()
    emit({"event": "ready", "before": {n: [e.lookup(data.FULL, h) for h in prompts] for n, e in engines.items()},
          "loads_ok": loads_ok(stores["loader"])})
    stop = threading.Event()

    def raw(name: str) -> None:  # one call of the bare Mooncake client: what bounds it?
        start = time.monotonic()
        result = stores[name].client.batch_is_exist([PROBE_KEY])
        emit({"raw": name, "t": start, "dt": time.monotonic() - start, "result": list(result)})

    def commands() -> None:
        for line in sys.stdin:
            if line.strip() == "raw":
                for name in stores:
                    threading.Thread(target=raw, args=(name,), daemon=True).start()
            else:
                break
        stop.set()

    threading.Thread(target=commands, daemon=True).start()
    i = 0
    while not stop.is_set():
        for name, engine in engines.items():
            start = time.monotonic()
            hit = engine.lookup(data.FULL, prompts[i % len(prompts)])
            emit({"s": name, "t": start, "dt": time.monotonic() - start, "hit": hit})
        i += 1
        stop.wait(PERIOD_S)
    emit({"event": "done", "after": {n: [e.lookup(data.FULL, h) for h in prompts] for n, e in engines.items()},
          "loads_ok": loads_ok(stores["loader"]), "log_lines": records.lines[:20],
          "log_line_count": len(records.lines)})
    os._exit(0)


if __name__ == "__main__":
    main()
