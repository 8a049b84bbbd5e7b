"""mooncake_keys: fast, vLLM-compatible prefix-cache lookups against a Mooncake store.

Keys are byte-identical to vLLM's ``MooncakeStoreConnector`` and hit lengths equal its lookup;
the key building and rank reduction run in a compiled core when one is available
(``ACCELERATED``), in a pure-Python twin otherwise.

The package reads as the data flow: ``lookup`` (hashes -> keys -> hit length; it names no
engine), ``store`` (where the keys are asked), ``kvpool`` (one rank's saves and loads), ``vllm``
(the drop-in, its mapping and its releases' contract rows; a second engine would be a sibling),
``report`` (an explanation printed), ``bench`` and ``cli`` (demo, bench, explain). The names here are what a user needs; the internals
(``lookup.coordinator.Coordinator``, ``lookup.keycache.KeyCache``, ...) stay importable from
their modules. Names that need torch or the Mooncake client are imported on first use.
"""

from .lookup._core import ACCELERATED
from .lookup.deployment import Deployment
from .lookup.engine import LookupEngine, LookupResult, LookupStats, TailKeyBoundary
from .lookup.hashes import BlockHashes
from .lookup.keys import KeyMetadata, PoolKey, model_name_from_path
from .lookup.layout import ParallelLayout
from .lookup.specs import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroup, MambaSpec, SlidingWindowSpec
from .store.memory import MemoryStore
from .store.recording import RecordingStore

# Each engine's releases, registered for the Deployment argument that names them (vllm_compat):
# the rows live in the engine's folder, which imports no vLLM for them.
from .vllm import contracts  # noqa: E402

del contracts

_LAZY = {  # heavier modules, imported on first use
    "KVPool": "kvpool",  # torch
    "SaveResult": "kvpool",
    "LoadResult": "kvpool",
    "KVPoolError": "kvpool",
    "KVPoolStoreError": "kvpool",
    "LocalMaster": "store.local_master",
    "LocalMasterError": "store.local_master",
    "MooncakeStore": "store.mooncake",
    "MooncakeStoreError": "store.mooncake",
    "MooncakeStoreUnavailable": "store.mooncake",
    "MooncakeStoreConfig": "store.config",
    "OpenStore": "store.default",
    "open_store": "store.default",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'mooncake_keys' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)


def __dir__():
    return sorted(set(globals()) | set(_LAZY))


__version__ = "0.2.0"

__all__ = [
    "ACCELERATED",
    "BlockHashes",
    "ChunkedLocalAttentionSpec",
    "Deployment",
    "FullAttentionSpec",
    "KeyMetadata",
    "KVCacheGroup",
    "KVPool",
    "KVPoolError",
    "KVPoolStoreError",
    "LoadResult",
    "LocalMaster",
    "LocalMasterError",
    "LookupEngine",
    "LookupResult",
    "LookupStats",
    "MambaSpec",
    "MemoryStore",
    "model_name_from_path",
    "MooncakeStore",
    "MooncakeStoreConfig",
    "MooncakeStoreError",
    "MooncakeStoreUnavailable",
    "open_store",
    "OpenStore",
    "ParallelLayout",
    "PoolKey",
    "RecordingStore",
    "SaveResult",
    "SlidingWindowSpec",
    "TailKeyBoundary",
    "__version__",
]
