"""mooncake_keys: fast, vLLM-compatible prefix-cache lookups against a Mooncake store.

Keys are byte-identical to vLLM's ``MooncakeStoreConnector`` and hit lengths equal its
PCP/DCP-correct lookup; the key building and rank reduction run in a compiled core when one
is available (``ACCELERATED``), in a pure-Python twin otherwise.
"""

from ._core import ACCELERATED
from ._keys import KeyMetadata, PoolKey, model_name_from_path
from .coordinator import Coordinator
from .engine import LookupEngine, LookupStats
from .hashes import BlockHashes
from .keycache import KeyCache, KeyCacheStats
from .layout import ParallelLayout
from .memory_store import MemoryStore
from .specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec
from .embedded import OpenStore, open_store
from .local_master import LocalMaster, LocalMasterError
from .mooncake_store import (
    MooncakeStore,
    MooncakeStoreConfig,
    MooncakeStoreError,
    MooncakeStoreUnavailable,
)

_LAZY = {  # need torch: imported on first use
    "KVPool": "kvpool",
    "SaveResult": "kvpool",
    "LoadResult": "kvpool",
    "KVPoolError": "kvpool",
    "KVPoolStoreError": "kvpool",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mooncake_keys' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)

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
    "KVPool",
    "KVPoolError",
    "KVPoolStoreError",
    "LoadResult",
    "LocalMaster",
    "LocalMasterError",
    "LookupEngine",
    "LookupStats",
    "MemoryStore",
    "MooncakeStore",
    "MooncakeStoreConfig",
    "MooncakeStoreError",
    "MooncakeStoreUnavailable",
    "OpenStore",
    "ParallelLayout",
    "PoolKey",
    "SaveResult",
    "SlidingWindowSpec",
    "model_name_from_path",
    "open_store",
]
