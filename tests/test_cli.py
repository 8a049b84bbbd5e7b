"""The command line: it parses and prints, refuses bad arguments before any work, and writes the
benchmark's plots only where asked (by default into a new temporary directory it names)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from mooncake_keys import cli
from mooncake_keys.bench import suite


@pytest.mark.parametrize("argv, message", [
    (["demo", "--requests", "0"], "must be from 1 to 100000"),
    (["bench", "--repeat", "0"], "must be from 1 to 100000"),
    (["demo", "--memory", "--requests", "9" * 26], "must be from 1 to 100000"),  # ran without bound
    (["bench", "--quick", "--no-master", "--plot", "x.txt"], "must end in .png"),  # died after the run
    (["bench", "--master-plot", "plot"], "must end in .png"),
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
    out = subprocess.run([sys.executable, "-m", "mooncake_keys", "bench", "--quick", "--no-master"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
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
