"""The asynchronous in-scheduler lookup held for a long stream (``mooncake_keys bench --soak``).

One deployment built by vLLM's own code (rank 0's worker with its real ZMQ lookup server, the
scheduler-side ``FastMooncakeStoreConnector`` as the engine core builds it: ``lookup_in_scheduler``,
vLLM's ``lookup_async``, ``share_loads`` on, the master's lease configured) on a ``LocalMaster``
(read lease 200 ms) with a holder client owning the store's memory. The scheduler is played step
by step through the connector's own methods, as vLLM's scheduler calls them:

* every step, new requests arrive (vLLM ``Request`` objects, their hashes vLLM's): each one of
  :data:`SYSTEMS` system prompts, stored, and a part of its own, partly stored in one request in
  three (stored before it is first asked, so no lookup under way needs it);
* every waiting request is asked ``get_num_new_matched_tokens``; an answer is compared at once
  with vLLM's own lookup (rank 0's ``MooncakeStoreWorker.lookup``, synchronous) on the store as
  it is; a request answered with a load lands it a step later (``update_connector_output``) and
  finishes after a few steps (``request_finished``, then vLLM's ``build_connector_meta`` with it
  among the finished requests, which discards its lookup);
* a tenth of the requests are aborted while they wait (the same way);
* every ``reset_every`` requests, vLLM's reset (``reset_cache``: rank 0 removes every key with
  force) while lookups are pending; the requests waiting then are answered on the emptied store
  (each must be 0: vLLM's own answer there), then the system prompts are stored again.

Measured: answers compared and how many differed from vLLM's (must be 0), lookups submitted
twice while under way (must be 0), answers left behind at the end (must be 0), the largest size
of every table the scheduler side holds after warm-up (the batcher's, share_loads', vLLM's
``load_specs``) and the process's resident memory after warm-up and at the end. Needs vLLM 0.32
or 0.33 and the Mooncake client. Self-contained: the harness it imports is
:mod:`.vllm_workers` and :func:`.on_master.master_for_vllm`.
"""

from __future__ import annotations

import gc
import logging
import os
import random
import sys
import time
from typing import Any, Callable, Dict, List, Optional

__all__ = ["SYSTEMS", "run_soak", "format_report", "check_bounds"]

BLOCK = 16
#: System prompts the requests share, in blocks of BLOCK tokens.
SYSTEMS = (16, 32, 48, 64, 96, 128, 192, 256)
#: A request's own part, in blocks (uniform).
OWN_BLOCKS = (1, 64)
#: Requests arriving per step (uniform), steps an answered request runs before it finishes.
ARRIVALS = (0, 12)
RUN_STEPS = (1, 4)
ABORT_FRACTION = 0.1
#: A step of the engine between two scheduler passes (seconds).
STEP_S = 0.001
#: The part of the stream before the tables are measured (warm-up).
WARMUP = 0.2

Progress = Optional[Callable[[str], Any]]


def _cfg(lease_ms: int) -> Dict[str, Any]:
    return {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
            "tp_size": 2, "num_kv_heads": 2, "reuse_model_config": True, "lookup_server": True,
            "groups": [{"type": "full", "block_size": BLOCK}],
            "extra_config": {"lookup_in_scheduler": True, "lookup_async": True, "lookup_rpc_port": 31,
                             "master_lease_ttl_ms": lease_ms}}


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def run_soak(requests: int = 20000, *, reset_every: int = 4000, seed: int = 0, progress: Progress = None
             ) -> Dict[str, Any]:
    """One soak of ``requests`` requests (see the module docstring): a dict of its figures."""
    from ..lookup.engine import LookupEngine
    from ..vllm.versions import contract_for_installed
    from ..vllm.worker import deployment_of_worker
    from .on_master import master_for_vllm, put_keys
    from .vllm_baseline import workers

    vllm_workers = workers()

    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput

    vllm_workers.quiet(logging.CRITICAL)
    logging.getLogger("mooncake_keys").setLevel(logging.ERROR)
    rng = random.Random(seed)
    with master_for_vllm() as (master, holder):
        cfg = _cfg(int(master.default_kv_lease_ttl))
        worker = vllm_workers.build_worker(cfg, holder)
        connector = client = None
        try:
            connector = vllm_workers.build_scheduler_connector(cfg)
            sched = connector.connector_scheduler
            client = sched.client
            if not vllm_workers.wait_verified(client, 30):
                raise RuntimeError(f"the in-scheduler client did not verify rank 0: {client.why_not}")
            keys_of = LookupEngine.for_deployment(deployment_of_worker(worker, contract_for_installed() or "0.33"),
                                                  store=holder).candidate_keys
            systems = [list(range(100_000 * (s + 1), 100_000 * (s + 1) + n * BLOCK)) for s, n in enumerate(SYSTEMS)]
            system_hashes = [vllm_workers.make_request(f"system-{s}", t, BLOCK).block_hashes
                             for s, t in enumerate(systems)]

            def store_systems() -> None:
                for tokens, hashes in zip(systems, system_hashes):
                    put_keys(holder, keys_of(len(tokens), list(hashes)))

            store_systems()
            figures = _play(requests, reset_every, rng, connector, sched, client, worker, holder, systems, keys_of,
                            store_systems, SchedulerOutput, KVConnectorOutput, progress)
            figures["lease_ms"] = int(master.default_kv_lease_ttl)
            figures["reuse_ms"] = client._batcher.reuse_s * 1e3 if client._batcher is not None else 0.0
            return figures
        finally:
            if client is not None:
                client.close()
            vllm_workers.release(worker)


def _play(requests: int, reset_every: int, rng: random.Random, connector: Any, sched: Any, client: Any, worker: Any,
          holder: Any, systems: List[List[int]], keys_of: Any, store_systems: Callable[[], None],
          scheduler_output: Any, connector_output: Any, progress: Progress) -> Dict[str, Any]:
    """The scheduler's steps (see the module docstring); the figures."""
    from .on_master import put_keys
    from .vllm_baseline import workers

    vllm_workers = workers()

    waiting: Dict[str, Any] = {}  # request id -> Request, still asked
    running: List[List[Any]] = []  # [steps left, Request]
    landing: set = set()  # loads that land at the next step
    finished: set = set()  # finished since the last schedule: vLLM's next build_connector_meta has them
    abort_at: Dict[str, int] = {}
    counts = {"answered": 0, "compared_hits": 0, "different": 0, "aborted": 0, "resets": 0, "steps": 0,
              "held_polls": 0}
    most: Dict[str, int] = {}
    arrived = 0
    draining = False
    rss: Dict[str, float] = {}
    differed: List[tuple] = []  # (request, step, our answer, vLLM's, after a reset)
    blocks: Dict[str, int] = {}
    trend: List[tuple] = []  # (requests, resident MB, Python blocks) at every tenth of the stream
    start = time.perf_counter()
    warm = max(1, int(requests * WARMUP))
    next_reset = reset_every
    batcher = None
    while arrived < requests or waiting or running:
        counts["steps"] += 1
        step = counts["steps"]
        # the engine's step: loads that landed, then the schedule's output with the finished requests
        connector.update_connector_output(connector_output(finished_recving=set(landing)))
        landing.clear()
        out = scheduler_output.make_empty()
        out.finished_req_ids = set(finished)
        connector.build_connector_meta(out)
        finished.clear()
        connector.get_kv_connector_stats()  # vLLM reads the scheduler side's stats every step,
        worker_stats = getattr(worker, "kv_connector_stats", None)  # and rank 0's (another process in vLLM)
        if worker_stats is not None:
            worker_stats.reset()
        if draining and not waiting:  # every request waiting at the reset is answered: store again
            store_systems()
            draining = False
        if not draining and arrived < requests:
            for _ in range(rng.randint(*ARRIVALS)):
                if arrived >= requests:
                    break
                rid = f"r{arrived}"
                s = rng.randrange(len(systems))
                own = list(range(10_000_000 + arrived * 4096, 10_000_000 + arrived * 4096
                                 + rng.randint(*OWN_BLOCKS) * BLOCK + rng.randrange(BLOCK)))
                req = vllm_workers.make_request(rid, systems[s] + own, BLOCK)
                if arrived % 3 == 0:  # part of its own part stored, before it is first asked
                    mine = keys_of(req.num_tokens - req.num_tokens % BLOCK, list(req.block_hashes))
                    first_own = len(systems[s]) // BLOCK * 2
                    put_keys(holder, mine[first_own:first_own + 2 * rng.randrange(len(own) // BLOCK + 1)])
                waiting[rid] = req
                if rng.random() < ABORT_FRACTION:
                    abort_at[rid] = step + rng.randint(0, 3)
                arrived += 1
                # No gc.collect() while lookups run: a full collection holds the interpreter long
                # enough (~0.5 s here) for a store call to pass its time limit and answer 0.
                if arrived == warm:
                    rss["warm"] = _rss_mb()
                    blocks["warm"] = sys.getallocatedblocks()
                if arrived % max(1, requests // 10) == 0:
                    trend.append((arrived, round(_rss_mb(), 1), sys.getallocatedblocks()))
                    if progress:
                        progress(f"{arrived:,} requests, resident {trend[-1][1]:.1f} MB, "
                                 f"{trend[-1][2]:,} Python blocks")
            if arrived >= next_reset and arrived < requests:  # vLLM's reset, lookups pending
                if connector.reset_cache() is not True:
                    raise RuntimeError("vLLM's reset_cache failed")
                counts["resets"] += 1
                next_reset += reset_every
                draining = True
        # the schedule: every waiting request asked (an abort first, as vLLM frees it)
        for rid, req in list(waiting.items()):
            if abort_at.get(rid, step + 1) <= step:
                del waiting[rid]
                del abort_at[rid]
                connector.request_finished(req, [])
                finished.add(rid)
                counts["aborted"] += 1
                continue
            tokens, load_async = connector.get_num_new_matched_tokens(req, 0)
            if tokens is None:
                counts["held_polls"] += 1
                continue
            del waiting[rid]
            abort_at.pop(rid, None)
            own = vllm_workers.hit_length(worker.lookup.original(req.num_tokens, list(req.block_hashes)))
            counts["answered"] += 1
            counts["compared_hits"] += own > 0
            if tokens != own or (draining and tokens != 0):
                counts["different"] += 1
                differed.append((rid, step, tokens, own, draining))
            if tokens and load_async:
                landing.add(rid)
            running.append([rng.randint(*RUN_STEPS), req])
        for item in list(running):
            item[0] -= 1
            if item[0] <= 0:
                running.remove(item)
                connector.request_finished(item[1], [])
                finished.add(item[1].request_id)
        batcher = client._batcher
        if arrived >= warm and batcher is not None:
            sizes = {f"batcher {k}": v for k, v in batcher.sizes().items()}
            shared = connector._shared_loads
            if shared is not None:
                sizes.update({f"share_loads {k}": v for k, v in shared.sizes().items()})
            sizes["vLLM load_specs"] = len(sched.load_specs)
            sizes["waiting requests"] = len(waiting)
            for name, size in sizes.items():
                most[name] = max(most.get(name, 0), size)
        time.sleep(STEP_S)
    # the last finished requests, as vLLM's next schedule hands them over
    out = scheduler_output.make_empty()
    out.finished_req_ids = set(finished)
    connector.build_connector_meta(out)
    deadline = time.monotonic() + 5
    while batcher is not None and batcher.sizes()["lookups"] and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    rss["end"] = _rss_mb()
    blocks["end"] = sys.getallocatedblocks()
    stats = batcher.stats.as_dict() if batcher is not None else {}
    counts["store_faults"] = client.engine.stats().store_failures
    return {"requests": requests, **counts, "seconds": time.perf_counter() - start, "most": most,
            "rss_warm_mb": rss.get("warm", 0.0), "rss_end_mb": rss["end"], "blocks_warm": blocks.get("warm", 0),
            "blocks_end": blocks["end"], "trend": trend, "batcher": stats,
            "left_behind": batcher.sizes()["lookups"] if batcher is not None else 0,
            "shared_loads_holds": getattr(connector._shared_loads, "holds", 0), "differed": differed[:20]}


def format_report(f: Dict[str, Any]) -> str:
    """The soak's figures as text."""
    b = f["batcher"]
    lines = [
        f"{f['requests']:,} requests in {f['steps']:,} scheduler steps, {f['seconds']:.1f} s: "
        f"{f['answered']:,} answered ({f['compared_hits']:,} hits), {f['aborted']:,} aborted while waiting, "
        f"{f['resets']} resets (vLLM's reset_cache) with lookups pending",
        f"answers different from vLLM's own lookup on the same store: {f['different']} (store calls failed: "
        f"{f['store_faults']})",
        f"lookups submitted: {b.get('submitted', 0):,}, submitted again while under way: {b.get('replaced', 0)}, "
        f"started again after a reset: {b.get('restarted', 0):,}, discarded: {b.get('discarded', 0):,}; "
        f"answers left behind at the end: {f['left_behind']}",
        f"master calls: {b.get('calls', 0):,} for {f['answered'] + f['aborted']:,} lookups; keys asked "
        f"{b.get('keys_asked', 0):,} of {b.get('keys_wanted', 0):,} wanted ({b.get('keys_reused', 0):,} reused "
        f"within {f['reuse_ms']:.0f} ms, a tenth of the {f['lease_ms']} ms lease)",
        f"resident memory: {f['rss_warm_mb']:.1f} MB after warm-up ({WARMUP:.0%} of the stream), "
        f"{f['rss_end_mb']:.1f} MB at the end ({f['rss_end_mb'] - f['rss_warm_mb']:+.1f} MB); Python's allocated "
        f"blocks {f['blocks_warm']:,} -> {f['blocks_end']:,} ({f['blocks_end'] - f['blocks_warm']:+,})",
        "  at every tenth (requests: MB, blocks): " + ", ".join(f"{n:,}: {mb:.1f}, {b:,}" for n, mb, b in f["trend"]),
        "largest tables after warm-up: " + ", ".join(f"{k} {v:,}" for k, v in sorted(f["most"].items())),
    ]
    return "\n".join(lines)


def check_bounds(f: Dict[str, Any]) -> List[str]:
    """What the soak must show, one line each: empty when everything held."""
    from ..lookup.batch import RECENT_HASHES, RECENT_REQUESTS
    from ..lookup.shared_loads import MAX_RELEASED

    b, most = f["batcher"], f["most"]
    problems = []
    if f["different"]:
        problems.append(f"{f['different']} answers differed from vLLM's own lookup (first: {f['differed'][:3]})")
    if f["store_faults"]:
        problems.append(f"{f['store_faults']} store calls failed (their lookups answered 0)")
    if b.get("replaced"):
        problems.append(f"{b['replaced']} lookups were submitted again while under way")
    if f["left_behind"]:
        problems.append(f"{f['left_behind']} answers were left behind")
    if most.get("batcher lookups", 0) > most.get("waiting requests", 0) + 16:
        problems.append(f"the batcher held {most['batcher lookups']} lookups for at most "
                        f"{most.get('waiting requests', 0)} waiting requests")
    if most.get("batcher recent_requests", 0) > RECENT_REQUESTS:
        problems.append("more recent requests than RECENT_REQUESTS")
    if most.get("batcher distinct_hashes", 0) > RECENT_REQUESTS * min(RECENT_HASHES, max(SYSTEMS) + OWN_BLOCKS[1] + 1):
        problems.append(f"{most['batcher distinct_hashes']} distinct hashes counted")
    if most.get("share_loads released", 0) > MAX_RELEASED:
        problems.append("share_loads remembered more released requests than MAX_RELEASED")
    if most.get("vLLM load_specs", 0) > most.get("waiting requests", 0) + 16 * RUN_STEPS[1] + 16:
        problems.append(f"vLLM's load_specs grew to {most['vLLM load_specs']}")
    return problems
