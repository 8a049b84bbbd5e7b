"""A safe adapter over Mooncake's ``MooncakeDistributedStore`` client.

The raw client has sharp edges (see ``shared/spec/mooncake-store.md``):

* any method called before a successful ``setup()`` or after ``close()`` is a
  SIGSEGV, not an exception;
* with a dead master every RPC stalls ~4.3 s before it returns -900, and with
  a hung master it stalls for the whole RPC timeout (30 s by default);
* ``setup()`` against an unreachable master retries for ~90 s by default;
* a key with a lone surrogate makes the whole batch call fail.

:class:`MooncakeStore` keeps its own open flag, checks ``health_check()``
before every call to the master, validates keys before the RPC and sets
short timeouts through the client's environment variables. Its method names
match the client's, so it is a drop-in ``store`` for a lookup engine.

:class:`MooncakeStoreConfig` reads the same JSON file as vLLM's Mooncake
store connector (path in ``MOONCAKE_CONFIG_PATH``), with vLLM's defaults.

Client environment variables (process-wide; an explicit argument wins, then a
value already exported, then ours):
``MC_STORE_CLIENT_SETUP_RETRIES`` (ours 1) and ``MC_RPC_TIMEOUT_MS`` (ours
2000 ms) are read by each ``setup()``; ``MC_TCP_BIND_ADDRESS`` is set to a
loopback ``local_hostname``; ``MC_LOG_LEVEL`` (ours ERROR) is read only when
``mooncake.store`` is first imported, so set it before any other import of it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import logging
import os
import re
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any, Literal

from ._gate import CallGate

__all__ = [
    "CONFIG_PATH_ENV",
    "MooncakeStore",
    "MooncakeStoreConfig",
    "MooncakeStoreError",
    "MooncakeStoreUnavailable",
    "check_keys",
    "parse_size",
]

logger = logging.getLogger("mooncake_keys.mooncake_store")

CONFIG_PATH_ENV = "MOONCAKE_CONFIG_PATH"
#: vLLM reads the requester's advertised hostname from this variable.
LOCAL_HOSTNAME_ENV = "MOONCAKE_REQUESTER_LOCAL_HOSTNAME"

GiB = 1 << 30
_MODES = ("embedded", "standalone-store")
_UNITS = {"b": 1, "kb": 1 << 10, "mb": 1 << 20, "gb": 1 << 30}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(gb|mb|kb|b)?")

# Our defaults for the client's environment knobs, used only when neither an
# argument nor an exported value gives one.
#: 1 retry: setup() against no master fails in ~4.4 s instead of ~90 s.
DEFAULT_SETUP_RETRIES = 1
#: Bounds every RPC to a hung master (the client's default is 30 s).
DEFAULT_RPC_TIMEOUT_MS = 2000

#: Seconds between TCP probes of the master's RPC port (0 or None: no probe). The client's own
#: ping notices a dead master after 1-5 s, and every call stalls ~4.3 s until it does; a refused
#: connection on the master's port tells within one interval.
DEFAULT_PROBE_INTERVAL_S = 0.05

#: ``ErrorCode::RPC_FAIL``: the master could not be reached for this call.
RPC_FAIL = -900

#: ``health_check()`` codes of the Mooncake client.
HEALTHY, NOT_INITIALISED, MASTER_UNREACHABLE = 0, 1, 2
_HEALTH_REASONS = {
    NOT_INITIALISED: "client not initialised or closed",
    MASTER_UNREACHABLE: "master unreachable",
}


class MooncakeStoreError(RuntimeError):
    """A Mooncake store call or setup failed, or the store is closed."""


class MooncakeStoreUnavailable(MooncakeStoreError):
    """The client's health check is not OK, so no RPC was sent.

    ``health`` holds the client's code: 1 not initialised/closed, 2 master
    unreachable.
    """

    def __init__(self, health: int, master_address: str = "", detail: str = "") -> None:
        self.health = health
        reason = _HEALTH_REASONS.get(health, "unknown health state")
        where = f" at {master_address}" if master_address else ""
        if detail:
            super().__init__(f"Mooncake store unavailable{where}: {reason} ({detail})")
        else:
            super().__init__(f"Mooncake store unavailable{where}: health_check()={health} ({reason})")


# --------------------------------------------------------------------------- config


def parse_size(value: Any) -> int:
    """Parse a size in bytes the way vLLM's Mooncake connector does.

    An ``int`` passes through; another non-string goes through ``int()``.
    A string is lowercased and stripped and must read ``number[.number]
    [gb|mb|kb|b]``: units are 1024-based, no unit means bytes, and the result
    is truncated to whole bytes (``"1.5kb"`` is 1536).
    """
    if isinstance(value, int):
        return value
    if not isinstance(value, str):
        return int(value)
    text = value.lower().strip()
    if not text:
        raise ValueError("size must not be empty")
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ValueError(f"invalid size {value!r}: expected a number with an optional unit gb, mb, kb or b")
    number, unit = match.groups()
    return int(float(number) * _UNITS[unit or "b"])


@dataclasses.dataclass(frozen=True)
class MooncakeStoreConfig:
    """vLLM's Mooncake store JSON config, with vLLM's defaults.

    Sizes are in bytes. ``mode="standalone-store"`` means this client mounts
    no segment (``global_segment_size == 0``) and only uses other clients'
    memory. Fields the vLLM JSON may carry but this library does not use are
    ignored when parsing.
    """

    metadata_server: str = ""
    master_server_address: str = ""
    protocol: str = "rdma"
    device_name: str = ""
    mode: Literal["embedded", "standalone-store"] = "embedded"
    global_segment_size: int = 4 * GiB
    local_buffer_size: int = 4 * GiB
    enable_offload: bool = False

    def __post_init__(self) -> None:
        for name in ("global_segment_size", "local_buffer_size"):
            try:
                size = parse_size(getattr(self, name))
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{name}: {exc}") from None
            object.__setattr__(self, name, size)
        if self.mode not in _MODES:
            raise ValueError(f"mode: must be one of {_MODES}, got {self.mode!r}")
        if self.local_buffer_size <= 0:
            raise ValueError(f"local_buffer_size: must be > 0, got {self.local_buffer_size}")
        if self.mode == "embedded" and self.global_segment_size <= 0:
            raise ValueError(
                f"global_segment_size: must be > 0 in embedded mode, got {self.global_segment_size}"
            )
        if self.mode == "standalone-store" and self.global_segment_size != 0:
            raise ValueError(
                f"global_segment_size: must be 0 in standalone-store mode, got {self.global_segment_size}"
            )

    @classmethod
    def loopback(cls, master_server_address: str) -> MooncakeStoreConfig:
        """Our defaults for one machine: P2P handshake, TCP, a 64 MiB segment
        and a 16 MiB buffer (the same as :meth:`MooncakeStore.connect`)."""
        return cls(
            metadata_server="P2PHANDSHAKE",
            master_server_address=master_server_address,
            protocol="tcp",
            global_segment_size=64 << 20,
            local_buffer_size=16 << 20,
        )

    def to_dict(self) -> dict[str, Any]:
        """The JSON object vLLM reads (write it to ``MOONCAKE_CONFIG_PATH``)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MooncakeStoreConfig:
        """Build from a parsed JSON object; unknown keys are ignored."""
        if not isinstance(data, dict):
            raise ValueError(f"Mooncake config must be a JSON object, got {type(data).__name__}")
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> MooncakeStoreConfig:
        """Read a vLLM Mooncake JSON config file."""
        with open(path, encoding="utf-8") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_env(cls) -> MooncakeStoreConfig:
        """Read the file named by ``MOONCAKE_CONFIG_PATH``, as vLLM does."""
        path = os.environ.get(CONFIG_PATH_ENV)
        if not path:
            raise ValueError(f"The environment variable '{CONFIG_PATH_ENV}' is not set.")
        return cls.from_file(path)


# --------------------------------------------------------------------------- keys


def check_keys(keys: Sequence[str]) -> list[str]:
    """Return ``keys`` as a list after checking that the client can send them.

    ``keys`` must be a list or tuple of ``str`` each encodable as strict
    UTF-8 (no lone surrogates). The client would raise on the whole batch,
    or accept ``bytes`` as an alias of the same key; we refuse both up front
    with a ``TypeError`` naming the first bad index.
    """
    if not isinstance(keys, (list, tuple)):
        raise TypeError(f"keys must be a list or tuple of str, got {type(keys).__name__}")
    try:
        # Fast path, one C-level pass: ~1.3 ms for 100k ASCII keys.
        if all(map(str.isascii, keys)):
            return keys if isinstance(keys, list) else list(keys)
    except TypeError:  # a non-str element: find it below
        pass
    for i, key in enumerate(keys):
        if not isinstance(key, str):
            raise TypeError(f"keys[{i}] must be str, got {type(key).__name__}")
        if not key.isascii():
            try:
                key.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise TypeError(f"keys[{i}] is not valid UTF-8 ({exc.reason} at position {exc.start})") from None
    return keys if isinstance(keys, list) else list(keys)


def _check_key(key: str) -> None:
    check_keys((key,))


def _check_batch(keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[str]:
    checked = check_keys(keys)
    if not len(checked) == len(ptrs) == len(sizes):
        raise ValueError(f"keys, ptrs and sizes differ in length: {len(checked)}, {len(ptrs)}, {len(sizes)}")
    return checked


# --------------------------------------------------------------------------- import


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


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _set_client_env(local_hostname: str, setup_retries: int | None, rpc_timeout_ms: int | None) -> None:
    """Set the process-wide variables the client reads at setup.

    An explicit argument overrides the environment; ``None`` keeps a value
    the user exported and falls back to our default otherwise.
    """
    if _is_loopback(local_hostname):
        # Else the transfer engine advertises the first non-loopback NIC.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1" if local_hostname == "localhost" else local_hostname)
    for name, value, default in (
        ("MC_STORE_CLIENT_SETUP_RETRIES", setup_retries, DEFAULT_SETUP_RETRIES),
        ("MC_RPC_TIMEOUT_MS", rpc_timeout_ms, DEFAULT_RPC_TIMEOUT_MS),
    ):
        if value is not None:
            os.environ[name] = str(int(value))
        else:
            os.environ.setdefault(name, str(default))


# --------------------------------------------------------------------------- store


class MooncakeStore:
    """A Mooncake client that raises instead of crashing or stalling.

    Build one with :meth:`connect` or :meth:`from_config`, or wrap a client
    you have already set up. Every call to the master first checks the
    client's cached ``health_check()`` (free) and raises
    :class:`MooncakeStoreUnavailable` at once when it is not 0, so a dead
    master costs microseconds instead of a ~4.3 s stall per call. The
    client's 1 s ping flags a dead master after ~1 s, sometimes ~5.3 s;
    calls in that window still stall and return -900. Calls after
    :meth:`close` raise :class:`MooncakeStoreError`. ``close()`` waits for
    calls in flight, so the client is never closed under a running call.
    Thread-safe: the client releases the GIL, and calls may run in parallel.
    """

    def __init__(
        self,
        client: Any,
        *,
        master_address: str = "",
        probe_interval_s: float | None = DEFAULT_PROBE_INTERVAL_S,
    ) -> None:
        """Wrap ``client``, a ``MooncakeDistributedStore`` whose ``setup()`` returned 0.

        With a ``host:port`` master address and ``probe_interval_s``, a daemon thread
        connects to the master's RPC port every interval; a refused or timed-out connection
        makes calls raise :class:`MooncakeStoreUnavailable` at once, before the client's own
        ping has noticed (1-5 s, during which each call stalls ~4.3 s).
        """
        self._client = client
        self.master_address = master_address
        self._gate = CallGate()
        self._closed = threading.Event()
        self._probe = _MasterProbe.start_for(master_address, probe_interval_s)

    # ----------------------------------------------------------- construction

    @classmethod
    def connect(
        cls,
        master_address: str,
        *,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        global_segment_size: int | str = 64 << 20,
        local_buffer_size: int | str = 16 << 20,
        protocol: str = "tcp",
        device_name: str = "",
        setup_retries: int | None = None,
        rpc_timeout_ms: int | None = None,
        probe_interval_s: float | None = DEFAULT_PROBE_INTERVAL_S,
    ) -> MooncakeStore:
        """Set up a client against the master at ``master_address`` ("host:port").

        The defaults suit one machine on loopback: P2P handshake (no metadata
        server), TCP, a 64 MiB segment contributed to the pool and a 16 MiB
        staging buffer (sizes in bytes or strings such as ``"64mb"``;
        ``global_segment_size=0`` gives a lookup-only client whose ``put``
        fails). ``setup_retries`` (``MC_STORE_CLIENT_SETUP_RETRIES``, default
        1, ~4.4 s to fail) and ``rpc_timeout_ms`` (``MC_RPC_TIMEOUT_MS``,
        default 2000 ms) are process-wide environment variables read by the
        client; see :func:`_set_client_env`.
        """
        if not master_address:
            raise ValueError("master_address must be a non-empty 'host:port'")
        segment, buffer = parse_size(global_segment_size), parse_size(local_buffer_size)
        if segment < 0 or buffer < 0:
            raise ValueError(f"sizes must be >= 0, got segment {segment}, buffer {buffer}")
        _set_client_env(local_hostname, setup_retries, rpc_timeout_ms)
        client = _import_client_class()()
        started = time.monotonic()
        rc = client.setup(local_hostname, metadata_server, segment, buffer, protocol, device_name, master_address)
        elapsed_ms = (time.monotonic() - started) * 1000
        if rc != 0:
            _close_quietly(client)
            raise MooncakeStoreError(
                f"Mooncake setup failed (rc={rc}) after {elapsed_ms:.0f} ms: master {master_address!r}, "
                f"metadata server {metadata_server!r}, protocol {protocol!r}, local hostname "
                f"{local_hostname!r}. Is mooncake_master running and listening on that address?"
            )
        logger.debug("connected to Mooncake master %s in %.0f ms", master_address, elapsed_ms)
        return cls(client, master_address=master_address, probe_interval_s=probe_interval_s)

    @classmethod
    def from_config(
        cls,
        config_or_path: MooncakeStoreConfig | str | os.PathLike[str] | None = None,
        *,
        local_hostname: str | None = None,
        setup_retries: int | None = None,
        rpc_timeout_ms: int | None = None,
    ) -> MooncakeStore:
        """Connect with a vLLM-style config, a path to its JSON, or ``None``.

        ``None`` reads the file named by ``MOONCAKE_CONFIG_PATH``. The local
        hostname is, in order: the argument, ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME``,
        then ``127.0.0.1``.
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
            metadata_server=config.metadata_server,
            local_hostname=local_hostname,
            global_segment_size=config.global_segment_size,
            local_buffer_size=config.local_buffer_size,
            protocol=config.protocol,
            device_name=config.device_name,
            setup_retries=setup_retries,
            rpc_timeout_ms=rpc_timeout_ms,
        )

    # ----------------------------------------------------------- guard

    def _enter(self, check_health: bool = True) -> Any:
        if not self._gate.enter():
            raise MooncakeStoreError("store is closed")
        if check_health:
            if self._probe is not None and self._probe.down:
                self._gate.leave()
                raise MooncakeStoreUnavailable(MASTER_UNREACHABLE, self.master_address, self._probe.reason)
            health = self._client.health_check()
            if health != HEALTHY:
                self._gate.leave()
                raise MooncakeStoreUnavailable(health, self.master_address)
        return self._client

    def _leave(self) -> None:
        self._gate.leave()

    def _call(self, method: str, *args: Any, check_health: bool = True) -> Any:
        client = self._enter(check_health)
        try:
            result = getattr(client, method)(*args)
        finally:
            self._leave()
        if self._probe is not None and _rpc_failed(result):
            # The master just dropped the connection: the next calls would stall ~4.3 s each
            # until the client's ping notices. Refuse them until a probe reaches the master.
            self._probe.suspect(f"{method} returned {RPC_FAIL} (RPC_FAIL)")
        return result

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
        if not self._gate.enter():
            return NOT_INITIALISED
        try:
            return self._client.health_check()
        finally:
            self._gate.leave()

    def close(self) -> None:
        """Close the client once in-flight calls end. Idempotent; takes ~1-2 s.

        Closing unmounts this client's segment: objects stored there vanish.
        """
        first = self._gate.close()
        if first and self._probe is not None:
            self._probe.stop()
        if not first:
            self._closed.wait()
            return
        try:
            self._client.close()
        finally:
            self._closed.set()

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

        Other codes (negative ``ErrorCode`` such as -900 RPC_FAIL) are passed
        through; callers should count anything but 1 as missing. Keys are
        checked first (``TypeError``), an empty batch returns ``[]`` without
        an RPC, and an unhealthy client raises :class:`MooncakeStoreUnavailable`.
        Each hit grants the object a read lease on the master.
        """
        checked = check_keys(keys)
        if not checked:
            return []
        return self._call("batch_is_exist", checked)

    def is_exist(self, key: str) -> int:
        """1 exists, 0 missing, negative on error."""
        _check_key(key)
        return self._call("is_exist", key)

    def put(self, key: str, value: bytes | bytearray | memoryview) -> int:
        """Store ``value``; 0 on success, a negative ``ErrorCode`` otherwise.

        A put of an existing key returns 0 but keeps the old value.
        """
        _check_key(key)
        if isinstance(value, str):
            raise TypeError("value must be bytes-like, not str")
        return self._call("put", key, value)

    def get(self, key: str) -> bytes:
        """The value, or ``b""`` when the key is missing or the read failed."""
        _check_key(key)
        return self._call("get", key)

    def remove(self, key: str, force: bool = False) -> int:
        """0 removed, -704 missing, -706 under a read lease (unless ``force``)."""
        _check_key(key)
        return self._call("remove", key, force)

    def remove_all(self, force: bool = True) -> int:
        """Remove every object in the pool; returns the number removed."""
        return self._call("remove_all", force)

    def register_buffer(self, ptr: int, size: int) -> int:
        """Register ``size`` bytes at address ``ptr`` for zero-copy I/O; 0 on success.

        Local to this client, so it does not need a healthy master.
        """
        return self._call("register_buffer", ptr, size, check_health=False)

    def unregister_buffer(self, ptr: int) -> int:
        """Undo :meth:`register_buffer`; 0 on success. Works with the master down."""
        return self._call("unregister_buffer", ptr, check_health=False)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Put ``sizes[i]`` bytes from registered address ``ptrs[i]``; per key 0 or < 0."""
        checked = _check_batch(keys, ptrs, sizes)
        if not checked:
            return []
        return self._call("batch_put_from", checked, list(ptrs), list(sizes))

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read into registered buffers; per key the bytes read or a negative code."""
        checked = _check_batch(keys, ptrs, sizes)
        if not checked:
            return []
        return self._call("batch_get_into", checked, list(ptrs), list(sizes))


def _rpc_failed(result: Any) -> bool:
    if isinstance(result, int):
        return result == RPC_FAIL
    return isinstance(result, list) and bool(result) and result[0] == RPC_FAIL and all(
        r == RPC_FAIL for r in result
    )


class _MasterProbe(threading.Thread):
    """Connects to the master's RPC port every ``interval`` s; ``down`` while that fails."""

    def __init__(self, host: str, port: int, interval: float) -> None:
        super().__init__(name=f"mooncake-probe-{host}:{port}", daemon=True)
        self.address = (host, port)
        self.interval = interval
        self.down = False
        self.reason = ""
        self._stop_event = threading.Event()
        self._wake = threading.Event()

    @classmethod
    def start_for(cls, master_address: str, interval: float | None) -> "_MasterProbe | None":
        if not interval or interval <= 0:
            return None
        host, sep, port = master_address.rpartition(":")
        if not sep or not port.isdigit() or "://" in master_address or ";" in master_address:
            return None  # HA / etcd addresses: leave it to the client's own ping
        probe = cls(host.strip("[]"), int(port), interval)
        probe.start()
        return probe

    def suspect(self, reason: str) -> None:
        """Mark the master down now and re-probe at once (a live master clears it within µs)."""
        if not self.down:
            logger.warning("Mooncake master %s:%d suspected down: %s", *self.address, reason)
        self.reason = reason
        self.down = True
        self._wake.set()

    def run(self) -> None:
        while not self._stop_event.is_set():
            self._wake.clear()
            try:
                with socket.create_connection(self.address, timeout=max(self.interval, 0.5)):
                    pass
                if self.down:
                    logger.info("Mooncake master %s:%d answers again", *self.address)
                self.down, self.reason = False, ""
            except OSError as exc:
                if not self.down:
                    logger.warning("Mooncake master %s:%d unreachable: %s", *self.address, exc)
                self.reason = f"TCP probe of the master: {exc.strerror or exc}"
                self.down = True
            self._wake.wait(self.interval)

    def stop(self) -> None:
        self._stop_event.set()
        self._wake.set()


def _close_quietly(client: Any) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - cleanup after a failed setup must not mask its error
        logger.debug("close() after failed setup raised", exc_info=True)
