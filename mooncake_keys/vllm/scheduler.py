"""The lookup in the scheduler: answered in-process through the scheduler's own Mooncake client
instead of the ZMQ round trip to rank 0 (``"lookup_in_scheduler": true``).

The scheduler-side connector already holds everything the keys depend on (parallel sizes,
model, KV-cache groups, its own coordinator: vLLM 0.32 and later), so it builds the same engine
as rank 0. It answers a lookup itself only once a background thread has checked rank 0's
published lookup key prefixes against its own and rank 0's handshake token (:mod:`.handshake`);
until then, and whenever they differ, lookups take vLLM's ZMQ path. Its Mooncake client asks
only ``batch_is_exist``: no segment, no buffer (Mooncake's ``rpc_only`` protocol).

vLLM's scheduler asks ``lookup(req_id, num_tokens, block_hashes, non_block=...)``:

* ``non_block=False`` (vLLM's default): answered at once, in the scheduler's thread (one lookup,
  as rank 0 would, without the ZMQ hop);
* ``non_block=True`` (``"lookup_async": true`` in ``kv_connector_extra_config``): the request is
  handed to a :class:`~mooncake_keys.lookup.batch.LookupBatcher` and None is answered until its
  lookup is decided (vLLM then retries the request on a later step). The scheduler's thread
  never waits on the master; lookups pending together go to the master together, a key shared
  by several requests asked once; ``discard`` (a request aborted while pending) stops it. The
  last call's answers are reused only with the master's lease known (``lease_s``), and ``reset``
  (vLLM's, which removes every key with force) forgets every answer got before it.

``num_tokens`` is taken as vLLM's own client takes it: one its wire format (u32) cannot carry is
answered 0 with a log line, as vLLM answers it; everything in range as rank 0 would.

Every lookup answered here is recorded as vLLM's ``lookup_exists`` operation and the drop-in's
own metrics (side ``scheduler``), reported through the scheduler connector's stats.

``"key_events"`` in ``kv_connector_extra_config`` (off by default; Mooncake 0.3.14's master run
with ``--enable_kv_events``): ``{"endpoint": "tcp://host:port", "http": "http://host:metrics_port"}``,
or a list of those, one per HA master. The scheduler's engine then keeps a mirror of this
deployment's keys from the master's events (:mod:`mooncake_keys.events`): a miss is answered
without asking the master, a hit with one call that verifies and leases exactly its keys; while
the mirror is incomplete (a gap, a restart, a failover, events off) lookups ask the master.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional

from .._checks import in_token_range
from ..lookup.batch import LookupBatcher
from ..lookup.deployment import Deployment
from ..lookup.engine import LookupEngine, LookupResult
from .handshake import ask_rank0, read_published, token_answer
from .mapping import Unsupported, deployment_of
from .worker import VllmResults, log_once

__all__ = ["SchedulerLookupClient", "scheduler_deployment", "check_rank0", "key_events_of", "KEY_EVENTS"]

logger = logging.getLogger("mooncake_keys.vllm")

#: Seconds between looks for rank 0's published prefixes while none was found yet.
RECHECK_S = 1.0
#: The ``kv_connector_extra_config`` key of the key-event mirror (off when absent or null).
KEY_EVENTS = "key_events"


def key_events_of(vllm_config: Any) -> Optional[Any]:
    """The masters whose key events the scheduler's engine mirrors (``"key_events"``), checked;
    None when off. ValueError/TypeError naming the setting otherwise."""
    value = vllm_config.kv_transfer_config.kv_connector_extra_config.get(KEY_EVENTS)
    if value is None:
        return None
    from ..events.mirror import sources_of

    try:
        return sources_of(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"kv_connector_extra_config[{KEY_EVENTS!r}]: {exc}") from None


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
    rank 0's keys and token are confirmed, through ``zmq_client`` until then (and for ``reset``,
    which rank 0 must run). ``verify`` (e.g. :func:`check_rank0`: None when confirmed, else why
    not) runs in a background thread until it confirms; None checks nothing and answers
    in-process at once (for tests of the lookups alone). ``lease_s``: the master's read lease in
    seconds (None: unknown), for the asynchronous lookups' reuse of answers."""

    def __init__(self, zmq_client: Any, engine: LookupEngine, store: Any, *,
                 verify: Optional[Callable[[], Optional[str]]], lease_s: Optional[float] = None) -> None:
        self.zmq = zmq_client
        self.engine = engine
        self.store = store
        self.lease_s = lease_s
        self.verified = False
        #: Why lookups still take the ZMQ path (the handshake's last answer), None once verified.
        self.why_not: Optional[str] = "the handshake with rank 0 has not run yet"
        self._results = VllmResults(engine)
        self._batcher: Optional[LookupBatcher] = None
        self._closed = threading.Event()
        self._lock = threading.Lock()
        if verify is None:
            self.verified, self.why_not = True, None
            return
        self._thread = threading.Thread(target=self._verify_loop, args=(verify,), daemon=True,
                                        name="mooncake_keys-handshake")
        self._thread.start()

    def _verify_loop(self, verify: Callable[[], Optional[str]]) -> None:
        """Until rank 0 is confirmed (or refused): look every ``RECHECK_S`` seconds. The
        scheduler's thread never runs this (reading a file, a ZMQ round trip)."""
        reported = None
        while not self._closed.is_set():
            try:
                problem = verify()
            except Exception as exc:  # noqa: BLE001 - the check must never end the scheduler
                problem = f"{type(exc).__name__}: {exc}"
            self.why_not = problem
            if problem is None:
                self.verified = True
                logger.info("mooncake_keys: lookups answered in the scheduler (rank 0's keys confirmed)")
                return
            if problem.startswith("refused:"):
                log_once(logging.WARNING, "mooncake_keys: lookups stay on the ZMQ path to rank 0: %s", problem[8:])
                return
            if problem != reported:  # a reason why not yet, once each
                logger.info("mooncake_keys: lookups take the ZMQ path to rank 0 for now: %s", problem)
                reported = problem
            self._closed.wait(RECHECK_S)

    # ------------------------------------------------------------------ vLLM's client API
    def lookup(self, req_id: str, num_tokens: int, block_hashes: Any, non_block: bool = False) -> Any:
        if not self.verified:
            return self.zmq.lookup(req_id, num_tokens, block_hashes, non_block=non_block)
        if not in_token_range(num_tokens):  # vLLM's client fails to encode it, logs, and answers 0
            logger.warning("mooncake_keys: lookup of %s answered 0: num_tokens %r does not fit vLLM's lookup "
                           "wire format (0 .. 2**32 - 1)", req_id, num_tokens)
            return self._results(LookupResult(0))
        if not non_block:
            return self._results(self.engine.lookup_result(num_tokens, block_hashes))
        batcher = self._batcher or self._start_batcher()
        result = batcher.poll(req_id)
        if result is not None:
            return self._results(result)
        if not batcher.pending(req_id):  # pending from submit until the answer is taken: no gap
            batcher.submit(req_id, num_tokens, list(block_hashes))  # vLLM's list may grow later
        return None

    def _start_batcher(self) -> LookupBatcher:
        with self._lock:
            if self._batcher is None:
                self._batcher = LookupBatcher(self.engine, lease_s=self.lease_s,
                                              name="mooncake_keys-scheduler-lookups")
            return self._batcher

    def discard(self, req_id: str) -> None:
        if self._batcher is not None:
            self._batcher.discard(req_id)
        self.zmq.discard(req_id)

    def reset(self) -> bool:
        """vLLM's reset (rank 0 removes every key, with force), then every answer got before it
        is forgotten: none is reused, lookups under way start again (also when the reset
        failed: it may have removed some keys)."""
        try:
            return self.zmq.reset()
        finally:
            self.engine.key_cache.clear()
            if self._batcher is not None:
                self._batcher.forget_answers()

    def close(self) -> None:
        self._closed.set()
        try:
            if self._batcher is not None:
                self._batcher.close()
            self.zmq.close()
            self.engine.close()  # its key-event mirror, if it made one
        finally:
            close = getattr(self.store, "close", None)
            if close is not None:
                close()

    def __getattr__(self, name: str) -> Any:  # anything else vLLM's client has
        return getattr(self.zmq, name)


def check_rank0(path: str, vllm_config: Any, engine: LookupEngine) -> Optional[str]:
    """None when rank 0 published this engine's very prefixes and answers its token; else why
    not: ``"refused: ..."`` when it never will (the keys differ), else a reason to look again."""
    published, problem = read_published(path)
    if published is None:
        return problem
    token, prefixes = published
    if prefixes != engine.prefixes:
        return "refused: the scheduler's lookup keys differ from rank 0's"
    answer = ask_rank0(vllm_config)
    if answer is None:
        return "rank 0 does not answer the handshake lookup"
    if answer != token_answer(token):
        return f"rank 0's handshake answer does not match {path} (a stale or foreign file)"
    return None
