"""Where the keys are asked: an in-process store, the store double of tests and examples, the
Mooncake client adapter, and a local ``mooncake_master`` to run it against. Only :mod:`.memory`
and :mod:`.recording` are imported eagerly; the rest loads the Mooncake client lazily, on first
use."""

from .memory import MemoryStore
from .recording import RecordingStore

__all__ = ["MemoryStore", "RecordingStore"]
