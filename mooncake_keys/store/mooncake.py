"""A safe adapter over Mooncake's ``MooncakeDistributedStore`` client.

The raw client has sharp edges (see ``docs/mooncake.md``):

* any method called before a successful ``setup()`` or after ``close()`` is a
  SIGSEGV, not an exception;
* with a dead master every RPC stalls ~4.3 s before it returns -900, and with
  a hung master it stalls for the whole RPC timeout (30 s by default);
* ``setup()`` against an unreachable master retries for ~90 s by default;
* a key with a lone surrogate makes the whole batch call fail.

:class:`MooncakeStore` keeps its own open flag, checks ``health_check()``
before every call to the master, validates keys before the RPC and sets
short timeouts through the client's environment variables (``config``). Its
method names match the client's, so it is a drop-in ``store`` for a lookup
engine.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

from .keycheck import check_batch, check_key, check_keys
from .config import LOCAL_HOSTNAME_ENV, MooncakeStoreConfig, parse_size, set_client_env
from .gate import CallGate, GateClosed
from .probe import DEFAULT_PROBE_INTERVAL_S, MasterProbe

__all__ = [
    "MooncakeStore",
    "MooncakeStoreError",
    "MooncakeStoreUnavailable",
]

logger = logging.getLogger("mooncake_keys.store")

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
        self._probe = MasterProbe.start_for(master_address, probe_interval_s)

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
        set_client_env(local_hostname, setup_retries, rpc_timeout_ms)
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

    def _call(self, method: str, *args: Any, check_health: bool = True) -> Any:
        try:
            with self._gate.call("store"):
                if check_health:
                    self._check_health()
                result = getattr(self._client, method)(*args)
        except GateClosed:
            raise MooncakeStoreError("store is closed") from None
        if self._probe is not None and _rpc_failed(result):
            # The master just dropped the connection: the next calls would stall ~4.3 s each
            # until the client's ping notices. Refuse them until a probe reaches the master.
            self._probe.suspect(f"{method} returned {RPC_FAIL} (RPC_FAIL)")
        return result

    def _check_health(self) -> None:
        if self._probe is not None and self._probe.down:
            raise MooncakeStoreUnavailable(MASTER_UNREACHABLE, self.master_address, self._probe.reason)
        health = self._client.health_check()
        if health != HEALTHY:
            raise MooncakeStoreUnavailable(health, self.master_address)

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
                return self._client.health_check()
        except GateClosed:
            return NOT_INITIALISED

    def close(self) -> None:
        """Close the client once in-flight calls end. Idempotent; takes ~1-2 s.

        Closing unmounts this client's segment: objects stored there vanish.
        """
        self._gate.close(self._close_client)

    def _close_client(self) -> None:
        if self._probe is not None:
            self._probe.stop()
        self._client.close()

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
        check_key(key)
        return self._call("is_exist", key)

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
    except Exception:  # noqa: BLE001 - cleanup after a failed setup must not mask its error
        logger.debug("close() after failed setup raised", exc_info=True)
