"""The lookup in the scheduler: answered in-process through the scheduler's own Mooncake client
instead of the ZMQ round trip to rank 0 (``"lookup_in_scheduler": true``).

The scheduler-side connector already holds everything the keys depend on (parallel sizes,
model, KV-cache groups, its own coordinator), so it builds the same engine as rank 0. Before
answering a single lookup itself, it checks its lookup key prefixes against the ones rank 0
published (:func:`publish`): equal, or it stays on the ZMQ path. Its Mooncake client asks only
``batch_is_exist``: no segment, no buffer (Mooncake's ``rpc_only`` protocol). Anything that
fails (no config, no master, a deployment it cannot derive) leaves the ZMQ path in place, with
one log line.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any, Optional, Sequence

from ..lookup.deployment import Deployment
from ..lookup.engine import LookupEngine
from .mapping import Unsupported, deployment_of
from .worker import log_once

__all__ = ["SchedulerLookupClient", "handshake_path", "publish", "scheduler_deployment"]

logger = logging.getLogger("mooncake_keys.vllm")

#: Seconds between looks for rank 0's published prefixes while none was found yet.
_RECHECK_S = 1.0


def handshake_path(vllm_config: Any) -> str:
    """Where rank 0 publishes its lookup key prefixes: beside its ZMQ lookup socket."""
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

    return get_zmq_rpc_path_lookup(vllm_config).removeprefix("ipc://") + ".mooncake_keys.json"


def publish(vllm_config: Any, prefixes: Sequence[Sequence[str]]) -> str:
    """Rank 0: write its lookup key prefixes for the scheduler (atomically); returns the path."""
    path = handshake_path(vllm_config)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump({"pid": os.getpid(), "prefixes": [list(p) for p in prefixes]}, f)
    os.replace(tmp, path)
    return path


def _published(path: str) -> Optional[Any]:
    """Rank 0's prefixes if its file is there and its writer alive, else None."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        os.kill(int(data["pid"]), 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return tuple(tuple(p) for p in data.get("prefixes", ()))


def scheduler_deployment(sched: Any, vllm_config: Any, contract: str) -> Deployment:
    """The deployment of rank 0's lookup, from what the scheduler-side connector holds."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    coord = getattr(sched, "_store_coord", None)
    if coord is None:
        raise Unsupported("the scheduler holds no store coordinator (vLLM 0.32 and later do, but not "
                          "a capacity-only connector)")
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config
    if extra.get("store_tp_size") is not None or extra.get("enable_store_tp_lcm") is True:
        raise Unsupported("store layouts (store_tp_size / enable_store_tp_lcm) are resolved on the workers")
    pc = vllm_config.parallel_config
    mc = vllm_config.model_config
    return deployment_of(
        vllm_compat=contract, groups=coord.kv_cache_groups, coord=coord, registry=KVCacheSpecRegistry,
        tp_size=pc.tensor_parallel_size, pp_size=pc.pipeline_parallel_size,
        pcp_size=pc.prefill_context_parallel_size, dcp_size=pc.decode_context_parallel_size,
        num_kv_heads=mc.get_total_num_kv_heads(), model_name=mc.model.rstrip("/").split("/")[-1],
        cache_prefix=str(extra.get("cache_prefix", "")),
    )


class SchedulerLookupClient:
    """In place of vLLM's ``LookupKeyClient`` in the scheduler: lookups answered in-process once
    rank 0's prefixes confirm the engine's, through ``zmq_client`` until then (and for
    ``reset``, which rank 0 must run)."""

    def __init__(self, zmq_client: Any, engine: LookupEngine, store: Any, path: str) -> None:
        self.zmq = zmq_client
        self.engine = engine
        self.store = store
        self.path = path
        self.verified = False
        self._refused = False
        self._next_check = 0.0
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
            MooncakeLookupResult,
            TailKeyBoundary,
        )

        self._types = (MooncakeLookupResult, TailKeyBoundary)
        self._check()

    def _check(self) -> bool:
        if self.verified or self._refused:
            return self.verified
        now = time.monotonic()
        if now < self._next_check:
            return False
        self._next_check = now + _RECHECK_S
        published = _published(self.path)
        if published is None:
            return False
        if published != self.engine.prefixes:
            self._refused = True
            log_once(logging.WARNING, "mooncake_keys: the scheduler's lookup keys differ from rank 0's: "
                     "lookups stay on the ZMQ path")
            return False
        self.verified = True
        logger.info("mooncake_keys: lookups answered in the scheduler (rank 0's keys confirmed)")
        return True

    def lookup(self, req_id: str, num_tokens: int, block_hashes: Any, non_block: bool = False) -> Any:
        if not self._check():
            return self.zmq.lookup(req_id, num_tokens, block_hashes, non_block=non_block)
        result_cls, boundary_cls = self._types
        r = self.engine.lookup_result(num_tokens, block_hashes)
        return result_cls(r.hit_length, tuple(boundary_cls(b.group_id, b.num_tokens) for b in r.tail_key_boundaries))

    def discard(self, req_id: str) -> None:
        self.zmq.discard(req_id)

    def reset(self) -> bool:
        ok = self.zmq.reset()
        self.engine.key_cache.clear()
        return ok

    def close(self) -> None:
        try:
            self.zmq.close()
        finally:
            close = getattr(self.store, "close", None)
            if close is not None:
                close()

    def __getattr__(self, name: str) -> Any:  # anything else vLLM's client has
        return getattr(self.zmq, name)
