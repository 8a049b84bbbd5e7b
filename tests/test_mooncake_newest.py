"""Mooncake 0.3.14's own Python client (its CUDA 13 wheel, unpacked under the cache): leases =
keys loaded, measured key by key on a real 0.3.14 master, and the fallback to
``batch_is_exist`` against a 0.3.13.post1 master. The client runs in a child process with the
stand-in GPU driver of tests/support/no_device_driver.py (every driver call: no device); the
Mooncake client code is the wheel's own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.mooncake_fixtures import NEWEST, newest_dir
from support.no_device_driver import FOLDER, build, client_env

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.mooncake

REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def newest_client():
    root = newest_dir()
    if root is None:
        pytest.skip(f"Mooncake {NEWEST} is not unpacked: run 'bash scripts/dev.sh install'")
    build(root)  # the stand-in driver (built by dev.sh already; rebuilt only if it changed)
    from mooncake_keys.store.local_master import find_master_executable

    installed = find_master_executable()  # this venv's 0.3.13.post1 master, found before the path changes
    env = client_env(root)
    env["PYTHONPATH"] = f"{root}:{REPO_ROOT}:{REPO_ROOT / 'tests'}"
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "support" / "newest_client_driver.py"),
                          str(root / "mooncake" / "mooncake_master"), installed],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_client_is_the_wheels_own_with_the_stand_in_driver(newest_client):
    assert newest_client["client"].startswith(str(newest_dir()))
    assert (newest_dir() / FOLDER / "libcuda.so.1").exists()


def test_with_a_014_master_a_lookup_leases_exactly_the_keys_its_hit_loads(newest_client):
    run = newest_client["newest"]
    assert run["master"] == NEWEST and run["lease_probes"] is True
    assert run["hit"] == 300 * 16
    assert run["leased"] == 600 and run["leased_are_the_hit"]  # not the 180 keys behind the hole
    assert run["last_call_is_the_hit"]  # the lease call: LastHitOnly of exactly those keys
    assert run["stats"]["leased_keys"] == 600


def test_with_key_events_a_miss_asks_nothing_and_a_hit_one_call(newest_client):
    run = newest_client["newest_events"]
    assert run["miss"] == 0 and run["miss_calls"] == 0
    assert run["hit"] == 300 * 16 and run["calls"] == 1 and run["keys_asked"] == 600
    assert run["leased"] == 600 and run["leased_are_the_hit"]


def test_a_bursts_hits_are_leased_by_one_call_of_the_union_of_their_keys(newest_client):
    """Through a LookupBatcher, 8 hits on a shared 200-chunk prompt: one LastHitOnly call of its
    400 keys (before: one per hit, 8 x 400), all leased; a key of one request removed right
    before the lease call: that call (all 8's keys) leases nothing, one more of the 7 others'
    union leases theirs, and the one request's shorter hit is leased by its own call. Key by key,
    the master's leases are then exactly the keys of the hits."""
    for run in (newest_client["newest"]["burst"], newest_client["newest_events"]["burst"]):
        assert run["hits"] == {str(r): 200 * 16 for r in range(8)}
        assert run["lease_calls"] == [400] and run["leased_are_the_shared_prompt"]
        assert run["gone_hits"] == {str(r): (210 if r == 3 else 232) * 16 for r in range(8)}
        assert run["gone_lease_calls"] == [8 * 64 + 400, 7 * 64 + 400, 210 * 2]
        assert run["gone_leased_are_the_hits"]
    events = newest_client["newest_events"]["burst"]
    assert events["calls"] == 1 and events["keys_asked"] == 400  # the mirror answered every round


def test_with_a_01313_master_the_client_asks_batch_is_exist(newest_client):
    run = newest_client["installed"]
    assert run["master"] == "0.3.13.post1" and run["lease_probes"] is False
    assert run["hit"] == 300 * 16
    # batch_is_exist leases what it finds: the hit, and what the rounds asked past it.
    assert run["leased"] >= 600 and run["stats"]["leased_keys"] == run["stats"]["present_keys"]
    burst = run["burst"]  # a batch's rounds shared, as before; no lease call
    assert burst["hits"] == {str(r): 200 * 16 for r in range(8)} and burst["lease_calls"] == []
    assert burst["gone_hits"] == {str(r): 232 * 16 for r in range(8)} and burst["gone_lease_calls"] == []
    assert burst["gone_leased_are_the_hits"]
