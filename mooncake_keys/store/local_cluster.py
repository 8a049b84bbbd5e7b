"""A Mooncake HA cluster on 127.0.0.1: etcd plus several ``mooncake_master`` s with an oplog.

>>> with LocalCluster(masters=2) as cluster:              # doctest: +SKIP
...     store = MooncakeStore.connect(cluster.master_address)   # "etcd://127.0.0.1:PORT"

The masters elect a leader through etcd; the others stand by. When the leader dies a standby
takes over (about 10 s here, 9.6 s measured: the leader's etcd lease runs out, then a fixed 5 s warm-up) and,
thanks to the oplog, every key put before is still there. Every process dies with the one that
started the cluster (see :mod:`.process`) and is stopped by PID.

etcd's data (~120 MiB) and the logs live in a work directory (:mod:`.workdir`) made at
:meth:`LocalCluster.start` and removed by :meth:`LocalCluster.stop`; on a failure the logs are
kept (etcd's data is not) and named in the error or a warning.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import time
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

from .._checks import int_arg, seconds_arg, text_arg
from .local_master import HOST, LocalMaster, LocalMasterError, free_port, http_json
from .process import ManagedProcess, in_netns, owns_listening_port
from .workdir import WorkDir

__all__ = ["LocalCluster", "find_etcd_executable"]

logger = logging.getLogger("mooncake_keys.store")

_RUNNING: set = set()


def find_etcd_executable() -> str:
    found = shutil.which("etcd")
    if found:
        return found
    raise LocalMasterError("etcd not found: install it (Debian: apt-get install etcd-server)")


#: The most masters one cluster starts (each is a process with its own ports).
MAX_MASTERS = 16

#: Times etcd is started on new ports when one it was given is taken meanwhile.
PORT_ATTEMPTS = 3


class LocalCluster:
    """etcd and ``masters`` HA ``mooncake_master`` processes with an oplog, on loopback.

    The logs (``etcd.log``, ``master<i>.log``) go to ``log_dir`` when given (and stay there),
    else into the work directory; ``log_dir`` tells where they are once started. ``executable``
    is the ``mooncake_master`` every master runs (default: the installed package's);
    ``kv_events=True`` makes each publish its key events on a port of its own (only the leader
    has any to publish).

    ``host`` and ``netns``: the address etcd and the masters bind (default 127.0.0.1) and the
    Linux network namespace they run in (see :class:`LocalMaster`). ``master_hosts``, one
    ``(address, netns)`` per master, puts each master on a host of its own instead (etcd stays
    on ``host``)."""

    def __init__(self, masters: int = 2, *, default_kv_lease_ttl: Optional[int] = 200, ready_timeout: float = 30.0,
                 log_dir: Optional[str] = None, executable: Optional[str] = None, kv_events: bool = False,
                 host: str = HOST, netns: Optional[str] = None,
                 master_hosts: Optional[Sequence[Tuple[str, Optional[str]]]] = None) -> None:
        int_arg("masters", masters, min=1, max=MAX_MASTERS)
        places = [(host, netns)] * masters if master_hosts is None else [tuple(h) for h in master_hosts]
        if len(places) != masters:
            raise ValueError(f"master_hosts names {len(places)} hosts for {masters} masters")
        self.host = text_arg("host", host)
        self.netns = None if netns is None else text_arg("netns", netns)
        self.ready_timeout = seconds_arg("ready_timeout", ready_timeout)
        self._log_dir_given = log_dir
        self.log_dir = log_dir
        self._workdir: Optional[WorkDir] = None  # made at start: a cluster never started leaves nothing
        self.etcd_port = free_port()
        self._etcd = ManagedProcess("etcd", "")
        self._etcd_signalled = False
        endpoints = f"{self.host}:{self.etcd_port}"
        # Their log paths are set at start, in the log directory.
        self.masters: List[LocalMaster] = [
            LocalMaster(default_kv_lease_ttl=default_kv_lease_ttl, etcd_endpoints=endpoints,
                        ready_timeout=ready_timeout, executable=executable, kv_events=kv_events,
                        host=address, netns=ns)
            for address, ns in places
        ]

    @property
    def master_address(self) -> str:
        """What clients pass as the master address: ``"etcd://HOST:PORT"`` (127.0.0.1 by default)."""
        return f"etcd://{self.host}:{self.etcd_port}"

    @property
    def etcd_pid(self) -> Optional[int]:
        return self._etcd.pid

    def start(self) -> "LocalCluster":
        """Start etcd, then the masters; return once one of them serves."""
        etcd = find_etcd_executable()
        _RUNNING.add(self)
        if self._workdir is None:
            self._workdir = WorkDir("cluster")
        self.log_dir = self._log_dir_given or self._workdir.path
        self._etcd.log_path = os.path.join(self.log_dir, "etcd.log")
        for i, master in enumerate(self.masters):
            master.log_path = Path(self.log_dir) / f"master{i}.log"
        try:
            for attempt in range(PORT_ATTEMPTS):
                try:
                    self._start_etcd(etcd)
                    break
                except LocalMasterError as exc:
                    # Ports are picked free, then bound by etcd: another process may take one in
                    # between (seen once in CI). New ones, a few times.
                    if "address already in use" not in str(exc) or attempt == PORT_ATTEMPTS - 1:
                        raise
                    self._etcd.stop()
                    shutil.rmtree(os.path.join(self._workdir.path, "etcd-data"), ignore_errors=True)
                    self.etcd_port = free_port()
                    for master in self.masters:
                        master.etcd_endpoints = f"{self.host}:{self.etcd_port}"
            for master in self.masters:
                master.start()
            self.wait_leader(self.ready_timeout)
        except LocalMasterError as exc:
            self._stop(keep=str(exc))
            raise LocalMasterError(f"{exc}\n(the cluster's logs are kept in {self.log_dir})") from None
        except BaseException:
            self.stop()
            raise
        return self

    def _start_etcd(self, exe: str) -> None:
        assert self._workdir is not None
        peer, metrics = free_port(), free_port()
        client_url, peer_url = f"http://{self.host}:{self.etcd_port}", f"http://{self.host}:{peer}"
        self._etcd_signalled = False
        self._etcd.start(in_netns(self.netns, [
            exe, "--data-dir", os.path.join(self._workdir.path, "etcd-data"), "--name", "default",
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"default={peer_url}", "--listen-metrics-urls", f"http://{self.host}:{metrics}",
        ]))
        deadline = time.monotonic() + self.ready_timeout
        while True:
            rc = self._etcd.exit_code()
            if rc is not None:
                raise LocalMasterError(f"etcd exited with code {rc}:\n{self._etcd.log_tail()}")
            health = http_json(f"{client_url}/health")
            if health and health.get("health") == "true" and owns_listening_port(self._etcd.pid or -1, self.etcd_port):
                return
            if time.monotonic() > deadline:
                raise LocalMasterError(f"etcd not ready after {self.ready_timeout} s:\n{self._etcd.log_tail()}")
            time.sleep(0.05)

    def leader(self) -> Optional[LocalMaster]:
        """The master that serves now, if any."""
        for master in self.masters:
            if master.is_running() and master.serving():
                return master
        return None

    def wait_leader(self, timeout: float = 30.0) -> LocalMaster:
        """Wait until some master serves; return it."""
        deadline = time.monotonic() + timeout
        while True:
            leader = self.leader()
            if leader is not None:
                return leader
            if not any(m.is_running() for m in self.masters):
                raise LocalMasterError("no mooncake_master of the cluster is running")
            if time.monotonic() > deadline:
                raise LocalMasterError(f"no serving mooncake_master after {timeout} s")
            time.sleep(0.05)

    def kill_leader(self) -> LocalMaster:
        """SIGKILL the serving master (a failover follows); return it."""
        leader = self.wait_leader(5.0)
        leader.kill()
        return leader

    def _failure(self) -> str:
        """What died by itself, if anything did (a process we stopped or killed did not)."""
        rc = None if self._etcd_signalled else self._etcd.exit_code()
        failed = [f"etcd pid {self.etcd_pid} had exited by itself with code {rc}"] if rc not in (None, 0) else []
        failed += [m.exited_by_itself() for m in self.masters if m.exited_by_itself()]
        return "; ".join(failed)

    def pause_etcd(self) -> None:
        """SIGSTOP etcd, so that requests to it hang (an etcd stall, for fault tests)."""
        self._etcd.signal(signal.SIGSTOP)

    def resume_etcd(self) -> None:
        """SIGCONT a paused etcd."""
        self._etcd.signal(signal.SIGCONT)

    def pids(self) -> List[int]:
        return [p for p in [self.etcd_pid, *(m.pid for m in self.masters)] if p is not None]

    def stop(self) -> None:
        """Stop the masters, then etcd, and remove the work directory: etcd's data and the logs
        (kept, with a warning naming them, when a process had exited by itself with an error)."""
        failure = self._failure()
        self._stop(keep=failure)
        if failure:
            logger.warning("%s; the cluster's logs are kept in %s", failure, self.log_dir)

    def _stop(self, keep: str = "") -> None:
        for master in self.masters:
            master.stop(timeout=5.0)
        self._etcd_signalled = True
        self._etcd.stop(timeout=5.0)
        _RUNNING.discard(self)
        if self._workdir is not None:
            if keep and self._log_dir_given is None:  # the logs are in it
                shutil.rmtree(os.path.join(self._workdir.path, "etcd-data"), ignore_errors=True)
                self._workdir.keep(keep)
            else:
                self._workdir.remove()
            self._workdir = None

    def __enter__(self) -> "LocalCluster":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"<LocalCluster {self.master_address} masters={len(self.masters)}>"


@atexit.register
def _stop_all() -> None:
    for cluster in list(_RUNNING):
        cluster.stop()
