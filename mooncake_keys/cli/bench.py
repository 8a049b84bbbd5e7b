"""``mooncake_keys bench``: the run of :mod:`mooncake_keys.bench.suite`, plots where asked.

The two plots go into ``--plot-dir`` (by default a new temporary directory, whose path is
printed), or to ``--plot`` / ``--master-plot``; every path is checked while the arguments are
parsed, before anything is measured."""

from __future__ import annotations

import argparse
import os
import tempfile

HELP = "the standard scenarios, side by side with vLLM's approaches"
#: The plots' file names in --plot-dir.
PLOT_NAME, MASTER_PLOT_NAME = "ns_per_key.png", "master_hit_fraction.png"


def _plot_dir(text: str) -> str:
    from . import unwritable

    why = unwritable(text, directory=True)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write the plots there: {why}")
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from . import png_path, positive_int

    parser.add_argument("--repeat", type=positive_int, default=5,
                        help="timed repeats per case (the median is kept; the ns/key sweep keeps the minimum)")
    parser.add_argument("--quick", action="store_true", help="one short round: a smoke run (about 10 s)")
    parser.add_argument("--no-master", action="store_true", help="skip the lookups on a real mooncake_master")
    parser.add_argument("--plot-dir", type=_plot_dir, metavar="DIR",
                        help=f"where the plots go ({PLOT_NAME}, {MASTER_PLOT_NAME}); default: a new temporary "
                             "directory, printed")
    parser.add_argument("--plot", type=png_path, metavar="PATH", help="the client-side plot's path")
    parser.add_argument("--master-plot", type=png_path, metavar="PATH", help="the real-master plot's path")


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
