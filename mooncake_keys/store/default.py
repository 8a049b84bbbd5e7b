"""The default store: one call that gives a working store.

Order: an explicit master address; an explicit config path; ``MOONCAKE_KEYS_MASTER``
("host:port"); a vLLM config named by ``MOONCAKE_CONFIG_PATH``; otherwise a :class:`LocalMaster` on 127.0.0.1 started for the
caller. Only when the mooncake package cannot be imported (not installed, or libibverbs1
missing) does it fall back to the in-process :class:`MemoryStore`, and it logs why.

:func:`configured_master` is the one place these settings are read and checked: a setting that
cannot be used (an address that is not ``host:port``, a config file that is missing, not JSON, or
names no ``master_server_address``) is a :class:`BadMasterSetting` naming it, before any client
exists; a master it names that does not answer is a ``MooncakeStoreError`` naming the setting.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Optional

from .memory import MemoryStore

__all__ = ["BadMasterSetting", "ConfiguredMaster", "OpenStore", "configured_master", "open_store", "MASTER_ENV"]

logger = logging.getLogger("mooncake_keys.store")

MASTER_ENV = "MOONCAKE_KEYS_MASTER"


class BadMasterSetting(ValueError):
    """A master setting (an argument or an environment variable) that cannot be used.

    ``setting`` names it (``MOONCAKE_KEYS_MASTER``, ``MOONCAKE_CONFIG_PATH``, ``master_address``
    or ``config_path``); the message starts with it."""

    def __init__(self, setting: str, message: str) -> None:
        super().__init__(f"{setting}: {message}")
        self.setting = setting


@dataclasses.dataclass(frozen=True)
class ConfiguredMaster:
    """The master a setting names: ``setting`` (which one), ``address`` (``host:port`` or
    ``etcd://...``) and, when it came from a vLLM config file, that ``config``."""

    setting: str
    address: str
    config: Any = None  # a MooncakeStoreConfig, for a config file


def configured_master(master_address: Optional[str] = None,
                      config_path: Optional[str] = None) -> Optional[ConfiguredMaster]:
    """The master named, in order, by ``master_address``, ``config_path``,
    ``MOONCAKE_KEYS_MASTER`` or the file in ``MOONCAKE_CONFIG_PATH``; None when none is set.

    Only the first one set is read, and it is checked whole: :class:`BadMasterSetting` naming it
    when it cannot be used. Nothing is connected to."""
    from .config import CONFIG_PATH_ENV, MooncakeStoreConfig
    from .probe import parse_master_address

    env_address = os.environ.get(MASTER_ENV, "").strip()
    env_path = os.environ.get(CONFIG_PATH_ENV, "").strip()
    address: Optional[str] = None
    path = ""
    if master_address is not None:
        setting, address = "master_address", master_address
    elif config_path is not None:
        setting, path = "config_path", config_path
    elif env_address:
        setting, address = MASTER_ENV, env_address
    elif env_path:
        setting, path = CONFIG_PATH_ENV, env_path
    else:
        return None
    if address is not None:
        try:
            parse_master_address(address)
        except ValueError as exc:
            raise BadMasterSetting(setting, str(exc).replace("master_address", "the address")) from None
        return ConfiguredMaster(setting, address)
    try:
        config = MooncakeStoreConfig.from_file(path)
    except (TypeError, ValueError) as exc:
        raise BadMasterSetting(setting, str(exc)) from None
    if not config.master_server_address:
        raise BadMasterSetting(setting, f"{path!r} names no master_server_address")
    try:
        parse_master_address(config.master_server_address)
    except ValueError as exc:
        raise BadMasterSetting(setting, f"{path!r}: {exc}".replace("master_address",
                                                                          "its master_server_address")) from None
    return ConfiguredMaster(setting, config.master_server_address, config)


class OpenStore:
    """A store and, when this process started it, the master behind it. Close both with ``close()``."""

    def __init__(self, store: Any, kind: str, master: Any = None, reason: str = "") -> None:
        self.store = store
        #: "mooncake (local master)", "mooncake (configured)" or "memory".
        self.kind = kind
        self.master = master
        #: Why the memory fallback was taken (empty otherwise).
        self.reason = reason

    def describe(self) -> str:
        if self.master is not None:
            return f"{self.kind} at {self.master.master_address} (pid {self.master.pid})"
        if self.kind == "memory":
            return f"memory (in-process; {self.reason})"
        return f"{self.kind} at {getattr(self.store, 'master_address', '?')}"

    def close(self) -> None:
        try:
            close = getattr(self.store, "close", None)
            if close is not None:
                close()
        finally:
            if self.master is not None:
                self.master.stop()
                self.master = None

    def __enter__(self) -> "OpenStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _mooncake_missing() -> Optional[str]:
    """Why the mooncake client cannot be used here, or None if it can."""
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")  # read when mooncake.store is first imported
    try:
        import mooncake.store  # noqa: F401
    except ImportError as exc:
        if "libibverbs" in str(exc):
            return "libibverbs1 is missing (apt-get install libibverbs1)"
        return f"the mooncake package is not installed ({exc}); pip install 'mooncake-keys[mooncake]'"
    return None


def _unreachable(address: str, timeout: float = 1.0) -> Optional[str]:
    """Why no master accepts a connection at ``address`` (an HA cluster: its leader), or None."""
    import socket

    from .probe import resolve_master

    try:
        host, port = resolve_master(address, timeout=timeout)
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as exc:
        return exc.strerror or str(exc) or type(exc).__name__
    return None


def connect_configured(named: ConfiguredMaster, *, lookup_only: bool = False, **connect_kwargs: Any) -> Any:
    """A :class:`~.mooncake.MooncakeStore` connected to the master ``named`` (its config's
    settings for a config file; ``connect_kwargs`` otherwise). A master that accepts no connection
    is refused at once, before the client's setup (seconds, and its own error lines): both that
    and a failed setup are ``MooncakeStoreError`` naming ``named.setting``."""
    from .mooncake import MooncakeStore, MooncakeStoreError

    if not isinstance(named, ConfiguredMaster):
        raise TypeError(f"named must be a ConfiguredMaster, got {type(named).__name__}")
    why = _unreachable(named.address)
    if why:
        raise MooncakeStoreError(f"{named.setting}: the master {named.address} cannot be reached: {why}")
    try:
        if named.config is None:
            return MooncakeStore.connect(named.address, lookup_only=lookup_only, **connect_kwargs)
        return MooncakeStore.from_config(named.config, lookup_only=lookup_only)
    except MooncakeStoreError as exc:
        raise MooncakeStoreError(f"{named.setting}: the master {named.address} cannot be reached: {exc}") from exc


def open_store(
    master_address: Optional[str] = None,
    *,
    config_path: Optional[str] = None,
    fallback_to_memory: bool = True,
    **connect_kwargs: Any,
) -> OpenStore:
    """Connect to the configured Mooncake master, or start one locally; see the module doc.

    A setting that cannot be used raises :class:`BadMasterSetting` (see :func:`configured_master`),
    and a configured master that cannot be reached ``MooncakeStoreError`` naming the setting: only
    a missing mooncake package falls back (when ``fallback_to_memory``), never a failed connection.
    """
    named = configured_master(master_address, config_path)
    missing = _mooncake_missing()
    if missing is not None:
        if not fallback_to_memory:
            raise ImportError(f"Mooncake is unavailable: {missing}")
        logger.warning("Mooncake is unavailable (%s): using the in-process MemoryStore", missing)
        return OpenStore(MemoryStore(), "memory", reason=missing)

    from .local_master import LocalMaster
    from .mooncake import MooncakeStore

    if named is not None:
        store = connect_configured(named, **connect_kwargs)
        return OpenStore(store, "mooncake (configured)")
    master = LocalMaster().start()
    try:
        store = MooncakeStore.connect(master.master_address, **connect_kwargs)
    except BaseException:
        master.stop()
        raise
    logger.info("started a local mooncake_master at %s (log %s)", master.master_address, master.log_path)
    return OpenStore(store, "mooncake (local master)", master=master)
