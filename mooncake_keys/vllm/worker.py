"""``accelerate_worker``: vLLM's rank-0 ``MooncakeStoreWorker.lookup``, answered by the engine.

The worker keeps everything of vLLM's (store, threads, metrics, the ZMQ lookup server); only its
``lookup`` attribute is replaced, by one built from the worker's own state and checked against
it (:mod:`.mapping`). The replacement answers with vLLM's own result types and values, asks
through the worker's store, and records vLLM's ``lookup_exists`` metric for every call as the
original does. By default it sends the very keys vLLM sends, in one ``batch_is_exist``
(``strategy="oneshot"``); ``strategy="rounds"`` asks only the keys the answer needs (the same
answer, several calls: :mod:`mooncake_keys.lookup.rounds`). A worker the engine cannot reproduce keeps vLLM's lookup, and the
reason is logged once.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Optional

from ..lookup.engine import STRATEGIES, LookupEngine
from ..lookup.hashes import BlockHashes
from ..lookup.deployment import Deployment
from .mapping import Unsupported, check_against, deployment_of
from .versions import contract_for_installed

__all__ = ["accelerate_worker", "deployment_of_worker", "block_hashes_from_vllm"]

logger = logging.getLogger("mooncake_keys.vllm")
_LOGGED: set = set()


def log_once(level: int, message: str, *args: Any) -> None:
    """Log ``message`` the first time it is seen in this process (the line shown is the caller's)."""
    text = message % args if args else message
    if text not in _LOGGED:
        _LOGGED.add(text)
        logger.log(level, text, stacklevel=2)


def _store_layout_tp(worker: Any) -> Optional[int]:
    """The store TP size when the worker keys a TP-sharded store layout, else None."""
    layout = getattr(worker.token_dbs[0], "store_layout", None) if worker.token_dbs else None
    if layout is None or not any(c.__name__ == "TPShardedStoreLayout" for c in type(layout).__mro__):
        return None
    return worker.store_tp_size


def deployment_of_worker(worker: Any, vllm_compat: str) -> Deployment:
    """The deployment of a built vLLM worker (see :func:`.mapping.deployment_of`)."""
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    md = worker.token_dbs[0].metadata
    return deployment_of(
        vllm_compat=vllm_compat, groups=worker._kv_cache_groups, coord=worker.coord,
        registry=KVCacheSpecRegistry, tp_size=worker.tp_size, pp_size=worker.pp_size,
        pcp_size=worker.pcp_size, dcp_size=worker.dcp_size, num_kv_heads=worker.num_kv_head,
        model_name=md.model_name, cache_prefix=md.cache_prefix,
        store_namespace=getattr(md, "store_namespace", ""), store_tp_size=_store_layout_tp(worker),
        use_mla=bool(getattr(worker, "use_mla", False)),
    )


class WorkerStore:
    """The worker's current store, asked as vLLM's lookup asks it: every ``batch_is_exist`` is
    timed and recorded as vLLM's ``lookup_exists`` operation; a raising call is recorded with
    status ``error`` and re-raised (the engine then answers 0, with a log line)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker

    def batch_is_exist(self, keys: Any) -> Any:
        record = getattr(self.worker, "_record_kv_connector_operation", None)
        start = time.perf_counter()
        try:
            results = self.worker.store.batch_is_exist(keys)
        except Exception:
            if record is not None:
                record("lookup_exists", time.perf_counter() - start, len(keys), status="error",
                       num_failed_keys=len(keys))
            raise
        if record is not None:
            record("lookup_exists", time.perf_counter() - start, len(keys))
        return results


def block_hashes_from_vllm(block_hashes: Any) -> Any:
    """vLLM's wire view (``BlobBlockHashes``) as a :class:`BlockHashes`, without copying;
    anything else as is (the engine reads it with ``lookup.hashes.as_block_hashes``)."""
    blob = getattr(block_hashes, "_blob", None)
    hash_len = getattr(block_hashes, "_hash_len", None)
    if blob is None or not isinstance(hash_len, int):
        return block_hashes
    n = len(block_hashes)
    if not n:
        return BlockHashes(b"", 0)
    return BlockHashes.from_blob(memoryview(blob)[: n * hash_len], hash_len)


class FastLookup:
    """A worker's ``lookup`` answered by a :class:`LookupEngine`, in vLLM's result types."""

    def __init__(self, engine: LookupEngine, original: Any) -> None:
        self.engine = engine
        #: vLLM's own lookup, kept for reference and comparison.
        self.original = original
        self._types = None
        if engine.deployment.contract.tail_key_boundaries:  # the release answers a result object
            from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
                MooncakeLookupResult,
                TailKeyBoundary,
            )

            self._types = (MooncakeLookupResult, TailKeyBoundary)

    def __call__(self, num_tokens: int, block_hashes: Any) -> Any:
        hashes = block_hashes_from_vllm(block_hashes)
        if self._types is None:
            return self.engine.lookup(num_tokens, hashes)
        result_cls, boundary_cls = self._types
        r = self.engine.lookup_result(num_tokens, hashes)
        return result_cls(r.hit_length, tuple(boundary_cls(b.group_id, b.num_tokens) for b in r.tail_key_boundaries))


def accelerate_worker(worker: Any, *, strategy: str = "oneshot") -> bool:
    """Answer ``worker.lookup`` with mooncake_keys; True when it does.

    ``worker`` is vLLM's rank-0 ``MooncakeStoreWorker`` (any release 0.25-0.33). The new lookup
    gives vLLM's own results (an ``int`` before 0.29, a ``MooncakeLookupResult`` with
    ``TailKeyBoundary`` objects from 0.29) with identical values, asks ``worker.store`` and records vLLM's ``lookup_exists`` metric
    per call. ``strategy`` is the engine's (see :class:`LookupEngine`): ``"oneshot"`` (default)
    sends vLLM's very keys in one ``batch_is_exist``; ``"rounds"`` asks only the keys the answer
    needs. A worker that cannot be reproduced (a capacity-only worker, an unsupported vLLM, a
    group kind with lookup rules of its own, ...) keeps vLLM's lookup: False, and one log line
    says why. Calling it again is harmless.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if isinstance(getattr(worker, "lookup", None), FastLookup):
        return True
    contract = contract_for_installed()
    if contract is None:
        from .versions import installed_version

        log_once(logging.WARNING, "mooncake_keys: vLLM %s is not a supported release (0.25-0.33): "
                 "keeping vLLM's own Mooncake lookup", installed_version())
        return False
    if getattr(worker, "_capacity_only", False) or getattr(worker, "coord", None) is None:
        log_once(logging.INFO, "mooncake_keys: capacity-only Mooncake worker (its lookup answers 0): "
                 "keeping vLLM's own lookup")
        return False
    try:
        engine = LookupEngine.for_deployment(deployment_of_worker(worker, contract), store=WorkerStore(worker),
                                             strategy=strategy)
        check_against(engine, worker.coord, worker._lookup_key_prefixes)
    except (Unsupported, ValueError, TypeError) as exc:
        log_once(logging.WARNING, "mooncake_keys: keeping vLLM's own Mooncake lookup for this deployment: %s", exc)
        return False
    worker.lookup = FastLookup(engine, worker.lookup)
    logger.info("mooncake_keys: Mooncake lookups of this worker run in mooncake_keys (vLLM %s contract, %s core, "
                "strategy %s)", contract, "compiled" if engine.deployment.core.__name__.endswith("_c") else "pure Python",
                engine.strategy)
    return True
