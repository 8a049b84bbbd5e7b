"""The command line: it parses and prints, refuses bad arguments before any work, and writes the
benchmark's plots only where asked (by default into a new temporary directory it names)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from mooncake_keys import cli
from mooncake_keys.bench import engine_bench, engine_demo, suite
from mooncake_keys.bench.engine import MatchedCall


@pytest.mark.parametrize("argv, message", [
    (["demo", "--requests", "0"], "must be from 1 to 100000"),
    (["bench", "--repeat", "0"], "must be from 1 to 100000"),
    (["demo", "--memory", "--requests", "9" * 26], "must be from 1 to 100000"),  # ran without bound
    (["bench", "--quick", "--no-master", "--plot", "x.txt"], "must end in .png"),  # died after the run
    (["bench", "--master-plot", "plot"], "must end in .png"),
    (["bench", "--engine", "--quick", "--engine-plot", "engine.txt"], "must end in .png"),
    (["bench", "--engine", "--quick", "--engine-plot", "/proc/engine.png"], "cannot write the plot"),
    (["bench", "--engine-plot", "engine.png"], "--engine-plot is the plot of --engine"),
    (["demo", "--vllm", "--memory"], "--vllm takes no --memory"),
])
def test_bad_counts_and_paths_are_refused_before_any_work(argv, message):
    out = subprocess.run([sys.executable, "-m", "mooncake_keys", *argv], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr


@pytest.fixture
def runs(monkeypatch):
    """``suite.run_bench`` recorded instead of run; it writes the plots it is given."""
    calls = []

    def fake_run_bench(**kw):
        calls.append(kw)
        for path in (kw["plot_path"], kw["master_plot"]):
            if path:
                os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(b"png")
        return 0

    monkeypatch.setattr(suite, "run_bench", fake_run_bench)
    return calls


def test_an_unwritable_plot_path_is_refused_before_measuring(runs, tmp_path, capsys):
    in_the_way = tmp_path / "file"
    in_the_way.write_text("")
    a_dir = tmp_path / "dir.png"
    a_dir.mkdir()
    for argv in (["--plot", str(in_the_way / "plot.png")], ["--master-plot", str(in_the_way / "a" / "b.png")],
                 ["--plot-dir", str(in_the_way)], ["--plot", str(a_dir)],
                 ["--plot", "/proc/plot.png"], ["--plot-dir", "/proc/plots"]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "cannot write the plot" in err and argv[0] in err, err
    assert runs == []  # nothing was measured


def test_plots_go_where_asked(runs, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["bench", "--quick", "--plot-dir", "plots"]) == 0
    assert sorted(os.listdir(tmp_path / "plots")) == ["master_hit_fraction.png", "ns_per_key.png"]
    assert f"plots go to {tmp_path / 'plots'}" in capsys.readouterr().out
    assert cli.main(["bench", "--no-master", "--plot", "one.png"]) == 0
    assert "plots go to" not in capsys.readouterr().out  # no directory made when none is needed
    assert runs[-1]["plot_path"] == "one.png" and runs[-1]["master"] is False
    assert sorted(os.listdir(tmp_path)) == ["one.png", "plots"]


def test_by_default_the_plots_go_to_a_new_temporary_directory_it_names(tmp_path):
    """A real quick run from a directory holding a docs/ folder: nothing is written there."""
    (tmp_path / "docs").mkdir()
    out = subprocess.run([sys.executable, "-m", "mooncake_keys", "bench", "--quick", "--no-master", "--report-only"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first = out.stdout.splitlines()[0]
    assert first.startswith("plots go to ")
    plot_dir = first[len("plots go to "):]
    try:
        assert os.path.dirname(plot_dir) in (tempfile.gettempdir(), os.path.realpath(tempfile.gettempdir()))
        assert os.listdir(tmp_path / "docs") == [] and os.listdir(tmp_path) == ["docs"]
        if "matplotlib is not installed" not in out.stdout:
            assert os.listdir(plot_dir) == ["ns_per_key.png"] and f"plot: {plot_dir}/ns_per_key.png" in out.stdout
    finally:
        import shutil

        shutil.rmtree(plot_dir, ignore_errors=True)


@pytest.fixture
def engine_runs(monkeypatch):
    """The engine benchmark and demo recorded instead of run, as if vLLM's CPU engine were here."""
    calls = []

    def fake_measure(**kw):
        calls.append(kw)
        return measured_rows()

    monkeypatch.setattr(engine_bench, "unavailable", lambda: None)
    monkeypatch.setattr(engine_bench, "measure", fake_measure)
    return calls


def test_the_engine_benchmark_refuses_bad_arguments_before_starting_anything(engine_runs, tmp_path, capsys,
                                                                            monkeypatch):
    in_the_way = tmp_path / "file"
    in_the_way.write_text("")
    for argv in (["--engine-plot", str(in_the_way / "engine.png")], ["--engine-plot", "/proc/engine.png"],
                 ["--engine-plot", str(tmp_path / "engine.svg")]):
        with pytest.raises(SystemExit) as exc:
            cli.main(["bench", "--engine", "--quick", *argv])
        assert exc.value.code == 2 and "--engine-plot" in capsys.readouterr().err
    for argv, message in ((["--plot", "x.png"], "not --plot"), (["--repeat", "3"], "not --repeat"),
                          (["--no-master"], "not --no-master"), (["--plot-dir", str(tmp_path)], "not --plot-dir")):
        assert cli.main(["bench", "--engine", *argv]) == 2
        assert message in capsys.readouterr().err
    monkeypatch.setattr(engine_bench, "unavailable", lambda: "vLLM is not installed here")
    assert cli.main(["bench", "--engine", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "cannot run here: vLLM is not installed here" in err and "bash scripts/dev.sh bench --engine" in err
    assert engine_runs == [] and os.listdir(tmp_path) == ["file"]  # nothing measured, nothing written


def test_the_engine_benchmark_prints_its_table_and_plots_only_where_asked(engine_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["bench", "--engine", "--quick"]) == 0
    out = capsys.readouterr().out
    assert engine_runs == [dict(quick=True, progress=engine_runs[0]["progress"])]
    assert "plot" not in out and os.listdir(tmp_path) == []
    assert "drop-in in scheduler async" in out and "1,125" in out and "mk scheduler" in out
    plot = tmp_path / "docs" / "engine.png"
    assert cli.main(["bench", "--engine", "--engine-plot", str(plot)]) == 0
    assert engine_runs[-1]["quick"] is False and f"plot: {plot}" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def measured_rows():
    """The rows :func:`engine_bench.measure` makes of two engines' results (a cold one, then the
    drop-in answering in the scheduler): figures chosen so that each column's arithmetic shows."""
    long_rows = [{"num_prompt_tokens": n, "num_cached_tokens": c, "ttft_ms": t, "tokens": [1, 2]}
                 for n, c, t in ((16000, 15968, 80.0), (12000, 11968, 60.0), (8000, 7968, 40.0))]
    burst_rows = [{"num_prompt_tokens": 2304, "num_cached_tokens": 2272, "ttft_ms": 20.0 + i, "tokens": [3]}
                  for i in range(engine_bench.BURST)]

    def metrics(calls, keys, ours):
        return {"metrics": {"vllm:mooncake_store_operation": [
                                {"labels": {"operation": "lookup_exists", "status": "ok"}, "value": calls},
                                {"labels": {"operation": "save_exists", "status": "ok"}, "value": 99}],
                            "vllm:mooncake_store_operation_keys": [
                                {"labels": {"operation": "lookup_exists", "status": "ok"}, "value": keys},
                                {"labels": {"operation": "load_get", "status": "ok"}, "value": 2 * keys}],
                            "vllm:mooncake_keys_lookups": [
                                {"labels": {"outcome": "hit", "side": "scheduler"}, "value": ours}]}}

    batches = [dict(start=100.0 * i, end=100.0 * i + 50, **metrics(*m))
               for i, m in enumerate(((1, 500, 1), (2, 875, 2), (3, 1125, 3), (5, 1445, 35)), 1)]
    # Lookups: one per long prompt (steps 1, 5, 9); the burst's 32 polls over steps 12 and 13.
    matched = [MatchedCall(100.010, 1, 0.001, True, "0"), MatchedCall(200.020, 5, 0.002, True, "1"),
               MatchedCall(300.030, 9, 0.003, True, "2")]
    # The burst: each request polled once (pending), then answered.
    matched += [MatchedCall(400.001 + i / 1000, 12 + i % 2, 0.0001, i % 2 == 1, str(3 + i // 2))
                for i in range(engine_bench.BURST)]
    result = {"rows": long_rows + burst_rows, "batches": batches, "matched": matched}
    rows = engine_bench._rows(engine_bench.COLD, result, 30.0)
    rows += engine_bench._rows(next(r for r in engine_bench.RUNS if r.name == "drop-in in scheduler async"), result, 30.0)
    return rows


def test_the_engine_benchmarks_rows_split_one_engine_into_its_two_workloads():
    long, burst = measured_rows()[2:]
    assert (long["workload"], long["run"], long["answered_by"]) == ("long prompts", "drop-in in scheduler async",
                                                                   "mk scheduler")
    assert (long["cached_tokens"], long["ttft_ms_median"], long["ttft_ms_max"]) == (35904, 60.0, 80.0)
    assert (long["sched_calls"], long["sched_steps"], long["master_calls"], long["master_keys"]) == (3, 3, 3, 1125)
    assert long["sched_ms"] == pytest.approx(6.0) and long["sched_ms_worst_step"] == pytest.approx(3.0)
    assert long["answers_ms"] == pytest.approx(33.0)  # the slowest of the three, from its own batch's arrival
    # The burst's figures are what the engine's counters gained during its batch alone.
    assert (burst["requests"], burst["cached_tokens"], burst["master_calls"], burst["master_keys"]) == (32, 72704, 2, 320)
    assert (long["loaded_keys"], burst["loaded_keys"]) == (2250, 640)
    assert (burst["sched_calls"], burst["sched_steps"]) == (32, 2)
    assert burst["sched_ms_worst_step"] == pytest.approx(1.6) and burst["ttft_ms_max"] == 51.0
    assert burst["answers_ms"] == pytest.approx(32.1)


def test_the_engine_demo_says_whether_the_tokens_were_the_same(monkeypatch, capsys):
    def fake_demo(same):
        def run(progress=None):
            first = {"rows": [{"num_prompt_tokens": 8000, "num_cached_tokens": 0, "ttft_ms": 300.0, "tokens": [1]}],
                     "metrics": {}}
            second = {"rows": [{"num_prompt_tokens": 8000, "num_cached_tokens": 7968, "ttft_ms": 40.0,
                                "tokens": [1 if same else 2]}],
                      "metrics": {"vllm:mooncake_keys_lookups": [{"labels": {"side": "worker"}, "value": 1}]}}
            return {"first": first, "second": second, "same_tokens": same}
        return run

    monkeypatch.setattr(engine_bench, "unavailable", lambda: None)
    monkeypatch.setattr(engine_demo, "run_engine_demo", fake_demo(True))
    assert cli.main(["demo", "--vllm"]) == 0
    out = capsys.readouterr().out
    assert "same tokens: yes" in out and "7,968" in out and "answered by mooncake_keys in the second engine: 1 of 1" in out
    monkeypatch.setattr(engine_demo, "run_engine_demo", fake_demo(False))
    assert cli.main(["demo", "--vllm"]) == 1
    assert "same tokens: NO" in capsys.readouterr().out
    monkeypatch.setattr(engine_bench, "unavailable", lambda: "vLLM is not installed here")
    assert cli.main(["demo", "--vllm"]) == 2
    assert "bash scripts/dev.sh demo --vllm" in capsys.readouterr().err
