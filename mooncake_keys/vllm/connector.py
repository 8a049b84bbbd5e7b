"""``FastMooncakeStoreConnector``: vLLM's ``MooncakeStoreConnector`` with mooncake_keys lookups.

Turned on with one line of config::

    --kv-transfer-config '{"kv_connector": "FastMooncakeStoreConnector",
                           "kv_connector_module_path": "mooncake_keys.vllm",
                           "kv_role": "kv_both"}'

Everything is vLLM's (saves, loads, events, metrics, the ZMQ lookup channel) except the lookup:
on rank 0 the worker's lookup is replaced by :func:`~mooncake_keys.vllm.accelerate_worker`.
In ``kv_connector_extra_config``: ``"lookup_strategy"`` is the engine's strategy,
``"rounds"`` (default: only the keys the answer needs) or ``"oneshot"`` (vLLM's very keys, one
call); ``"lookup_in_scheduler": true`` makes the scheduler answer lookups itself
(:mod:`.scheduler`), then vLLM's own ``"lookup_async": true`` makes them asynchronous and
coalesced; ``"master_lease_ttl_ms"`` (the master's ``--default_kv_lease_ttl``) lets those reuse
the last call's answers within a tenth of that lease (unset: never). With ``"lookup_async":
true`` a request whose blocks another request is loading waits for that load instead of loading
them again (:mod:`mooncake_keys.lookup.shared_loads`; ``"share_loads": false`` turns that off;
only on a release the drop-in supports, :mod:`.versions`). vLLM's reset (``reset_cache``, after
RL weight updates) forgets every answer and load the scheduler side held. The drop-in's log
lines join vLLM's log stream (:mod:`.logs`) and its metrics vLLM's (:mod:`.metrics`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector

from .._checks import MAX_SECONDS, int_arg
from ..lookup.engine import STRATEGIES
from ..lookup.shared_loads import SharedLoads
from .handshake import handshake_path, new_token, publish, withdraw
from .logs import join_vllm_logging
from .mapping import Unsupported
from .metrics import (FALLBACK, SHARED_WAIT, ConnectorStats, PromMetrics, add_row, fallback_row, recorder,
                      shared_wait_row)
from .scheduler import SchedulerLookupClient, check_rank0, key_events_of, scheduler_deployment
from .versions import contract_for_installed, installed_version, unsupported_reason
from .worker import RecordedStore, accelerate_worker, log_once

__all__ = ["FastMooncakeStoreConnector", "LOOKUP_IN_SCHEDULER", "LOOKUP_STRATEGY", "MASTER_LEASE_TTL_MS", "SHARE_LOADS"]

logger = logging.getLogger("mooncake_keys.vllm")

#: The ``kv_connector_extra_config`` switch of the in-scheduler lookup.
LOOKUP_IN_SCHEDULER = "lookup_in_scheduler"
#: The ``kv_connector_extra_config`` key of the lookup strategy.
LOOKUP_STRATEGY = "lookup_strategy"
#: The ``kv_connector_extra_config`` switch of :mod:`mooncake_keys.lookup.shared_loads` (default
#: true; it acts only where vLLM's ``lookup_async`` and ``load_async`` are both on).
SHARE_LOADS = "share_loads"
#: The ``kv_connector_extra_config`` key of the master's read lease, in ms (its
#: ``--default_kv_lease_ttl``): how long the asynchronous in-scheduler lookups may reuse an
#: answer (a tenth of it, at most 1 s). Unset: answers are never reused.
MASTER_LEASE_TTL_MS = "master_lease_ttl_ms"


def lease_of(extra: Dict[str, Any]) -> Optional[float]:
    """The master's read lease in seconds from ``kv_connector_extra_config`` (None: not given);
    a value that is not a whole number of ms in 1 .. a day: ValueError naming the key."""
    ms = extra.get(MASTER_LEASE_TTL_MS)
    if ms is None:
        return None
    try:
        return int_arg(f"kv_connector_extra_config[{MASTER_LEASE_TTL_MS!r}]", ms, min=1,
                       max=int(MAX_SECONDS * 1000)) / 1000.0
    except TypeError as exc:
        raise ValueError(str(exc)) from None


class FastMooncakeStoreConnector(MooncakeStoreConnector):
    """vLLM's Mooncake store connector whose lookups run in mooncake_keys."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        # (path, token) of rank 0's published handshake; vLLM's __del__ calls shutdown() even after a failed __init__
        self._handshake: Optional[Tuple[str, str]] = None
        self._sched_stats: Optional[ConnectorStats] = None
        self._sched_lock = threading.Lock()
        self._shared_loads: Optional[SharedLoads] = None
        join_vllm_logging()  # first: what follows logs in vLLM's stream
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._strategy = extra.get(LOOKUP_STRATEGY, "rounds")
        if self._strategy not in STRATEGIES:  # before vLLM's connector starts anything
            raise ValueError(f"kv_connector_extra_config[{LOOKUP_STRATEGY!r}] must be one of {STRATEGIES}, "
                             f"got {self._strategy!r}")
        self._lease_s = lease_of(extra)
        super().__init__(vllm_config, role, kv_cache_config)
        self._in_scheduler = bool(extra.get(LOOKUP_IN_SCHEDULER, False))
        share = extra.get(SHARE_LOADS, True)
        if not isinstance(share, bool):
            raise ValueError(f"kv_connector_extra_config[{SHARE_LOADS!r}] must be true or false, got {share!r}")
        if role == KVConnectorRole.SCHEDULER:
            sched = self.connector_scheduler
            if self._in_scheduler and sched is not None:
                self._lookup_in_scheduler(vllm_config)
            if share and sched is not None and getattr(sched, "lookup_async", False) \
                    and getattr(sched, "load_async", False):
                if contract_for_installed() is None:  # the drop-in does not run on this release
                    log_once(logging.INFO, "mooncake_keys: share_loads is off: %s", unsupported_reason(installed_version()))
                else:
                    self._shared_loads = SharedLoads(
                        int(sched._hash_block_size),
                        on_wait=lambda seconds, outcome: self._append(SHARED_WAIT, shared_wait_row(seconds, outcome)))
            return
        worker = self.connector_worker
        if worker is None or vllm_config.parallel_config.rank != 0:
            return  # only rank 0 answers lookups
        if accelerate_worker(worker, strategy=self._strategy) and self._in_scheduler:
            token = new_token()
            try:
                self._handshake = (publish(vllm_config, worker.lookup.engine.prefixes, token), token)
                worker.lookup.handshake_token = token
            except OSError as exc:
                log_once(logging.WARNING, "mooncake_keys: could not publish rank 0's lookup keys (%s): "
                         "the scheduler keeps the ZMQ path", exc)

    # ------------------------------------------------------------------ the scheduler side
    def _lookup_in_scheduler(self, vllm_config: Any) -> None:
        from ..lookup.engine import LookupEngine
        from ..store.mooncake import MooncakeStore

        sched = self.connector_scheduler
        contract = contract_for_installed()
        try:
            if contract is None:
                raise Unsupported(unsupported_reason(installed_version()) or "this vLLM release is not supported")
            deployment = scheduler_deployment(sched, vllm_config, contract)
            store = MooncakeStore.lookup_client()
        except Exception as exc:  # noqa: BLE001 - any failure: vLLM's ZMQ path stays
            log_once(logging.WARNING, "mooncake_keys: lookups stay on the ZMQ path to rank 0: %s: %s",
                     type(exc).__name__, exc)
            self._append(FALLBACK, fallback_row(f"in the scheduler: {type(exc).__name__}: {exc}"))
            return
        engine = LookupEngine.for_deployment(deployment, store=RecordedStore(store, self._record),
                                             strategy=self._strategy, key_events=key_events_of(vllm_config))
        engine.observer = recorder(self._append, "scheduler")
        path = handshake_path(vllm_config)
        sched.client = SchedulerLookupClient(sched.client, engine, store, lease_s=self._lease_s,
                                             verify=lambda: check_rank0(path, vllm_config, engine))

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Any:
        """vLLM's, except that a request whose next block another request is loading stays
        pending (``(None, False)``, asked again next step) until that load lands."""
        shared = self._shared_loads
        try:
            if shared is not None and request.block_hashes \
                    and shared.waits(request.request_id, request.block_hashes, num_computed_tokens):
                return None, False
        except Exception as exc:  # noqa: BLE001 - never the scheduler's end: vLLM's behaviour instead
            self._stop_sharing(exc)
        answer = super().get_num_new_matched_tokens(request, num_computed_tokens)
        shared = self._shared_loads
        if shared is not None and answer[0] and answer[1]:  # tokens to load, asynchronously
            try:
                shared.loading(request.request_id, request.block_hashes, num_computed_tokens, answer[0])
            except Exception as exc:  # noqa: BLE001
                self._stop_sharing(exc)
        return answer

    def _stop_sharing(self, exc: BaseException) -> None:
        self._shared_loads = None
        log_once(logging.WARNING, "mooncake_keys: share_loads is off for this engine (%s: %s); requests "
                 "load what they hit, as with vLLM's connector", type(exc).__name__, exc)

    def update_connector_output(self, connector_output: Any) -> None:
        super().update_connector_output(connector_output)
        if self._shared_loads is not None:
            self._shared_loads.step(connector_output.finished_recving or ())

    def reset_cache(self) -> Any:
        """vLLM's (its store's keys removed with force, through rank 0), then the scheduler
        side forgets the loads it knew of (the in-scheduler lookups forget their answers in the
        client's ``reset``, which vLLM's reset calls)."""
        try:
            return super().reset_cache()
        finally:
            if self._shared_loads is not None:
                self._shared_loads.clear()

    def request_finished_all_groups(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        # vLLM's request_finished (every release 0.25-0.33) ends here too: one place forgets it.
        if self._shared_loads is not None:
            self._shared_loads.finished([request.request_id])
        return super().request_finished_all_groups(request, *args, **kwargs)

    def _append(self, operation: str, row: Dict[str, Any]) -> None:
        """Add a row to the scheduler side's stats (vLLM asks for them every step)."""
        with self._sched_lock:
            if self._sched_stats is None:
                self._sched_stats = ConnectorStats()
            add_row(self._sched_stats.data, operation, row)

    def _record(self, operation: str, duration_seconds: float, num_keys: int, *, num_bytes: int = 0,
                status: str = "ok", num_failed_keys: int = 0) -> None:
        """vLLM's ``_record_kv_connector_operation``, for the scheduler's own store calls."""
        self._append(operation, {"duration_seconds": duration_seconds, "num_keys": num_keys, "num_bytes": num_bytes,
                                 "status": status, "num_failed_keys": num_failed_keys})

    # ------------------------------------------------------------------ vLLM's metrics hooks
    def get_kv_connector_stats(self) -> Any:
        if self.connector_worker is not None:
            return super().get_kv_connector_stats()
        with self._sched_lock:  # the scheduler side: its lookups, if it answers any
            stats, self._sched_stats = self._sched_stats, None
        return stats

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None) -> Any:
        return ConnectorStats(data=data) if data is not None else ConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> Any:
        return PromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._handshake is not None:
            withdraw(*self._handshake)
            self._handshake = None
        shutdown = getattr(super(), "shutdown", None)
        if shutdown is not None:
            shutdown()
