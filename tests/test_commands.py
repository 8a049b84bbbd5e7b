"""The commands at their edges, run as a newcomer runs them (``python -m mooncake_keys ...`` in a
child process): a master setting that cannot be used, Ctrl-C, a benchmark target missed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List

import pytest

from mooncake_keys.store.default import MASTER_ENV

CONFIG_ENV = "MOONCAKE_CONFIG_PATH"
#: Each command with arguments it would run with: a bad setting must stop it before any work.
COMMANDS = {
    "demo": ["demo", "--requests", "5"],
    "bench": ["bench", "--quick", "--no-master"],
    "explain": ["explain", "--model", "m", "--group", "full:16", "--hashes", "-"],
}


def env_with(**settings: str) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in (MASTER_ENV, CONFIG_ENV)}
    env.update(settings)
    return env


def run(argv: List[str], env: Dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mooncake_keys", *argv], input="00ff\n", capture_output=True,
                          text=True, env=env, timeout=300)


def bad_settings(tmp: Path) -> List[tuple]:
    (tmp / "not.json").write_text("master_server_address: 127.0.0.1:50051\n")
    (tmp / "no_master.json").write_text(json.dumps({"metadata_server": "P2PHANDSHAKE", "protocol": "tcp"}))
    (tmp / "bad_master.json").write_text(json.dumps({"master_server_address": "host:notaport"}))
    return [
        (MASTER_ENV, "garbage", "must be 'host:port'"),
        (MASTER_ENV, "host:notaport", "must be 'host:port'"),
        (MASTER_ENV, "127.0.0.1:0", "must be 'host:port'"),
        (CONFIG_ENV, str(tmp / "missing.json"), "No such file or directory"),
        (CONFIG_ENV, str(tmp), "is not a regular file"),
        (CONFIG_ENV, str(tmp / "not.json"), "is not JSON"),
        (CONFIG_ENV, str(tmp / "no_master.json"), "names no master_server_address"),
        (CONFIG_ENV, str(tmp / "bad_master.json"), "its master_server_address must be 'host:port'"),
    ]


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_setting_that_cannot_be_used_is_one_line_naming_it_and_exit_2(command, tmp_path):
    for variable, value, message in bad_settings(tmp_path):
        out = run(COMMANDS[command], env_with(**{variable: value}))
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (variable, value, out.returncode, out.stderr[-3000:])
        assert lines[0].startswith(f"mooncake_keys {command}: error: {variable}: ") and message in lines[0], lines
        assert out.stdout == "", out.stdout  # refused before any work


@pytest.mark.parametrize("command", ["demo", "explain"])
@pytest.mark.parametrize("how", ["address", "config"])
def test_a_master_nobody_serves_is_one_line_naming_the_setting_and_exit_1(command, how, tmp_path):
    if how == "address":
        variable, env = MASTER_ENV, env_with(**{MASTER_ENV: "127.0.0.1:1"})
    else:
        config = tmp_path / "mooncake.json"
        config.write_text(json.dumps({"master_server_address": "127.0.0.1:1", "metadata_server": "P2PHANDSHAKE",
                                      "protocol": "tcp"}))
        variable, env = CONFIG_ENV, env_with(**{CONFIG_ENV: str(config)})
    pytest.importorskip("mooncake.store")  # demo falls back to the memory store without the client
    out = run(COMMANDS[command], env)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, (out.returncode, out.stderr[-3000:])
    assert lines[0].startswith(f"mooncake_keys {command}: error: {variable}: the master 127.0.0.1:1 cannot be "
                               "reached"), lines


def test_the_help_documents_the_exit_statuses():
    out = subprocess.run([sys.executable, "-m", "mooncake_keys", "demo", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0
    for status in ("0", "1", "2", "130"):
        assert f"\n  {status:<4} " in out.stdout, out.stdout
    assert MASTER_ENV in out.stdout and CONFIG_ENV in out.stdout


#: What the Mooncake client logs while closing when its master went first (a Ctrl-C reached the
#: master too): seconds of retries, then these.
TEARDOWN_ERRORS = ("RPC call failed", "Failed to ping master", "Failed to unmount", "Client not available")


def _sigint_as_a_terminal_job_has() -> None:
    """SIGINT's default disposition, as a shell gives a job it starts in the foreground. Not
    inherited: a suite started in the background (``nohup ... &``) ignores SIGINT, that survives
    exec, and a Python started so never turns Ctrl-C into KeyboardInterrupt."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_stops_the_demo_and_its_master_with_one_line_and_exit_130():
    """Ctrl-C as a terminal sends it: SIGINT to the demo's whole process group, once the demo is
    serving (its output says so). It exits 130 with one line, and its master is gone."""
    import re
    import signal

    pytest.importorskip("mooncake.store")
    pytest.importorskip("torch")
    from mooncake_keys.store.local_master import LocalMasterError, find_master_executable

    try:
        find_master_executable()
    except LocalMasterError as exc:
        pytest.skip(str(exc))
    proc = subprocess.Popen([sys.executable, "-m", "mooncake_keys", "demo", "--requests", "100000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env_with(),
                            start_new_session=True, preexec_fn=_sigint_as_a_terminal_job_has)
    master_pid = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # readiness: the store is open and the requests are being served
            found = re.search(r"^store: mooncake \(local master\) at \S+ \(pid (\d+)\)", line)
            if found:
                master_pid = int(found.group(1))
            if line.startswith("  served "):
                break
        else:
            pytest.fail(f"the demo ended before serving: {proc.wait()} {proc.stderr.read()[-3000:]}")
        assert master_pid is not None and os.path.exists(f"/proc/{master_pid}")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)  # a hang guard only
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    lines = err.strip().splitlines()
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and len(lines) <= 6, err[-3000:]
    assert lines[-1].startswith("mooncake_keys demo: interrupted"), lines
    assert not [line for line in lines if any(e in line for e in TEARDOWN_ERRORS)], err
    assert not os.path.exists(f"/proc/{master_pid}"), f"mooncake_master pid {master_pid} outlived the demo"


def test_a_target_not_met_is_exit_1_unless_report_only():
    """The verdict the bench closes on, over the target lines it printed (summarise's here, on
    rows where the compiled core is as fast as vLLM: 1x against targets of 20x and more)."""
    from mooncake_keys.bench.suite import missed_targets, summarise, verdict

    slow = summarise([dict(mode="cold", impl="c", scenario=s, ratio_vs_vllm=1.0) for s in "abcde"])
    assert missed_targets(slow) and all("NOT met" in line for line in missed_targets(slow)), slow
    assert verdict(slow, report_only=False) == ("targets: 2 of 2 NOT met (exit 1; --report-only only reports)", 1)
    assert verdict(slow, report_only=True) == ("targets: 2 of 2 NOT met (--report-only: exit 0)", 0)
    fast = summarise([dict(mode="cold", impl="c", scenario=s, ratio_vs_vllm=0.01) for s in "abcde"])
    assert not missed_targets(fast) and verdict(fast, report_only=False) == ("targets: all 2 met", 0)


@pytest.mark.parametrize("report_only", [False, True])
def test_the_bench_exit_status_follows_its_targets(report_only):
    """A real quick run: it closes on the verdict line, and exits 1 exactly when that says a
    target is NOT met (with --report-only: 0 whatever it says)."""
    argv = ["bench", "--quick", "--no-master", "--plot-dir", "."] + (["--report-only"] if report_only else [])
    import tempfile

    with tempfile.TemporaryDirectory() as where:
        out = subprocess.run([sys.executable, "-m", "mooncake_keys", *argv], cwd=where, capture_output=True,
                             text=True, env=env_with(), timeout=600)
    last = out.stdout.strip().splitlines()[-1]
    assert last.startswith("targets: "), out.stdout[-2000:]
    printed = [line for line in out.stdout.splitlines() if line.strip().startswith("target ")]
    assert printed and ("NOT met" in last) == any("NOT met" in line for line in printed), out.stdout[-3000:]
    assert out.returncode == (0 if report_only or "NOT met" not in last else 1), (out.returncode, last)


ROOT = Path(__file__).resolve().parent.parent


def dev_demo(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(ROOT / "scripts" / "dev.sh"), "demo", *argv], capture_output=True, text=True,
                          env=env_with(), timeout=1800)


def test_dev_sh_demo_says_each_step_skips_an_up_to_date_install_and_ends_on_a_verdict():
    """``bash scripts/dev.sh demo`` as a newcomer runs it, twice: the second run finds the install
    up to date (no pip), and each run closes on one verdict line, a failed one too."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip("runs dev.sh against the checkout's .venv: only from that venv's python")
    pytest.importorskip("torch")
    first = dev_demo("--requests", "5")  # installs only what its stamp does not show installed
    assert first.returncode == 0, first.stderr[-3000:]
    second = dev_demo("--requests", "5")
    assert second.returncode == 0, second.stderr[-3000:]
    steps = [line for line in second.stderr.splitlines() if line.startswith("== ")]
    assert steps[0] == "== torch 2.13.0 (CPU): installed already", steps
    assert steps[1].startswith("== mooncake_keys[") and ": up to date" in steps[1], steps
    assert not any("installing" in s for s in steps), steps
    assert second.stdout.strip().splitlines()[-1].startswith("demo: OK - done in "), second.stdout[-2000:]
    failed = dev_demo("--requests", "0")
    assert failed.returncode == 2
    assert failed.stdout.strip().splitlines()[-1] == "demo: FAILED (exit 2, while running the demo)", failed.stdout


def test_the_library_refuses_the_same_settings_with_a_value_error_naming_them(tmp_path, monkeypatch):
    """configured_master is the one check: open_store raises what the commands print, before a
    master is started or a client made."""
    from mooncake_keys.store import local_master
    from mooncake_keys.store.default import BadMasterSetting, configured_master, open_store

    monkeypatch.setattr(local_master.LocalMaster, "start", lambda self: pytest.fail("started a master"))
    for variable, value, message in bad_settings(tmp_path):
        monkeypatch.delenv(MASTER_ENV, raising=False)
        monkeypatch.delenv(CONFIG_ENV, raising=False)
        monkeypatch.setenv(variable, value)
        for call in (configured_master, open_store):
            with pytest.raises(BadMasterSetting) as caught:
                call()
            assert isinstance(caught.value, ValueError) and caught.value.setting == variable
            assert str(caught.value).startswith(f"{variable}: ") and message in str(caught.value)
    with pytest.raises(BadMasterSetting, match=r"^master_address: the address must be 'host:port'"):
        open_store("garbage")
    with pytest.raises(BadMasterSetting, match=r"^config_path: Mooncake config .* No such file"):
        open_store(config_path=str(tmp_path / "missing.json"))
