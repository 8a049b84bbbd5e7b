"""Rank 0's lookup keys, handed to the scheduler: a file only rank 0's user can write, tied to
this deployment's live rank 0 by a token that rank 0 also answers over vLLM's own ZMQ channel.

The scheduler answers lookups itself only when its lookup key prefixes equal rank 0's. Rank 0
publishes them (:func:`publish`) in a private directory beside vLLM's lookup socket
(``<socket dir>/mooncake_keys-<uid>/<socket name>.json``: mode 0700, owned by rank 0's user;
the file mode 0600, written under a fresh name with no-follow, exclusive creation, then renamed
in place). The file holds a random token; rank 0's lookup answers a lookup whose one "hash" is
:data:`MAGIC` (13 bytes: no vLLM block hash has that length) with a number derived from the
token. A stale file of an earlier deployment, or one planted by another user, cannot make the
scheduler trust it: its token is not the one the live rank 0 answers.

Reading is careful: only a regular file owned by this user, in a directory no one else can
write, of at most :data:`MAX_BYTES`, opened without following links and without blocking (a
FIFO or a device at the path is refused, not waited on), its JSON checked field by field. Any
problem is a reason string, never an exception: the scheduler keeps vLLM's ZMQ path.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import stat
from typing import Any, Optional, Sequence, Tuple

__all__ = ["MAGIC", "MAX_BYTES", "handshake_path", "publish", "withdraw", "read_published", "token_answer",
           "is_handshake", "ask_rank0", "new_token"]

#: The one "block hash" of a handshake lookup.
MAGIC = b"mooncake_keys"
#: The largest handshake file read (prefixes of thousands of namespaces fit easily).
MAX_BYTES = 1 << 20


def new_token() -> str:
    return secrets.token_hex(16)


def token_answer(token: str) -> int:
    """What rank 0 answers a handshake lookup with: a number the token decides (u32, never 0)."""
    return int.from_bytes(hashlib.sha256(token.encode()).digest()[:4], "big") | 1


def is_handshake(block_hashes: Any) -> bool:
    """Whether a lookup's hashes (vLLM's wire view, or a list) are the handshake's."""
    hash_len = getattr(block_hashes, "_hash_len", None)
    if hash_len is not None:
        if hash_len != len(MAGIC) or len(block_hashes) != 1:
            return False
        return bytes(block_hashes._blob[: len(MAGIC)]) == MAGIC
    return isinstance(block_hashes, (list, tuple)) and len(block_hashes) == 1 and block_hashes[0] == MAGIC


def _socket_path(vllm_config: Any) -> str:
    from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.worker import get_zmq_rpc_path_lookup

    return get_zmq_rpc_path_lookup(vllm_config)


def handshake_path(vllm_config: Any) -> str:
    """Where rank 0 publishes its lookup key prefixes (see the module docstring)."""
    sock = _socket_path(vllm_config).removeprefix("ipc://")
    folder = os.path.join(os.path.dirname(sock) or ".", f"mooncake_keys-{os.getuid()}")
    return os.path.join(folder, os.path.basename(sock) + ".json")


def _private_dir(folder: str, create: bool) -> Optional[str]:
    """None when ``folder`` is a directory (not a link) owned by this user that no one else
    can write; else what is wrong with it."""
    if create:
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        except OSError as exc:
            return f"cannot make {folder}: {exc}"
    try:
        st = os.lstat(folder)
    except OSError as exc:
        return f"{folder}: {exc}"
    if not stat.S_ISDIR(st.st_mode):
        return f"{folder} is not a directory"
    if st.st_uid != os.getuid():
        return f"{folder} belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"{folder} is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def publish(vllm_config: Any, prefixes: Sequence[Sequence[str]], token: str) -> str:
    """Rank 0: write its lookup key prefixes and ``token`` for the scheduler; returns the path.
    OSError when it cannot (the scheduler then keeps the ZMQ path)."""
    path = handshake_path(vllm_config)
    problem = _private_dir(os.path.dirname(path), create=True)
    if problem is not None:
        raise OSError(problem)
    tmp = os.path.join(os.path.dirname(path), f".{os.getpid()}.{secrets.token_hex(8)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"token": token, "prefixes": [list(p) for p in prefixes]}, f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return path


def withdraw(path: str, token: str) -> bool:
    """Rank 0 at shutdown: remove its file at ``path`` if it still holds ``token``; True when
    removed. A later rank 0 of the same socket path (a restarted worker, another engine of the
    same host and port) may have published its own there since: that file is left alone. (Seen
    in the tests: a worker collected late removed the next worker's file, and the scheduler then
    kept the ZMQ path.)"""
    published, _ = read_published(path)
    if published is None or published[0] != token:
        return False
    try:
        os.unlink(path)
    except OSError:
        return False
    return True


def read_published(path: str) -> Tuple[Optional[Tuple[str, Tuple[Tuple[str, ...], ...]]], str]:
    """``((token, prefixes), "")`` from rank 0's file, or ``(None, why not)``."""
    problem = _private_dir(os.path.dirname(path), create=False)
    if problem is not None:
        return None, problem
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        return None, f"{path}: {exc.strerror or exc}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file"
        if st.st_uid != os.getuid():
            return None, f"{path} belongs to another user (uid {st.st_uid})"
        if st.st_size > MAX_BYTES:
            return None, f"{path} is larger than {MAX_BYTES} bytes"
        raw = os.read(fd, MAX_BYTES + 1)
    except OSError as exc:
        return None, f"{path}: {exc}"
    finally:
        os.close(fd)
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return None, f"{path} is not JSON: {type(exc).__name__}"
    token = data.get("token") if isinstance(data, dict) else None
    prefixes = data.get("prefixes") if isinstance(data, dict) else None
    if not isinstance(token, str) or len(token) != 32:
        return None, f"{path} holds no token"
    if not isinstance(prefixes, list) or not prefixes or not all(
            isinstance(p, list) and p and all(isinstance(x, str) for x in p) for p in prefixes):
        return None, f"{path} holds no lookup key prefixes (a list of lists of text)"
    return (token, tuple(tuple(p) for p in prefixes)), ""


def ask_rank0(vllm_config: Any, timeout_s: float = 1.0) -> Optional[int]:
    """Ask rank 0's lookup server the handshake lookup over vLLM's ZMQ socket (a socket of our
    own, never vLLM's client's); its answer, or None when none came within ``timeout_s``."""
    import zmq

    sock = zmq.Context.instance().socket(zmq.REQ)
    try:
        ms = max(1, int(timeout_s * 1000))
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, ms)
        sock.setsockopt(zmq.SNDTIMEO, ms)
        sock.connect(_socket_path(vllm_config))
        sock.send_multipart([b"lookup", (1).to_bytes(4, "big"), len(MAGIC).to_bytes(2, "big"), MAGIC])
        reply = sock.recv()
    except zmq.ZMQError:
        return None
    finally:
        sock.close(linger=0)
    return int.from_bytes(reply[:4], "big") if len(reply) >= 4 else None
