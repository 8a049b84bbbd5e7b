"""The public API: the names ``import mooncake_keys as mk`` gives, and that importing it stays light."""

import subprocess
import sys

import mooncake_keys as mk

PUBLIC = [
    "ACCELERATED", "BlockHashes", "Coordinator", "Deployment", "FullAttentionSpec", "KVCacheGroup",
    "KVPool", "KVPoolError", "KVPoolStoreError", "KeyCache", "KeyCacheStats", "KeyMetadata",
    "LoadResult", "LocalMaster", "LocalMasterError", "LookupEngine", "LookupResult", "LookupStats",
    "MemoryStore", "MooncakeStore", "MooncakeStoreConfig", "MooncakeStoreError", "MooncakeStoreUnavailable",
    "OpenStore", "ParallelLayout", "PoolKey", "SaveResult", "SlidingWindowSpec", "TailKeyBoundary",
    "model_name_from_path", "open_store",
]


def test_the_public_names():
    assert sorted(mk.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(mk, name) is not None, name


def test_public_names_come_from_their_owners():
    from mooncake_keys.lookup import _core, engine, keys, layout, specs
    from mooncake_keys.store import memory

    assert mk.ACCELERATED is _core.ACCELERATED
    assert mk.LookupEngine is engine.LookupEngine and mk.LookupResult is engine.LookupResult
    assert mk.KeyMetadata is keys.KeyMetadata and mk.ParallelLayout is layout.ParallelLayout
    assert mk.FullAttentionSpec is specs.FullAttentionSpec and mk.MemoryStore is memory.MemoryStore


def test_import_is_light():
    """``import mooncake_keys`` loads neither torch, nor the Mooncake client, nor vLLM."""
    code = ("import sys, mooncake_keys; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mooncake', 'vllm', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
