"""Headline figures, outside asv (one process, a few seconds each):

    cd asv_bench && python figures.py [--skip-memory]

1. key building, compiled core, cold (never-seen requests, shapes forgotten; freeing the list
   is included, as in a lookup): ns per key for R = 1, 8, 32 at 2,048 hashes;
2. ns per key at ~10k keys (1,280 hashes x R 8) and ~1M keys (131,072 hashes x R 8), for key
   building and for the whole client-side lookup;
3. the 1M-key lookup's memory: tracemalloc peak during the lookup and the RSS it adds, against the
   total size of its key strings (sum of ``sys.getsizeof``), per implementation. The peak is that
   of a second lookup: for ``c`` it is near 0, since it rewrites the first lookup's strings in
   place; the RSS added is the first lookup's.

Times are the minimum over rounds of the mean of a batch, GC off; memory figures come from a
fresh child process per implementation, so that one's peak does not hide another's.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time

import benchmarks  # noqa: F401  (puts the checkout's tests/ on sys.path: the vllm column's harness)
from mooncake_keys.bench import scenarios
from mooncake_keys.bench import sidebyside


def _ns_per_key(impl: str, scenario: scenarios.Scenario, what: str, rounds: int, batch: int) -> tuple:
    b = scenarios.lookup_bench(impl, scenario, answer=(what == "lookup"))
    call = b.impl.lookup if what == "lookup" else b.impl.candidate_keys
    scenarios.burn_in(b, call)
    keys = scenarios.count_keys(scenario)
    best = float("inf")
    for _ in range(rounds):
        reqs = [b.fresh_request() for _ in range(batch)]
        gc.disable()
        total = 0
        for req in reqs:
            b.impl.forget_shapes()
            t0 = time.perf_counter_ns()
            call(req)
            total += time.perf_counter_ns() - t0
        gc.enable()
        best = min(best, total / batch)
    return keys, best / keys, best / 1e3


def _peak_rss() -> int:
    """Peak RSS in bytes: VmHWM (resettable through clear_refs) where there is /proc, else ru_maxrss."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _memory_child(impl: str) -> None:
    import tracemalloc

    try:  # reset the peak-RSS mark (Linux), which a child inherits from its parent
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    sc = scenarios.grid_scenario(131072, 8)
    b = scenarios.lookup_bench(impl, sc, isolate=True)
    req = b.fresh_request()
    gc.collect()
    rss0 = _peak_rss()
    b.impl.lookup(req)  # the peak RSS this one adds
    rss1 = _peak_rss()
    req2 = b.fresh_request()
    tracemalloc.start()
    b.impl.lookup(req2)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    keys = scenarios.keys_of(sc, req, sc.token_len)
    key_bytes = sum(map(sys.getsizeof, keys))
    print(f"{impl} {len(keys)} {key_bytes} {peak} {rss1 - rss0}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.memory_child:
        _memory_child(args.memory_child)
        return 0

    if not args.skip_memory:
        # Run first, while this process is small: a child starts from its parent's peak RSS.
        print("3. 1M-key lookup (131,072 hashes x R 8, cold): memory vs its key strings")
        print(f"   {'impl':5} {'keys':>8} {'key str MB':>10} {'tracemalloc peak MB':>20} {'ratio':>6} "
              f"{'RSS added MB':>13} {'ratio':>6}")
        for impl in sidebyside.available(scenarios.IMPLS):  # vllm only where vLLM 0.33 is installed
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--memory-child", impl],
                                 capture_output=True, text=True, check=True).stdout.split()
            _, n, kb, peak, rss = out
            kb, peak, rss = int(kb), int(peak), int(rss)
            print(f"   {impl:5} {int(n):8d} {kb / 2**20:10.1f} {peak / 2**20:20.1f} {peak / kb:6.2f} "
                  f"{rss / 2**20:13.1f} {rss / kb:6.2f}")
    print("1. key building, c, cold, 2,048 hashes of 32 B, Full(64):")
    for r in (1, 8, 32):
        keys, nspk, us = _ns_per_key("c", scenarios.grid_scenario(2048, r), "keys", 5, 20)
        print(f"   R={r:2d}: {keys:7d} keys  {us:9.1f} us  {nspk:6.1f} ns/key")

    print("2. ns/key at ~10k and ~1M keys (R=8), cold:")
    for impl in ("c", "py", "seed"):
        for what in ("keys", "lookup"):
            row = []
            for hashes, rounds, batch in ((1280, 5, 20), (131072, 3, 2)):
                keys, nspk, us = _ns_per_key(impl, scenarios.grid_scenario(hashes, 8), what, rounds, batch)
                row.append(f"{keys:8d} keys {nspk:6.1f} ns/key ({us / 1e3:8.2f} ms)")
            print(f"   {impl:4} {what:6}: " + " | ".join(row))

    return 0


if __name__ == "__main__":
    sys.exit(main())
