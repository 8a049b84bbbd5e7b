"""The holder host of tests/test_partitions.py: a Mooncake client whose 64 MiB segment holds the
saved keys. It saves every prompt of :mod:`partition_data`, prints one JSON line
(``{"ready": true, ...}``) and then holds its segment until its stdin closes (the test ends it).

Environment: ``MK_MASTER`` (``etcd://HOST:PORT``), ``MK_HOST`` (this host's address).
It ends with ``os._exit``: closing a client set up with ``etcd://`` waits out its 30 s etcd watch.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
os.environ["MC_TCP_BIND_ADDRESS"] = os.environ["MK_HOST"]  # advertise this host's address

import torch  # noqa: E402

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore  # noqa: E402

import partition_data as data  # noqa: E402


def main() -> None:
    store = MooncakeStore.connect(os.environ["MK_MASTER"], local_hostname=os.environ["MK_HOST"],
                                  global_segment_size=64 << 20)
    kv = torch.frombuffer(bytearray(data.kv_bytes()), dtype=torch.uint8).reshape(-1, data.BLOCK)
    pool = mk.KVPool(data.MODEL, data.GROUPS, data.LAYOUT, rank=(0, 0, 0, 0), kv_caches=kv,
                     hash_block_size=data.HASH_BLOCK, store=store)
    saved = []
    for i, hashes in enumerate(data.prompts()):
        res = pool.save(data.TOKENS, hashes, data.block_ids(i))
        saved.append(bool(res.ok and res.stored == res.asked))
    print(json.dumps({"ready": all(saved), "saved": saved, "hostname": store.client.get_hostname()}), flush=True)
    sys.stdin.read()  # until the test closes our stdin (or dies: then we die with it)
    os._exit(0)


if __name__ == "__main__":
    main()
