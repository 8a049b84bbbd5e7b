"""The default store: one call that gives a working store.

Order: an explicit master address; ``MOONCAKE_KEYS_MASTER`` ("host:port"); a vLLM config named
by ``MOONCAKE_CONFIG_PATH``; otherwise a :class:`LocalMaster` on 127.0.0.1 started for the
caller. Only when the mooncake package cannot be imported (not installed, or libibverbs1
missing) does it fall back to the in-process :class:`MemoryStore`, and it logs why.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from .memory import MemoryStore

__all__ = ["OpenStore", "open_store", "MASTER_ENV"]

logger = logging.getLogger("mooncake_keys.store")

MASTER_ENV = "MOONCAKE_KEYS_MASTER"


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


def open_store(
    master_address: Optional[str] = None,
    *,
    config_path: Optional[str] = None,
    fallback_to_memory: bool = True,
    **connect_kwargs: Any,
) -> OpenStore:
    """Connect to the configured Mooncake master, or start one locally; see the module doc.

    A configured master that cannot be reached raises ``MooncakeStoreError``: only a missing
    mooncake package falls back (when ``fallback_to_memory``), never a failed connection.
    """
    missing = _mooncake_missing()
    if missing is not None:
        if not fallback_to_memory:
            raise ImportError(f"Mooncake is unavailable: {missing}")
        logger.warning("Mooncake is unavailable (%s): using the in-process MemoryStore", missing)
        return OpenStore(MemoryStore(), "memory", reason=missing)

    from .local_master import LocalMaster
    from .config import CONFIG_PATH_ENV
    from .mooncake import MooncakeStore

    address = master_address or os.environ.get(MASTER_ENV, "").strip() or None
    if address:
        return OpenStore(MooncakeStore.connect(address, **connect_kwargs), "mooncake (configured)")
    config_path = config_path or os.environ.get(CONFIG_PATH_ENV) or None
    if config_path:
        return OpenStore(MooncakeStore.from_config(config_path), "mooncake (configured)")
    master = LocalMaster().start()
    try:
        store = MooncakeStore.connect(master.master_address, **connect_kwargs)
    except BaseException:
        master.stop()
        raise
    logger.info("started a local mooncake_master at %s (log %s)", master.master_address, master.log_path)
    return OpenStore(store, "mooncake (local master)", master=master)
