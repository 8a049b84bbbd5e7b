"""Temp directories owned by a live process (a master's log, a cluster's etcd data and logs).

A :class:`WorkDir` is ``<tmp>/mooncake_keys-<kind>-<pid>-<start time>-<random>``, and its owner
holds an ``fcntl.flock`` on ``owner.lock`` inside for as long as the directory lives. The owner
removes it on every exit it sees (a stop, a context manager, interpreter exit); what an exit it
cannot see leaves behind (SIGKILL, a SIGTERM Python does not handle, a power cut) is removed by
:func:`sweep_stale` when the next :class:`WorkDir` is made, once its owner is gone: no process has
that PID *and* start time (``/proc/<pid>/stat``: a PID reused by another process does not count)
and the lock can be taken (an owner in another PID namespace still holds it). A directory kept
on a failure, whose logs an error names, holds a ``KEPT`` file and is never swept.
"""

from __future__ import annotations

import atexit
import logging
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from typing import List, Optional

try:
    import fcntl
except ImportError:  # not POSIX: the owner's PID alone tells
    fcntl = None  # type: ignore[assignment]

__all__ = ["WorkDir", "sweep_stale"]

logger = logging.getLogger("mooncake_keys.store")

PREFIX = "mooncake_keys-"
LOCK_FILE = "owner.lock"
KEPT_FILE = "KEPT"
#: A directory without its lock file yet is being made; older than this, its owner died doing so.
_UNLOCKED_GRACE_S = 60.0
_NAME = re.compile(r"mooncake_keys-[a-z]+-(\d+)-(\d+)-[A-Za-z0-9_]+")
_LIVE: set = set()
_LIVE_LOCK = threading.Lock()


def _start_time(pid: int) -> Optional[str]:
    """The start time of process ``pid`` (clock ticks since boot, Linux), "" where ``/proc`` does
    not tell, or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[19]  # field 22; the fields after ')' start at 3
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return ""


class WorkDir:
    """A temp directory this process owns; ``kind`` (lowercase letters) names what it holds.

    Making one first sweeps the directories of owners that are gone (:func:`sweep_stale`).
    ``remove()`` deletes it; ``keep(reason)`` leaves it for good (its logs are named in an error)."""

    def __init__(self, kind: str) -> None:
        sweep_stale()
        pid = os.getpid()
        self.path = tempfile.mkdtemp(prefix=f"{PREFIX}{kind}-{pid}-{_start_time(pid) or 0}-")
        self._lock_fd: Optional[int] = os.open(os.path.join(self.path, LOCK_FILE),
                                               os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        if fcntl is not None:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with _LIVE_LOCK:
            _LIVE.add(self)

    @property
    def live(self) -> bool:
        """Neither removed nor kept yet."""
        return self._lock_fd is not None

    def _release(self) -> bool:
        with _LIVE_LOCK:
            fd, self._lock_fd = self._lock_fd, None
            _LIVE.discard(self)
        if fd is None:
            return False
        os.close(fd)
        return True

    def remove(self) -> None:
        """Delete the directory and everything in it (idempotent; a kept one stays)."""
        if self._release():
            shutil.rmtree(self.path, ignore_errors=True)

    def keep(self, reason: str) -> str:
        """Leave the directory for good (never swept): ``reason`` is written into it. Its path."""
        if self.live:
            try:
                with open(os.path.join(self.path, KEPT_FILE), "w") as f:
                    f.write(reason + "\n")
            except OSError:
                pass
            self._release()
        return self.path

    def __repr__(self) -> str:
        return f"<WorkDir {self.path} {'live' if self.live else 'released'}>"


def sweep_stale(parent: Optional[str] = None) -> List[str]:
    """Remove the work directories under ``parent`` (default: the temp dir) whose owner is gone;
    return their paths. Only this user's directories, never a kept one, never through a link."""
    parent = parent or tempfile.gettempdir()
    removed = []
    try:
        names = [n for n in os.listdir(parent) if n.startswith(PREFIX)]
    except OSError:
        return removed
    for name in names:
        match = _NAME.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or os.path.lexists(os.path.join(path, KEPT_FILE)):
            continue
        pid, started = int(match.group(1)), match.group(2)
        alive = _start_time(pid)
        if alive is not None and alive in (started, ""):
            continue  # the owner runs (or this platform cannot tell it from a reused PID: the lock decides)
        if _remove_if_unlocked(path, st.st_mtime):
            removed.append(path)
    if removed:
        logger.info("removed %d work directories whose owner is gone: %s", len(removed), ", ".join(removed))
    return removed


def _remove_if_unlocked(path: str, mtime: float) -> bool:
    try:
        fd = os.open(os.path.join(path, LOCK_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        if time.time() - mtime < _UNLOCKED_GRACE_S:
            return False  # being made right now
        shutil.rmtree(path, ignore_errors=True)
        return True
    except OSError:
        return False
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # held: its owner lives
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


@atexit.register
def _remove_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for workdir in live:
        workdir.remove()
