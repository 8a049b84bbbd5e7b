"""``accelerate_worker``: vLLM's rank-0 ``MooncakeStoreWorker.lookup``, answered by the engine.

The worker keeps everything of vLLM's (store, threads, metrics, the ZMQ lookup server); only its
``lookup`` attribute is replaced, by one built from the worker's own state and checked against
it (:mod:`.mapping`). The replacement answers with vLLM's own result types and values, asks
through the worker's store, records vLLM's ``lookup_exists`` metric for every call as the
original does, and a row per lookup for the drop-in's own metrics (:mod:`.metrics`). By
default it asks only the keys the answer needs (``strategy="rounds"``: the same answer in a few
calls, :mod:`mooncake_keys.lookup.rounds`); ``strategy="oneshot"`` sends the very keys vLLM
sends, in one ``batch_is_exist``. A worker the engine cannot reproduce keeps vLLM's lookup,
and the reason is logged once and reported in the metrics.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any, Callable, Dict, Optional

from ..lookup.engine import STRATEGIES, LookupEngine, LookupResult
from ..lookup.hashes import BlockHashes
from ..lookup.deployment import Deployment
from .handshake import is_handshake, token_answer
from .mapping import Unsupported, check_against, deployment_of
from .metrics import FALLBACK, add_row, fallback_row, recorder
from .versions import contract_for_installed

__all__ = ["accelerate_worker", "deployment_of_worker", "block_hashes_from_vllm", "RecordedStore", "VllmResults"]

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


class RecordedStore:
    """A store asked as vLLM's lookup asks its own: every ``batch_is_exist`` is timed and
    recorded as vLLM's ``lookup_exists`` operation with ``record`` (vLLM's
    ``_record_kv_connector_operation`` signature); a raising call is recorded with status
    ``error`` and re-raised (the engine then answers 0, with a log line). ``store`` is the store
    itself, or a function returning the current one (a worker's ``store`` may be replaced)."""

    def __init__(self, store: Any, record: Optional[Callable[..., None]]) -> None:
        self._get = store if callable(store) and not hasattr(store, "batch_is_exist") else (lambda: store)
        self.record = record

    def lease_probes(self) -> bool:
        """The store's answer (Mooncake 0.3.14's lease-free probes), False if it has none."""
        probes = getattr(self._get(), "lease_probes", None)
        return bool(probes()) if callable(probes) else False

    def batch_probe_key(self, keys: Any, policy: str = "none", candidate_size: int = 1) -> Any:
        """The store's ``batch_probe_key``, recorded as ``batch_is_exist`` is (vLLM's
        ``lookup_exists``: it is the lookup's existence check)."""
        store = self._get()
        return self._recorded(lambda: store.batch_probe_key(keys, policy, candidate_size), len(keys))

    def batch_is_exist(self, keys: Any) -> Any:
        store = self._get()
        return self._recorded(lambda: store.batch_is_exist(keys), len(keys))

    def _recorded(self, call: Callable[[], Any], n: int) -> Any:
        """``call()`` (an existence call of ``n`` keys), timed and recorded."""
        record = self.record
        start = time.perf_counter()
        try:
            results = call()
        except Exception:
            if record is not None:
                record("lookup_exists", time.perf_counter() - start, n, status="error", num_failed_keys=n)
            raise
        if record is not None:
            record("lookup_exists", time.perf_counter() - start, n)
        return results


def worker_store(worker: Any) -> RecordedStore:
    """The worker's current store, recorded in the worker's own stats."""
    return RecordedStore(lambda: worker.store, getattr(worker, "_record_kv_connector_operation", None))


def stats_appender(worker: Any) -> Callable[[str, Dict[str, Any]], None]:
    """A function adding a row to the worker's connector stats (vLLM sends them on with every
    step's output), under the worker's own lock."""
    lock = getattr(worker, "_kv_connector_stats_lock", None)

    def append(operation: str, row: Dict[str, Any]) -> None:
        stats = getattr(worker, "kv_connector_stats", None)
        if stats is None:
            return
        if lock is None:
            add_row(stats.data, operation, row)
            return
        with lock:
            add_row(worker.kv_connector_stats.data, operation, row)

    return append


class VllmResults:
    """The installed release's lookup result types: a ``MooncakeLookupResult`` with
    ``TailKeyBoundary`` objects from 0.29, a plain int before (the contract says which)."""

    def __init__(self, engine: LookupEngine) -> None:
        self._types = None
        if engine.deployment.contract.tail_key_boundaries:  # the release answers a result object
            from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import (
                MooncakeLookupResult,
                TailKeyBoundary,
            )

            self._types = (MooncakeLookupResult, TailKeyBoundary)

    def __call__(self, r: LookupResult) -> Any:
        if self._types is None:
            return r.hit_length
        result_cls, boundary_cls = self._types
        return result_cls(r.hit_length, tuple(boundary_cls(b.group_id, b.num_tokens) for b in r.tail_key_boundaries))


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


#: Model directory names that say nothing of the model: another deployment may well use one.
_GENERIC_NAME = re.compile(r"(model|models|merged|output|outputs|final|hf|weights|ckpt|checkpoint|latest|best|"
                           r"main|export|snapshot|base|chat|instruct)?([-_.]?(checkpoint|ckpt|step|epoch|iter)?"
                           r"[-_.]?\d*)", re.IGNORECASE)


def warn_if_keys_may_collide(model_name: str, cache_prefix: str) -> None:
    """One warning when this deployment's keys may be another's: vLLM names keys by the model
    path's last component, so two models in folders of the same name share keys (one loads the
    other's KV) unless ``cache_prefix`` tells them apart. The keys stay vLLM's either way."""
    if cache_prefix or not _GENERIC_NAME.fullmatch(model_name):
        return
    log_once(logging.WARNING, "mooncake_keys: the store keys of this deployment start with the model folder name "
             "%r and no cache_prefix: another model saved from a folder of that name would share its keys and load "
             "the wrong KV; set \"cache_prefix\" in kv_connector_extra_config to tell deployments apart "
             "(docs/vllm.md, \"Keys shared between deployments\")", model_name)


class FastLookup:
    """A worker's ``lookup`` answered by a :class:`LookupEngine`, in vLLM's result types. With
    a ``handshake_token`` it also answers the scheduler's handshake lookup (:mod:`.handshake`)."""

    def __init__(self, engine: LookupEngine, original: Any) -> None:
        self.engine = engine
        #: vLLM's own lookup, kept for reference and comparison.
        self.original = original
        self.handshake_token: Optional[str] = None
        self._results = VllmResults(engine)

    def __call__(self, num_tokens: int, block_hashes: Any) -> Any:
        if self.handshake_token is not None and is_handshake(block_hashes):
            return self._results(LookupResult(token_answer(self.handshake_token)))
        if self._results._types is None:
            return self.engine.lookup(num_tokens, block_hashes_from_vllm(block_hashes))
        return self._results(self.engine.lookup_result(num_tokens, block_hashes_from_vllm(block_hashes)))


def accelerate_worker(worker: Any, *, strategy: str = "rounds") -> bool:
    """Answer ``worker.lookup`` with mooncake_keys; True when it does.

    ``worker`` is vLLM's rank-0 ``MooncakeStoreWorker`` (any release 0.25-0.33). The new lookup
    gives vLLM's own results (an ``int`` before 0.29, a ``MooncakeLookupResult`` with
    ``TailKeyBoundary`` objects from 0.29) with identical values, asks ``worker.store`` and records vLLM's ``lookup_exists`` metric
    per call. ``strategy`` is the engine's (see :class:`LookupEngine`): ``"rounds"`` (default)
    asks only the keys the answer needs (the same answer; lookups of fewer than 2,048 keys ask
    once); ``"oneshot"`` sends vLLM's very keys in one ``batch_is_exist``. A worker that cannot be reproduced (a capacity-only worker, an unsupported vLLM, a
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

        reason = f"vLLM {installed_version()} is not a supported release (0.25-0.33)"
        log_once(logging.WARNING, "mooncake_keys: %s: keeping vLLM's own Mooncake lookup", reason)
        stats_appender(worker)(FALLBACK, fallback_row(reason))
        return False
    if getattr(worker, "_capacity_only", False) or getattr(worker, "coord", None) is None:
        log_once(logging.INFO, "mooncake_keys: capacity-only Mooncake worker (its lookup answers 0): "
                 "keeping vLLM's own lookup")
        return False
    try:
        engine = LookupEngine.for_deployment(deployment_of_worker(worker, contract), store=worker_store(worker),
                                             strategy=strategy)
        check_against(engine, worker.coord, worker._lookup_key_prefixes)
    except (Unsupported, ValueError, TypeError) as exc:
        log_once(logging.WARNING, "mooncake_keys: keeping vLLM's own Mooncake lookup for this deployment: %s", exc)
        stats_appender(worker)(FALLBACK, fallback_row(str(exc)))
        return False
    engine.observer = recorder(stats_appender(worker), "worker")
    warn_if_keys_may_collide(engine.deployment.model_name, engine.deployment.cache_prefix)
    worker.lookup = FastLookup(engine, worker.lookup)
    logger.info("mooncake_keys: Mooncake lookups of this worker run in mooncake_keys (vLLM %s contract, %s core, "
                "strategy %s)", contract, "compiled" if engine.deployment.core.__name__.endswith("_c") else "pure Python",
                engine.strategy)
    return True
