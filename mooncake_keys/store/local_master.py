"""Run a real ``mooncake_master`` on 127.0.0.1 for tests and local use.

>>> with LocalMaster() as master:                        # doctest: +SKIP
...     store = MooncakeStore.connect(master.master_address)

The master listens on loopback only (RPC and metrics ports) and runs no HTTP
metadata server: clients use ``metadata_server="P2PHANDSHAKE"``. The master
keeps everything in memory, so a restart loses every key.
"""

from __future__ import annotations

import atexit
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LocalMaster", "LocalMasterError", "find_master_executable"]

logger = logging.getLogger("mooncake_keys.store")

HOST = "127.0.0.1"
_EXE = "mooncake_master"
# No proxy: an http_proxy variable must never route our health probe elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))
_RUNNING: set[LocalMaster] = set()


class LocalMasterError(RuntimeError):
    """mooncake_master could not be found, started or made ready."""


def find_master_executable() -> str:
    """Path of ``mooncake_master``: the binary inside the installed ``mooncake``
    package first (so our PID is the master's own), then next to
    ``sys.executable``, then ``$PATH``."""
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class LocalMaster:
    """A ``mooncake_master`` child process bound to 127.0.0.1.

    Ports are picked free on first start and kept by :meth:`restart`.
    ``default_kv_lease_ttl`` is in ms (our default 200, the master's 10000):
    a lookup leases every key it finds, and a short lease lets tests remove
    keys soon after. ``ready_timeout`` is in seconds. Used as a context
    manager it stops the master on exit, also when the body raised; an
    ``atexit`` hook stops any master still running when Python exits.
    """

    def __init__(
        self,
        *,
        rpc_port: int | None = None,
        metrics_port: int | None = None,
        default_kv_lease_ttl: int | None = 200,
        log_path: str | os.PathLike[str] | None = None,
        extra_args: Sequence[str] = (),
        ready_timeout: float = 15.0,
        executable: str | None = None,
    ) -> None:
        self.rpc_port = rpc_port
        self.metrics_port = metrics_port
        self.default_kv_lease_ttl = default_kv_lease_ttl
        self.extra_args = list(extra_args)
        self.ready_timeout = ready_timeout
        self.executable = executable
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix="mooncake_master-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        self._proc: subprocess.Popen[bytes] | None = None

    # ----------------------------------------------------------- addresses

    @property
    def master_address(self) -> str:
        """``"127.0.0.1:PORT"``, what clients pass as the master address."""
        if self.rpc_port is None:
            raise LocalMasterError("master not started yet")
        return f"{HOST}:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        """The metadata setting clients need: peers handshake directly."""
        return "P2PHANDSHAKE"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ----------------------------------------------------------- lifecycle

    def start(self) -> LocalMaster:
        """Start the master and wait until ``/health`` says it is ready."""
        if self.is_running():
            raise LocalMasterError(f"mooncake_master already running (pid {self.pid})")
        exe = self.executable or find_master_executable()
        self.rpc_port = self.rpc_port or _free_port()
        self.metrics_port = self.metrics_port or _free_port()
        args = [
            exe,
            f"--rpc_address={HOST}",
            f"--rpc_port={self.rpc_port}",
            f"--metrics_host={HOST}",
            f"--metrics_port={self.metrics_port}",
            "--logtostderr",
        ]
        if self.default_kv_lease_ttl is not None:
            args.append(f"--default_kv_lease_ttl={int(self.default_kv_lease_ttl)}")
        args += self.extra_args
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        _RUNNING.add(self)
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        logger.debug("mooncake_master pid %s ready at %s", self.pid, self.master_address)
        return self

    def _wait_ready(self) -> None:
        url = f"http://{HOST}:{self.metrics_port}/health"
        deadline = time.monotonic() + self.ready_timeout
        assert self._proc is not None
        while True:
            rc = self._proc.poll()
            if rc is not None:
                raise LocalMasterError(self._exit_message(rc))
            try:
                with _OPENER.open(url, timeout=0.5) as resp:
                    if b'"service_ready":true' in resp.read():
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise LocalMasterError(
                    f"mooncake_master not ready after {self.ready_timeout} s at {url}; log {self.log_path}:\n"
                    + self.log_tail()
                )
            time.sleep(0.05)

    def _exit_message(self, rc: int) -> str:
        tail = self.log_tail()
        hint = ""
        if "libibverbs.so.1" in tail:
            hint = " It needs the system library libibverbs.so.1: run 'apt-get install libibverbs1'."
        return f"mooncake_master exited with code {rc} before it was ready.{hint} Log {self.log_path}:\n{tail}"

    def log_tail(self, chars: int = 3000) -> str:
        """The last ``chars`` characters of the master's log."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
                return f.read().decode("utf-8", "replace")
        except OSError:
            return ""

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (graceful, ~1-2 s), then SIGKILL after ``timeout`` seconds."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            self._signal(signal.SIGCONT)  # a paused master cannot act on SIGTERM
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                logger.warning("mooncake_master pid %s ignored SIGTERM for %s s; killing it", proc.pid, timeout)
                proc.kill()
                proc.wait()
        _RUNNING.discard(self)

    def kill(self) -> None:
        """SIGKILL the master at once and reap it (for fault tests)."""
        proc = self._proc
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        _RUNNING.discard(self)

    def restart(self) -> LocalMaster:
        """Stop if running, then start again on the same ports (keys are lost)."""
        self.stop()
        return self.start()

    def pause(self, timeout: float = 2.0) -> None:
        """SIGSTOP the master, so that calls to it hang (for fault tests).

        Returns once every thread is stopped (Linux ``/proc``), so that a
        request sent right after cannot slip through while the signal lands.
        """
        self._signal(signal.SIGSTOP)
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
        self._signal(signal.SIGCONT)

    def _signal(self, sig: int) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.send_signal(sig)

    def __enter__(self) -> LocalMaster:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.is_running() else "stopped"
        return f"<LocalMaster {HOST}:{self.rpc_port} {state}>"


@atexit.register
def _stop_all() -> None:
    for master in list(_RUNNING):
        master.stop(timeout=5.0)
