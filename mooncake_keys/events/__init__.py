"""The master's key events, mirrored: which of a deployment's keys the store holds, known here.

Mooncake 0.3.14's master publishes a ZMQ event for every object stored and removed
(``--enable_kv_events``). :class:`KeyMirror` keeps, from a snapshot and those events, the keys
of one deployment (its key prefixes), so that a lookup answers a miss without asking the master,
and a hit with one call that verifies and leases exactly its keys (``LookupEngine(key_events=...)``).
:mod:`.wire` reads the messages; :mod:`.mirror` keeps the keys.
"""

from .mirror import EventSource, KeyMirror, MirrorStats

__all__ = ["EventSource", "KeyMirror", "MirrorStats"]
