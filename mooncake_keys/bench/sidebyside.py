"""The implementations side by side on the standard scenarios, in one process, without asv.

    >>> from mooncake_keys.bench.sidebyside import run_standard, format_table
    >>> print(format_table(run_standard()))

For every standard scenario (``scenarios.STANDARD``) and mode (cold: requests the engine has never
seen, made before the timer, plan caches cleared; warm: the same request again, in steady
state) each implementation is timed in turn, interleaved round after round, so that a noisy
machine slows all of them alike. A sample is a batch of lookups timed with
``time.perf_counter_ns`` (GC off, as ``timeit`` does); the figure kept is the median over
``repeat`` rounds. The store is ``scenarios.stub_store``: only client-side work
(key building, reduction, coordinator) is timed.
"""

from __future__ import annotations

import gc
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from .scenarios import IMPLS, SCENARIOS, STANDARD, Impl, Request, build_impl, make_request, membership_answer, stub_store
from .table import text_table
from ..lookup import _core

__all__ = ["available", "format_table", "run_standard", "sample_ns"]

Progress = Optional[Callable[[str], Any]]


def available(impls: Sequence[str]) -> List[str]:
    from .vllm_baseline import unavailable

    out = []
    for impl in impls:
        if impl == "c" and _core._core_c is None:
            continue  # no compiled core: no "c" rows
        if impl == "vllm" and unavailable() is not None:
            continue  # no vLLM 0.33 here: no "vllm" rows (the command says why)
        out.append(impl)
    return out


def _minor_faults() -> int:
    try:
        import resource
    except ImportError:  # not on Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def sample_ns(runner: "Impl", reqs: Sequence["Request"], cold: bool) -> Tuple[int, int]:
    """Wall time of one batch of lookups in ns, and the minor page faults it took.

    For cold lookups forgetting the shapes stays outside the timer (each call is timed on its
    own)."""
    lookup, forget = runner.lookup, runner.forget_shapes
    gc_was = gc.isenabled()
    gc.disable()
    try:
        faults = _minor_faults()
        if cold:
            clock = time.perf_counter_ns
            total = 0
            for req in reqs:
                forget()
                t0 = clock()
                lookup(req)
                total += clock() - t0
            return total, _minor_faults() - faults
        t0 = time.perf_counter_ns()
        for req in reqs:
            lookup(req)
        total = time.perf_counter_ns() - t0
        return total, _minor_faults() - faults
    finally:
        if gc_was:
            gc.enable()


def run_standard(repeat: int = 5, progress: Progress = None, *, impls: Sequence[str] = tuple(IMPLS),
                 scenarios: Sequence[str] = tuple(STANDARD), modes: Sequence[str] = ("cold", "warm"),
                 sample_ms: float = 20.0, max_batch: int = 50) -> List[Dict[str, Any]]:
    """Time each impl on the standard scenarios (or any of ``scenarios.SCENARIOS``: the flagship
    layouts run the impls they name), cold and warm; one row per (scenario, mode, impl).

    Row fields: ``scenario``, ``mode``, ``impl``, ``keys`` (keys sent per lookup), ``ns_per_lookup``,
    ``ns_per_key``, ``lookups_per_s``, ``ratio_vs_seed``, ``ratio_vs_pre`` and ``ratio_vs_vllm``
    (this impl's time over the baseline's: below 1 is faster; None when that baseline was not
    run), ``hit`` (tokens),
    ``faults_per_lookup`` (minor page faults per lookup in the kept sample: a young process's
    allocator maps fresh memory for a while, which makes cold lookups slower; see
    ``scenarios.burn_in``).
    ``sample_ms`` is the target length of one timed batch (at most ``max_batch`` lookups).
    ``progress`` (if given) is called with a short text after each scenario is prepared and
    after each round. Raises RuntimeError if the implementations disagree on a hit, or if a cold
    lookup was served by the engine's key cache.
    """
    rows: List[Dict[str, Any]] = []
    for sname in scenarios:
        sc = SCENARIOS[sname]
        here = available([i for i in impls if i in sc.impls])
        first = make_request(sc, 0)
        store = stub_store(membership_answer(sc, first))
        runners = {impl: build_impl(impl, sc, store) for impl in here}
        keys = len(store.answer)
        hits = {}
        for impl, runner in runners.items():  # twice: the engine keeps a request on its second sight
            hits[impl] = [runner.lookup(first) for _ in range(2)][-1]
        if len(set(hits.values())) != 1:
            raise RuntimeError(f"scenario {sname}: implementations disagree on the hit: {hits}")
        batch = _batch_sizes(runners, first, modes, sample_ms, max_batch)
        n_cold = max((batch[("cold", i)] for i in here), default=0) if "cold" in modes else 0
        if progress:
            progress(f"scenario {sname}: {keys} keys per lookup")
        samples: Dict[tuple, List[Tuple[float, float]]] = {k: [] for k in batch}
        issued = 0
        for rnd in range(repeat):
            # Cold: never-seen requests, made before the timer; the same ones for every impl
            # (each engine sees each of them once).
            fresh = [make_request(sc, issued + 1 + i) for i in range(n_cold)]
            issued += n_cold
            for mode in modes:
                for impl, runner in runners.items():
                    n = batch[(mode, impl)]
                    if mode == "cold":
                        hits_before = runner.key_cache_hits()
                        ns, flt = sample_ns(runner, fresh[:n], cold=True)
                        if runner.key_cache_hits() != hits_before:
                            raise RuntimeError(f"scenario {sname}: a cold {impl} lookup hit the key cache")
                    else:
                        ns, flt = sample_ns(runner, [first] * n, cold=False)
                    samples[(mode, impl)].append((ns / n, flt / n))
            if progress:
                progress(f"scenario {sname}: round {rnd + 1}/{repeat}")
        rows += _rows(sname, keys, hits, samples, modes, here)
    return rows


def _batch_sizes(runners: Dict[str, "Impl"], first: "Request", modes: Sequence[str],
                 sample_ms: float, max_batch: int) -> Dict[tuple, int]:
    """Lookups per timed sample, per (mode, impl), from one warm calibration lookup each (a cold
    lookup is slower: fewer calls)."""
    batch: Dict[tuple, int] = {}
    for mode in modes:
        for impl, runner in runners.items():
            t = sample_ns(runner, [first], cold=False)[0]
            batch[(mode, impl)] = max(1, min(max_batch, int(sample_ms * 1e6 / max(t, 1))))
    return batch


def _rows(sname: str, keys: int, hits: Dict[str, int], samples: Dict[tuple, List[Tuple[float, float]]],
          modes: Sequence[str], impls: Sequence[str]) -> List[Dict[str, Any]]:
    """The table rows of one scenario: medians, and ratios to the baselines run."""
    median = {k: sorted(v)[len(v) // 2] for k, v in samples.items()}
    rows = []
    for mode in modes:
        for impl in impls:
            ns, flt = median[(mode, impl)]
            base = {b: median[(mode, b)][0] if (mode, b) in median else None for b in ("seed", "pre", "vllm")}
            rows.append(dict(
                scenario=sname, mode=mode, impl=impl, keys=keys,
                ns_per_lookup=ns, ns_per_key=ns / keys if keys else math.nan,
                lookups_per_s=1e9 / ns if ns else math.inf,
                **{f"ratio_vs_{b}": ns / t if t else None for b, t in base.items()},
                hit=hits[impl], faults_per_lookup=flt,
            ))
    return rows


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    """The rows as a fixed-width text table."""
    return text_table(
        [("scenario", "8"), ("mode", "5"), ("impl", "5"), ("keys", "7d"), ("us/lookup", "10.1f"), ("ns/key", "8.1f"),
         ("lookups/s", "10.1f"), ("vs vllm", "8.3f"), ("vs seed", "8.3f"), ("vs pre", "8.3f"), ("faults", "7.1f")],
        [(r["scenario"], r["mode"], r["impl"], r["keys"], r["ns_per_lookup"] / 1e3, r["ns_per_key"], r["lookups_per_s"],
          r.get("ratio_vs_vllm"), r["ratio_vs_seed"], r["ratio_vs_pre"], r.get("faults_per_lookup", 0))
         for r in rows])


if __name__ == "__main__":
    import sys as _sys

    t0 = time.perf_counter()
    table = format_table(run_standard(progress=lambda s: print(s, file=_sys.stderr)))
    print(table)
    print(f"({time.perf_counter() - t0:.1f} s)", file=_sys.stderr)
