"""Child processes (``mooncake_master``, ``etcd``) that die with the process that started them.

Linux: each child asks the kernel for SIGKILL when its parent goes (``PR_SET_PDEATHSIG``), so
it dies with us whatever ends us, SIGKILL included. The kernel sends that signal when the
*thread* that forked the child exits, not the process; so every child is forked by one
process-wide spawner thread that never exits. The child also checks, before it execs, that its
parent is still the one that forked it (a parent killed before ``prctl`` ran). Elsewhere the
children are stopped by ``atexit`` and context managers only.

A child that starts processes of its own (vLLM's server: an engine core and a worker, which no
signal of ours reaches once their parent is gone) runs under a guard (:func:`spawn_guarded`,
this module run as ``python -m mooncake_keys.store.process``): a small process bound to die
with us by a signal it can catch (``SIGTERM``), that runs the child in a session of its own and,
when we go, when it is told to stop, or when the child exits, ends that whole session.

Readiness helpers check that a port is LISTENed on *by the child itself* (its socket inode is
one of the child's file descriptors): a second server started on ports another one holds can
answer health checks for a while before it dies, or be answered for by the other. They read the
child's own ``/proc/PID/net/tcp``: a child started in another network namespace
(``ip netns exec``) listens in that namespace's table, not ours.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
from typing import Any, List, Optional, Sequence

__all__ = ["ManagedProcess", "file_tail", "in_netns", "spawn", "spawn_guarded", "owns_listening_port", "listening_ports",
           "listening_sockets"]

_PR_SET_PDEATHSIG = 1
_requests: "queue.Queue[Any]" = queue.Queue()
_spawner: Optional[threading.Thread] = None
_spawner_lock = threading.Lock()


def _preexec(parent_pid: int) -> Any:
    libc = ctypes.CDLL(None, use_errno=True)

    def preexec() -> None:  # runs in the forked child: prctl and getppid only
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        if os.getppid() != parent_pid:  # the parent died before prctl ran
            os._exit(1)

    return preexec


def _spawn_loop() -> None:
    while True:
        args, kwargs, reply = _requests.get()
        try:
            reply.put(subprocess.Popen(args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            reply.put(exc)


def in_netns(netns: Optional[str], args: Sequence[str]) -> List[str]:
    """``args`` run inside the network namespace ``netns`` (``ip netns exec NETNS ARGS...``;
    unchanged when ``netns`` is None). ``ip`` enters the namespace and execs ``args``, so the
    child keeps its PID and the death signal :func:`spawn` asked for (not a set-user-ID exec)."""
    return list(args) if netns is None else ["ip", "netns", "exec", netns, *args]


def spawn(args: Sequence[str], **popen_kwargs: Any) -> "subprocess.Popen[bytes]":
    """``subprocess.Popen(args, **popen_kwargs)``, the child bound to die with this process."""
    if not sys.platform.startswith("linux"):
        return subprocess.Popen(list(args), **popen_kwargs)
    global _spawner
    with _spawner_lock:
        if _spawner is None:
            _spawner = threading.Thread(target=_spawn_loop, name="mooncake_keys-spawner", daemon=True)
            _spawner.start()
    reply: "queue.Queue[Any]" = queue.Queue()
    _requests.put((list(args), dict(popen_kwargs, preexec_fn=_preexec(os.getpid())), reply))
    result = reply.get()
    if isinstance(result, BaseException):
        raise result
    return result


def spawn_guarded(args: Sequence[str], *, pid_file: str, grace: float = 30.0,
                  **popen_kwargs: Any) -> "subprocess.Popen[bytes]":
    """``args`` under a guard (see the module docstring), itself started by :func:`spawn`; what is
    returned is the guard. The child's PID is written to ``pid_file`` once it runs. SIGTERM to the
    guard (and our own end, whatever it is) sends SIGTERM to the child, waits at most ``grace``
    seconds for it, then SIGKILLs every process of the child's session; so does the child's own
    exit. Never SIGKILL the guard: what the child started would outlive it."""
    guard = [sys.executable, "-m", __name__, str(os.getpid()), str(float(grace)), pid_file, "--", *args]
    return spawn(guard, **popen_kwargs)


def _guard(argv: Sequence[str]) -> int:
    """The guard's main: ``PARENT_PID GRACE PID_FILE -- ARGS...``; the child's exit code."""
    parent, grace, pid_file, sep, args = int(argv[0]), float(argv[1]), argv[2], argv[3], list(argv[4:])
    if sep != "--" or not args:
        raise SystemExit("usage: python -m mooncake_keys.store.process PARENT_PID GRACE PID_FILE -- ARGS...")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    if sys.platform.startswith("linux"):
        # Our parent's end reaches us as a signal we can act on (spawn asked for SIGKILL).
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != parent:  # the parent died before prctl ran
        return 1
    child = subprocess.Popen(args, start_new_session=True)
    tmp = f"{pid_file}.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(str(child.pid))
    os.replace(tmp, pid_file)
    while child.poll() is None and not stop.wait(0.2):
        pass
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(child.pid, signal.SIGKILL)  # everything of the child's session, whatever outlived it
    except (ProcessLookupError, PermissionError):
        pass
    rc = child.wait()
    return rc if rc >= 0 else 128 - rc


def listening_sockets(pid: int) -> List[tuple]:
    """``(address, port)`` of every TCP socket the process ``pid`` LISTENs on (Linux ``/proc``;
    [] elsewhere), e.g. ``("127.0.0.1", 50051)``, ``("0.0.0.0", 15123)``, ``("::", 15124)``."""
    inodes = _socket_inodes(pid)
    return sorted({(addr, port) for addr, port, inode in _listeners(pid) if inode in inodes})


def listening_ports(pid: int) -> List[int]:
    """TCP ports the process ``pid`` LISTENs on."""
    return sorted({port for _, port in listening_sockets(pid)})


def owns_listening_port(pid: int, port: int) -> bool:
    """Whether the process ``pid`` itself LISTENs on TCP ``port`` (Linux ``/proc``)."""
    inodes = _socket_inodes(pid)
    return any(p == port and inode in inodes for _, p, inode in _listeners(pid))


def _address(hex_addr: str) -> str:
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:  # /proc/net/tcp: one little-endian word
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    # /proc/net/tcp6: four little-endian words
    return socket.inet_ntop(socket.AF_INET6, b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))


def _listeners(pid: int) -> List[tuple]:
    """``(address, port, inode)`` of every LISTEN socket in the network namespace of ``pid``."""
    out = []
    for proto in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{proto}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # LISTEN
                addr, port = fields[1].rsplit(":", 1)
                out.append((_address(addr), int(port, 16), fields[9]))
    return out


def _socket_inodes(pid: int) -> set:
    out = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(link[8:-1])
    return out


def file_tail(path: str, chars: int = 3000) -> str:
    """The last ``chars`` characters of the file at ``path`` ('' when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - chars))
            return f.read().decode("utf-8", "replace")
    except OSError:
        return ""


class ManagedProcess:
    """One child process started with :func:`spawn`, its log file, and how it is stopped."""

    def __init__(self, name: str, log_path: str) -> None:
        self.name = name
        self.log_path = log_path
        self.proc: Optional["subprocess.Popen[bytes]"] = None

    def start(self, args: Sequence[str], env: Optional[dict] = None) -> None:
        """Start the child in a session of its own: a Ctrl-C at the terminal (SIGINT to the
        foreground process group) reaches us, not it, so we stop it after its clients have closed
        (a master gone first makes every client log errors and retry for seconds while closing).
        It still dies with us (see the module doc)."""
        with open(self.log_path, "ab") as log:
            self.proc = spawn(args, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                              start_new_session=True)

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc is not None else None

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def exit_code(self) -> Optional[int]:
        return self.proc.poll() if self.proc is not None else None

    def signal(self, sig: int) -> None:
        if self.is_running():
            assert self.proc is not None
            self.proc.send_signal(sig)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a paused child is continued first), then SIGKILL after ``timeout`` seconds."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGCONT)  # a paused child cannot act on SIGTERM
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL now, and reap."""
        if self.is_running():
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()

    def log_tail(self, chars: int = 3000) -> str:
        return file_tail(self.log_path, chars)


if __name__ == "__main__":
    sys.exit(_guard(sys.argv[1:]))
