"""The command line: ``mooncake_keys {demo,bench}`` (also ``python -m mooncake_keys``)."""

from __future__ import annotations

import argparse
import logging
from typing import List, Optional


#: The most prompts a demo serves, or repeats a bench takes: enough for any run, bounded.
MAX_COUNT = 100_000


def _positive_int(text: str) -> int:
    try:
        value = int(text) if len(text) <= 12 else MAX_COUNT + 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_COUNT}, got {text}")
    return value


def _png_path(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is written as PNG: the path must end in .png, got {text!r}")
    return text


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake_keys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a simulated serving workload: save, lookup, load")
    demo.add_argument("--requests", type=_positive_int, default=300, help="number of prompts (default 300)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--memory", action="store_true", help="use the in-process MemoryStore, not Mooncake")
    bench = sub.add_parser("bench", help="the standard scenarios, side by side with vLLM's approaches")
    bench.add_argument("--repeat", type=_positive_int, default=5, help="timed repeats per case (the median is kept; the ns/key sweep keeps the minimum)")
    bench.add_argument("--quick", action="store_true", help="one short round: a smoke run (about 10 s)")
    bench.add_argument("--plot", type=_png_path, default="docs/ns_per_key.png", help="where to write the client-side PNG plot")
    bench.add_argument("--no-master", action="store_true", help="skip the lookups on a real mooncake_master")
    bench.add_argument("--master-plot", type=_png_path, default="docs/master_hit_fraction.png",
                       help="where to write the real-master PNG plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from ..store.memory import MemoryStore
        from .demo import run_demo

        summary = run_demo(args.requests, args.seed, store=MemoryStore() if args.memory else None)
        return 1 if summary["blocks_wrong"] or summary["failed_loads"] else 0
    from .bench import run_bench

    return run_bench(repeat=1 if args.quick else args.repeat, plot_path=args.plot, master=not args.no_master,
                     master_plot=args.master_plot, quick=args.quick)


