"""Mooncake's key-event messages, as its 0.3.14 master publishes them (the one place that knows
their format).

A message is three ZMQ frames: a topic (empty), the sequence number as a big-endian unsigned
64-bit integer (1, 2, 3, ... from the master's start, one per message), and a msgpack array
``[timestamp_ms, [event, ...], dp_rank]``. An event is a map; what a mirror reads of it is
``object_key`` (the whole key) and ``event_type`` (``"stored"`` or ``"removed"``; the older
``type``, ``"BlockStored"`` / ``"BlockRemoved"``, where it is missing). Measured on 0.3.14: one
event per message while they come slowly, several together when they come fast; a put of a key that exists, an
eviction and the end of the segment holding a key publish nothing.
"""

from __future__ import annotations

import struct
from typing import Any, List, Sequence, Tuple

__all__ = ["STORED", "REMOVED", "WireError", "decode"]

#: What an event says of its key.
STORED, REMOVED = 1, 0
_KINDS = {"stored": STORED, "removed": REMOVED, "BlockStored": STORED, "BlockRemoved": REMOVED}
_SEQ = struct.Struct(">Q")


class WireError(ValueError):
    """A message that is not a Mooncake key-event message."""


def decode(frames: Sequence[bytes], unpackb: Any) -> Tuple[int, List[Tuple[int, str]]]:
    """``(sequence number, [(STORED or REMOVED, key), ...])`` of one message (``unpackb``:
    msgpack's); events without a key or of another kind are left out. WireError otherwise."""
    if len(frames) != 3 or len(frames[1]) != 8:
        raise WireError(f"expected 3 frames (topic, 8-byte sequence number, payload), got "
                        f"{[len(f) for f in frames]} bytes")
    (seq,) = _SEQ.unpack(frames[1])
    try:
        payload = unpackb(frames[2])
    except Exception as exc:  # noqa: BLE001 - msgpack's errors are several classes
        raise WireError(f"payload is not msgpack: {type(exc).__name__}: {exc}") from None
    if not (isinstance(payload, (list, tuple)) and len(payload) >= 2 and isinstance(payload[1], (list, tuple))):
        raise WireError(f"payload is not [timestamp, [events], ...]: {type(payload).__name__}")
    out = []
    for event in payload[1]:
        if not isinstance(event, dict):
            continue
        key = event.get("object_key")
        kind = _KINDS.get(event.get("event_type") or event.get("type"))  # type: ignore[arg-type]
        if isinstance(key, bytes):
            key = key.decode("utf-8", "surrogateescape")
        if isinstance(key, str) and key and kind is not None:
            out.append((kind, key))
    return seq, out
