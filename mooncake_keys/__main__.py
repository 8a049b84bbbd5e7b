"""Command line: ``python -m mooncake_keys {demo,bench}`` (also the ``mooncake_keys`` script)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake_keys", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="a simulated serving workload: save, lookup, load")
    demo.add_argument("--requests", type=int, default=300, help="number of prompts (default 300)")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--memory", action="store_true", help="use the in-process MemoryStore, not Mooncake")
    bench = sub.add_parser("bench", help="the standard scenarios, side by side with vLLM's approaches")
    bench.add_argument("--repeat", type=int, default=5, help="timed repeats per case (min is kept)")
    bench.add_argument("--plot", default="docs/ns_per_key.png", help="where to write the PNG plot")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command == "demo":
        from .demo import run_demo
        from .memory_store import MemoryStore

        summary = run_demo(args.requests, args.seed, store=MemoryStore() if args.memory else None)
        return 1 if summary["blocks_wrong"] or summary["failed_loads"] else 0
    from .bench import run_bench

    return run_bench(repeat=args.repeat, plot_path=args.plot)


if __name__ == "__main__":
    sys.exit(main())
