"""Shared fixtures: every behaviour test runs on both cores (ids ``c`` / ``py``)."""

from __future__ import annotations

import functools
import os
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import mooncake_keys  # noqa: E402
from mooncake_keys.lookup import _core  # noqa: E402

try:
    from support.mooncake_fixtures import (  # noqa: F401,E402
        clean_mooncake_store, each_master_store, master_version, mooncake_master, mooncake_store, newest_master,
        newest_store,
    )
except ImportError:  # the Mooncake I/O modules are optional
    pass


from support.cores import NO_C_ENGINES  # noqa: E402


def pytest_configure(config):
    """Under ``MK_REQUIRE_REAL=1`` (the test command sets it) a missing real component is an error.

    The store, failover, multi-process and heat-map tests skip themselves where Mooncake, torch,
    numpy, matplotlib or etcd is absent (the partition tests: where network namespaces cannot be
    made, e.g. not root or no iproute2), which is right on a developer's partial install and wrong
    in CI: there a failed install would turn the real-component tests into silent skips.
    """
    if not os.environ.get("MK_REQUIRE_REAL"):
        return
    import shutil

    missing = [name for name in ("mooncake.store", "torch", "numpy", "hypothesis", "matplotlib", "prometheus_client")
               if _find_spec(name) is None]
    missing += [f"{exe} (executable)" for exe in ("etcd",) if shutil.which(exe) is None]
    missing += [name for name in ("zmq", "msgpack") if _find_spec(name) is None]
    from support.mooncake_fixtures import NEWEST, newest_dir

    if newest_dir() is None:
        missing.append(f"Mooncake {NEWEST} (unpacked by 'bash scripts/dev.sh install', named in MK_MOONCAKE_NEWEST)")
    from support.netns import unavailable as no_netns

    why = no_netns()  # tests/test_partitions.py: hosts are network namespaces
    if why:
        missing.append(f"network namespaces ({why})")
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


@pytest.fixture
def recording_store():
    """``mooncake_keys.RecordingStore`` that also checks the engine sends a list of str."""
    return functools.partial(mooncake_keys.RecordingStore, check_keys=True)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("MOONCAKE_KEYS_NO_EXTENSIONS", raising=False)
    yield

