"""Configuration of a Mooncake client: vLLM's JSON config file, sizes, and the client's
process-wide environment variables.

:class:`MooncakeStoreConfig` reads the same JSON file as vLLM's Mooncake store connector (path
in ``MOONCAKE_CONFIG_PATH``), with vLLM's defaults.

Client environment variables (process-wide; an explicit argument wins, then a value already
exported, then ours): ``MC_STORE_CLIENT_SETUP_RETRIES`` (ours 1), ``MC_RPC_TIMEOUT_MS`` (ours
1000 ms: how long a hung master holds a call) and ``MC_RPC_CONNECT_TIMEOUT_MS`` (ours 500 ms:
each of the client's connect attempts to a master that drops packets) are read by ``setup()``; ``MC_TCP_BIND_ADDRESS`` is set to a loopback
``local_hostname``; ``MC_LOG_LEVEL`` (ours ERROR) is read only when ``mooncake.store`` is first
imported, so set it before any other import of it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import os
import re
import reprlib
import stat
from typing import Any, Literal

from .._checks import MAX_SECONDS, int_arg

__all__ = [
    "CONFIG_PATH_ENV",
    "LOCAL_HOSTNAME_ENV",
    "MooncakeStoreConfig",
    "parse_size",
    "set_client_env",
]

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
DEFAULT_RPC_TIMEOUT_MS = 1000
#: Bounds each connect attempt to a master whose host drops packets (the client's default: 30 s).
DEFAULT_RPC_CONNECT_TIMEOUT_MS = 500
#: The most setup retries accepted (each failed attempt takes seconds).
MAX_SETUP_RETRIES = 100
#: The largest size in bytes (the client takes sizes as 64-bit integers).
MAX_SIZE = (1 << 63) - 1
#: The largest config file read: a vLLM Mooncake config is a few hundred bytes.
MAX_CONFIG_BYTES = 1 << 20


def parse_size(value: Any) -> int:
    """Parse a size in bytes the way vLLM's Mooncake connector does.

    An ``int`` passes through; another non-string goes through ``int()``.
    A string is lowercased and stripped and must read ``number[.number]
    [gb|mb|kb|b]``: units are 1024-based, no unit means bytes, and the result
    is truncated to whole bytes (``"1.5kb"`` is 1536).
    """
    if isinstance(value, bool):
        raise TypeError(f"a size must be an int or a string such as '4gb', got {value!r}")
    if isinstance(value, str):
        text = value.lower().strip()
        if not text:
            raise ValueError("size must not be empty")
        match = _SIZE_RE.fullmatch(text)
        if match is None:
            raise ValueError(f"invalid size {reprlib.repr(value)}: expected a number with an optional unit gb, mb, kb or b")
        number, unit = match.groups()
        scaled = float(number) * _UNITS[unit or "b"]
        size = int(scaled) if scaled < MAX_SIZE + 1 else MAX_SIZE + 1  # "9" * 400 is inf as a float
    else:
        try:
            size = int(value)
        except OverflowError:  # inf
            size = MAX_SIZE + 1
    if size > MAX_SIZE:
        raise ValueError(f"size {reprlib.repr(value)} is larger than {MAX_SIZE} bytes")
    return size


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
        """Read a vLLM Mooncake JSON config file (a regular file of at most 1 MiB)."""
        if not isinstance(path, (str, os.PathLike)):  # an int would be read as a file descriptor
            raise TypeError(f"the Mooncake config path must be a str or os.PathLike, got {type(path).__name__}")
        try:
            st = os.stat(path)
        except OSError as exc:
            raise ValueError(f"Mooncake config {os.fspath(path)!r}: {exc.strerror or exc}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"Mooncake config {os.fspath(path)!r} is not a regular file")
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"Mooncake config {os.fspath(path)!r} is larger than {MAX_CONFIG_BYTES} bytes")
        try:
            data = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ValueError(f"Mooncake config {os.fspath(path)!r} is not JSON (or nested too deeply): "
                             f"{exc}") from None
        return cls.from_dict(data)

    @classmethod
    def from_env(cls) -> MooncakeStoreConfig:
        """Read the file named by ``MOONCAKE_CONFIG_PATH``, as vLLM does."""
        path = os.environ.get(CONFIG_PATH_ENV)
        if not path:
            raise ValueError(f"The environment variable '{CONFIG_PATH_ENV}' is not set.")
        return cls.from_file(path)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_client_env(setup_retries: int | None, rpc_timeout_ms: int | None) -> None:
    """TypeError/ValueError naming ``setup_retries`` or ``rpc_timeout_ms`` (None: the default)."""
    if setup_retries is not None:
        int_arg("setup_retries", setup_retries, min=0, max=MAX_SETUP_RETRIES)
    if rpc_timeout_ms is not None:
        int_arg("rpc_timeout_ms", rpc_timeout_ms, min=1, max=int(MAX_SECONDS * 1000))


def set_client_env(local_hostname: str, setup_retries: int | None, rpc_timeout_ms: int | None) -> None:
    """Set the process-wide variables the client reads at setup.

    An explicit argument overrides the environment; ``None`` keeps a value
    the user exported and falls back to our default otherwise.
    """
    check_client_env(setup_retries, rpc_timeout_ms)
    if _is_loopback(local_hostname):
        # Else the transfer engine advertises the first non-loopback NIC.
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1" if local_hostname == "localhost" else local_hostname)
    for name, value, default in (
        ("MC_STORE_CLIENT_SETUP_RETRIES", setup_retries, DEFAULT_SETUP_RETRIES),
        ("MC_RPC_TIMEOUT_MS", rpc_timeout_ms, DEFAULT_RPC_TIMEOUT_MS),
        ("MC_RPC_CONNECT_TIMEOUT_MS", None, DEFAULT_RPC_CONNECT_TIMEOUT_MS),
    ):
        if value is not None:
            os.environ[name] = str(int(value))
        else:
            os.environ.setdefault(name, str(default))


