"""Shared fixtures: every behaviour test runs on both cores (ids ``c`` / ``py``)."""

from __future__ import annotations

import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import mooncake_keys  # noqa: E402
from mooncake_keys.lookup import _core  # noqa: E402

try:
    from support.mooncake_fixtures import clean_mooncake_store, mooncake_master, mooncake_store  # noqa: F401,E402
except ImportError:  # the Mooncake I/O modules are optional
    pass


from support.cores import NO_C_ENGINES  # noqa: E402


def pytest_configure(config):
    """Under ``MK_REQUIRE_REAL=1`` (the test command sets it) a missing real component is an error.

    The store, failover and multi-process tests skip themselves where Mooncake, torch, numpy or
    etcd is absent, which is right on a developer's partial install and wrong in CI: there a
    failed install would turn the real-component tests into silent skips.
    """
    if not os.environ.get("MK_REQUIRE_REAL"):
        return
    import shutil

    missing = [name for name in ("mooncake.store", "torch", "numpy", "hypothesis") if _find_spec(name) is None]
    missing += [f"{exe} (executable)" for exe in ("etcd",) if shutil.which(exe) is None]
    if missing:
        raise pytest.UsageError(f"MK_REQUIRE_REAL=1 but these are missing: {', '.join(missing)}")


def _find_spec(name):
    import importlib.util

    try:
        return importlib.util.find_spec(name)
    except ModuleNotFoundError:  # a missing parent package ("mooncake" for "mooncake.store")
        return None

IMPLS = [
    pytest.param("c", marks=pytest.mark.c_extension, id="c"),
    pytest.param("py", id="py"),
]


@pytest.fixture(params=IMPLS)
def impl(request) -> types.ModuleType:
    """The core module under test; engines and pools made in the test use it by default."""
    if request.param == "c" and NO_C_ENGINES:
        pytest.skip(NO_C_ENGINES)
    with _core.default_core(request.param) as mod:
        yield mod


class RecordingStore:
    """A store that answers a given list (or function of the keys) and records each call."""

    def __init__(self, answer=None, exists=None):
        self.answer = answer
        self.exists = exists
        self.calls = []

    def batch_is_exist(self, keys):
        assert type(keys) is list and all(type(k) is str for k in keys)
        self.calls.append(list(keys))
        if self.exists is not None:
            return [1 if k in self.exists else 0 for k in keys]
        if callable(self.answer):
            return self.answer(keys)
        return list(self.answer)


@pytest.fixture
def recording_store():
    return RecordingStore


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("MOONCAKE_KEYS_NO_EXTENSIONS", raising=False)
    yield


mooncake_keys  # referenced for the side effect of importing the package first
