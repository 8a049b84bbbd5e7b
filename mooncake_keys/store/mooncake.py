"""A safe adapter over Mooncake's ``MooncakeDistributedStore`` client.

The raw client has sharp edges (docs/mooncake.md):

* any method called before a successful ``setup()`` or after ``close()`` is a SIGSEGV, not an
  exception (so are ``setup`` with an empty master address, and ``rpc_only`` with memory);
* with a dead master every call stalls ~4.3 s before it returns -900, whatever the timeouts
  say; a hung master holds a call for the whole RPC timeout (30 s by default);
* ``setup()`` against an unreachable master retries for ~90 s by default;
* a key with a lone surrogate makes the whole batch call fail.

:class:`MooncakeStore` keeps its own open flag (:mod:`.gate`), validates arguments and keys
before the client sees them, sets bounded timeouts (:mod:`.config`), refuses calls at once
while a probe cannot reach the master (:mod:`.probe`), and runs every existence call on a lane
with a time limit (:mod:`.lane`): a lookup never waits longer than ``call_timeout_s``, the
first call after a master dies included. Its method names match the client's, so it is a
drop-in ``store`` for a lookup engine and a KV pool.

Mooncake 0.3.14 added an existence check that takes no read lease, ``batch_probe_key``, and a
way to lease one chosen set of keys all-or-nothing (policy ``LastHitOnly`` with one candidate
of every key). It works only when the client *and* the master are 0.3.14: a 0.3.14 client of an
older master is answered ``-900`` for every key. :meth:`MooncakeStore.lease_probes` finds out
which, once per client, and remembers; a lookup engine then asks without leases and leases
exactly the keys its hit loads (:mod:`mooncake_keys.lookup.rounds`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Callable, List, Optional, Tuple

from .._checks import bool_arg, int_arg, seconds_arg, text_arg
from .config import LOCAL_HOSTNAME_ENV, MooncakeStoreConfig, parse_size, set_client_env
from .gate import CallGate, GateClosed
from .keycheck import check_batch, check_key, check_keys
from .lane import CallLane, LaneBusy, LaneTimeout
from .probe import DEFAULT_PROBE_INTERVAL_S, MasterProbe, parse_master_address, resolve_master

__all__ = [
    "DEFAULT_CALL_TIMEOUT_S",
    "LEASE_NONE",
    "LEASE_LAST_HIT_ONLY",
    "MooncakeStore",
    "MooncakeStoreError",
    "MooncakeStoreUnavailable",
]

logger = logging.getLogger("mooncake_keys.store")

#: Seconds an existence call (``batch_is_exist``, ``is_exist``) may take before it is given up.
DEFAULT_CALL_TIMEOUT_S = 0.5

#: ``ErrorCode::RPC_FAIL``: the master could not be reached for this call.
RPC_FAIL = -900
#: ``batch_probe_key`` policies (Mooncake 0.3.14; it refuses any other spelling): no lease at
#: all, or a lease on the last group of ``candidate_size`` keys that all exist.
LEASE_NONE, LEASE_LAST_HIT_ONLY = "none", "LastHitOnly"
#: The key :meth:`MooncakeStore.lease_probes` asks to find out whether the master answers
#: ``batch_probe_key`` (no one stores it; any answer but -900 says the master knows the call).
SUPPORT_PROBE_KEY = "mooncake_keys/does-the-master-answer-batch_probe_key"
#: The protocol of a client that only asks the master (no segment, no buffer, no listener).
LOOKUP_ONLY_PROTOCOL = "rpc_only"
_PROTOCOLS = ("tcp", "rdma", LOOKUP_ONLY_PROTOCOL)
#: The smallest segment the client accepts (it answers -600 below).
MIN_SEGMENT_SIZE = 16 << 20

#: ``health_check()`` codes of the Mooncake client.
HEALTHY, NOT_INITIALISED, MASTER_UNREACHABLE = 0, 1, 2
_HEALTH_REASONS = {
    NOT_INITIALISED: "client not initialised or closed",
    MASTER_UNREACHABLE: "master unreachable",
}
_BIND_WARNED = False


class MooncakeStoreError(RuntimeError):
    """A Mooncake store call or setup failed, or the store is closed."""


class MooncakeStoreUnavailable(MooncakeStoreError):
    """No call was sent (or it was given up): the master cannot be reached now.

    ``health`` holds the client's code: 1 not initialised/closed, 2 master unreachable.
    """

    def __init__(self, health: int, master_address: str = "", detail: str = "") -> None:
        self.health = health
        reason = _HEALTH_REASONS.get(health, "unknown health state")
        where = f" at {master_address}" if master_address else ""
        if detail:
            super().__init__(f"Mooncake store unavailable{where}: {reason} ({detail})")
        else:
            super().__init__(f"Mooncake store unavailable{where}: health_check()={health} ({reason})")


# --------------------------------------------------------------------------- setup


def _import_client_class() -> type:
    """Import ``MooncakeDistributedStore`` with an actionable error message."""
    # Read once, at the first import of mooncake.store: silences INFO/WARNING spam.
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as exc:
        if "libibverbs" in str(exc):
            raise ImportError(
                "The Mooncake client needs the system library libibverbs.so.1, even without RDMA: "
                f"run 'apt-get install libibverbs1' ({exc})"
            ) from exc
        if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "mooncake":
            raise ImportError(
                "The Mooncake client is not installed: run 'pip install mooncake-keys[mooncake]' "
                "(or 'pip install mooncake-transfer-engine-non-cuda')"
            ) from exc
        raise ImportError(f"Cannot import mooncake.store: {exc}") from exc
    return MooncakeDistributedStore


def _setup_failure(rc: int, elapsed_s: float, master: str, metadata_server: str, protocol: str,
                   segment: int, local_hostname: str) -> str:
    """What a failed ``setup()`` most likely means (measured causes, docs/mooncake.md)."""
    if rc == -600:
        if 0 < segment < MIN_SEGMENT_SIZE:
            return f"global_segment_size ({segment} bytes) must be at least {MIN_SEGMENT_SIZE} (16 MiB)"
        return (f"the client refused its arguments or could not allocate its memory (segment {segment} "
                f"bytes, local hostname {local_hostname!r}): out of memory?")
    if master.startswith("etcd://"):
        if elapsed_s >= 3:
            return f"etcd at {master!r} is unreachable"
        return f"no Mooncake master serves the cluster in etcd at {master!r} (or its cluster id differs)"
    if elapsed_s >= 3:
        return f"no Mooncake master answers at {master!r}: is mooncake_master running and listening there?"
    return (f"the client could not start (protocol {protocol!r}, metadata server {metadata_server!r}): "
            "check them and the client's log (MC_LOG_LEVEL=WARNING)")


def _client_memory(global_segment_size: int | str, local_buffer_size: int | str, protocol: str,
                   lookup_only: bool) -> Tuple[int, int, str]:
    """Checked (segment bytes, buffer bytes, protocol) of a client to set up."""
    segment, buffer = parse_size(global_segment_size), parse_size(local_buffer_size)
    if segment < 0 or buffer < 0:
        raise ValueError(f"sizes must be >= 0, got global_segment_size {segment}, local_buffer_size {buffer}")
    if 0 < segment < MIN_SEGMENT_SIZE:
        raise ValueError(f"global_segment_size must be 0 or at least {MIN_SEGMENT_SIZE} (16 MiB), got {segment}")
    if lookup_only:
        return 0, 0, LOOKUP_ONLY_PROTOCOL  # a lookup-only client holds no memory (rpc_only crashes with some)
    if protocol == LOOKUP_ONLY_PROTOCOL:
        raise ValueError("protocol 'rpc_only' is what lookup_only=True uses: pass that instead")
    if protocol not in _PROTOCOLS:
        raise ValueError(f"protocol must be one of {_PROTOCOLS} (lowercase), got {protocol!r}")
    return segment, buffer, protocol


def _check_timing(probe_interval_s: Optional[float], call_timeout_s: float) -> Tuple[Optional[float], float]:
    """The checked probe interval (None: no probe) and per-call time limit, in seconds."""
    probe = None if probe_interval_s is None else seconds_arg("probe_interval_s", probe_interval_s)
    return probe, seconds_arg("call_timeout_s", call_timeout_s)


def _setup_client(master_address: str, *, metadata_server: str, local_hostname: str, segment: int,
                  buffer: int, protocol: str, device_name: str) -> Any:
    """A set-up raw client, or MooncakeStoreError saying what went wrong."""
    client = _import_client_class()()
    started = time.monotonic()
    rc = client.setup(local_hostname, metadata_server, segment, buffer, protocol, device_name, master_address)
    elapsed = time.monotonic() - started
    if rc != 0:
        _close_quietly(client)
        cause = _setup_failure(rc, elapsed, master_address, metadata_server, protocol, segment, local_hostname)
        raise MooncakeStoreError(f"Mooncake setup failed (rc={rc}) after {elapsed * 1000:.0f} ms: {cause}")
    logger.debug("connected to Mooncake master %s in %.0f ms", master_address, elapsed * 1000)
    return client


def _warn_about_listeners(protocol: str) -> None:
    global _BIND_WARNED
    if protocol != LOOKUP_ONLY_PROTOCOL and not _BIND_WARNED:
        _BIND_WARNED = True
        logger.warning(
            "this Mooncake client (protocol %r) listens on all interfaces (0.0.0.0 and [::], ports "
            "15000-17000): Mooncake 0.3.13 has no setting for that address, MC_TCP_BIND_ADDRESS "
            "included. Keep the host behind a firewall or run it in a network namespace "
            "(docs/mooncake.md); lookup-only clients listen on nothing.", protocol)


# --------------------------------------------------------------------------- store


class MooncakeStore:
    """A Mooncake client that raises instead of crashing or stalling.

    Build one with :meth:`connect`, :meth:`from_config` or :meth:`lookup_client`, or wrap a
    client you have already set up. Before each call to the master it checks the probe's view
    (a dead master is refused in microseconds) and the client's cached ``health_check()``;
    ``batch_is_exist`` and ``is_exist`` run on a lane and are given up after
    ``call_timeout_s`` (the store then counts as down until a probe reaches the master), so a
    lookup never waits longer. Data calls (puts, gets into registered memory) are never given
    up half way: the client may still be writing. Calls after :meth:`close` raise
    :class:`MooncakeStoreError`; ``close()`` waits for calls in flight. Thread-safe.
    """

    #: ``batch_is_exist`` neither changes nor keeps the key list it is given.
    mutates_keys = False

    def __init__(
        self,
        client: Any,
        *,
        master_address: str = "",
        probe_interval_s: Optional[float] = DEFAULT_PROBE_INTERVAL_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
        reconnect: Optional[Callable[[str, int], Any]] = None,
    ) -> None:
        """Wrap ``client``, a ``MooncakeDistributedStore`` whose ``setup()`` returned 0.

        ``master_address`` ("host:port" or "etcd://host:port[;...]") is what the probe watches
        (no probe without one, or with ``probe_interval_s`` None). ``reconnect(host, port)``, if
        given, sets up a client for a new HA leader (lookup-only clients follow the leader so).
        """
        probe_interval_s, call_timeout_s = _check_timing(probe_interval_s, call_timeout_s)
        self._client = client
        # Whether this client and its master answer batch_probe_key: None until found out.
        self._probes: Optional[bool] = None
        self._probes_lock = threading.Lock()
        self._retired: List[Any] = []  # clients replaced after a failover, closed with the store
        self._reconnect = reconnect
        self._swap_lock = threading.Lock()
        self.master_address = master_address
        self.call_timeout_s = call_timeout_s
        self._gate = CallGate()
        self._lane = CallLane(f"mooncake-calls-{master_address or id(self)}")
        self._probe = (
            MasterProbe.start_for(master_address, probe_interval_s, self._follow_leader if reconnect else None)
            if master_address else None
        )

    # ----------------------------------------------------------- construction

    @classmethod
    def connect(
        cls,
        master_address: str,
        *,
        lookup_only: bool = False,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int | str = 64 << 20,
        local_buffer_size: int | str = 16 << 20,
        protocol: str = "tcp",
        device_name: str = "",
        setup_retries: Optional[int] = None,
        rpc_timeout_ms: Optional[int] = None,
        probe_interval_s: Optional[float] = DEFAULT_PROBE_INTERVAL_S,
        call_timeout_s: float = DEFAULT_CALL_TIMEOUT_S,
    ) -> MooncakeStore:
        """Set up a client against ``master_address``: ``"host:port"``, or an HA cluster's
        ``"etcd://host:port[;host:port...]"``.

        The defaults suit one machine on loopback: P2P handshake (no metadata server), TCP, a
        64 MiB segment contributed to the pool (at least 16 MiB, or 0) and a 16 MiB staging
        buffer (sizes in bytes or strings such as ``"64mb"``). ``lookup_only=True`` gives a
        client that only asks the master (Mooncake's ``rpc_only`` protocol: no memory, no
        listening socket; with an HA cluster it follows the leader itself). ``setup_retries``
        and ``rpc_timeout_ms`` are the client's process-wide environment variables (see
        :func:`.config.set_client_env`).
        """
        parse_master_address(master_address)  # ValueError naming it: an empty one crashes setup()
        # Every argument is checked before a client exists (none is left behind by a bad one).
        bool_arg("lookup_only", lookup_only)
        for name, value in (("metadata_server", metadata_server), ("local_hostname", local_hostname),
                            ("protocol", protocol), ("device_name", device_name)):
            text_arg(name, value)
        _check_timing(probe_interval_s, call_timeout_s)  # setup_retries, rpc_timeout_ms: set_client_env
        segment, buffer, protocol = _client_memory(global_segment_size, local_buffer_size, protocol, lookup_only)
        set_client_env(local_hostname, setup_retries, rpc_timeout_ms)
        _warn_about_listeners(protocol)
        setup = dict(metadata_server=metadata_server, local_hostname=local_hostname, segment=segment,
                     buffer=buffer, protocol=protocol, device_name=device_name)
        reconnect: Optional[Callable[[str, int], Any]] = None
        target = master_address
        if lookup_only and master_address.startswith("etcd://"):
            # An rpc_only client given etcd:// takes ~30 s to follow a failover and to close:
            # it asks the leader directly, and a new client follows a new leader.
            try:
                host, port = resolve_master(master_address)
            except OSError as exc:  # etcd unreadable, an answer that is not etcd's, no leader
                raise MooncakeStoreError(f"Mooncake setup failed: no leader found for {master_address}: {exc}") from None
            target = f"{host}:{port}"

            def _reconnect(h: str, p: int) -> Any:
                return _setup_client(f"{h}:{p}", **setup)

            reconnect = _reconnect

        client = _setup_client(target, **setup)
        return cls(client, master_address=master_address, probe_interval_s=probe_interval_s,
                   call_timeout_s=call_timeout_s, reconnect=reconnect)

    @classmethod
    def from_config(
        cls,
        config_or_path: MooncakeStoreConfig | str | os.PathLike[str] | None = None,
        *,
        local_hostname: Optional[str] = None,
        lookup_only: bool = False,
        setup_retries: Optional[int] = None,
        rpc_timeout_ms: Optional[int] = None,
    ) -> MooncakeStore:
        """Connect with a vLLM-style config, a path to its JSON, or ``None``.

        ``None`` reads the file named by ``MOONCAKE_CONFIG_PATH``. The local hostname is, in
        order: the argument, ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME``, then ``127.0.0.1``.
        """
        if config_or_path is None:
            config = MooncakeStoreConfig.from_env()
        elif isinstance(config_or_path, MooncakeStoreConfig):
            config = config_or_path
        else:
            config = MooncakeStoreConfig.from_file(config_or_path)
        if local_hostname is None:
            local_hostname = os.environ.get(LOCAL_HOSTNAME_ENV, "").strip() or "127.0.0.1"
        return cls.connect(
            config.master_server_address,
            lookup_only=lookup_only,
            metadata_server=config.metadata_server,
            local_hostname=local_hostname,
            global_segment_size=config.global_segment_size,
            local_buffer_size=config.local_buffer_size,
            protocol=config.protocol,
            device_name=config.device_name,
            setup_retries=setup_retries,
            rpc_timeout_ms=rpc_timeout_ms,
        )

    @classmethod
    def lookup_client(cls, config_or_path: MooncakeStoreConfig | str | os.PathLike[str] | None = None) -> MooncakeStore:
        """A lookup-only client of the master a vLLM Mooncake config names (default: the file in
        ``MOONCAKE_CONFIG_PATH``): it asks ``batch_is_exist`` and holds no memory."""
        return cls.from_config(config_or_path, lookup_only=True)

    # ----------------------------------------------------------- guard

    def _probe_says_down(self) -> bool:
        probe = self._probe
        if probe is None or not probe.down:
            return False
        probe.ensure_running()  # a dead probe must not hold the store down
        return True

    def _check_up(self) -> None:
        if self._probe_says_down():
            assert self._probe is not None
            raise MooncakeStoreUnavailable(MASTER_UNREACHABLE, self.master_address, self._probe.reason)
        health = self._client.health_check()
        if health != HEALTHY:
            raise MooncakeStoreUnavailable(health, self.master_address)

    def _suspect(self, reason: str) -> None:
        if self._probe is not None:
            self._probe.suspect(reason)

    def _after(self, method: str, result: Any) -> Any:
        if _rpc_failed(result):
            # The master just dropped the connection: the next calls would stall ~4.3 s each.
            # Refuse them until a probe reaches the master.
            self._suspect(f"{method} returned {RPC_FAIL} (RPC_FAIL)")
        return result

    def _call(self, method: str, *args: Any, check_health: bool = True) -> Any:
        """A data call, in the caller's thread: never given up half way."""
        try:
            with self._gate.call("store"):
                if check_health:
                    self._check_up()
                result = getattr(self._client, method)(*args)
        except GateClosed:
            raise MooncakeStoreError("store is closed") from None
        return self._after(method, result)

    def _ask(self, method: str, *args: Any) -> Any:
        """An existence call, on the lane: given up after ``call_timeout_s``.

        An answer of RPC_FAIL everywhere is asked again (after 10, 20, 40 ... ms) within the
        same time limit: the first calls after a master came back can meet the connections the
        old one dropped. A master that stays dead makes a retry stall, and the limit ends it."""
        try:
            with self._gate.call("store"):
                self._check_up()
                fn = getattr(self._client, method)
                deadline = time.monotonic() + self.call_timeout_s
                try:
                    result = self._lane.run(fn, *args, timeout=self.call_timeout_s)
                    pause = 0.01
                    while _rpc_failed(result) and deadline - time.monotonic() > pause:
                        time.sleep(pause)
                        pause *= 2
                        result = self._lane.run(fn, *args, timeout=deadline - time.monotonic())
                except LaneTimeout as exc:
                    self._suspect(str(exc))
                    raise MooncakeStoreUnavailable(MASTER_UNREACHABLE, self.master_address, str(exc)) from None
                except LaneBusy as exc:
                    raise MooncakeStoreUnavailable(MASTER_UNREACHABLE, self.master_address, str(exc)) from None
        except GateClosed:
            raise MooncakeStoreError("store is closed") from None
        return self._after(method, result)

    def _follow_leader(self, host: str, port: int) -> None:
        """The probe saw a new HA leader: move a lookup-only client to it."""
        assert self._reconnect is not None
        fresh = self._reconnect(host, port)
        with self._swap_lock:
            self._retired.append(self._client)
            self._client = fresh
            self._probes = None  # a new client: found out again
        logger.info("Mooncake lookup client moved to the new leader %s:%d", host, port)

    # ----------------------------------------------------------- state

    @property
    def client(self) -> Any:
        """The raw client, for advanced use. It segfaults after :meth:`close`."""
        return self._client

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def health_check(self) -> int:
        """0 healthy, 1 not initialised or closed, 2 master unreachable (cached, < 1 µs)."""
        try:
            with self._gate.call("store"):
                if self._probe_says_down():
                    return MASTER_UNREACHABLE
                return self._client.health_check()
        except GateClosed:
            return NOT_INITIALISED

    def close(self) -> None:
        """Close the client once calls in flight end (a call the lane gave up included).
        Idempotent; a second close waits for the first. Takes ~1-2 s for a client holding a
        segment (its objects vanish with it), up to ~30 s for one set up with ``etcd://``, and
        ~0 for a lookup-only client."""
        self._gate.close(self._close_client)

    def _close_client(self) -> None:
        if self._probe is not None:
            self._probe.stop()
        self._lane.close()
        for client in [*self._retired, self._client]:
            _close_quietly(client)
        self._retired.clear()

    def __enter__(self) -> MooncakeStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<MooncakeStore master={self.master_address!r} {state}>"

    # ----------------------------------------------------------- client API

    def batch_is_exist(self, keys: Sequence[str]) -> list[int]:
        """One code per key, in order: 1 exists, 0 missing.

        Other codes (negative ``ErrorCode`` such as -900 RPC_FAIL) are passed through; callers
        should count anything but 1 as missing. Keys are checked first (``TypeError``), an
        empty batch returns ``[]`` without an RPC, and an unreachable master raises
        :class:`MooncakeStoreUnavailable` within ``call_timeout_s``. Each hit grants the
        object a read lease on the master.
        """
        checked = check_keys(keys)
        if not checked:
            return []
        return self._ask("batch_is_exist", checked)

    def lease_probes(self) -> bool:
        """Whether :meth:`batch_probe_key` works: the client has it and its master answers it
        (Mooncake 0.3.14 on both ends). Found out once per client, by asking a key no one
        stores with both calls (a master that answers ``batch_is_exist`` but ``-900`` for every
        key of ``batch_probe_key`` is an older one), and remembered; False while it cannot be
        found out (the master is down: asked again next time) or while another thread asks."""
        known = self._probes
        if known is not None:
            return known
        if not self._probes_lock.acquire(blocking=False):
            return False
        try:
            if self._probes is None:
                self._probes = self._find_out_probes()
            return bool(self._probes)
        finally:
            self._probes_lock.release()

    def _find_out_probes(self) -> Optional[bool]:
        """True, False, or None (not known: the master did not answer)."""
        client = self._client
        if not callable(getattr(client, "batch_probe_key", None)):
            return False  # a client before 0.3.14
        try:
            with self._gate.call("store"):
                self._check_up()
                timeout = self.call_timeout_s
                # Straight on the lane: an old master's -900 must not be retried nor suspected.
                answer = self._lane.run(client.batch_probe_key, [SUPPORT_PROBE_KEY], timeout=timeout)
                if isinstance(answer, list) and len(answer) == 1 and answer[0] in (0, 1):
                    return True
                exist = self._lane.run(client.batch_is_exist, [SUPPORT_PROBE_KEY], timeout=timeout)
        except (GateClosed, LaneTimeout, LaneBusy, MooncakeStoreUnavailable):
            return None
        except Exception:  # noqa: BLE001 - a client that cannot probe does not probe
            logger.debug("batch_probe_key of %s raised", self.master_address, exc_info=True)
            return False
        if isinstance(exist, list) and len(exist) == 1 and exist[0] in (0, 1):
            logger.info("the Mooncake master %s does not answer batch_probe_key (%s; it is older than "
                        "this 0.3.14 client): lookups ask batch_is_exist", self.master_address, answer)
            return False
        return None

    def batch_probe_key(self, keys: Sequence[str], policy: str = LEASE_NONE, candidate_size: int = 1) -> list[int]:
        """Mooncake 0.3.14's existence check: per key 1 exists, 0 missing, negative on error.

        ``policy`` :data:`LEASE_NONE` grants no lease; :data:`LEASE_LAST_HIT_ONLY` leases the last
        group of ``candidate_size`` consecutive keys that all exist (``candidate_size=len(keys)``:
        every key, exactly when all exist). ``candidate_size`` must divide the number of keys.
        Checked, timed and refused as :meth:`batch_is_exist`; ``MooncakeStoreError`` when the
        client has no such call (before 0.3.14). An answer of -900 for every key from a master
        known to answer it makes :meth:`lease_probes` find out again (an older master may have
        taken its place)."""
        checked = check_keys(keys)
        if policy not in (LEASE_NONE, LEASE_LAST_HIT_ONLY):
            raise ValueError(f"policy must be {LEASE_NONE!r} or {LEASE_LAST_HIT_ONLY!r}, got {policy!r}")
        int_arg("candidate_size", candidate_size, min=1)
        if checked and len(checked) % candidate_size:
            raise ValueError(f"candidate_size ({candidate_size}) must divide the number of keys ({len(checked)})")
        if not checked:
            return []
        if not callable(getattr(self._client, "batch_probe_key", None)):
            raise MooncakeStoreError("this Mooncake client has no batch_probe_key (it came with Mooncake 0.3.14)")
        result = self._ask("batch_probe_key", checked, policy, candidate_size)
        if _rpc_failed(result) and self._probes:
            self._probes = None
        return result

    def is_exist(self, key: str) -> int:
        """1 exists, 0 missing, negative on error."""
        check_key(key)
        return self._ask("is_exist", key)

    def put(self, key: str, value: bytes | bytearray | memoryview) -> int:
        """Store ``value``; 0 on success, a negative ``ErrorCode`` otherwise.

        A put of an existing key returns 0 but keeps the old value.
        """
        check_key(key)
        if isinstance(value, str):
            raise TypeError("value must be bytes-like, not str")
        return self._call("put", key, value)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when the key is missing or the read failed."""
        check_key(key)
        return self._call("get", key)

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed, -704 missing, -706 under a read lease (unless ``force``)."""
        check_key(key)
        return self._call("remove", key, force)

    def batch_remove(self, keys: Sequence[str], force: bool = False) -> list[int]:
        """:meth:`remove` for each key; one code per key."""
        checked = check_keys(keys)
        if not checked:
            return []
        return self._call("batch_remove", checked, force)

    def remove_all(self, force: bool = True) -> int:
        """Remove every object in the pool; returns the number removed."""
        return self._call("remove_all", force)

    def register_buffer(self, ptr: int, size: int) -> int:
        """Register ``size`` bytes at address ``ptr`` for zero-copy I/O; 0 on success.

        Local to this client, so it does not need a reachable master.
        """
        return self._call("register_buffer", ptr, size, check_health=False)

    def unregister_buffer(self, ptr: int) -> int:
        """Undo :meth:`register_buffer`; 0 on success. Works with the master down."""
        return self._call("unregister_buffer", ptr, check_health=False)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Put ``sizes[i]`` bytes from registered address ``ptrs[i]``; per key 0 or < 0."""
        checked = check_batch(keys, ptrs, sizes)
        if not checked:
            return []
        return self._call("batch_put_from", checked, list(ptrs), list(sizes))

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read into registered buffers; per key the bytes read or a negative code."""
        checked = check_batch(keys, ptrs, sizes)
        if not checked:
            return []
        return self._call("batch_get_into", checked, list(ptrs), list(sizes))


def _rpc_failed(result: Any) -> bool:
    if isinstance(result, int):
        return result == RPC_FAIL
    return isinstance(result, list) and bool(result) and result[0] == RPC_FAIL and all(
        r == RPC_FAIL for r in result
    )


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - cleanup must go on
        logger.debug("close() of a Mooncake client raised", exc_info=True)
