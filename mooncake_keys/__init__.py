"""mooncake_keys: fast, vLLM-compatible prefix-cache lookups against a Mooncake store.

Keys are byte-identical to vLLM's ``MooncakeStoreConnector`` and hit lengths equal its
PCP/DCP-correct lookup; the key building and rank reduction run in a compiled core when one
is available (``ACCELERATED``), in a pure-Python twin otherwise.
"""

from ._core import ACCELERATED
from ._keys import KeyMetadata, PoolKey, model_name_from_path
from .coordinator import Coordinator
from .engine import LookupEngine
from .hashes import BlockHashes
from .keycache import KeyCache, KeyCacheStats
from .layout import ParallelLayout
from .memory_store import MemoryStore
from .specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

__version__ = "0.1.0"

__all__ = [
    "ACCELERATED",
    "BlockHashes",
    "Coordinator",
    "FullAttentionSpec",
    "KVCacheGroup",
    "KeyCache",
    "KeyCacheStats",
    "KeyMetadata",
    "LookupEngine",
    "MemoryStore",
    "ParallelLayout",
    "PoolKey",
    "SlidingWindowSpec",
    "model_name_from_path",
]
