"""pytest fixtures for tests against a real mooncake_master on 127.0.0.1.

Import them into ``tests/conftest.py``::

    from support.mooncake_fixtures import clean_mooncake_store, mooncake_master, mooncake_store  # noqa: F401

Each fixture skips its test when the ``mooncake`` package cannot be imported.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from mooncake_keys.store.local_master import LocalMaster
from mooncake_keys.store.mooncake import MooncakeStore

# The client reads its log level once, when mooncake.store is first imported.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


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
