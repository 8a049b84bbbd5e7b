"""Is the Mooncake master reachable? A background probe, so that a dead one is refused at once.

Every ``interval`` seconds the probe finds the master's RPC address and connects to it: for
``host:port`` that address itself; for an HA cluster (``etcd://host:port[;host:port...]``) the
leader's address, read from etcd (``mooncake-store/<cluster id>/master_view``, the cluster id
from ``MC_STORE_CLUSTER_ID`` as the client reads it). A standby opens its RPC port only when it
starts serving, so a refused connect covers both a dead leader and one still warming up. While
the probe fails the store is *down*: calls are refused in microseconds instead of stalling
~4.3 s each inside the client. ``suspect`` marks it down at once (a call that overran its time
limit, or answered RPC_FAIL everywhere) until the next probe reaches a master.

The probe survives any answer: etcd's is checked (type and shape), every exception is handled
and logged once per distinct problem, and a probe thread that died anyway is restarted by
:meth:`MasterProbe.ensure_running` (the store calls it while down), so a store is never held
down while its master answers. When etcd cannot be read (a stall, a restart, an odd answer) the
last known leader keeps being asked, as long as it accepts connections, for up to
``etcd_grace_s`` (10 s: about what a leader cut off from etcd needs to lose its lease, after
which another may serve); an etcd that answers "no leader" is believed at once.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import os
import reprlib
import socket
import threading
import time
import urllib.request
from typing import Callable, List, Optional, Set, Tuple

from .._checks import utf8_encodable

__all__ = [
    "DEFAULT_ETCD_GRACE_S",
    "DEFAULT_PROBE_INTERVAL_S",
    "EtcdUnreadable",
    "MasterProbe",
    "NoLeader",
    "parse_master_address",
    "resolve_master",
]

logger = logging.getLogger("mooncake_keys.store")

#: Seconds between probes of the master (0 or None: no probe).
DEFAULT_PROBE_INTERVAL_S = 0.05
#: Seconds the last known HA leader keeps being asked while etcd cannot be read.
DEFAULT_ETCD_GRACE_S = 10.0
#: The largest etcd answer read: a master view is a few hundred bytes.
MAX_ETCD_ANSWER_BYTES = 1 << 16
#: Distinct problems logged per outage (a problem whose text keeps changing cannot flood the log).
_MAX_REPORTED = 32

ETCD_PREFIX = "etcd://"
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EtcdUnreadable(OSError):
    """No etcd endpoint gave a usable answer (unreachable, timed out, or not etcd's answer)."""


class NoLeader(OSError):
    """etcd answered: no master of the cluster is published as leader."""


class _OddAnswer(ValueError):
    """An etcd endpoint answered something that is not etcd's answer to our question."""


def parse_master_address(address: str) -> Tuple[Optional[Tuple[str, int]], List[str]]:
    """``(host, port)`` of a plain master address, or the etcd endpoints of an HA one.

    ValueError naming ``master_address`` when it is neither."""
    if not isinstance(address, str) or not address.strip():
        raise ValueError(f"master_address must be 'host:port' or 'etcd://host:port[;host:port]', got {reprlib.repr(address)}")
    if address.startswith(ETCD_PREFIX):
        endpoints = [e.strip() for e in address[len(ETCD_PREFIX):].split(";") if e.strip()]
        if not endpoints or any(_split(e) is None for e in endpoints):
            raise ValueError(f"master_address {reprlib.repr(address)}: every etcd endpoint must be 'host:port'")
        return None, endpoints
    hostport = _split(address)
    if hostport is None:
        raise ValueError(f"master_address must be 'host:port' or 'etcd://host:port[;host:port]', got {reprlib.repr(address)}")
    return hostport, []


def _split(hostport: str) -> Optional[Tuple[str, int]]:
    host, sep, port = hostport.strip().rpartition(":")
    # ASCII digits only (str.isdigit takes '²' and other scripts' digits), at most 5 of them.
    if not sep or not host or not (port.isascii() and port.isdigit() and len(port) <= 5) \
            or not 0 < int(port) < 65536 or not host.isprintable() or not utf8_encodable(host):
        return None
    return host.strip("[]"), int(port)


def _etcd_leader(endpoint: str, cluster_id: str, timeout: float) -> Optional[str]:
    """The leader's RPC address that etcd at ``endpoint`` publishes, or None (no leader).

    OSError when it cannot be asked; :class:`_OddAnswer` saying what is wrong when the answer is
    not etcd's (checked field by field: a JSON object with a ``header``, ``kvs`` a list of
    objects, the ``value`` base64 of UTF-8 text)."""
    key = base64.b64encode(f"mooncake-store/{cluster_id}/master_view".encode()).decode()
    req = urllib.request.Request(f"http://{endpoint}/v3/kv/range", data=json.dumps({"key": key}).encode(),
                                 method="POST")
    with _OPENER.open(req, timeout=timeout) as resp:
        raw = resp.read(MAX_ETCD_ANSWER_BYTES + 1)
    if len(raw) > MAX_ETCD_ANSWER_BYTES:
        raise _OddAnswer(f"the answer is larger than {MAX_ETCD_ANSWER_BYTES} bytes")
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError):  # RecursionError: nested too deeply
        raise _OddAnswer(f"the answer is not JSON: {reprlib.repr(raw[:80])}") from None
    if not isinstance(answer, dict):
        raise _OddAnswer(f"the answer is a JSON {_json_kind(answer)}, not an object")
    if not isinstance(answer.get("header"), dict):
        raise _OddAnswer("the answer has no 'header' object: not an etcd v3 range answer")
    kvs = answer.get("kvs", [])
    if not isinstance(kvs, list):
        raise _OddAnswer(f"'kvs' is a JSON {_json_kind(kvs)}, not an array")
    if not kvs:
        return None
    entry = kvs[0]
    if not isinstance(entry, dict) or not isinstance(entry.get("value"), str):
        raise _OddAnswer("'kvs[0]' is not an object with a string 'value'")
    try:
        return base64.b64decode(entry["value"], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise _OddAnswer(f"'kvs[0].value' is not base64 of UTF-8 text: {reprlib.repr(entry['value'])}") from None


def _json_kind(value: object) -> str:
    return {list: "array", str: "string", bool: "boolean", type(None): "null", dict: "object"}.get(
        type(value), "number")


def _describe(exc: BaseException) -> str:
    """One short line for an exception met while asking etcd or a master."""
    if isinstance(exc, (_OddAnswer, EtcdUnreadable, NoLeader)):
        return str(exc)
    if isinstance(exc, socket.timeout):
        return "timed out"
    reason = getattr(exc, "reason", None)  # urllib's URLError wraps the socket's error
    if isinstance(reason, BaseException):
        return _describe(reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def resolve_master(address: str, timeout: float = 0.5) -> Tuple[str, int]:
    """The RPC address of the master that serves ``address`` (an HA cluster: its leader).

    :class:`NoLeader` when etcd publishes none; :class:`EtcdUnreadable` naming every endpoint
    and what was wrong with it when none could be read. Both are ``OSError``."""
    hostport, endpoints = parse_master_address(address)
    if hostport is not None:
        return hostport
    cluster_id = os.environ.get("MC_STORE_CLUSTER_ID", "mooncake_cluster")
    errors = []
    for endpoint in endpoints:
        try:
            leader = _etcd_leader(endpoint, cluster_id, timeout)
        except Exception as exc:  # noqa: BLE001 - whatever an endpoint does, try the next one
            errors.append(f"etcd {endpoint}: {_describe(exc)}")
            continue
        if leader is None:
            raise NoLeader(f"no leader of Mooncake cluster {cluster_id!r} in etcd {endpoint}")
        found = _split(leader)
        if found is None:
            errors.append(f"etcd {endpoint}: names the leader {reprlib.repr(leader)}, not host:port")
            continue
        return found
    raise EtcdUnreadable("; ".join(errors))


class MasterProbe:
    """Probes the master every ``interval`` s on a thread of its own; ``down`` (with
    ``reason``) while that fails.

    ``on_leader_change(host, port)`` is called when the serving master's address changes (an
    HA failover), after it accepted a connection. ``leader`` is the last master that did.
    """

    def __init__(self, master_address: str, interval: float,
                 on_leader_change: Optional[Callable[[str, int], None]] = None,
                 etcd_grace_s: float = DEFAULT_ETCD_GRACE_S) -> None:
        parse_master_address(master_address)
        self.master_address = master_address
        self.interval = interval
        self.on_leader_change = on_leader_change
        self.etcd_grace_s = etcd_grace_s
        self.down = False
        self.reason = ""
        self.leader: Optional[Tuple[str, int]] = None
        self._etcd_unreadable_since: Optional[float] = None
        self._reported: Set[str] = set()  # problems logged since the master last answered
        self._stop_event = threading.Event()
        self._wake = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._thread_lock = threading.Lock()

    @classmethod
    def start_for(cls, master_address: str, interval: Optional[float],
                  on_leader_change: Optional[Callable[[str, int], None]] = None) -> Optional["MasterProbe"]:
        if not interval or interval <= 0:
            return None
        probe = cls(master_address, interval, on_leader_change)
        probe.probe_once()  # the state is known before the first call
        probe.start()
        return probe

    # ----------------------------------------------------------- the thread

    def start(self) -> None:
        with self._thread_lock:
            self._start_thread()

    def _start_thread(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"mooncake-probe-{self.master_address}", daemon=True)
        self._thread.start()

    def is_alive(self) -> bool:
        """The probe thread runs."""
        thread = self._thread
        return thread is not None and thread.is_alive()

    def ensure_running(self) -> None:
        """Start a new probe thread if the last one died (nothing it meets should end it; this
        makes sure a dead one cannot hold a store down) and the probe was not stopped."""
        if self._stop_event.is_set() or self.is_alive():
            return
        with self._thread_lock:
            if self._stop_event.is_set() or self.is_alive():
                return
            logger.warning("the probe of Mooncake master %s had stopped: started again", self.master_address)
            self._start_thread()
        self._wake.set()

    def _run(self) -> None:
        while not self._stop_event.is_set():
            self._wake.clear()
            self.probe_once()
            self._wake.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()

    # ----------------------------------------------------------- probing

    def suspect(self, reason: str) -> None:
        """Mark the master down now and re-probe at once (a live master clears it within ms)."""
        self._report(f"suspected down: {reason}")
        self.reason = reason
        self.down = True
        self._wake.set()

    def probe_once(self) -> bool:
        """One probe; True when a master accepted the connection. Never raises."""
        try:
            return self._probe()
        except Exception as exc:  # noqa: BLE001 - nothing may end the probe
            self._fail(f"the probe failed: {type(exc).__name__}: {exc}", exc_info=True)
            return False

    def _probe(self) -> bool:
        timeout = max(self.interval, 0.5)
        try:
            host, port, etcd_read = self._find_master(timeout)
            with socket.create_connection((host, port), timeout=timeout):
                pass
        except OSError as exc:
            self._fail(f"probe of the master: {_describe(exc)}")
            return False
        previous, self.leader = self.leader, (host, port)
        if previous is not None and previous != self.leader:
            logger.warning("Mooncake master %s: the leader moved from %s:%d to %s:%d",
                           self.master_address, *previous, host, port)
            if self.on_leader_change is not None:
                try:
                    self.on_leader_change(host, port)
                except Exception as exc:  # noqa: BLE001 - stay down; the next probe tries again
                    self.leader = previous
                    self._fail(f"following the new leader {host}:{port} failed: {type(exc).__name__}: {exc}",
                               exc_info=True)
                    return False
        if etcd_read and self._reported:
            logger.info("Mooncake master %s answers again", self.master_address)
            self._reported.clear()
        self.down, self.reason = False, ""
        return True

    def _find_master(self, timeout: float) -> Tuple[str, int, bool]:
        """``(host, port, etcd was read)`` of the master to connect to: through an etcd that
        cannot be read, the last known leader for up to ``etcd_grace_s``."""
        try:
            host, port = resolve_master(self.master_address, timeout)
        except EtcdUnreadable as exc:
            now = time.monotonic()
            if self._etcd_unreadable_since is None:
                self._etcd_unreadable_since = now
            if self.leader is None or now - self._etcd_unreadable_since > self.etcd_grace_s:
                raise
            self._report(f"etcd unreadable ({exc}): asking the last known leader {self.leader[0]}:{self.leader[1]} "
                         f"for up to {self.etcd_grace_s:g} s")
            return self.leader[0], self.leader[1], False
        self._etcd_unreadable_since = None
        return host, port, True

    def _fail(self, reason: str, exc_info: bool = False) -> None:
        self._report(reason, exc_info=exc_info)
        self.reason = reason
        self.down = True

    def _report(self, problem: str, exc_info: bool = False) -> None:
        """Log ``problem`` once until the master answers again."""
        if problem in self._reported or len(self._reported) >= _MAX_REPORTED:
            return
        self._reported.add(problem)
        logger.warning("Mooncake master %s: %s", self.master_address, problem, exc_info=exc_info)
