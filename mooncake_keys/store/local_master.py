"""Run a real ``mooncake_master`` on 127.0.0.1 for tests and local use.

>>> with LocalMaster() as master:                        # doctest: +SKIP
...     store = MooncakeStore.connect(master.master_address)

The master listens on loopback only (RPC and metrics ports) and runs no HTTP metadata server:
clients use ``metadata_server="P2PHANDSHAKE"``. It keeps everything in memory, so a restart
loses every key (an HA master with an oplog does not: see :mod:`.local_cluster`).

It dies with the process that started it, whatever ends that process (Linux: see
:mod:`.process`), and it is ready only when *it* answers: alive, ``/health`` ready, and the RPC
and metrics ports held by its own sockets (a second master on ports another one holds would
otherwise look ready, answered for by the first, until it dies a second later).

``executable`` chooses the binary (default: the installed ``mooncake`` package's), so one machine
can run the masters of two Mooncake releases side by side (the tests run 0.3.13.post1's and
0.3.14's). ``kv_events=True`` (0.3.14's master; 0.3.13.post1's accepts the flags and publishes
nothing) makes it publish its key events on a loopback ZMQ port (:attr:`LocalMaster.events_endpoint`),
read by :mod:`mooncake_keys.events`.

Unless given a ``log_path``, it logs into a work directory of its own (:mod:`.workdir`),
removed on a clean stop; on a failure (it would not start, or it had exited by itself) the log is
kept and named in the error or a warning.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import re
import subprocess
import logging
import os
import shutil
import signal
import socket
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from .._checks import MAX_SECONDS, bool_arg, int_arg, seconds_arg, text_arg
from .process import ManagedProcess, in_netns, owns_listening_port
from .workdir import WorkDir

__all__ = ["LocalMaster", "LocalMasterError", "find_master_executable", "free_port", "master_version"]

logger = logging.getLogger("mooncake_keys.store")

HOST = "127.0.0.1"
_EXE = "mooncake_master"
# No proxy: an http_proxy variable must never route our health probe elsewhere.
OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_RUNNING: set = set()


class LocalMasterError(RuntimeError):
    """mooncake_master (or etcd) could not be found, started or made ready."""


def find_master_executable() -> str:
    """Path of ``mooncake_master``: the binary inside the installed ``mooncake`` package first
    (so our PID is the master's own), then next to ``sys.executable``, then ``$PATH``."""
    spec = importlib.util.find_spec("mooncake")
    candidates = [os.path.join(d, _EXE) for d in (spec.submodule_search_locations or [])] if spec else []
    candidates.append(os.path.join(os.path.dirname(sys.executable), _EXE))
    for path in candidates:
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    found = shutil.which(_EXE)
    if found:
        return found
    raise LocalMasterError(
        "mooncake_master not found: install the Mooncake client with "
        "'pip install mooncake-keys[mooncake]' (or 'pip install mooncake-transfer-engine-non-cuda')"
    )


_VERSIONS: dict = {}


def master_version(executable: Optional[str] = None) -> str:
    """The release of a ``mooncake_master`` binary (``"0.3.14"``), as its ``--version`` prints it
    (asked once per path); "" when it does not say."""
    exe = executable or find_master_executable()
    if exe not in _VERSIONS:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30)
            found = re.search(r"version (\S+)", out.stdout + out.stderr)
        except (OSError, subprocess.SubprocessError):
            found = None
        _VERSIONS[exe] = found.group(1) if found else ""
    return _VERSIONS[exe]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _distinct_port(taken: set) -> int:
    """A free port not in ``taken`` (added to it)."""
    while True:
        port = free_port()
        if port not in taken:
            taken.add(port)
            return port


def http_json(url: str, timeout: float = 0.5) -> Optional[Any]:
    """GET ``url`` and parse JSON; None on any failure."""
    try:
        with OPENER.open(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except (OSError, ValueError):
        return None


class LocalMaster:
    """A ``mooncake_master`` child process bound to 127.0.0.1 (or ``host``).

    Ports are picked free on first start and kept by :meth:`restart`. ``default_kv_lease_ttl``
    is in ms (ours 200, the master's 10000): a lookup leases every key it finds, and a short
    lease lets tests remove keys soon after. ``ready_timeout`` is in seconds. With
    ``etcd_endpoints`` (``"127.0.0.1:PORT"``) it is an HA master with an oplog (see
    :class:`~mooncake_keys.store.local_cluster.LocalCluster`). Used as a context manager it
    stops the master on exit; an ``atexit`` hook stops any master still running.

    ``log_path`` is the master's log (appended to, and left where it is); without one the log is
    ``master.log`` in a work directory made at :meth:`start` and removed by a clean :meth:`stop`,
    kept when the master failed (the error, or a warning, names it). ``log_path`` tells where it
    is once started.

    ``executable``: the ``mooncake_master`` to run (default :func:`find_master_executable`).
    ``kv_events=True``: it publishes its key events (ZMQ PUB on ``events_port``, picked free and
    kept by :meth:`restart`; Mooncake publishes only with a backend id, ``mooncake_keys`` here).

    ``host`` is the address it binds and clients use (default 127.0.0.1); ``netns`` a Linux
    network namespace it runs in (``ip netns exec``; that namespace must own ``host``, and this
    process must be able to reach it for the readiness checks).
    """

    def __init__(
        self,
        *,
        rpc_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        default_kv_lease_ttl: Optional[int] = 200,
        log_path: Optional[str | os.PathLike[str]] = None,
        extra_args: Sequence[str] = (),
        ready_timeout: float = 15.0,
        executable: Optional[str] = None,
        etcd_endpoints: Optional[str] = None,
        kv_events: bool = False,
        events_port: Optional[int] = None,
        host: str = HOST,
        netns: Optional[str] = None,
    ) -> None:
        self.host = text_arg("host", host)
        self.netns = None if netns is None else text_arg("netns", netns)
        self.rpc_port = None if rpc_port is None else int_arg("rpc_port", rpc_port, min=1, max=65535)
        self.metrics_port = None if metrics_port is None else int_arg("metrics_port", metrics_port, min=1, max=65535)
        self.default_kv_lease_ttl = (None if default_kv_lease_ttl is None else  # milliseconds
                                     int_arg("default_kv_lease_ttl", default_kv_lease_ttl, min=1,
                                             max=int(MAX_SECONDS * 1000)))
        self.extra_args = list(extra_args)
        self.ready_timeout = seconds_arg("ready_timeout", ready_timeout)
        self.executable = executable
        self.etcd_endpoints = etcd_endpoints
        self.kv_events = bool_arg("kv_events", kv_events)
        self.events_port = None if events_port is None else int_arg("events_port", events_port, min=1, max=65535)
        self.log_path: Optional[Path] = None if log_path is None else Path(log_path)
        self._own_log = False  # the log lives in a work directory of ours (no log_path given)
        self._workdir: Optional[WorkDir] = None
        self._signalled = False  # we stopped or killed it: its exit is not a failure
        self._child = ManagedProcess("mooncake_master", "")

    # ----------------------------------------------------------- addresses

    @property
    def master_address(self) -> str:
        """``"HOST:PORT"`` (``"127.0.0.1:PORT"`` by default), what clients pass as the master address."""
        if self.rpc_port is None:
            raise LocalMasterError("master not started yet")
        return f"{self.host}:{self.rpc_port}"

    @property
    def http_address(self) -> str:
        """``"http://HOST:PORT"``: the master's HTTP server (``/health``, ``/get_all_keys``,
        ``/kv_events/status``), on its metrics port."""
        if self.metrics_port is None:
            raise LocalMasterError("master not started yet")
        return f"http://{self.host}:{self.metrics_port}"

    @property
    def events_endpoint(self) -> str:
        """``"tcp://HOST:PORT"``, where the master publishes its key events (``kv_events=True``)."""
        if not self.kv_events:
            raise LocalMasterError("this master publishes no key events (kv_events=False)")
        if self.events_port is None:
            raise LocalMasterError("master not started yet")
        return f"tcp://{self.host}:{self.events_port}"

    @property
    def version(self) -> str:
        """The release of the binary this master runs (``"0.3.14"``)."""
        return master_version(self.executable)

    @property
    def metadata_server(self) -> str:
        """The metadata setting clients need: peers handshake directly."""
        return "P2PHANDSHAKE"

    @property
    def pid(self) -> Optional[int]:
        return self._child.pid

    def is_running(self) -> bool:
        return self._child.is_running()

    def health(self) -> Optional[dict]:
        """The master's ``/health`` answer (role, ha_state, service_ready, ...), or None."""
        if self.metrics_port is None:
            return None
        return http_json(f"http://{self.host}:{self.metrics_port}/health")

    # ----------------------------------------------------------- lifecycle

    def _args(self, exe: str) -> list:
        args = [
            exe,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
        ]
        if self.default_kv_lease_ttl is not None:
            args.append(f"--default_kv_lease_ttl={int(self.default_kv_lease_ttl)}")
        if self.kv_events:
            args += ["--enable_kv_events=true", f"--kv_events_bind_endpoint=tcp://{self.host}:{self.events_port}",
                     "--kv_events_backend_id=mooncake_keys"]
        if self.etcd_endpoints:
            args += ["--enable_ha=true", "--enable_oplog=true", f"--etcd_endpoints={self.etcd_endpoints}",
                     "--enable_metric_reporting=false"]
        return args + self.extra_args

    def start(self) -> "LocalMaster":
        """Start the master and wait until it is ready (an HA master: serving or standby)."""
        if self.is_running():
            raise LocalMasterError(f"mooncake_master already running (pid {self.pid})")
        exe = self.executable or find_master_executable()
        # Ports picked one after another can come out equal (each probe socket is closed first).
        taken = {p for p in (self.rpc_port, self.metrics_port, self.events_port) if p}
        self.rpc_port = self.rpc_port or _distinct_port(taken)
        self.metrics_port = self.metrics_port or _distinct_port(taken)
        if self.kv_events:
            self.events_port = self.events_port or _distinct_port(taken)
        if self.log_path is None or self._own_log:
            self._own_log = True
            if self._workdir is None:  # a restart after a kill appends to the same log
                self._workdir = WorkDir("master")
            self.log_path = Path(self._workdir.path) / "master.log"
        self._child.log_path = str(self.log_path)
        self._signalled = False
        _RUNNING.add(self)
        try:
            self._child.start(in_netns(self.netns, self._args(exe)))
            self._wait(self._ready, self.ready_timeout, "ready")
        except LocalMasterError as exc:
            self._stop(keep=str(exc))  # the log the error names is kept
            raise
        except BaseException:
            self.stop()
            raise
        logger.debug("mooncake_master pid %s ready at %s", self.pid, self.master_address)
        return self

    def _owns(self, port: Optional[int]) -> bool:
        return self.pid is not None and port is not None and owns_listening_port(self.pid, port)

    def _ready(self) -> bool:
        """Alive, /health answered by this child, and (unless an HA standby) serving on its RPC port."""
        h = self.health()
        if not h or not self._owns(self.metrics_port):
            return False
        if self.etcd_endpoints and h.get("ha_state") in ("standby", "candidate", "leader_warmup"):
            return True  # a standby opens its RPC port only when it starts serving
        return bool(h.get("service_ready")) and self._owns(self.rpc_port) and self._events_ready()

    def _events_ready(self) -> bool:
        """Key events, if asked for and the master publishes them (0.3.13.post1's does not):
        published from a port of its own."""
        if not self.kv_events:
            return True
        status = http_json(f"{self.http_address}/kv_events/status")
        return not (isinstance(status, dict) and status.get("enabled")) or self._owns(self.events_port)

    def serving(self) -> bool:
        """This master serves (the leader, with its RPC port held by its own socket)."""
        h = self.health()
        return bool(h and h.get("service_ready")) and self._owns(self.rpc_port)

    def wait_serving(self, timeout: float = 30.0) -> "LocalMaster":
        """Wait until this (HA) master is the serving leader."""
        self._wait(self.serving, timeout, "serving")
        return self

    def _wait(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while True:
            rc = self._child.exit_code()
            if rc is not None:
                raise LocalMasterError(self._exit_message(rc))
            if condition():
                return
            if time.monotonic() > deadline:
                raise LocalMasterError(
                    f"mooncake_master pid {self.pid} not {what} after {timeout} s at {self.host}:{self.rpc_port} "
                    f"(metrics {self.metrics_port}); log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _exit_message(self, rc: int) -> str:
        tail = self.log_tail()
        hint = ""
        if "libibverbs.so.1" in tail:
            hint = " It needs the system library libibverbs.so.1: run 'apt-get install libibverbs1'."
        elif "Address already in use" in tail or rc == 1:
            hint = f" Are its ports ({self.rpc_port}, {self.metrics_port}) taken by another process?"
        return f"mooncake_master exited with code {rc} before it was ready.{hint} Log {self.log_path}:\n{tail}"

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the master's log."""
        return self._child.log_tail(chars)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (graceful, ~1-2 s), then SIGKILL after ``timeout`` seconds. Removes the log
        (unless ``log_path`` was given), or keeps it, with a warning naming it, when the master
        had exited by itself with an error."""
        failure = self.exited_by_itself()
        self._stop(timeout, keep=failure)
        if failure:
            logger.warning("%s; its log is kept: %s", failure, self.log_path)

    def exited_by_itself(self) -> str:
        """Why the master counts as failed: it exited with an error, not stopped or killed by us
        ("" when it did not)."""
        rc = None if self._signalled else self._child.exit_code()
        return "" if rc in (None, 0) else f"mooncake_master pid {self.pid} had exited by itself with code {rc}"

    def _stop(self, timeout: float = 10.0, keep: str = "") -> None:
        """Stop the child; then remove our work directory, or keep it (``keep``: why)."""
        self._signalled = True
        self._child.stop(timeout)
        _RUNNING.discard(self)
        if self._workdir is not None:
            if keep:
                self._workdir.keep(keep)
            else:
                self._workdir.remove()
            self._workdir = None

    def kill(self) -> None:
        """SIGKILL the master at once and reap it (for fault tests). Its log stays until :meth:`stop`."""
        self._signalled = True
        self._child.kill()

    def restart(self) -> "LocalMaster":
        """Stop if running, then start again on the same ports (a plain master loses its keys)."""
        self.stop()
        return self.start()

    def pause(self, timeout: float = 2.0) -> None:
        """SIGSTOP the master, so that calls to it hang (for fault tests).

        Returns once every thread is stopped (Linux ``/proc``), so that a request sent right
        after cannot slip through while the signal lands.
        """
        self._child.signal(signal.SIGSTOP)
        deadline = time.monotonic() + timeout
        while self.is_running() and not self._all_threads_stopped() and time.monotonic() < deadline:
            time.sleep(0.001)

    def _all_threads_stopped(self) -> bool:
        task_dir = f"/proc/{self.pid}/task"
        try:
            for tid in os.listdir(task_dir):
                with open(f"{task_dir}/{tid}/stat") as f:
                    # The state follows the parenthesised command name.
                    if f.read().rpartition(")")[2].split()[0] not in ("T", "t"):
                        return False
        except OSError:
            return True  # no /proc (not Linux) or the process is gone: nothing to wait for
        return True

    def resume(self) -> None:
        """SIGCONT a paused master."""
        self._child.signal(signal.SIGCONT)

    def __enter__(self) -> "LocalMaster":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"<LocalMaster {self.host}:{self.rpc_port} {state}>"


@atexit.register
def _stop_all() -> None:
    for master in list(_RUNNING):
        master.stop(timeout=5.0)
