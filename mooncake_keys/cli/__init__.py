"""The command line: ``mooncake_keys {demo,bench}`` (also ``python -m mooncake_keys``).

It parses arguments and prints; what runs lives in :mod:`mooncake_keys.bench` (``demo``: the
serving workload, ``suite``: the benchmark run). Each subcommand module has ``add_cli_args`` and
``main(args)``."""

from __future__ import annotations

import argparse
import logging
from typing import List, Optional

from . import bench, demo

#: The most prompts a demo serves, or repeats a bench takes: enough for any run, bounded.
MAX_COUNT = 100_000


def positive_int(text: str) -> int:
    """An argparse type: a whole number from 1 to :data:`MAX_COUNT`."""
    try:
        value = int(text) if len(text) <= 12 else MAX_COUNT + 1
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if not 1 <= value <= MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be from 1 to {MAX_COUNT}, got {text}")
    return value


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="mooncake_keys", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"demo": demo, "bench": bench}
    for name, module in commands.items():
        module.add_cli_args(sub.add_parser(name, help=module.HELP, description=module.HELP))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    return commands[args.command].main(args)
