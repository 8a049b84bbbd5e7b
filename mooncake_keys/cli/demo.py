"""``mooncake_keys demo``: the serving workload of :mod:`mooncake_keys.bench.demo`."""

from __future__ import annotations

import argparse

HELP = "a simulated serving workload: save, lookup, load"


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from . import positive_int

    parser.add_argument("--requests", type=positive_int, default=300, help="number of prompts (default 300)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory", action="store_true", help="use the in-process MemoryStore, not Mooncake")


def main(args: argparse.Namespace) -> int:
    from ..bench.demo import run_demo
    from ..store.memory import MemoryStore

    summary = run_demo(args.requests, args.seed, store=MemoryStore() if args.memory else None)
    return 1 if summary["blocks_wrong"] or summary["failed_loads"] else 0
