"""pytest fixtures for tests against a real mooncake_master on 127.0.0.1.

Import them into ``tests/conftest.py``::

    from support.mooncake_fixtures import clean_mooncake_store, mooncake_master, mooncake_store  # noqa: F401

Each fixture skips its test when the ``mooncake`` package cannot be imported.

Two masters: the installed client's own (0.3.13.post1) and the newest, Mooncake 0.3.14, which
ships only in its CUDA 13 wheel; ``bash scripts/dev.sh install`` (and ``test``) unpack it under
the cache and name it in ``MK_MOONCAKE_NEWEST``. A test that matters on both takes
``master_version`` (``@pytest.mark.parametrize("master_version", MASTERS, indirect=True)`` or the
``each_master_store`` fixture) and runs the binary :func:`master_executable` names; the client
stays the installed 0.3.13.post1 one (the 0.3.14 client: tests/test_mooncake_newest.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Optional

import pytest

from mooncake_keys.store.local_master import LocalMaster
from mooncake_keys.store.mooncake import MooncakeStore

# The client reads its log level once, when mooncake.store is first imported.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

#: The releases whose masters the tests run, and the newest one's.
INSTALLED, NEWEST = "0.3.13.post1", "0.3.14"
MASTERS = [pytest.param(INSTALLED, id="master-0.3.13"), pytest.param(NEWEST, id="master-0.3.14")]


def newest_dir() -> Optional[Path]:
    """The unpacked Mooncake 0.3.14 wheel (``MK_MOONCAKE_NEWEST``, else where dev.sh caches it)."""
    given = os.environ.get("MK_MOONCAKE_NEWEST")
    cache = os.environ.get("MOONCAKE_KEYS_CACHE") or os.path.expanduser("~/.cache/mooncake_keys")
    for path in ([Path(given)] if given else []) + [Path(cache) / f"mooncake-{NEWEST}"]:
        if (path / ".mooncake_keys-ready").exists() and (path / "mooncake" / "mooncake_master").exists():
            return path
    return None


def master_executable(version: str) -> Optional[str]:
    """The ``mooncake_master`` of ``version`` (None: the installed package's); skips the test
    when the newest is not unpacked (``bash scripts/dev.sh install`` does it; under
    ``MK_REQUIRE_REAL=1`` conftest makes that an error)."""
    if version == INSTALLED:
        return None
    found = newest_dir()
    if found is None:
        pytest.skip(f"Mooncake {NEWEST} is not unpacked: run 'bash scripts/dev.sh install'")
    return str(found / "mooncake" / "mooncake_master")


@pytest.fixture
def master_version(request: pytest.FixtureRequest) -> str:
    """The Mooncake release whose master the test runs (parametrized indirectly with MASTERS)."""
    return getattr(request, "param", INSTALLED)


@pytest.fixture(scope="session")
def newest_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMaster]:
    """One Mooncake 0.3.14 master for the session, publishing its key events."""
    pytest.importorskip("mooncake.store")
    exe = master_executable(NEWEST)
    log_path = tmp_path_factory.mktemp("mooncake-newest") / "master.log"
    with LocalMaster(log_path=log_path, executable=exe, kv_events=True) as master:
        yield master


@pytest.fixture(scope="session")
def newest_store(newest_master: LocalMaster) -> Iterator[MooncakeStore]:
    """The 0.3.14 master's holder client (a 0.3.13.post1 client: they are wire-compatible)."""
    store = MooncakeStore.connect(newest_master.master_address)
    yield store
    store.close()


@pytest.fixture(params=MASTERS)
def each_master_store(request: pytest.FixtureRequest) -> Iterator[MooncakeStore]:
    """The holder store of each master (0.3.13.post1's, then 0.3.14's), emptied after the test."""
    store = request.getfixturevalue("mooncake_store" if request.param == INSTALLED else "newest_store")
    yield store
    if store.health_check() == 0:
        store.remove_all(force=True)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMaster]:
    """One master for the session (lease TTL 200 ms); log in the tmp dir."""
    pytest.importorskip("mooncake.store")
    log_path = tmp_path_factory.mktemp("mooncake") / "master.log"
    with LocalMaster(log_path=log_path) as master:
        yield master


@pytest.fixture(scope="session")
def mooncake_store(mooncake_master: LocalMaster) -> Iterator[MooncakeStore]:
    """The long-lived "holder" client: it mounts the 64 MiB segment that keys
    live in, so they survive other clients closing. ``close()`` takes ~1-2 s,
    hence session scope: use unique key prefixes or :func:`clean_mooncake_store`."""
    store = MooncakeStore.connect(mooncake_master.master_address)
    yield store
    store.close()


@pytest.fixture
def clean_mooncake_store(mooncake_store: MooncakeStore) -> Iterator[MooncakeStore]:
    """The holder store, emptied (with force, ignoring leases) after the test."""
    yield mooncake_store
    if mooncake_store.health_check() == 0:
        mooncake_store.remove_all(force=True)
