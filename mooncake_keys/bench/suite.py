"""The run of ``mooncake_keys bench``: the standard scenarios and the flagship layouts
(DeepSeek-V4-Flash's and Qwen3-Next's, ``scenarios.FLAGSHIP``) side by side with vLLM's own lookup.

The scenarios and baselines live in ``mooncake_keys.bench``, so the command works from an
installed wheel: ``vllm`` is the installed vLLM 0.33's real lookup (left out, with a note,
where vLLM 0.33 or the checkout's worker harness is missing; ``bash scripts/dev.sh bench``
runs in a vLLM 0.33 venv with the harness on the path),
``seed`` vLLM PR #46188 and ``pre`` the code before it (re-expressed). It prints a table (ns
per key, lookups/s, ratios), the geometric means over the standard scenarios against the
targets, the sweep of ns per key against keys per lookup (with its PNG plot where a path is
given) and the scaling from ~10k to ~1M keys. Then, where the Mooncake
client and ``mooncake_master`` are installed, lookups on a real master on loopback by fraction of
the prefix stored (``mooncake_keys.bench.on_master``: one-shot, rounds, vLLM 0.33), with the
rounds targets and a second plot, and the in-scheduler lookup against vLLM's ZMQ hop to rank 0
(``mooncake_keys.bench.in_scheduler``, where vLLM 0.33 is installed), and a burst of requests
sharing a system prompt, vLLM's lookups against the in-scheduler ones, synchronous and
asynchronous (``mooncake_keys.bench.burst``).
"""

from __future__ import annotations

import math
import os
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..lookup import _core
from . import sidebyside
from .scenarios import (FLAGSHIP, IMPLS, STANDARD, build_impl, burn_in, grid_scenario, lookup_bench, make_request,
                        membership_answer, prime, stub_store)

__all__ = ["run_bench", "missed_targets", "summarise", "speedup", "sweep", "scaling", "scaling_lines", "plot", "master_unavailable"]

#: (mode, impl, scenarios, at least this many times faster than vLLM 0.33): the targets of docs/benchmarks.md
#: (the standard scenarios a-e; the flagship layouts f, g: DeepSeek-V4-Flash's and Qwen3-Next's).
TARGETS = (("cold", "c", "abcde", 20.0), ("warm", "c", "abcde", 60.0), ("cold", "c", "d", 20.0),
           ("cold", "py", "abcde", 2.0), ("cold", "c", "fg", 40.0), ("warm", "c", "fg", 200.0))
#: The scenario sets whose geometric means the summary gives.
SUMMARISED = ("".join(STANDARD), "".join(FLAGSHIP))
SWEEP_HASHES = (256, 1024, 4096, 16384)  # x 8 namespaces: 2k .. 131k keys per lookup


class _Bar:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        self.total, self.done, self.t0 = total, 0, time.perf_counter()

    def step(self, text: str) -> None:
        self.done = min(self.done + 1, self.total)
        width = 30
        fill = int(width * self.done / self.total)
        sys.stderr.write(f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                         f"{time.perf_counter() - self.t0:5.1f}s {text[:40]:40}")
        sys.stderr.flush()

    def close(self) -> None:
        sys.stderr.write("\n")


def _geomean(values: Sequence[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else math.nan


def speedup(rows: Sequence[Dict[str, Any]], mode: str, impl: str, scenarios: str, base: str) -> float:
    """Geometric mean over ``scenarios`` of how many times faster ``impl`` is than ``base``."""
    ratios = [r[f"ratio_vs_{base}"] for r in rows if r["mode"] == mode and r["impl"] == impl
              and r["scenario"] in scenarios and r.get(f"ratio_vs_{base}")]
    return 1 / _geomean(ratios) if ratios else math.nan


def summarise(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """Geometric-mean speed-ups per mode and implementation, and the targets against vLLM 0.33."""
    ran = {r["scenario"] for r in rows}
    lines = []
    for names in ("".join(n for n in group if n in ran) for group in SUMMARISED):
        for mode in ("cold", "warm"):
            for impl in ("c", "py"):
                parts = [f"{speedup(rows, mode, impl, names, b):6.1f}x vs {b}" for b in ("vllm", "seed", "pre")
                         if names and not math.isnan(speedup(rows, mode, impl, names, b))]
                if parts:
                    lines.append(f"{mode:4} {impl:2}: " + ", ".join(parts) + f" (geometric mean of {', '.join(names)})")
    for mode, impl, scen, target in TARGETS:
        got = speedup(rows, mode, impl, scen, "vllm")
        if not math.isnan(got):
            verdict = "met" if got >= target else "NOT met"
            lines.append(f"target {mode} {impl} on {','.join(scen)} >= {target:g}x vLLM 0.33: {got:.1f}x, {verdict}")
    return lines


def missed_targets(lines: Sequence[str]) -> List[str]:
    """The target lines of a run (``target ...``, each ending in its verdict) that say NOT met."""
    return [line.strip() for line in lines if line.strip().startswith("target ") and "NOT met" in line]


def verdict(lines: Sequence[str], report_only: bool) -> Tuple[str, int]:
    """The closing line over a run's target lines, and the exit status: 1 when one is NOT met,
    unless ``report_only`` (then the run only reports)."""
    checked = [line for line in lines if line.strip().startswith("target ")]
    missed = missed_targets(checked)
    if not missed:
        return f"targets: all {len(checked)} met", 0
    if report_only:
        return f"targets: {len(missed)} of {len(checked)} NOT met (--report-only: exit 0)", 0
    return f"targets: {len(missed)} of {len(checked)} NOT met (exit 1; --report-only only reports)", 1


def sweep(repeat: int, bar: _Bar) -> Dict[str, List[tuple]]:
    """Cold ns per key against keys per lookup, Full(64) on 8 namespaces, for each impl."""
    out: Dict[str, List[tuple]] = {impl: [] for impl in IMPLS}
    impls = sidebyside.available(IMPLS)
    for n in SWEEP_HASHES:
        sc = grid_scenario(n, 8, "full", 32)
        first = make_request(sc, 0)
        store = stub_store(membership_answer(sc, first))
        runners = {impl: build_impl(impl, sc, store) for impl in impls}
        keys = len(store.answer)
        best = {impl: math.inf for impl in impls}
        for rnd in range(repeat):
            reqs = [make_request(sc, 1 + rnd * 4 + i) for i in range(3 if n <= 4096 else 1)]
            for impl, runner in runners.items():
                ns, _ = sidebyside.sample_ns(runner, reqs, cold=True)
                best[impl] = min(best[impl], ns / len(reqs))
        for impl in impls:
            out[impl].append((keys, best[impl] / keys))
        bar.step(f"sweep: {keys} keys per lookup")
    return out


#: Hashes per lookup of the scaling check, x 8 namespaces: ~10k, ~131k and ~1M keys.
SCALING_HASHES = (1280, 16384, 131072)
#: The scaling target (docs/benchmarks.md): ns per key at ~1M keys at most this many times that at ~10k.
SCALING_TARGET = 2.0


def scaling(repeat: int, bar: _Bar) -> List[Dict[str, Any]]:
    """The compiled core's ns per key, cold and warm, at ~10k, ~131k and ~1M keys (Full(64),
    8 namespaces), each after the allocator has settled (``scenarios.burn_in``); the median
    of ``repeat`` rounds, cold and warm interleaved."""
    rows = []
    impl = "c" if _core._core_c is not None else "py"
    for n in SCALING_HASHES:
        sc = grid_scenario(n, 8, "full", 32)
        b = lookup_bench(impl, sc)
        prime(b, b.impl.lookup)
        burn_in(b, b.impl.lookup)
        keys = len(b.answer)
        batch = max(1, min(20, 200_000 // keys))
        samples: Dict[str, List[float]] = {"cold": [], "warm": []}
        for _ in range(repeat):
            fresh = [b.fresh_request() for _ in range(batch)]
            samples["cold"].append(sidebyside.sample_ns(b.impl, fresh, cold=True)[0] / batch / keys)
            samples["warm"].append(sidebyside.sample_ns(b.impl, [b.pool[0]] * batch, cold=False)[0] / batch / keys)
        med = {m: sorted(v)[len(v) // 2] for m, v in samples.items()}
        rows.append(dict(impl=impl, keys=keys, cold=med["cold"], warm=med["warm"]))
        bar.step(f"scaling: {keys} keys per lookup")
    return rows


def scaling_lines(rows: Sequence[Dict[str, Any]]) -> List[str]:
    lines = [f"{r['impl']} {r['keys']:8d} keys: cold {r['cold']:6.1f} ns/key, warm {r['warm']:6.1f} ns/key "
             f"(warm/cold {r['warm'] / r['cold']:.2f})" for r in rows]
    small, big = rows[0], rows[-1]
    growth = big["cold"] / small["cold"]
    lines.append(f"target ns/key at {big['keys']} keys <= {SCALING_TARGET:g}x at {small['keys']} (cold): "
                 f"{growth:.2f}x, {'met' if growth <= SCALING_TARGET else 'NOT met'}")
    worst = max(r["warm"] / r["cold"] for r in rows)
    lines.append(f"target warm never slower than cold: worst warm/cold {worst:.2f} "
                 f"({'met' if worst <= 1.05 else 'NOT met'}; within 5 % counts as equal: a request too "
                 f"large for the key cache is not admitted, so warm repeats the cold work)")
    return lines


def plot(points: Dict[str, List[tuple]], path: str) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    styles = {"c": "o-", "py": "s-", "seed": "^--", "pre": "v--", "vllm": "D-"}
    names = {"c": "mooncake_keys (compiled)", "py": "mooncake_keys (pure Python)",
             "seed": "vLLM #46188 (seed)", "pre": "vLLM before #46188 (pre)", "vllm": "vLLM 0.33 (its own lookup)"}
    for impl, pts in points.items():
        if pts:
            ax.plot([k for k, _ in pts], [v for _, v in pts], styles[impl], label=names[impl])
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("keys per lookup (Full(64), 8 namespaces, 32-byte hashes)")
    ax.set_ylabel("client-side ns per key (cold)")
    ax.set_title("Lookup cost per key, stub store, one run side by side")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def master_unavailable() -> Optional[str]:
    """Why the real-master section cannot run here, or None when it can."""
    # The client's log level is read at the first import of mooncake.store: this may be it, so the
    # quiet default of store/mooncake.py applies here too (else every INFO line of the client shows).
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # ImportError, or a missing system library
        return f"the Mooncake client cannot be imported ({type(exc).__name__}: {exc}); pip install 'mooncake-keys[mooncake]'"
    from ..store.local_master import LocalMasterError, find_master_executable

    try:
        find_master_executable()
    except LocalMasterError as exc:
        return str(exc)
    return None


def run_master_section(repeat: int, plot_path: Optional[str], quick: bool, out=print) -> List[str]:
    """Lookups on a real mooncake_master by hit fraction: one-shot, rounds and vLLM 0.33; returns
    its target lines."""
    from . import on_master

    missing = master_unavailable()
    if missing:
        out(f"note: no real-master section in this run: {missing}")
        return []
    scenarios, fractions = ("af", (0.0, 0.1, 1.0)) if quick else (on_master.SCENARIOS, on_master.HIT_FRACTIONS)
    out(f"\nreal mooncake_master on loopback: scenarios {', '.join(scenarios)}, prefix stored "
        f"{', '.join(f'{f:.0%}' for f in fractions)}; median of {repeat} interleaved lookups each")
    bar = _Bar(len(scenarios) * len(fractions))
    t0 = time.perf_counter()
    rows = on_master.run_on_master(scenarios=scenarios, fractions=fractions, repeat=repeat, progress=bar.step)
    bar.close()
    out(on_master.format_table(rows))
    lines = on_master.check_targets(rows)
    for line in lines:
        out(line)
    if plot_path:
        written = on_master.plot(rows, plot_path)
        out(f"plot: {written}" if written else "plot: matplotlib is not installed (pip install matplotlib)")
    out(f"({time.perf_counter() - t0:.1f} s)")
    return lines


def run_in_scheduler_section(repeat: int, out=print) -> None:
    """The in-scheduler lookup against vLLM's ZMQ hop to rank 0 (needs vLLM 0.33 and Mooncake)."""
    from .vllm_baseline import unavailable

    missing = unavailable() or master_unavailable()
    if missing:
        out(f"note: no in-scheduler section in this run: {missing}")
        return
    from . import in_scheduler

    out("\nlookup in the scheduler vs vLLM's ZMQ hop to rank 0 (vLLM 0.33's own connectors, real master; "
        f"median of {repeat} interleaved lookups, 75% of the prefix stored):")
    t0 = time.perf_counter()
    out(in_scheduler.format_rows(in_scheduler.run_in_scheduler(repeat=repeat)))
    out(f"({time.perf_counter() - t0:.1f} s)")


def run_burst_section(out=print) -> List[str]:
    """A burst of requests sharing a system prompt: vLLM's lookups against the in-scheduler ones,
    synchronous and asynchronous (needs vLLM 0.32+ and Mooncake); returns its target lines."""
    from .vllm_baseline import unavailable

    missing = unavailable() or master_unavailable()
    if missing:
        out(f"note: no burst section in this run: {missing}")
        return []
    from . import burst

    out(f"\na burst of {burst.BURST} requests sharing a {burst.SYSTEM_TOKENS}-token system prompt, TP 4, real master "
        "(vLLM's own connectors; scheduler-thread time per get_num_new_matched_tokens call):")
    t0 = time.perf_counter()
    rows = burst.run_burst()
    out(burst.format_rows(rows))
    lines = burst.check_targets(rows)
    for line in lines:
        out(line)
    out(f"({time.perf_counter() - t0:.1f} s)")
    return lines


def run_bench(repeat: int = 5, plot_path: Optional[str] = None, out=print, *, master: bool = True,
              master_plot: Optional[str] = None, quick: bool = False, report_only: bool = False) -> int:
    """The whole run, printed through ``out``; the two PNG plots go to ``plot_path`` (client
    side) and ``master_plot`` (real master), none where a path is None. ``quick``: one short
    round of the real-master section. It closes on a verdict over every target it checked
    (:func:`verdict`) and returns the exit status: 1 when a target is NOT met, unless
    ``report_only``."""
    from .vllm_baseline import unavailable

    out(f"core: {'compiled' if _core.ACCELERATED else 'pure Python'}; stub store (client-side work only); "
        f"median of {repeat} rounds, implementations interleaved")
    missing = unavailable()
    if missing:
        out(f"note: no vLLM 0.33 baseline in this run: {missing}")
    scenarios = tuple(STANDARD) + tuple(FLAGSHIP)
    bar = _Bar(len(scenarios) * (repeat + 1) + len(SWEEP_HASHES) + len(SCALING_HASHES))
    t0 = time.perf_counter()
    rows = sidebyside.run_standard(repeat=repeat, progress=bar.step, scenarios=scenarios)
    points = sweep(max(2, repeat // 2), bar)
    scale = scaling(max(3, repeat), bar)
    bar.close()
    out(sidebyside.format_table(rows))
    out("ratios: this implementation's time / the baseline's (below 1 is faster)")
    checked = []
    for line in summarise(rows):
        out(line)
        checked.append(line)
    out("cold ns per key by keys per lookup: " + "; ".join(
        f"{impl} " + ", ".join(f"{k}:{v:.0f}" for k, v in pts) for impl, pts in points.items() if pts))
    out("scaling (client side, stub store):")
    for line in scaling_lines(scale):
        out("  " + line)
        checked.append(line)
    if plot_path:
        written = plot(points, plot_path)
        out(f"plot: {written}" if written else "plot: matplotlib is not installed (pip install matplotlib)")
    out(f"({time.perf_counter() - t0:.1f} s)")
    if master:
        checked += run_master_section(max(3, 3 * repeat), master_plot, quick, out)
        run_in_scheduler_section(max(5, 10 * repeat), out)
        checked += run_burst_section(out)
    line, status = verdict(checked, report_only)
    out(line)
    return status
