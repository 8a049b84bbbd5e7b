"""``FastMooncakeStoreConnector``: vLLM's ``MooncakeStoreConnector`` with mooncake_keys lookups.

Turned on with one line of config::

    --kv-transfer-config '{"kv_connector": "FastMooncakeStoreConnector",
                           "kv_connector_module_path": "mooncake_keys.vllm",
                           "kv_role": "kv_both"}'

Everything is vLLM's (saves, loads, events, metrics, the ZMQ lookup channel) except the lookup:
on rank 0 the worker's lookup is replaced by :func:`~mooncake_keys.vllm.accelerate_worker`.
With ``"lookup_in_scheduler": true`` in ``kv_connector_extra_config`` the scheduler answers
lookups itself (:mod:`.scheduler`). ``"lookup_strategy"`` there is the engine's strategy:
``"oneshot"`` (default: vLLM's very keys, one call) or ``"rounds"`` (only the keys the answer
needs: a miss costs a few keys instead of the whole prompt's).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector import MooncakeStoreConnector

from ..lookup.engine import STRATEGIES
from .mapping import Unsupported
from .scheduler import SchedulerLookupClient, handshake_path, publish, scheduler_deployment
from .versions import contract_for_installed
from .worker import accelerate_worker, log_once

__all__ = ["FastMooncakeStoreConnector", "LOOKUP_IN_SCHEDULER", "LOOKUP_STRATEGY"]

logger = logging.getLogger("mooncake_keys.vllm")

#: The ``kv_connector_extra_config`` switch of the in-scheduler lookup.
LOOKUP_IN_SCHEDULER = "lookup_in_scheduler"
#: The ``kv_connector_extra_config`` key of the lookup strategy.
LOOKUP_STRATEGY = "lookup_strategy"


class FastMooncakeStoreConnector(MooncakeStoreConnector):
    """vLLM's Mooncake store connector whose lookups run in mooncake_keys."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        self._handshake: Optional[str] = None  # vLLM's __del__ calls shutdown() even after a failed __init__
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        self._strategy = extra.get(LOOKUP_STRATEGY, "oneshot")
        if self._strategy not in STRATEGIES:  # before vLLM's connector starts anything
            raise ValueError(f"kv_connector_extra_config[{LOOKUP_STRATEGY!r}] must be one of {STRATEGIES}, "
                             f"got {self._strategy!r}")
        super().__init__(vllm_config, role, kv_cache_config)
        self._in_scheduler = bool(extra.get(LOOKUP_IN_SCHEDULER, False))
        if role == KVConnectorRole.SCHEDULER:
            if self._in_scheduler and self.connector_scheduler is not None:
                self._lookup_in_scheduler(vllm_config)
            return
        worker = self.connector_worker
        if worker is None or vllm_config.parallel_config.rank != 0:
            return  # only rank 0 answers lookups
        if accelerate_worker(worker, strategy=self._strategy) and self._in_scheduler:
            try:
                self._handshake = publish(vllm_config, worker.lookup.engine.prefixes)
            except OSError as exc:
                log_once(logging.WARNING, "mooncake_keys: could not publish rank 0's lookup keys (%s): "
                         "the scheduler keeps the ZMQ path", exc)

    def _lookup_in_scheduler(self, vllm_config: Any) -> None:
        from ..lookup.engine import LookupEngine
        from ..store.mooncake import MooncakeStore

        sched = self.connector_scheduler
        contract = contract_for_installed()
        try:
            if contract is None:
                raise Unsupported("this vLLM release is not supported")
            deployment = scheduler_deployment(sched, vllm_config, contract)
            store = MooncakeStore.lookup_client()
        except Exception as exc:  # noqa: BLE001 - any failure: vLLM's ZMQ path stays
            log_once(logging.WARNING, "mooncake_keys: lookups stay on the ZMQ path to rank 0: %s: %s",
                     type(exc).__name__, exc)
            return
        engine = LookupEngine.for_deployment(deployment, store=store, strategy=self._strategy)
        sched.client = SchedulerLookupClient(sched.client, engine, store, handshake_path(vllm_config))

    def shutdown(self) -> None:
        if self._handshake is not None:
            try:
                os.unlink(self._handshake)
            except OSError:
                pass
            self._handshake = None
        shutdown = getattr(super(), "shutdown", None)
        if shutdown is not None:
            shutdown()
