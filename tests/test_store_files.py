"""No files left behind by the local processes: a master's log and a cluster's directory (etcd's
data, ~120 MiB, and the logs) are removed on every exit we see, swept at the next start when
their owner was SIGKILLed, and kept (named in the error or a warning) only on a failure. Real
mooncake_master and etcd; directories of owners that are not gone are never touched."""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.mooncake

from mooncake_keys.store import workdir  # noqa: E402
from mooncake_keys.store.local_cluster import LocalCluster  # noqa: E402
from mooncake_keys.store.local_master import LocalMaster, LocalMasterError  # noqa: E402
from mooncake_keys.store.workdir import WorkDir, sweep_stale  # noqa: E402
from support.child import gone, wait_gone  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
TMP = tempfile.gettempdir()


def ours() -> set:
    """This process's work directories in the temp dir."""
    return {n for n in os.listdir(TMP) if n.startswith("mooncake_keys-") and f"-{os.getpid()}-" in n}


def needs_etcd():
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")




def start_owner(body: str) -> tuple:
    """A Python process that runs ``body`` (which sets ``out``), prints ``out`` as JSON, then waits."""
    code = ("import json, time\n" + textwrap.dedent(body) +
            "\nprint(json.dumps(out), flush=True)\ntime.sleep(3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), MC_LOG_LEVEL="ERROR"))
    line = proc.stdout.readline()
    assert line, f"the owner died before it was ready (rc {proc.wait()})"
    return proc, json.loads(line)


# ------------------------------------------------------------------ a master's log


def test_a_master_leaves_no_log_after_a_clean_stop():
    before = ours()
    master = LocalMaster().start()
    log = Path(master.log_path)
    assert log.is_file() and log.parent.name.startswith(f"mooncake_keys-master-{os.getpid()}-")
    master.kill()  # a fault test's kill and restart append to the same log
    master.start()
    assert master.log_path == log and log.is_file()
    master.restart()
    master.stop()
    assert not log.exists() and not log.parent.exists()
    assert ours() == before


def test_a_given_log_path_is_left_where_it_is(tmp_path):
    with LocalMaster(log_path=tmp_path / "m.log") as master:
        pass
    assert master.log_path == tmp_path / "m.log" and master.log_path.stat().st_size > 0


def test_a_master_that_does_not_start_keeps_its_log_and_names_it(tmp_path):
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho 'fake master: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    master = LocalMaster(executable=str(fake))
    with pytest.raises(LocalMasterError, match="exited with code 3") as info:
        master.start()
    log = Path(master.log_path)
    try:
        assert str(log) in str(info.value) and "cannot start" in log.read_text()
        assert (log.parent / "KEPT").is_file()
        assert str(log.parent) not in sweep_stale()  # a kept log is never swept
        assert log.exists()
    finally:
        shutil.rmtree(log.parent)


def test_a_master_that_died_by_itself_keeps_its_log_with_a_warning(caplog):
    master = LocalMaster().start()
    log = Path(master.log_path)
    os.kill(master.pid, signal.SIGKILL)  # not through master.kill(): as if it had crashed
    # Until every thread of it has exited it cannot be reaped (its main thread reads as a zombie).
    deadline = time.monotonic() + 10
    while master.is_running() and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        with caplog.at_level(logging.WARNING, logger="mooncake_keys.store"):
            master.stop()
        lines = [r.getMessage() for r in caplog.records if "exited by itself" in r.getMessage()]
        assert len(lines) == 1 and str(log) in lines[0] and "code -9" in lines[0], lines
        assert log.is_file()
    finally:
        shutil.rmtree(log.parent)


# ------------------------------------------------------------------ a cluster's directory


def test_a_cluster_never_started_leaves_nothing():
    before = ours()
    cluster = LocalCluster(masters=2)
    assert cluster.log_dir is None and ours() == before
    cluster.stop()  # stopping one never started is harmless
    assert ours() == before


def test_a_cluster_leaves_nothing_after_a_clean_stop():
    needs_etcd()
    before = ours()
    with LocalCluster(masters=1) as cluster:
        work = Path(cluster.log_dir)
        assert (work / "etcd-data").is_dir() and (work / "etcd.log").is_file() and (work / "master0.log").is_file()
        cluster.kill_leader()  # a failover test's kill is no failure
    assert not work.exists()
    assert ours() == before


def test_a_cluster_that_does_not_start_keeps_its_logs_not_its_data(tmp_path):
    needs_etcd()
    fake = tmp_path / "mooncake_master"
    fake.write_text("#!/bin/sh\necho 'fake master: cannot start' >&2\nexit 3\n")
    fake.chmod(0o755)
    cluster = LocalCluster(masters=1)
    cluster.masters[0].executable = str(fake)
    with pytest.raises(LocalMasterError, match="exited with code 3") as info:
        cluster.start()
    work = Path(cluster.log_dir)
    try:
        assert f"the cluster's logs are kept in {work}" in str(info.value)
        assert str(work / "master0.log") in str(info.value)
        assert "cannot start" in (work / "master0.log").read_text() and (work / "etcd.log").is_file()
        assert not (work / "etcd-data").exists()
        assert not any(p for p in cluster.pids() if not gone(p))
    finally:
        shutil.rmtree(work)


def test_an_owner_that_exits_without_stopping_leaves_nothing():
    needs_etcd()
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json
        from mooncake_keys.store.local_cluster import LocalCluster
        from mooncake_keys.store.local_master import LocalMaster
        c = LocalCluster(masters=1).start()
        m = LocalMaster().start()
        print(json.dumps([c.log_dir, str(m.log_path)]))
        raise SystemExit(0)  # neither is stopped: the interpreter's exit does it
    """)], capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(REPO_ROOT)))
    assert out.returncode == 0, out.stderr[-2000:]
    cluster_dir, master_log = json.loads(out.stdout)
    assert not os.path.exists(cluster_dir) and not os.path.exists(os.path.dirname(master_log))


def test_the_dirs_of_a_sigkilled_owner_are_swept_at_the_next_start():
    """A SIGKILLed parent cannot clean up: its processes die (PDEATHSIG) and its directories
    (~120 MiB for a cluster) are removed by the next start, anyone's. A live owner's stay."""
    needs_etcd()
    body = """
        from mooncake_keys.store.local_cluster import LocalCluster
        from mooncake_keys.store.local_master import LocalMaster
        c = LocalCluster(masters=1).start()
        m = LocalMaster().start()
        out = {"dirs": [c.log_dir, str(m.log_path.parent)], "pids": c.pids() + [m.pid]}
    """
    killed, dead = start_owner(body)
    alive, live = start_owner(body)
    try:
        killed.kill()
        killed.wait(10)
        assert wait_gone(dead["pids"]) == []
        assert all(os.path.isdir(d) for d in dead["dirs"])  # what the kill left
        size = sum(f.stat().st_size for f in Path(dead["dirs"][0]).rglob("*") if f.is_file())
        with LocalMaster() as master:  # the next start
            assert not any(os.path.exists(d) for d in dead["dirs"])
            assert all(os.path.isdir(d) for d in live["dirs"])  # its owner lives
            assert os.path.isdir(master.log_path.parent)
        print(f"swept {size / 2**20:.0f} MiB left by a SIGKILLed cluster owner")
    finally:
        alive.kill()
        alive.wait(10)
        wait_gone(live["pids"])
    sweep_stale()
    assert not any(os.path.exists(d) for d in live["dirs"])


# ------------------------------------------------------------------ the sweep's rules, on hand-made dirs


def _made(parent: Path, name: str, lock: bool = True) -> Path:
    d = parent / name
    d.mkdir()
    if lock:
        (d / "owner.lock").touch()
    return d


def test_the_sweep_takes_only_dirs_whose_owner_is_gone(tmp_path):
    me, started = os.getpid(), workdir._start_time(os.getpid())
    exited = subprocess.Popen(["true"])
    exited.wait()
    dead = exited.pid
    made = {
        "mine": _made(tmp_path, f"mooncake_keys-master-{me}-{started}-a1"),
        "pid reused": _made(tmp_path, f"mooncake_keys-master-{me}-{int(started) + 1}-a2"),
        "dead owner": _made(tmp_path, f"mooncake_keys-cluster-{dead}-1-a3"),
        "kept": _made(tmp_path, f"mooncake_keys-cluster-{dead}-1-a4"),
        "lock held": _made(tmp_path, f"mooncake_keys-cluster-{dead}-2-a5"),
        "being made": _made(tmp_path, f"mooncake_keys-cluster-{dead}-3-a6", lock=False),
        "not ours": _made(tmp_path, f"mooncake_cluster-{dead}-a7"),
    }
    (made["kept"] / "KEPT").write_text("a failure\n")
    link = tmp_path / f"mooncake_keys-cluster-{dead}-4-a8"
    link.symlink_to(made["dead owner"])
    # An owner whose PID this process cannot see (another PID namespace) still holds its lock.
    holder = subprocess.Popen([sys.executable, "-c", "import sys, fcntl, time\n"
                               "f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); print(1, flush=True)\n"
                               "time.sleep(3600)", str(made["lock held"] / "owner.lock")], stdout=subprocess.PIPE)
    try:
        assert holder.stdout.readline()
        assert set(sweep_stale(str(tmp_path))) == {str(made["pid reused"]), str(made["dead owner"])}
        assert all(p.exists() for k, p in made.items() if k not in ("pid reused", "dead owner"))
        assert link.is_symlink()
        old = time.time() - 3600
        os.utime(made["being made"], (old, old))  # an owner that died before it took its lock
        assert sweep_stale(str(tmp_path)) == [str(made["being made"])]
    finally:
        holder.kill()
        holder.wait()
    assert sweep_stale(str(tmp_path)) == [str(made["lock held"])]  # its owner is gone now


def test_a_work_dir_is_removed_or_kept():
    d = WorkDir("test")
    assert os.path.isfile(os.path.join(d.path, "owner.lock")) and d.live
    d.remove()
    d.remove()
    assert not os.path.exists(d.path) and not d.live
    k = WorkDir("test")
    try:
        assert k.keep("why") == k.path and not k.live
        k.remove()  # a kept one stays
        assert open(os.path.join(k.path, "KEPT")).read() == "why\n"
    finally:
        shutil.rmtree(k.path)


def test_a_cluster_whose_etcd_port_is_taken_meanwhile_starts_on_new_ports(monkeypatch):
    """Ports are picked free and bound later by etcd: one taken in between (seen once in CI)
    makes the cluster start etcd again on new ones, its masters following."""
    needs_etcd()
    import socket

    from mooncake_keys.store import local_cluster

    taken = []
    real = local_cluster.free_port

    def first_one_taken():
        port = real()
        if not taken:  # the cluster's etcd client port: another process binds it first
            s = socket.socket()
            s.bind(("127.0.0.1", port))
            s.listen()
            taken.append(s)
        return port

    monkeypatch.setattr(local_cluster, "free_port", first_one_taken)
    cluster = local_cluster.LocalCluster(masters=1)
    first = cluster.etcd_port
    try:
        cluster.start()
        assert cluster.etcd_port != first and cluster.leader() is not None
        assert cluster.masters[0].etcd_endpoints.endswith(f":{cluster.etcd_port}")
    finally:
        cluster.stop()
        taken[0].close()
