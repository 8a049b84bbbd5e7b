"""``KeyMirror``: one deployment's keys in the store, kept from the master's key events.

A background thread subscribes to the master's events (ZMQ SUB, one socket per master of an
HA cluster: only the leader publishes), loads a snapshot of the keys the master holds
(``GET /get_all_keys`` on its HTTP port, keeping only keys under the deployment's prefixes), and
applies every event after it. The mirror is *complete* from then on, as long as the sequence
numbers follow one another; it answers which of a lookup's keys it holds (:meth:`KeyMirror.answer`).

What an answer is worth, measured on Mooncake 0.3.14 (docs/mooncake.md, "Key events"):

* **absent is reliable**: a key becomes present only by a put, and every put publishes an event
  (an answer of absent is at most as late as the event; a lookup then finds a shorter hit,
  never one that cannot load);
* **present is not**: an eviction, and the end of the client whose segment held a key, publish
  nothing, so a key the mirror holds may be gone. A lookup therefore never trusts a hit from
  the mirror: it verifies (and leases) the hit's keys in one call, and the keys found gone are
  dropped from the mirror (:meth:`KeyMirror.forget`);
* **but a segment mounted again brings its keys back without an event**: after a failover the
  new leader serves with the keys of its oplog hidden until their holders mount their segments
  on it (0-3 s here). So the mirror also watches the master's segments (``/get_all_segments``):
  it waits (up to :data:`SEGMENT_WAIT_S`) for the segments it knew to be mounted again before it
  reads a snapshot, and a change of the segments (one mounted, or gone with its keys) builds it
  again.

**Dropped and rebuilt** (the mirror answers nothing meanwhile: lookups ask the master in rounds)
on a change of the master's segments, a gap in the sequence numbers (messages lost: the subscriber's queue of
:data:`RECEIVE_QUEUE` messages overflowed, or the master dropped events, which its
``/kv_events/status`` counts), a disconnect (a master restart: its numbers start again at 1), a
failover (another master publishes, or the leader changes), events turned off, a snapshot that
cannot be read, and more keys than ``max_keys``.

**Memory**: a 64-bit fingerprint per key (Python's keyed SipHash of the key string, in a set):
about 60-75 bytes per key, ~70 MB per million keys (measured: ``mooncake_keys bench``, docs/
benchmarks.md); ``max_keys`` bounds it (default 2 million: ~150 MB). A fingerprint two keys
share (2^-64 for a pair) can only make a hit that the verify call then refuses, or, once one of
the two is removed, a miss.

The snapshot is consistent with the events because the status's published count is read
before it: the first message received must be numbered at most one past that count (else
messages were missed since, and the mirror is built again); replaying messages from before the
snapshot ends each key in the state of its last event, which is the store's.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .._checks import int_arg, seconds_arg
from .wire import STORED, WireError, decode

__all__ = ["EventSource", "KeyMirror", "MirrorStats", "DEFAULT_MAX_KEYS", "RECEIVE_QUEUE"]

logger = logging.getLogger("mooncake_keys.events")

#: The most keys a mirror holds by default (~150 MB); past it the mirror is off until it fits.
DEFAULT_MAX_KEYS = 2_000_000
#: Messages the subscriber queues before ZMQ drops (then a gap rebuilds the mirror).
RECEIVE_QUEUE = 100_000
#: Events remembered, so that a key seen gone is not dropped when an event for it came meanwhile.
RECENT_EVENTS = 8192
#: Seconds between looks at an incomplete mirror's causes (no leader, events off, ...), and
#: between checks of the master's dropped-event count while complete.
RECHECK_S = 1.0
#: Seconds the mirror stays off after it held too many keys.
OVER_CAPACITY_RETRY_S = 60.0
#: Seconds a new leader is given to have every segment the mirror knew mounted again, before its
#: snapshot is read anyway (a holder that died with the old leader never comes back).
SEGMENT_WAIT_S = 10.0
# No proxy: the master's HTTP port is asked directly.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


@dataclass(frozen=True)
class EventSource:
    """One master's key events: ``endpoint`` where it publishes them (``"tcp://host:port"``, its
    ``--kv_events_bind_endpoint``) and ``http`` its HTTP server (``"http://host:port"``, the
    metrics port: ``/health``, ``/get_all_keys``, ``/kv_events/status``)."""

    endpoint: str
    http: str

    def __post_init__(self) -> None:
        if not (isinstance(self.endpoint, str) and self.endpoint.startswith(("tcp://", "ipc://"))):
            raise ValueError(f"key_events endpoint must be 'tcp://host:port', got {self.endpoint!r}")
        if not (isinstance(self.http, str) and self.http.startswith(("http://", "https://"))):
            raise ValueError(f"key_events http must be 'http://host:port' (the master's metrics port), "
                             f"got {self.http!r}")


def sources_of(value: Any) -> Tuple[EventSource, ...]:
    """The masters of ``value``: an :class:`EventSource`, a mapping ``{"endpoint", "http"}``, or
    a list of those (an HA cluster's masters). ``ValueError``/``TypeError`` naming
    ``key_events`` otherwise."""
    items = [value] if isinstance(value, (EventSource, Mapping)) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, (list, tuple)):
        raise TypeError("key_events must be {'endpoint': 'tcp://host:port', 'http': 'http://host:port'} or a "
                        f"list of them, got {type(value).__name__}")
    out = []
    for item in items:
        if isinstance(item, EventSource):
            out.append(item)
        elif isinstance(item, Mapping):
            extra = set(item) - {"endpoint", "http"}
            if extra or not {"endpoint", "http"} <= set(item):
                raise ValueError(f"key_events entries have exactly the keys 'endpoint' and 'http', got {sorted(item)}")
            out.append(EventSource(item["endpoint"], item["http"]))
        else:
            raise TypeError(f"key_events entries must be mappings, got {type(item).__name__}")
    if not out:
        raise ValueError("key_events must name at least one master")
    return tuple(out)


@dataclass(frozen=True)
class MirrorStats:
    """A mirror's state and counters since it started."""

    #: "complete" (answering), "building", "events off", "no leader", "over capacity", "closed"
    #: (or "stopped": the thread could not start, e.g. an endpoint ZMQ refuses).
    state: str
    #: Keys held now (0 unless complete).
    keys: int
    #: Event messages received (a batch put's events come in one), every event they held (any
    #: deployment's), and the events of this deployment's keys applied.
    messages: int
    events_seen: int
    events: int
    #: Times the mirror was dropped (a gap, a reconnect, a restart or failover, events off, ...).
    gaps: int
    #: Snapshots loaded (each made the mirror complete).
    rebuilds: int
    #: Keys dropped because a lookup found them gone (evicted: no event says so).
    forgotten: int
    #: Why the mirror was last dropped or is not complete ("" if it never was).
    reason: str = ""

    @property
    def complete(self) -> bool:
        return self.state == "complete"


class _Drop(Exception):
    """The mirror must be dropped and built again (the message says why)."""


class KeyMirror:
    """The keys under ``prefixes`` (a deployment's key prefixes, up to ``@group:<g>``) that the
    master holds, kept from its key events by a background thread (see the module docstring).

    ``sources``: what :func:`sources_of` reads. ``max_keys`` bounds the memory. ``timeout_s``
    bounds each HTTP request of the master (the snapshot of a large store takes longer: it gets
    ``snapshot_timeout_s``). Thread-safe; :meth:`close` stops the thread.
    """

    def __init__(self, sources: Any, *, prefixes: Iterable[str], max_keys: int = DEFAULT_MAX_KEYS,
                 timeout_s: float = 1.0, snapshot_timeout_s: float = 30.0) -> None:
        try:
            import msgpack
            import zmq
        except ImportError as exc:
            raise ImportError("key events need pyzmq and msgpack: pip install 'mooncake-keys[events]'") from exc
        self._zmq, self._unpackb = zmq, msgpack.unpackb
        self.sources = sources_of(sources)
        heads = []
        for p in prefixes:
            if not isinstance(p, str) or not p:
                raise TypeError(f"prefixes must be non-empty str, got {p!r}")
            heads.append(p + "@")
        if not heads:
            raise ValueError("prefixes must hold at least one key prefix")
        self.heads: Tuple[str, ...] = tuple(sorted(set(heads)))
        self._bheads = tuple(h.encode() for h in self.heads)
        self.max_keys = int_arg("max_keys", max_keys, min=1)
        self.timeout_s = seconds_arg("timeout_s", timeout_s)
        self.snapshot_timeout_s = seconds_arg("snapshot_timeout_s", snapshot_timeout_s)
        self._lock = threading.Lock()
        self._present: Optional[Set[int]] = None  # the fingerprints, while complete
        self._generation = 0  # bumped at every drop
        self._applied = 0  # events applied since the start (a mark for forget)
        self._recent: Deque[Tuple[int, int]] = collections.deque(maxlen=RECENT_EVENTS)
        self._state, self._reason = "building", ""
        self._counts = {"messages": 0, "events_seen": 0, "events": 0, "gaps": 0, "rebuilds": 0, "forgotten": 0}
        self._logged: Optional[str] = None
        self._segments: Optional[frozenset] = None  # the master's segments at the last snapshot
        self._dropped_at = time.monotonic()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mooncake_keys-key-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ lookups' side
    @property
    def ready(self) -> bool:
        """Whether the mirror is complete (its answers are worth asking)."""
        return self._present is not None

    def answer(self, keys: Sequence[str]) -> Optional[List[int]]:
        """Per key 1 when the mirror holds it, else 0; None while not complete."""
        present = self._present
        if present is None:
            return None
        return [1 if hash(k) in present else 0 for k in keys]

    def mark(self) -> Tuple[int, int]:
        """Where the mirror is now: what :meth:`forget` compares with (take it before a call)."""
        with self._lock:
            return self._generation, self._applied

    def forget(self, keys: Sequence[str], mark: Optional[Tuple[int, int]]) -> int:
        """Drop ``keys``, which the master answered absent in a call made after ``mark``, unless
        an event for one of them was applied since (it may be newer than that answer): the mirror
        holds what no event said went (an eviction). How many were dropped."""
        if mark is None or not keys:
            return 0
        with self._lock:
            present = self._present
            generation, applied = mark
            if present is None or generation != self._generation:
                return 0
            recent = self._recent
            if self._applied > applied and (not recent or recent[0][0] > applied + 1):
                return 0  # the events since the mark are no longer all remembered
            touched = {fp for i, fp in recent if i > applied}
            dropped = 0
            for k in keys:
                fp = hash(k)
                if fp in present and fp not in touched:
                    present.discard(fp)
                    dropped += 1
            self._counts["forgotten"] += dropped
            return dropped

    def stats(self) -> MirrorStats:
        with self._lock:
            present = self._present
            return MirrorStats(self._state, 0 if present is None else len(present), reason=self._reason,
                               **self._counts)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread and close its sockets. Idempotent."""
        self._closed.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)
        with self._lock:
            self._present = None
            self._state = "closed"

    def __enter__(self) -> "KeyMirror":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        s = self.stats()
        return f"<KeyMirror {s.state} {s.keys} keys, {len(self.sources)} master(s)>"

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        zmq = self._zmq
        ctx = zmq.Context()
        subs, monitors = [], []
        try:
            poller = zmq.Poller()
            for src in self.sources:
                sub = ctx.socket(zmq.SUB)
                sub.setsockopt(zmq.RCVHWM, RECEIVE_QUEUE)
                sub.setsockopt(zmq.RECONNECT_IVL, 50)
                sub.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
                sub.setsockopt(zmq.LINGER, 0)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
                sub.connect(src.endpoint)
                poller.register(sub, zmq.POLLIN)
                poller.register(mon, zmq.POLLIN)
                subs.append(sub)
                monitors.append(mon)
            self._loop(poller, subs, monitors)
        except Exception as exc:  # noqa: BLE001 - logged; the mirror is off, lookups ask the master
            logger.warning("key-event mirror stopped: %s: %s", type(exc).__name__, exc)
            self._drop(f"the mirror's thread stopped: {type(exc).__name__}: {exc}", count=False)
        finally:
            for s in subs + monitors:
                s.close(0)
            ctx.term()

    def _loop(self, poller: Any, subs: List[Any], monitors: List[Any]) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        connected = [False] * len(subs)
        leader: Optional[int] = None
        last_seq: Optional[int] = None
        first_max = 0  # while last_seq is None: the highest number the first message may have
        dropped_at_build = 0
        next_check = 0.0
        while not self._closed.is_set():
            try:
                now = time.monotonic()
                if self._present is None and now >= next_check:
                    built = self._build(poller, monitors, connected)
                    if built is None:
                        next_check = time.monotonic() + self._retry_after()
                        continue
                    leader, first_max, dropped_at_build = built
                    last_seq = None
                    next_check = time.monotonic() + RECHECK_S
                elif self._present is not None and now >= next_check:
                    self._check_status(leader, dropped_at_build)
                    next_check = now + RECHECK_S
                for sock, _ in poller.poll(100):
                    if sock in monitors:
                        i = monitors.index(sock)
                        event = recv_monitor_message(sock)["event"]
                        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                            connected[i] = True
                        elif event == zmq.EVENT_DISCONNECTED:
                            connected[i] = False
                            if i == leader and self._present is not None:
                                raise _Drop(f"disconnected from {self.sources[i].endpoint} (a master restart "
                                            "or failover)")
                        continue
                    i = subs.index(sock)
                    frames = sock.recv_multipart()
                    self._counts["messages"] += 1
                    if self._present is None:
                        continue  # read before the snapshot: replayed events do not matter
                    if i != leader:
                        raise _Drop(f"another master publishes ({self.sources[i].endpoint}): a failover")
                    seq, events = decode(frames, self._unpackb)
                    self._counts["events_seen"] += len(events)
                    if last_seq is None:
                        if seq > first_max:
                            raise _Drop(f"messages {first_max}-{seq - 1} were missed while the snapshot was read")
                    elif seq != last_seq + 1:
                        what = "the master restarted" if seq <= last_seq else f"{seq - last_seq - 1} messages lost"
                        raise _Drop(f"sequence number {seq} after {last_seq}: {what}")
                    last_seq = seq
                    self._apply(events)
            except _Drop as why:
                self._drop(str(why))
                next_check = 0.0
            except WireError as exc:
                self._drop(f"a message that is not a key event: {exc}")
                next_check = time.monotonic() + RECHECK_S
            except Exception as exc:  # noqa: BLE001 - the thread must not end: dropped, tried again
                self._drop(f"{type(exc).__name__}: {exc}")
                next_check = time.monotonic() + RECHECK_S

    def _retry_after(self) -> float:
        return OVER_CAPACITY_RETRY_S if self._state == "over capacity" else RECHECK_S

    def _apply(self, events: List[Tuple[int, str]]) -> None:
        heads = self.heads
        with self._lock:
            present = self._present
            if present is None:
                return
            for kind, key in events:
                if not key.startswith(heads):
                    continue
                fp = hash(key)
                self._applied += 1
                self._recent.append((self._applied, fp))
                self._counts["events"] += 1
                if kind == STORED:
                    present.add(fp)
                else:
                    present.discard(fp)
            if len(present) > self.max_keys:
                self._present = None
                self._generation += 1
                self._state, self._reason = "over capacity", f"more than max_keys ({self.max_keys}) keys"
                self._counts["gaps"] += 1
                self._log(self._reason)

    def _drop(self, reason: str, count: bool = True) -> None:
        self._dropped_at = time.monotonic()
        with self._lock:
            was = self._present is not None
            self._present = None
            self._generation += 1
            self._state, self._reason = ("building" if count else "stopped"), reason
            if was and count:
                self._counts["gaps"] += 1
        if was:
            self._log(f"dropped ({reason}): lookups ask the master until it is built again")

    def _not_complete(self, state: str, reason: str) -> None:
        with self._lock:
            self._state, self._reason = state, reason
        self._log(reason)

    def _log(self, message: str) -> None:
        """One warning per distinct problem until the mirror is complete again."""
        if message != self._logged:
            self._logged = message
            logger.warning("key-event mirror: %s", message)

    def _http(self, src: EventSource, path: str) -> Any:
        import json

        with _OPENER.open(src.http.rstrip("/") + path, timeout=self.timeout_s) as resp:
            return json.loads(resp.read())

    def _find_leader(self) -> Optional[int]:
        for i, src in enumerate(self.sources):
            try:
                health = self._http(src, "/health")
            except (OSError, ValueError):
                continue
            if isinstance(health, dict) and health.get("service_ready"):
                return i
        return None

    def _build(self, poller: Any, monitors: List[Any], connected: List[bool]) -> Optional[Tuple[int, int, int]]:
        """Load a snapshot; (leader, the highest number its first message may have, the
        master's dropped-event count) once complete, else None (why: the state says)."""
        leader = self._find_leader()
        if leader is None:
            self._not_complete("no leader", "no master answers as the serving leader")
            return None
        src = self.sources[leader]
        status = self._status(src)
        if status is None:
            return None
        self._wait_connected(poller, monitors, connected, leader)
        if not connected[leader]:
            self._not_complete("building", f"cannot subscribe to {src.endpoint}")
            return None
        segments = self._segments_of(src)
        if segments is None:
            return None
        missing = (self._segments or frozenset()) - segments
        if missing and time.monotonic() - self._dropped_at < SEGMENT_WAIT_S:
            self._not_complete("building", f"waiting for {len(missing)} segment(s) to be mounted on {src.http} "
                                           "again (their keys come back without events)")
            return None
        status = self._status(src)  # read again, now that the subscription is up
        if status is None:
            return None
        published = int(status.get("published_batches", status.get("published_events", 0)))
        dropped = int(status.get("dropped_events", 0))
        started = time.monotonic()
        try:
            present = self._snapshot(src)
        except _Drop as why:
            self._not_complete("over capacity" if "max_keys" in str(why) else "building", str(why))
            return None
        except (OSError, ValueError) as exc:
            self._not_complete("building", f"{src.http}/get_all_keys: {exc}")
            return None
        if self._segments_of(src) != segments:
            self._not_complete("building", f"the segments on {src.http} changed while its keys were read")
            return None
        self._segments = segments
        with self._lock:
            if self._closed.is_set():
                return None
            self._present = present
            self._generation += 1
            self._state, self._reason = "complete", ""
            self._counts["rebuilds"] += 1
        self._logged = None
        logger.info("key-event mirror complete: %d keys of this deployment from %s in %.0f ms", len(present),
                    src.http, (time.monotonic() - started) * 1e3)
        return leader, published + 1, dropped

    def _segments_of(self, src: EventSource) -> Optional[frozenset]:
        """The segments mounted on the master (``/get_all_segments``: one a line), or None."""
        try:
            with _OPENER.open(src.http.rstrip("/") + "/get_all_segments", timeout=self.timeout_s) as resp:
                return frozenset(line.strip() for line in resp.read().decode("utf-8", "replace").splitlines()
                                 if line.strip())
        except OSError as exc:
            self._not_complete("building", f"{src.http}/get_all_segments: {exc}")
            return None

    def _status(self, src: EventSource) -> Optional[Dict[str, Any]]:
        """The master's ``/kv_events/status`` while it publishes events, else None (why: the state)."""
        try:
            status = self._http(src, "/kv_events/status")
        except (OSError, ValueError) as exc:
            self._not_complete("building", f"{src.http}/kv_events/status: {exc}")
            return None
        if not (isinstance(status, dict) and status.get("enabled")):
            self._not_complete("events off", f"the master at {src.http} publishes no key events (start it with "
                                             "--enable_kv_events=true and a --kv_events_backend_id; 0.3.14 or later)")
            return None
        return status

    def _wait_connected(self, poller: Any, monitors: List[Any], connected: List[bool], i: int) -> None:
        from zmq.utils.monitor import recv_monitor_message

        zmq = self._zmq
        deadline = time.monotonic() + 2.0
        mon = monitors[i]
        while not connected[i] and time.monotonic() < deadline and not self._closed.is_set():
            if mon.poll(50):
                event = recv_monitor_message(mon)["event"]
                connected[i] = event == zmq.EVENT_HANDSHAKE_SUCCEEDED

    def _snapshot(self, src: EventSource) -> Set[int]:
        """The fingerprints of this deployment's keys among every key the master holds
        (``/get_all_keys``: one key a line)."""
        bheads, limit = self._bheads, self.max_keys
        present: Set[int] = set()
        with _OPENER.open(src.http.rstrip("/") + "/get_all_keys", timeout=self.snapshot_timeout_s) as resp:
            for line in resp:
                if line.startswith(bheads):
                    present.add(hash(line.rstrip(b"\r\n").decode("utf-8", "surrogateescape")))
                    if len(present) > limit:
                        raise _Drop(f"more than max_keys ({limit}) keys of this deployment")
        return present

    def _check_status(self, leader: Optional[int], dropped_at_build: int) -> None:
        """While complete: the master's own count of events it dropped (they never got a number)."""
        if leader is None:
            return
        src = self.sources[leader]
        try:
            status = self._http(src, "/kv_events/status")
        except (OSError, ValueError):
            return  # a master that does not answer: its disconnect says more
        if not (isinstance(status, dict) and status.get("enabled")):
            raise _Drop(f"the master at {src.http} no longer publishes key events")
        if int(status.get("dropped_events", 0)) > dropped_at_build:
            raise _Drop(f"the master at {src.http} dropped key events (its queue was full)")
        try:
            with _OPENER.open(src.http.rstrip("/") + "/get_all_segments", timeout=self.timeout_s) as resp:
                segments = frozenset(line.strip() for line in resp.read().decode("utf-8", "replace").splitlines()
                                     if line.strip())
        except OSError:
            return
        if segments != self._segments:
            known = self._segments or frozenset()
            added, gone = len(segments - known), len(known - segments)
            raise _Drop(f"the master's segments changed ({added} mounted, {gone} gone: keys come and go with them "
                        "without events)")
