"""MooncakeStore, MooncakeStoreConfig and LocalMaster against a real mooncake_master.

Skipped only when the ``mooncake`` package cannot be imported. Fault tests use
their own master and client so that the session's holder store is never hurt.
"""

from __future__ import annotations

import ctypes
import importlib.abc
import json
import os
import subprocess
import sys
import textwrap
import threading
import time
import unicodedata
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

# The client reads its log level once, when mooncake.store is first imported.
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
pytest.importorskip("mooncake.store")
pytestmark = pytest.mark.mooncake  # fixtures mooncake_master / mooncake_store come from conftest.py

from mooncake_keys.store.local_master import LocalMaster, LocalMasterError, free_port as _free_port  # noqa: E402
from support.mooncake_fixtures import MASTERS, NEWEST, master_executable  # noqa: E402
from mooncake_keys.store.config import MooncakeStoreConfig, parse_size  # noqa: E402
from mooncake_keys.store.keycheck import check_keys  # noqa: E402
from mooncake_keys.store.mooncake import (  # noqa: E402
    MooncakeStore,
    MooncakeStoreError,
    MooncakeStoreUnavailable,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


def _prefix() -> str:
    return f"test-{uuid.uuid4().hex[:8]}/"


def _wait_for(predicate, timeout: float, what: str, interval: float = 0.02) -> float:
    """Poll ``predicate`` until true; return the seconds it took."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{what} not reached within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _run_python(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO_ROOT,
    )


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("4gb", 4 << 30),
        ("64mb", 64 << 20),
        ("1.5kb", 1536),
        (" 2 GB ", 2 << 30),
        ("10b", 10),
        ("12", 12),
        (123, 123),
        (0, 0),
        (7.9, 7),  # non-str goes through int()
    ],
)
def test_parse_size(value: object, expected: int) -> None:
    assert parse_size(value) == expected


@pytest.mark.parametrize("value", ["", "   ", "4xb", "gb", "1.2.3mb", "-1mb", ".5gb", "4 g b"])
def test_parse_size_rejects(value: str) -> None:
    with pytest.raises(ValueError):
        parse_size(value)


def test_config_defaults_are_vllms() -> None:
    config = MooncakeStoreConfig()
    assert (config.metadata_server, config.master_server_address) == ("", "")
    assert (config.protocol, config.device_name, config.mode) == ("rdma", "", "embedded")
    assert config.global_segment_size == config.local_buffer_size == 4 << 30


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"mode": "cluster"}, "mode"),
        ({"local_buffer_size": 0}, "local_buffer_size"),
        ({"global_segment_size": 0}, "global_segment_size"),
        ({"mode": "standalone-store"}, "global_segment_size"),
        ({"local_buffer_size": "lots"}, "local_buffer_size"),
    ],
)
def test_config_validation_names_field(fields: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        MooncakeStoreConfig(**fields)


def test_config_from_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": "127.0.0.1:50051",
        "protocol": "tcp",
        "global_segment_size": "64mb",
        "local_buffer_size": "1.5kb",
        "some_future_field": 1,
    }))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    config = MooncakeStoreConfig.from_env()
    assert config == MooncakeStoreConfig(
        metadata_server="P2PHANDSHAKE", master_server_address="127.0.0.1:50051",
        protocol="tcp", global_segment_size=64 << 20, local_buffer_size=1536,
    )
    assert MooncakeStoreConfig.from_file(path) == config


def test_config_loopback_round_trips_through_json(tmp_path: Path) -> None:
    config = MooncakeStoreConfig.loopback("127.0.0.1:50051")
    assert (config.metadata_server, config.protocol) == ("P2PHANDSHAKE", "tcp")
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps(config.to_dict()))
    assert MooncakeStoreConfig.from_file(path) == config


def test_config_from_env_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_CONFIG_PATH", raising=False)
    with pytest.raises(ValueError, match=r"^The environment variable 'MOONCAKE_CONFIG_PATH' is not set\.$"):
        MooncakeStoreConfig.from_env()
    with pytest.raises(ValueError, match="MOONCAKE_CONFIG_PATH"):
        MooncakeStore.from_config()


@pytest.mark.parametrize("master_version", MASTERS, indirect=True)
def test_from_config_lookup_only_client_sees_holder_keys(
    master_version: str, request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    new = master_version == NEWEST
    mooncake_master = request.getfixturevalue("newest_master" if new else "mooncake_master")
    mooncake_store = request.getfixturevalue("newest_store" if new else "mooncake_store")
    key = _prefix() + "held"
    assert mooncake_store.put(key, b"value") == 0
    path = tmp_path / "mooncake.json"
    path.write_text(json.dumps({
        "metadata_server": "P2PHANDSHAKE",
        "master_server_address": mooncake_master.master_address,
        "protocol": "tcp",
        "mode": "standalone-store",
        "global_segment_size": 0,
        "local_buffer_size": "16mb",
    }))
    monkeypatch.setenv("MOONCAKE_CONFIG_PATH", str(path))
    with MooncakeStore.from_config() as reader:
        assert reader.batch_is_exist([key, key + "-missing"]) == [1, 0]
        assert reader.get(key) == b"value"
    assert reader.closed
    assert mooncake_store.batch_is_exist([key]) == [1]  # the reader's close did not take it away


# --------------------------------------------------------------------------- keys


def test_check_keys() -> None:
    keys = ["a", "ключ"]
    assert check_keys(keys) is keys
    assert check_keys(("a", "b")) == ["a", "b"]
    assert check_keys([]) == []
    with pytest.raises(TypeError, match=r"keys\[1\] must be str, got bytes"):
        check_keys(["a", b"b"])
    with pytest.raises(TypeError, match=r"keys\[2\] must be str, got NoneType"):
        check_keys(["a", "b", None])
    with pytest.raises(TypeError, match=r"keys\[1\] is not valid UTF-8"):
        check_keys(["ok", "bad\udcff", "also\ud800bad"])
    with pytest.raises(TypeError, match="list or tuple"):
        check_keys(k for k in ["a"])
    with pytest.raises(TypeError, match="list or tuple"):
        check_keys("abc")


def test_unicode_round_trip(clean_mooncake_store: MooncakeStore) -> None:
    store = clean_mooncake_store
    nfc = _prefix() + "ключ/日本語/🚀/é"
    keys = [nfc, _prefix() + "a\x00b", _prefix() + "tab\tspace new\nline [.*]"]
    for i, key in enumerate(keys):
        assert store.put(key, f"value{i}".encode()) == 0
    nfd = unicodedata.normalize("NFD", nfc)
    assert nfd != nfc
    assert store.batch_is_exist(keys + [nfd, keys[1][:-2]]) == [1, 1, 1, 0, 0]
    assert store.batch_is_exist(tuple(keys[:1])) == [1]
    assert store.is_exist(nfc) == 1
    assert store.get(nfc) == b"value0"
    assert store.get(nfd) == b""
    assert store.put(nfc, b"other") == 0  # an existing key keeps its value
    assert store.get(nfc) == b"value0"
    assert store.remove(nfc, force=True) == 0
    assert store.batch_is_exist([nfc]) == [0]


def test_bad_keys_raise_before_rpc(mooncake_store: MooncakeStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_rpc(*args: object, **kwargs: object) -> None:
        raise AssertionError("RPC sent")

    monkeypatch.setattr(mooncake_store, "_call", no_rpc)
    with pytest.raises(TypeError, match=r"keys\[1\]"):
        mooncake_store.batch_is_exist(["ok", "bad\udcff"])
    with pytest.raises(TypeError, match=r"^key is not valid UTF-8"):
        mooncake_store.is_exist("lone\udc80")
    with pytest.raises(TypeError, match=r"^key must be str"):
        mooncake_store.put(b"bytes-key", b"x")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="bytes-like"):
        mooncake_store.put("k", "text")  # type: ignore[arg-type]
    assert mooncake_store.batch_is_exist([]) == []
    monkeypatch.undo()
    assert mooncake_store.batch_is_exist(["still-works"]) == [0]


def test_zero_copy_batch_put_and_get(each_master_store: MooncakeStore) -> None:
    store = each_master_store
    size, n = 4096, 3
    src, dst = ctypes.create_string_buffer(size * n), ctypes.create_string_buffer(size * n)
    for i in range(n):
        ctypes.memset(ctypes.addressof(src) + i * size, 65 + i, size)
    keys = [_prefix() + f"block{i}" for i in range(n)]
    src_ptrs = [ctypes.addressof(src) + i * size for i in range(n)]
    dst_ptrs = [ctypes.addressof(dst) + i * size for i in range(n)]
    assert store.register_buffer(ctypes.addressof(src), size * n) == 0
    assert store.register_buffer(ctypes.addressof(dst), size * n) == 0
    try:
        assert store.batch_put_from(keys, src_ptrs, [size] * n) == [0] * n
        assert store.batch_is_exist(keys) == [1] * n
        assert store.batch_get_into(keys, dst_ptrs, [size] * n) == [size] * n
        assert dst.raw == src.raw
        with pytest.raises(ValueError, match="differ in length"):
            store.batch_get_into(keys, dst_ptrs[:1], [size] * n)
    finally:
        assert store.unregister_buffer(ctypes.addressof(src)) == 0
        assert store.unregister_buffer(ctypes.addressof(dst)) == 0


# --------------------------------------------------------------------------- setup and close


def test_setup_without_master_fails_fast() -> None:
    port = _free_port()  # nothing listens there
    start = time.monotonic()
    with pytest.raises(MooncakeStoreError, match=f"127.0.0.1:{port}.*mooncake_master running"):
        MooncakeStore.connect(f"127.0.0.1:{port}", setup_retries=1)
    elapsed = time.monotonic() - start
    assert elapsed < 45, elapsed  # ~4.4 s here (more on a loaded machine); the client's default retries take ~90 s


def test_calls_after_close_raise_not_crash(mooncake_master: LocalMaster) -> None:
    # The raw client segfaults after close(); run in a child so a crash shows as a signal.
    result = _run_python(
        """
        import sys
        from mooncake_keys.store.mooncake import MooncakeStore, MooncakeStoreError
        store = MooncakeStore.connect(sys.argv[1], global_segment_size=0)
        assert store.batch_is_exist(["k"]) == [0]
        store.close()
        store.close()  # idempotent
        assert store.health_check() == 1
        calls = [
            lambda: store.batch_is_exist(["k"]), lambda: store.is_exist("k"),
            lambda: store.put("k", b"v"), lambda: store.get("k"), lambda: store.remove("k"),
            lambda: store.remove_all(), lambda: store.register_buffer(1, 1),
            lambda: store.unregister_buffer(1), lambda: store.batch_put_from(["k"], [1], [1]),
            lambda: store.batch_get_into(["k"], [1], [1]),
        ]
        for call in calls:
            try:
                call()
            except MooncakeStoreError as exc:
                assert str(exc) == "store is closed", exc
            else:
                raise AssertionError("no error after close")
        print("CLOSED-OK")
        """,
        mooncake_master.master_address,
    )
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "CLOSED-OK" in result.stdout


class _SlowClient:
    """Stands in for the native client to make the close/call race deterministic."""

    def __init__(self) -> None:
        self.events: list[str] = []

    def health_check(self) -> int:
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        self.events.append("call start")
        time.sleep(0.3)
        self.events.append("call end")
        return [1] * len(keys)

    def close(self) -> int:
        self.events.append("close")
        return 0


def test_close_waits_for_call_in_flight() -> None:
    client = _SlowClient()
    store = MooncakeStore(client)
    results: list[list[int]] = []
    caller = threading.Thread(target=lambda: results.append(store.batch_is_exist(["a", "b"])))
    caller.start()
    _wait_for(lambda: client.events, 5, "call in flight", interval=0.005)
    second_close = threading.Thread(target=store.close)
    store.close()
    second_close.start()
    second_close.join(5)
    caller.join(5)
    assert results == [[1, 1]]
    assert client.events == ["call start", "call end", "close"]
    with pytest.raises(MooncakeStoreError, match="store is closed"):
        store.batch_is_exist(["a"])


# --------------------------------------------------------------------------- import errors


class _FailingFinder(importlib.abc.MetaPathFinder):
    def __init__(self, error: ImportError) -> None:
        self.error = error

    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name == "mooncake.store":
            raise self.error
        return None


@pytest.mark.parametrize(
    ("error", "hint"),
    [
        (ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
         "apt-get install libibverbs1"),
        (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"), r"pip install mooncake-keys\[mooncake\]"),
    ],
)
def test_import_errors_say_what_to_install(monkeypatch: pytest.MonkeyPatch, error: ImportError, hint: str) -> None:
    monkeypatch.delitem(sys.modules, "mooncake.store")
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(error), *sys.meta_path])
    with pytest.raises(ImportError, match=hint):
        MooncakeStore.connect("127.0.0.1:1")


# --------------------------------------------------------------------------- LocalMaster


def test_local_master_stops_when_body_raises(tmp_path: Path) -> None:
    master = LocalMaster(log_path=tmp_path / "m.log")
    with pytest.raises(KeyError):
        with master:
            pid = master.pid
            assert pid and _pid_alive(pid) and master.is_running()
            assert master.master_address == f"127.0.0.1:{master.rpc_port}"
            raise KeyError("boom")
    assert not master.is_running()
    assert not _pid_alive(pid)


def test_local_master_stopped_at_interpreter_exit() -> None:
    result = _run_python(
        """
        from mooncake_keys.store.local_master import LocalMaster
        master = LocalMaster().start()
        print(master.pid, flush=True)
        """
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert not _pid_alive(int(result.stdout.split()[0]))


def test_local_master_reports_missing_libibverbs(tmp_path: Path) -> None:
    fake = tmp_path / "mooncake_master"
    fake.write_text(
        "#!/bin/sh\necho 'mooncake_master: error while loading shared libraries: libibverbs.so.1: "
        "cannot open shared object file: No such file or directory' >&2\nexit 127\n"
    )
    fake.chmod(0o755)
    master = LocalMaster(executable=str(fake), log_path=tmp_path / "m.log")
    start = time.monotonic()
    with pytest.raises(LocalMasterError, match="apt-get install libibverbs1"):
        master.start()
    assert time.monotonic() - start < 5
    assert not master.is_running()


# --------------------------------------------------------------------------- faults (own master)


@pytest.fixture(scope="module", params=MASTERS)
def fault_master(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalMaster]:
    """Each release's master in turn (0.3.13.post1, 0.3.14), with the installed client."""
    with LocalMaster(log_path=tmp_path_factory.mktemp("mooncake-fault") / "master.log",
                     executable=master_executable(request.param)) as master:
        yield master


@pytest.fixture(scope="module")
def fault_store(fault_master: LocalMaster) -> Iterator[MooncakeStore]:
    store = MooncakeStore.connect(fault_master.master_address)
    yield store
    if not fault_master.is_running():
        fault_master.start()  # closing against a dead master stalls on its RPCs
    store.close()


@pytest.fixture
def healthy_fault_store(fault_master: LocalMaster, fault_store: MooncakeStore) -> MooncakeStore:
    fault_master.resume()
    if not fault_master.is_running():
        fault_master.start()
    _wait_for(lambda: fault_store.health_check() == 0, 10, "healthy client")
    return fault_store


def test_hung_master_is_bounded_by_rpc_timeout(fault_master: LocalMaster, healthy_fault_store: MooncakeStore) -> None:
    timeout_s = int(os.environ["MC_RPC_TIMEOUT_MS"]) / 1000
    fault_master.pause()
    try:
        start = time.monotonic()
        try:
            result = healthy_fault_store.batch_is_exist(["hung"])
        except MooncakeStoreUnavailable:  # the ping noticed first: even better
            result = None
        elapsed = time.monotonic() - start
    finally:
        fault_master.resume()
    assert result in (None, [-901])  # -901 RPC_TIMEOUT
    assert elapsed < timeout_s + 10, elapsed  # bounded by the RPC timeout (plus a loaded machine's delay), not the pause
    _wait_for(lambda: healthy_fault_store.health_check() == 0, 10, "healthy after SIGCONT")
    # The call given up on may still be on the lane (single flight) until the master answers it.
    _wait_for(lambda: _answers(healthy_fault_store, ["hung"]) == [0], 5, "an answer after SIGCONT")


def _answers(store: MooncakeStore, keys: list[str]) -> object:
    try:
        return store.batch_is_exist(keys)
    except MooncakeStoreUnavailable:
        return None


def test_dead_master_fails_fast_then_restart_recovers(
    fault_master: LocalMaster, healthy_fault_store: MooncakeStore
) -> None:
    store = healthy_fault_store
    key = _prefix() + "before-restart"
    assert store.put(key, b"v") == 0
    assert store.batch_is_exist([key]) == [1]
    ports = (fault_master.rpc_port, fault_master.metrics_port)

    fault_master.kill()
    # The client's 1 s ping notices in ~1 s, or in ~5.3 s when it first sits in a reconnect stall.
    _wait_for(lambda: store.health_check() == 2, 8, "health_check() == 2 after kill")
    start = time.monotonic()
    with pytest.raises(MooncakeStoreUnavailable, match="master unreachable") as info:
        store.batch_is_exist([key])
    elapsed = time.monotonic() - start
    assert info.value.health == 2
    assert elapsed < 2.5, elapsed  # refused without a call: typically < 1 ms; the raw client stalls ~4.3 s here
    for call in (lambda: store.is_exist(key), lambda: store.put(key, b"v"), lambda: store.get(key)):
        with pytest.raises(MooncakeStoreUnavailable):
            call()

    fault_master.start()
    assert (fault_master.rpc_port, fault_master.metrics_port) == ports
    _wait_for(lambda: store.health_check() == 0, 10, "reconnect after restart", interval=0.05)
    assert store.batch_is_exist([key]) == [0]  # the master is in-memory: old keys are gone
    _wait_for(lambda: store.put(key, b"again") == 0, 5, "put after restart", interval=0.1)
    assert store.batch_is_exist([key]) == [1]


def test_fault_store_close_then_calls_raise(healthy_fault_store: MooncakeStore) -> None:
    healthy_fault_store.close()
    assert healthy_fault_store.closed
    assert healthy_fault_store.health_check() == 1
    with pytest.raises(MooncakeStoreError, match="store is closed"):
        healthy_fault_store.batch_is_exist(["k"])
    healthy_fault_store.close()
