"""The master probe and etcd, on a real HA cluster (etcd + a master): the probe survives any
answer and never holds a store down while its master answers; an etcd stall of up to 2 s does
not zero lookups; ``etcd://`` errors are ``MooncakeStoreError`` naming the address and the
problem. Answers a real etcd never gives come from a fake endpoint on loopback
(tests/support/fake_etcd.py), which otherwise forwards to the real etcd."""

from __future__ import annotations

import base64
import ctypes
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.mooncake

import mooncake_keys as mk  # noqa: E402
from mooncake_keys.store.local_cluster import LocalCluster  # noqa: E402
from mooncake_keys.store.local_master import free_port  # noqa: E402
from mooncake_keys.store.mooncake import MooncakeStore, MooncakeStoreError  # noqa: E402
from mooncake_keys.store.probe import MasterProbe  # noqa: E402
from support.fake_etcd import FakeEtcd  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
HASHES = [bytes([i]) * 32 for i in range(1, 9)]
TOKENS = 8 * 16 + 1  # one past the 8 saved chunks: a full hit is not shortened


def b64(text: bytes) -> str:
    return base64.b64encode(text).decode()


HEADER = '"header": {"cluster_id": "1", "revision": "3"}'
#: Answers no real etcd gives, and the words of the error that names each.
ODD_ANSWERS = {
    "array": (b"[]", "a JSON array, not an object"),
    "string": (b'"127.0.0.1:1"', "a JSON string, not an object"),
    "number": (b"5", "a JSON number, not an object"),
    "null": (b"null", "a JSON null, not an object"),
    "not JSON": (b"<html>hello</html>", "not JSON"),
    "nested too deeply": (b"[" * 20000 + b"]" * 20000, "not JSON"),
    "too large": (b'{"pad": "' + b"x" * (1 << 17) + b'"}', "larger than"),
    "no header": (b'{"kvs": []}', "no 'header' object"),
    "kvs not an array": (('{%s, "kvs": {"value": "x"}}' % HEADER).encode(), "'kvs' is a JSON object, not an array"),
    "entry not an object": (('{%s, "kvs": [5]}' % HEADER).encode(), "'kvs[0]' is not an object"),
    "value not a string": (('{%s, "kvs": [{"value": 7}]}' % HEADER).encode(), "'kvs[0]' is not an object with a string"),
    "value not base64": (('{%s, "kvs": [{"value": "!!!"}]}' % HEADER).encode(), "not base64 of UTF-8"),
    "value not UTF-8": (('{%s, "kvs": [{"value": "%s"}]}' % (HEADER, b64(b"\xff\xfe"))).encode(), "not base64 of UTF-8"),
    "leader not host:port": (('{%s, "kvs": [{"value": "%s"}]}' % (HEADER, b64(b"leader"))).encode(),
                             "names the leader 'leader', not host:port"),
    "HTTP 404": (b"404 page not found", "HTTP Error 404"),
}


def _wait(cond, timeout: float, what: str) -> float:
    start = time.monotonic()
    while True:
        try:
            if cond():
                return time.monotonic() - start
        except mk.MooncakeStoreError:
            pass
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(0.02)


def _probe_lines(caplog, text: str) -> list:
    return [r.getMessage() for r in caplog.records if r.name == "mooncake_keys.store" and text in r.getMessage()]


# ------------------------------------------------------------------ connect: errors name the address


@pytest.mark.parametrize("kind", sorted(ODD_ANSWERS))
def test_connect_to_an_endpoint_that_answers_odd_json_is_a_store_error(kind):
    body, words = ODD_ANSWERS[kind]
    status = 404 if kind == "HTTP 404" else 200
    with FakeEtcd() as fake:
        fake.answer(body, status)
        start = time.monotonic()
        with pytest.raises(MooncakeStoreError) as info:
            MooncakeStore.connect(fake.address, lookup_only=True)
        assert time.monotonic() - start < 5  # no client was set up
    message = str(info.value)
    assert f"etcd 127.0.0.1:{fake.port}" in message and words in message, message
    assert fake.address in message


def test_connect_to_no_etcd_or_to_one_without_a_leader_is_a_store_error():
    port = free_port()  # nothing listens there
    with pytest.raises(MooncakeStoreError, match=f"etcd 127.0.0.1:{port}: Connection refused"):
        MooncakeStore.connect(f"etcd://127.0.0.1:{port}", lookup_only=True)
    with FakeEtcd() as fake:
        fake.answer(("{%s}" % HEADER).encode())  # etcd's answer when the key does not exist
        with pytest.raises(MooncakeStoreError, match=f"no leader of Mooncake cluster .* in etcd 127.0.0.1:{fake.port}"):
            MooncakeStore.connect(fake.address, lookup_only=True)


def test_every_endpoint_is_tried_and_named(cluster):
    with FakeEtcd() as odd:
        odd.answer(b"[]")
        # The first endpoint answers nonsense, the second is the real etcd: the leader is found.
        with MooncakeStore.connect(f"etcd://127.0.0.1:{odd.port};127.0.0.1:{cluster.etcd_port}",
                                   lookup_only=True) as store:
            assert store.batch_is_exist(["nothing"]) == [0]
        port = free_port()
        with pytest.raises(MooncakeStoreError, match=f"etcd 127.0.0.1:{odd.port}: the answer is a JSON array.*; "
                                                     f"etcd 127.0.0.1:{port}: Connection refused"):
            MooncakeStore.connect(f"etcd://127.0.0.1:{odd.port};127.0.0.1:{port}", lookup_only=True)


# ------------------------------------------------------------------ a real cluster


@pytest.fixture(scope="module")
def cluster():
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    with LocalCluster(masters=1) as c:
        yield c
        c.resume_etcd()
        for m in c.masters:
            m.resume()


@pytest.fixture(scope="module")
def saved(cluster):
    """A data client on the leader (it holds the segment), with one prompt saved; the hit it gives."""
    leader = cluster.wait_leader()
    holder = MooncakeStore.connect(leader.master_address)
    engine = mk.LookupEngine("probe-model", [mk.FullAttentionSpec(16)], mk.ParallelLayout(), hash_block_size=16,
                             store=holder)
    for key in engine.candidate_keys(TOKENS, HASHES):
        assert holder.put(key, b"kv") == 0
    full = engine.lookup(TOKENS, HASHES)
    assert full == 128
    yield full
    leader.resume()
    holder.close()


@pytest.fixture
def fake(cluster):
    with FakeEtcd(real=f"127.0.0.1:{cluster.etcd_port}") as f:
        yield f


def _engine(store):
    return mk.LookupEngine("probe-model", [mk.FullAttentionSpec(16)], mk.ParallelLayout(), hash_block_size=16,
                           store=store)


def _slow_call(cluster, engine):
    """The master hangs past a call's time limit: the store marks itself down (suspected)."""
    leader = cluster.wait_leader()
    leader.pause()
    try:
        assert engine.lookup(TOKENS, HASHES) == 0
    finally:
        leader.resume()


def test_one_odd_etcd_answer_then_a_slow_call_do_not_hold_the_store_down(cluster, saved, fake, caplog):
    """The reported failure: an etcd answer that is not a JSON object ended the probe thread, and
    after the next slow call the store stayed down for good while master and etcd were fine."""
    caplog.set_level(logging.INFO, logger="mooncake_keys")
    with MooncakeStore.connect(fake.address, lookup_only=True) as store:
        engine = _engine(store)
        assert engine.lookup(TOKENS, HASHES) == saved
        seen = fake.requests
        fake.answer_once(b"[]")
        _wait(lambda: fake.requests >= seen + 3, 5, "the probe to ask etcd again after the odd answer")
        assert store._probe.is_alive()
        _slow_call(cluster, engine)
        took = _wait(lambda: engine.lookup(TOKENS, HASHES) == saved, 10, "lookups to hit again")
        assert store._probe.is_alive() and not store._probe.down
    assert len(_probe_lines(caplog, "a JSON array, not an object")) == 1
    assert len(_probe_lines(caplog, "suspected down")) == 1
    print(f"hits again {took:.2f} s after the master resumed")


def test_the_probe_survives_every_odd_answer_and_logs_each_once(cluster, saved, fake, caplog):
    caplog.set_level(logging.WARNING, logger="mooncake_keys")
    with MooncakeStore.connect(fake.address, lookup_only=True) as store:
        engine = _engine(store)
        for kind, (body, words) in sorted(ODD_ANSWERS.items()):
            seen = fake.requests
            fake.answer(body, 404 if kind == "HTTP 404" else 200)
            _wait(lambda: fake.requests >= seen + 4, 5, f"the probe to ask etcd 4 times ({kind})")
            # etcd cannot be read: the last known leader, which answers, keeps being asked.
            assert store._probe.is_alive() and not store._probe.down, (kind, store._probe.reason)
            assert engine.lookup(TOKENS, HASHES) == saved, kind
            assert len(_probe_lines(caplog, words)) == 1, (kind, _probe_lines(caplog, words))
            caplog.clear()
            seen = fake.requests
            fake.forward()
            _wait(lambda: fake.requests >= seen + 2, 5, "etcd to be read again")
        assert engine.lookup(TOKENS, HASHES) == saved


def _kill_thread(thread) -> None:
    """End ``thread`` by raising SystemExit in it (what no answer can do any more)."""
    set_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    assert set_exc(ctypes.c_ulong(thread.ident), ctypes.py_object(SystemExit)) == 1
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the SystemExit we raise
@pytest.mark.parametrize("through", ["master", "etcd"])
def test_a_probe_thread_that_died_is_started_again(cluster, saved, fake, caplog, through):
    caplog.set_level(logging.WARNING, logger="mooncake_keys")
    address = cluster.wait_leader().master_address if through == "master" else fake.address
    with MooncakeStore.connect(address, lookup_only=True) as store:
        engine = _engine(store)
        assert engine.lookup(TOKENS, HASHES) == saved
        _kill_thread(store._probe._thread)
        _slow_call(cluster, engine)  # down, and no probe left to see the master answer
        _wait(lambda: engine.lookup(TOKENS, HASHES) == saved, 10, "lookups to hit again")
        assert store._probe.is_alive()
    assert len(_probe_lines(caplog, "had stopped: started again")) == 1


def test_an_etcd_stall_longer_than_the_grace_marks_the_master_down(cluster, saved):
    """The last known leader is trusted for ``etcd_grace_s`` only (10 s by default; 0.5 here)."""
    probe = MasterProbe(cluster.master_address, 0.05, etcd_grace_s=0.5)
    probe.probe_once()
    probe.start()
    try:
        assert not probe.down
        cluster.pause_etcd()
        try:
            time.sleep(0.3)
            assert not probe.down  # within the grace
            _wait(lambda: probe.down, 5, "the probe to give up on etcd")
            assert "etcd 127.0.0.1" in probe.reason and "timed out" in probe.reason
        finally:
            cluster.resume_etcd()
        _wait(lambda: not probe.down, 5, "the probe to read etcd again")
    finally:
        probe.stop()


def test_lookups_keep_hitting_through_an_etcd_stall_of_1_and_2_s():
    """etcd SIGSTOPped for 1 s, then 2 s, while lookups run every 20 ms through a lookup-only and a
    data client given ``etcd://``, and a client given the leader directly. The driver runs in its
    own process: closing a data client set up with etcd:// takes ~30 s (docs/mooncake.md)."""
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    out = subprocess.run([sys.executable, str(REPO_ROOT / "tests" / "support" / "etcd_stall_driver.py")],
                         capture_output=True, text=True, timeout=300,
                         env=dict(os.environ, PYTHONPATH=str(REPO_ROOT), MC_LOG_LEVEL="ERROR"))
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    for stall, per_client in result["stalls"].items():
        for client, (lookups, hits) in per_client.items():
            assert lookups >= 10 and hits == lookups, (stall, client, lookups, hits)
    print(json.dumps(result))
