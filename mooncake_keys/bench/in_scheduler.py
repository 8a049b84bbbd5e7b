"""The lookup in the scheduler against vLLM's ZMQ hop to rank 0, on a real master (vLLM 0.33).

vLLM's scheduler asks rank 0 for every lookup over a ZMQ socket; with ``"lookup_in_scheduler":
true`` the scheduler-side :class:`~mooncake_keys.vllm.FastMooncakeStoreConnector` answers
in-process through its own lookup-only Mooncake client. This measures both paths side by side
on one deployment built by vLLM's own code (the checkout's harness ``support.vllm_workers``:
rank 0's worker with its real ZMQ lookup server, the scheduler connector built as the engine
core builds it), a ``LocalMaster`` and a stored prefix: median ms per lookup, interleaved, and
the answers must agree. Needs vLLM 0.33, the Mooncake client and the harness
(:func:`.vllm_baseline.workers`).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any, Dict, List, Sequence

from .table import text_table

__all__ = ["CFG", "run_in_scheduler", "format_rows"]

#: The deployment: Full(16) + SWA(16, 32) on TP 2 x PP 2 (the tests' in-scheduler deployment).
CFG: Dict[str, Any] = {
    "kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
    "tp_size": 2, "pp_size": 2, "num_kv_heads": 2, "reuse_model_config": True, "lookup_server": True,
    "groups": [{"type": "full", "block_size": 16}, {"type": "swa", "block_size": 16, "sliding_window": 32}],
    "extra_config": {"lookup_in_scheduler": True, "lookup_rpc_port": 9},
}


def run_in_scheduler(hash_counts: Sequence[int] = (64, 1024), repeat: int = 60) -> List[Dict[str, Any]]:
    """One row per request size: ``hashes``, ``keys`` (one-shot keys), ``in_process_ms`` and
    ``zmq_ms`` (medians of ``repeat`` interleaved lookups), ``hit`` (tokens)."""
    from .on_master import master_for_vllm
    from .vllm_baseline import workers

    vllm_workers = workers()

    vllm_workers.quiet(logging.CRITICAL)
    rows = []
    with master_for_vllm() as (_, holder):
        worker = client = None
        try:
            worker = vllm_workers.build_worker(CFG, holder)
            client = vllm_workers.build_scheduler_connector(CFG).connector_scheduler.client
            if not vllm_workers.wait_verified(client):
                raise RuntimeError("the in-scheduler client did not verify its namespaces with rank 0 in 10 s")
            for n in hash_counts:
                rows.append(_measure(worker, client, holder, n, repeat))
        finally:
            if client is not None:
                client.close()
            if worker is not None:
                vllm_workers.release(worker)
    return rows


def _measure(worker: Any, client: Any, holder: Any, n: int, repeat: int) -> Dict[str, Any]:
    """Three quarters of the prefix stored (every group and namespace: rank 0's own keys)."""
    from .on_master import put_keys

    hashes = [n.to_bytes(4, "little") + i.to_bytes(4, "little") * 7 for i in range(n)]
    engine = worker.lookup.engine
    keys = engine.candidate_keys(n * 16, hashes)
    put_keys(holder, engine.candidate_keys(n * 16 * 3 // 4, hashes))
    times: Dict[str, List[float]] = {"in_process": [], "zmq": []}
    answers = set()
    for rnd in range(repeat):
        for name, call in (("in_process", client.lookup), ("zmq", client.zmq.lookup)):
            start = time.perf_counter()
            answer = call(f"{name}-{n}-{rnd}", n * 16, hashes)
            times[name].append((time.perf_counter() - start) * 1e3)
            answers.add(repr(answer))
    if len(answers) != 1:
        raise RuntimeError(f"the two paths disagree: {answers}")
    hit = getattr(engine.lookup_result(n * 16, hashes), "hit_length", 0)
    return dict(hashes=n, keys=len(keys), hit=hit, in_process_ms=statistics.median(times["in_process"]),
                zmq_ms=statistics.median(times["zmq"]))


def format_rows(rows: Sequence[Dict[str, Any]]) -> str:
    return text_table(
        [("hashes", "6d"), ("keys", "6d"), ("hit", "6d"), ("in-process ms", "14.3f"), ("ZMQ to rank 0 ms", "17.3f"),
         ("ratio", "6.2f")],
        [(r["hashes"], r["keys"], r["hit"], r["in_process_ms"], r["zmq_ms"], r["in_process_ms"] / r["zmq_ms"])
         for r in rows])
