"""``mooncake_keys bench``: the run of :mod:`mooncake_keys.bench.suite`, plots where asked.

The two plots go into ``--plot-dir`` (by default a new temporary directory, whose path is
printed), or to ``--plot`` / ``--master-plot``; every path is checked while the arguments are
parsed, before anything is measured."""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Optional

HELP = "the standard scenarios, side by side with vLLM's approaches"
#: The plots' file names in --plot-dir.
PLOT_NAME, MASTER_PLOT_NAME = "ns_per_key.png", "master_hit_fraction.png"


def _png_path(text: str) -> str:
    if not text.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"the plot is written as PNG: the path must end in .png, got {text!r}")
    why = unwritable(text)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write the plot there: {why}")
    return text


def _plot_dir(text: str) -> str:
    why = unwritable(text, directory=True)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write the plots there: {why}")
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from . import positive_int

    parser.add_argument("--repeat", type=positive_int, default=5,
                        help="timed repeats per case (the median is kept; the ns/key sweep keeps the minimum)")
    parser.add_argument("--quick", action="store_true", help="one short round: a smoke run (about 10 s)")
    parser.add_argument("--no-master", action="store_true", help="skip the lookups on a real mooncake_master")
    parser.add_argument("--plot-dir", type=_plot_dir, metavar="DIR",
                        help=f"where the plots go ({PLOT_NAME}, {MASTER_PLOT_NAME}); default: a new temporary "
                             "directory, printed")
    parser.add_argument("--plot", type=_png_path, metavar="PATH", help="the client-side plot's path")
    parser.add_argument("--master-plot", type=_png_path, metavar="PATH", help="the real-master plot's path")


def unwritable(path: str, directory: bool = False) -> Optional[str]:
    """Why a file (or, with ``directory``, a directory) cannot be written at ``path``, or None.

    The nearest existing directory on the way must take a new file (tried, then removed): a
    permission, a read-only file system or a file in the way is found before any work."""
    path = os.path.abspath(path)
    if os.path.exists(path) and os.path.isdir(path) != directory:
        return f"{path} is {'not ' if directory else ''}a directory"
    if not directory and os.path.exists(path) and not os.access(path, os.W_OK):
        return f"{path} is not writable"
    parent = path if directory else os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"{parent} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=parent, suffix=".png")
    except OSError as exc:
        return f"cannot write in {parent}: {exc.strerror or exc}"
    os.close(fd)
    os.unlink(probe)
    return None


def main(args: argparse.Namespace) -> int:
    plot_dir = args.plot_dir
    if plot_dir is None and not (args.plot and (args.master_plot or args.no_master)):
        plot_dir = tempfile.mkdtemp(prefix="mooncake_keys_bench_")
    plot = args.plot or os.path.join(plot_dir, PLOT_NAME)
    master_plot = args.master_plot or (os.path.join(plot_dir, MASTER_PLOT_NAME) if plot_dir else None)
    if plot_dir is not None:
        print(f"plots go to {os.path.abspath(plot_dir)}")
    from ..bench.suite import run_bench

    return run_bench(repeat=1 if args.quick else args.repeat, plot_path=plot, master=not args.no_master,
                     master_plot=master_plot, quick=args.quick)
