"""A burst of requests sharing a system prompt, looked up by vLLM's scheduler on a real master:
vLLM's own lookup (over ZMQ to rank 0, synchronous and asynchronous) against the drop-in's in
the scheduler (synchronous, and asynchronous: coalesced).

The deployment is built by vLLM's own code (the checkout's harness ``support.vllm_workers``:
rank 0's worker with its real ZMQ lookup server, the scheduler-side connector as the engine
core builds it), on a
``LocalMaster`` holding the system prompt (every namespace). ``BURST`` requests arrive together
(each the 4,096-token system prompt and 1,024 tokens of its own, TP 4); the scheduler is played
step by step: every step asks ``get_num_new_matched_tokens`` of each request still waiting (the
real connector method, with vLLM's own ``Request`` objects), then takes a step's time; an
asynchronous lookup answers None until it is decided. Measured per path: the scheduler
thread's time per ``get_num_new_matched_tokens`` call (median, p99, max), the steps until every
request was answered, the master calls and keys of the burst, and the keys the answers depend
on (every namespace of every chunk up to and including each request's first absent one: the
shared prompt's once, and one chunk of each request's own). Every path must give every request
the same answer. Needs vLLM 0.33 (or 0.32), the Mooncake client and the harness
(:func:`.vllm_baseline.workers`).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Dict, List, Optional, Sequence

from .table import text_table

__all__ = ["BURST", "SYSTEM_TOKENS", "OWN_TOKENS", "PATHS", "run_burst", "format_rows", "check_targets"]

BURST = 64
SYSTEM_TOKENS = 4096
OWN_TOKENS = 1024
BLOCK = 16
#: (path, connector class, kv_connector_extra_config).
PATHS = (
    ("vLLM sync (ZMQ)", "MooncakeStoreConnector", {}),
    ("vLLM async (ZMQ)", "MooncakeStoreConnector", {"lookup_async": True}),
    ("in-scheduler sync", "FastMooncakeStoreConnector", {"lookup_in_scheduler": True}),
    ("in-scheduler async", "FastMooncakeStoreConnector", {"lookup_in_scheduler": True, "lookup_async": True}),
)
#: A step of the engine between two scheduler passes (the model's forward), seconds.
STEP_S = 0.002
#: Targets (docs/benchmarks.md): scheduler-thread time per call in async mode, and keys per
#: burst over the keys the answers depend on.
ASYNC_CALL_US_TARGET = 50.0
KEYS_OVER_FLOOR_TARGET = 1.1


def _cfg(connector: str, extra: Dict[str, Any], port: int) -> Dict[str, Any]:
    cfg = {"kv_connector": connector, "tp_size": 4, "num_kv_heads": 4, "reuse_model_config": True,
           "lookup_server": True, "groups": [{"type": "full", "block_size": BLOCK}],
           "extra_config": {**extra, "lookup_rpc_port": port}}
    if connector == "FastMooncakeStoreConnector":
        cfg["kv_connector_module_path"] = "mooncake_keys.vllm"
    return cfg


def run_burst(burst: int = BURST, *, progress: Any = None) -> List[Dict[str, Any]]:
    """One row per path (see the module docstring)."""
    import mooncake_keys as mk

    from .on_master import master_for_vllm
    from .vllm_baseline import workers

    vllm_workers = workers()

    vllm_workers.quiet(logging.CRITICAL)
    logging.getLogger("mooncake_keys").setLevel(logging.ERROR)
    rows: List[Dict[str, Any]] = []
    with master_for_vllm() as (_, holder):
        system = list(range(7, 7 + SYSTEM_TOKENS))
        answers: Optional[List[int]] = None
        for i, (name, connector, extra) in enumerate(PATHS):
            counter = mk.RecordingStore(holder)
            worker = vllm_workers.build_worker(_cfg(connector, extra, 20 + i), counter)
            client = None
            try:
                if i == 0:  # the system prompt stored once, by rank 0's own keys
                    first = vllm_workers.make_request("s", system, BLOCK)
                    _store(holder, worker, first.block_hashes, SYSTEM_TOKENS)
                sched = vllm_workers.build_scheduler_connector(_cfg(connector, extra, 20 + i))
                client = sched.connector_scheduler.client
                if not vllm_workers.wait_verified(client):
                    raise RuntimeError(f"{name}: the in-scheduler client did not verify its namespaces in 10 s")
                if hasattr(client, "engine"):  # the scheduler's own store calls, counted
                    client.engine.store = mk.RecordingStore(client.engine.store, record_keys=False)
                requests = [vllm_workers.make_request(f"{name}-{r}", system + [2000 + r] * OWN_TOKENS, BLOCK)
                            for r in range(burst)]
                row = _play(name, sched.connector_scheduler, requests, counter, client)
                if answers is None:
                    answers = row.pop("answers")
                elif row.pop("answers") != answers:
                    raise RuntimeError(f"{name} answers differently from {PATHS[0][0]}")
                row["floor"] = _floor(worker, requests, answers)
                rows.append(row)
                if progress:
                    progress(name)
            finally:
                if client is not None:
                    client.close()
                vllm_workers.release(worker)
    return rows


def _store(holder: Any, worker: Any, block_hashes: Any, tokens: int) -> None:
    from ..lookup.engine import LookupEngine
    from ..vllm.worker import deployment_of_worker
    from .on_master import put_keys
    from ..vllm.versions import contract_for_installed

    engine = LookupEngine.for_deployment(deployment_of_worker(worker, contract_for_installed() or "0.33"),
                                         store=holder)
    put_keys(holder, engine.candidate_keys(tokens, list(block_hashes)))


def _play(name: str, sched: Any, requests: List[Any], counter: Any, client: Any) -> Dict[str, Any]:
    """The scheduler's steps until every request has its answer."""
    calls0, keys0 = _master_counts(counter, client)
    waiting = {r.request_id: r for r in requests}
    answers: Dict[str, int] = {}
    spent: List[float] = []
    steps = 0
    start = time.perf_counter()
    while waiting:
        steps += 1
        for rid, req in list(waiting.items()):
            t0 = time.perf_counter()
            got, _ = sched.get_num_new_matched_tokens(req, 0)
            spent.append(time.perf_counter() - t0)
            if got is not None:
                answers[rid] = got
                del waiting[rid]
        if waiting:
            time.sleep(STEP_S)
        if steps > 20000:
            raise RuntimeError(f"{name}: lookups never answered")
    wall = time.perf_counter() - start
    calls1, keys1 = _master_counts(counter, client)
    spent.sort()
    return {"path": name, "requests": len(requests), "steps": steps, "calls_per_request": len(spent) / len(requests),
            "call_us_median": statistics.median(spent) * 1e6, "call_us_p99": spent[int(0.99 * (len(spent) - 1))] * 1e6,
            "call_us_max": spent[-1] * 1e6, "burst_ms": wall * 1e3, "master_calls": calls1 - calls0,
            "master_keys": keys1 - keys0, "answers": [answers[r.request_id] for r in requests]}


def _master_counts(counter: Any, client: Any) -> tuple:
    """Calls and keys the master got: rank 0's store (vLLM's path) and the scheduler's own."""
    calls, keys = counter.num_calls, counter.keys_asked
    own = getattr(getattr(client, "engine", None), "store", None)
    if own is not None:
        calls += own.num_calls
        keys += own.keys_asked
    return calls, keys


def _floor(worker: Any, requests: List[Any], answers: List[int]) -> int:
    """Distinct keys the answers depend on: every namespace of every chunk up to and including
    each request's first absent one (or its last chunk)."""
    from ..lookup.engine import LookupEngine
    from ..vllm.worker import deployment_of_worker
    from ..vllm.versions import contract_for_installed

    import mooncake_keys as mk

    engine = LookupEngine.for_deployment(deployment_of_worker(worker, contract_for_installed() or "0.33"),
                                         store=mk.RecordingStore())
    keys = set()
    for req, hit in zip(requests, answers):
        hashes = list(req.block_hashes)
        upto = min((hit // BLOCK + 1) * BLOCK, len(hashes) * BLOCK)
        keys.update(engine.candidate_keys(upto, hashes))
    return len(keys)


def format_rows(rows: Sequence[Dict[str, Any]]) -> str:
    return text_table(
        [("path", "20"), ("steps", "5d"), ("calls/req", "9.2f"), ("call us med", "11.1f"), ("p99", "8.1f"),
         ("max", "9.1f"), ("burst ms", "9.1f"), ("master calls", "12d"), ("keys", "7d"), ("floor", "6d"),
         ("keys/floor", "10.2f")],
        [(r["path"], r["steps"], r["calls_per_request"], r["call_us_median"], r["call_us_p99"], r["call_us_max"],
          r["burst_ms"], r["master_calls"], r["master_keys"], r["floor"], r["master_keys"] / max(1, r["floor"]))
         for r in rows])


def check_targets(rows: Sequence[Dict[str, Any]]) -> List[str]:
    out = []
    for r in rows:
        if r["path"] == "in-scheduler async":
            ok = r["call_us_median"] <= ASYNC_CALL_US_TARGET
            out.append(f"target async scheduler-thread time per call <= {ASYNC_CALL_US_TARGET:g} us: "
                       f"median {r['call_us_median']:.1f} us (p99 {r['call_us_p99']:.1f}), {'met' if ok else 'NOT met'}")
            ratio = r["master_keys"] / max(1, r["floor"])
            out.append(f"target keys per burst <= {KEYS_OVER_FLOOR_TARGET:g} x the keys the answers depend on: "
                       f"{ratio:.2f} ({r['master_keys']} / {r['floor']}), {'met' if ratio <= KEYS_OVER_FLOOR_TARGET else 'NOT met'}")
    return out
