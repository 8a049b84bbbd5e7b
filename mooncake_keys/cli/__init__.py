"""The command line: ``mooncake_keys {demo,bench,explain}`` (also ``python -m mooncake_keys``).

It parses arguments and prints; what runs lives in :mod:`mooncake_keys.bench` (``demo``: the
serving workload, ``suite``: the benchmark run), :mod:`mooncake_keys.lookup.explain` (the
explanation) and :mod:`mooncake_keys.report` (its text and heat map). Each subcommand module has
``HELP``, ``add_cli_args`` and ``main(args)``; the argument types and the one-line error they
share are in :mod:`.args` (which imports none of them).

Exit statuses (:data:`EXIT_STATUSES`, also in ``--help``): 0 done; 1 the run failed what it
checks (demo: a wrong or failed load; bench: a target NOT met, unless ``--report-only``) or the
master cannot be reached; 2 bad arguments, or a ``MOONCAKE_KEYS_MASTER`` / ``MOONCAKE_CONFIG_PATH``
that cannot be used (every command checks them before any work, through
:func:`mooncake_keys.store.default.configured_master`); 3 (explain) a lookup too large to
explain; 130 interrupted (Ctrl-C). Every error is one line on stderr, naming what is wrong."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import tempfile
import textwrap
from types import FrameType
from typing import Callable, List, Optional

from . import bench, demo, explain
from .args import MAX_COUNT, error, png_path, positive_int, unwritable, whole_number

#: What each exit status means (the ``--help`` epilog).
EXIT_STATUSES = (
    (0, "done"),
    (1, "the run failed what it checks (demo: a wrong or failed load; bench: a target NOT met, unless "
        "--report-only), or the master cannot be reached"),
    (2, "bad arguments, or a MOONCAKE_KEYS_MASTER / MOONCAKE_CONFIG_PATH that cannot be used (checked by every "
        "command before any work)"),
    (3, "explain: a lookup too large to explain"),
    (130, "interrupted (Ctrl-C): what it started is stopped first"),
)
#: The exit status of a run stopped by Ctrl-C (128 + SIGINT, as a shell reports it).
INTERRUPTED = 130

def _interrupt_once(signum: int, frame: Optional[FrameType]) -> None:
    """The first Ctrl-C stops the run (KeyboardInterrupt); later ones are ignored while what it
    started is stopped."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise KeyboardInterrupt


def main(argv: Optional[List[str]] = None) -> int:
    epilog = "exit status:\n" + "\n".join(textwrap.fill(what, 96, initial_indent=f"  {code:<4} ",
                                                         subsequent_indent=" " * 7) for code, what in EXIT_STATUSES)
    parser = argparse.ArgumentParser(prog="mooncake_keys", description=__doc__.split("\n\n")[0], epilog=epilog,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"demo": demo, "bench": bench, "explain": explain}
    for name, module in commands.items():
        module.add_cli_args(sub.add_parser(name, help=module.HELP, description=module.HELP, epilog=epilog,
                                           formatter_class=argparse.RawDescriptionHelpFormatter))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from ..store.default import BadMasterSetting, configured_master

    try:
        configured_master()
    except BadMasterSetting as exc:
        return error(args.command, exc, 2)
    before = signal.getsignal(signal.SIGINT)
    if before is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupt_once)
    try:
        return commands[args.command].main(args)
    except KeyboardInterrupt:
        print(f"mooncake_keys {args.command}: interrupted (Ctrl-C); what it started is stopped", file=sys.stderr,
              flush=True)
        return INTERRUPTED
    finally:
        if before is signal.default_int_handler:
            signal.signal(signal.SIGINT, before)
