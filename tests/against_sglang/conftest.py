"""Tests against SGLang's own lookup code (SGLang 0.5.23's wheel unpacked first on PYTHONPATH).

``scripts/dev.sh test`` runs this folder once, in the SGLang oracle venv it builds under
``$MOONCAKE_KEYS_CACHE`` (the stand-in torchvision of ``stubs/`` on the path: see its docstring),
with ``MK_REQUIRE_SGLANG`` set to the release: then a missing or different SGLang, or a skipped
test, fails the run. Both cores are compared in that one run (each test names its core), so
SGLang's 20-30 s import is paid once, and once more by the gloo peer (rank 1). Elsewhere (no
SGLang importable) nothing in this folder is collected.

Session fixtures: SGLang's own plugin loader run once (it finds mooncake_keys' entry point and
applies its hooks, as in SGLang's scheduler processes), a real ``mooncake_master`` and its
holder client (tests/conftest.py), that client shared by every SGLang store of this process,
and the gloo peer.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

REQUIRED = os.environ.get("MK_REQUIRE_SGLANG", "")
HERE = os.path.dirname(os.path.abspath(__file__))


def _sglang_version() -> str:
    if importlib.util.find_spec("sglang") is None:
        return ""
    import sglang

    return str(sglang.__version__)


SGLANG_VERSION = _sglang_version()

if REQUIRED and SGLANG_VERSION != REQUIRED:
    raise pytest.UsageError(f"MK_REQUIRE_SGLANG={REQUIRED} but this interpreter has SGLang "
                            f"{SGLANG_VERSION or 'not importable'} (PYTHONPATH: the unpacked wheel)")

collect_ignore_glob = [] if SGLANG_VERSION else ["test_*.py"]

CORES = ("c", "py")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Under MK_REQUIRE_SGLANG nothing here may be skipped: a skip would hide a test not run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped") if reporter is not None else None
    if REQUIRED and skipped and session.exitstatus == 0:
        print(f"\nerror: {len(skipped)} test(s) skipped under MK_REQUIRE_SGLANG={REQUIRED}", file=sys.stderr)
        session.exitstatus = 1


@pytest.fixture(scope="session")
def plugins():
    """SGLang's own plugin loader, as its scheduler runs it: mooncake_keys' entry point found and
    its hooks applied to SGLang's MooncakeStore. Returns the hooked class."""
    from sglang.srt.plugins import load_plugins
    from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

    load_plugins()
    from mooncake_keys.sglang import plugin

    for name in ("batch_exists", "batch_exists_v2", "_put_batch_zero_copy_impl"):
        assert getattr(getattr(MooncakeStore, name), "__wrapped__", None) is not None, f"{name} not hooked"
    return MooncakeStore, plugin


@pytest.fixture(scope="session")
def oracle(plugins, mooncake_master, mooncake_store):
    """The harness, with this process's SGLang stores sharing the holder's Mooncake client."""
    import harness

    harness.OracleStore.client = mooncake_store.client
    return harness


@pytest.fixture(scope="session")
def master_address(mooncake_master):
    return mooncake_master.master_address


@pytest.fixture(scope="session")
def holder(mooncake_store):
    """The raw client that holds the segment the tests' objects go in."""
    return mooncake_store.client
