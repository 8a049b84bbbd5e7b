"""The store layer checks its arguments before a client or a process exists, and says which one
is wrong: sizes, config files, ``MooncakeStore.connect``, ``LocalMaster``, ``LocalCluster``."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from mooncake_keys.store.config import MooncakeStoreConfig, parse_size


@pytest.mark.parametrize("value", ["9" * 400, float("inf"), 2**70])
def test_an_enormous_size_is_a_value_error(value):
    with pytest.raises(ValueError, match="larger than"):
        parse_size(value)
    with pytest.raises(ValueError, match="global_segment_size"):
        MooncakeStoreConfig(global_segment_size=value)


@pytest.mark.parametrize("path", [1, True])
def test_a_config_path_that_is_an_int_is_refused_and_no_descriptor_closed(path):
    fd, name = tempfile.mkstemp()
    try:
        with pytest.raises(TypeError, match="must be a str or os.PathLike"):
            MooncakeStoreConfig.from_file(path)
        os.fstat(1)  # stdout is still open
    finally:
        os.close(fd)
        os.unlink(name)


def test_a_deeply_nested_config_is_a_value_error(tmp_path):
    p = tmp_path / "c.json"
    p.write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(ValueError, match="nested too deeply"):
        MooncakeStoreConfig.from_file(p)


def test_a_config_path_that_is_not_a_file_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in ("/dev/zero", str(fifo), str(tmp_path)):
        start = time.monotonic()
        with pytest.raises(ValueError, match="is not a regular file"):
            MooncakeStoreConfig.from_file(path)
        assert time.monotonic() - start < 1
    big = tmp_path / "big.json"
    big.write_bytes(b" " * (2 << 20))
    with pytest.raises(ValueError, match="larger than"):
        MooncakeStoreConfig.from_file(big)


@pytest.mark.parametrize("kw, exc, message", [
    (dict(call_timeout_s=float("nan")), ValueError, "call_timeout_s must be > 0"),
    (dict(call_timeout_s=10**30), ValueError, "call_timeout_s must be > 0"),
    (dict(call_timeout_s=None), TypeError, "call_timeout_s must be a number"),
    (dict(probe_interval_s=float("inf")), ValueError, "probe_interval_s must be > 0"),
    (dict(probe_interval_s=float("nan")), ValueError, "probe_interval_s must be > 0"),
    (dict(rpc_timeout_ms="abc"), TypeError, "rpc_timeout_ms must be an int"),
    (dict(rpc_timeout_ms=0), ValueError, "rpc_timeout_ms must be >= 1"),
    (dict(setup_retries=-1), ValueError, "setup_retries must be >= 0"),
    (dict(local_hostname=None), TypeError, "local_hostname must be a str"),
    (dict(metadata_server="\ud800"), ValueError, "metadata_server must be valid text"),
    (dict(device_name=None), TypeError, "device_name must be a str"),
    (dict(global_segment_size=2**70), ValueError, "larger than"),
    (dict(lookup_only=1), TypeError, "lookup_only must be a bool"),
])
def test_connect_checks_every_argument_before_a_client_exists(kw, exc, message, monkeypatch):
    from mooncake_keys.store import mooncake

    def no_setup(*args, **kwargs):  # a setup would take seconds: no master listens there
        raise AssertionError("a client was set up before the arguments were checked")

    monkeypatch.setattr(mooncake, "_setup_client", no_setup)
    with pytest.raises(exc, match=message):
        mooncake.MooncakeStore.connect("127.0.0.1:1", **kw)


@pytest.mark.parametrize("address", ["h:²", "h:" + "9" * 5000, "h:١٢٣", "\ud800:1", "h:0", "h:65536"])
def test_a_master_address_port_must_be_ascii_digits_in_range(address):
    from mooncake_keys.store.mooncake import MooncakeStore

    with pytest.raises(ValueError, match="master_address must be"):
        MooncakeStore.connect(address)


@pytest.mark.mooncake
def test_setup_arguments_the_client_cannot_take_are_named(mooncake_master):
    from mooncake_keys.store.mooncake import MooncakeStore, MooncakeStoreError

    with pytest.raises(ValueError, match="global_segment_size must be 0 or at least 16777216"):
        MooncakeStore.connect(mooncake_master.master_address, global_segment_size=1 << 20)
    with pytest.raises(ValueError, match="master_address must be"):
        MooncakeStore.connect("")
    with pytest.raises(ValueError, match="protocol must be one of"):
        MooncakeStore.connect(mooncake_master.master_address, protocol="TCP")
    with pytest.raises(MooncakeStoreError, match=r"rc=-600.*refused its arguments"):
        MooncakeStore.connect(mooncake_master.master_address, local_hostname="")


@pytest.mark.parametrize("kw, exc, message", [
    (dict(rpc_port=-1), ValueError, "rpc_port must be >= 1"),
    (dict(rpc_port=70000), ValueError, "rpc_port must be <= 65535"),
    (dict(rpc_port=True), TypeError, "rpc_port must be an int"),
    (dict(metrics_port=-5), ValueError, "metrics_port must be >= 1"),
    (dict(ready_timeout=float("nan")), ValueError, "ready_timeout must be > 0"),  # hung forever
    (dict(ready_timeout=None), TypeError, "ready_timeout must be a number"),
    (dict(default_kv_lease_ttl=float("inf")), TypeError, "default_kv_lease_ttl must be an int"),
])
def test_local_master_checks_its_arguments_before_starting(kw, exc, message):
    from mooncake_keys.store.local_master import LocalMaster

    with pytest.raises(exc, match=message):
        LocalMaster(**kw)


def test_local_cluster_checks_its_arguments():
    from mooncake_keys.store.local_cluster import LocalCluster

    with pytest.raises(ValueError, match="masters must be >= 1"):
        LocalCluster(0)
    with pytest.raises(TypeError, match="masters must be an int"):
        LocalCluster(2.0)
    with pytest.raises(ValueError, match="ready_timeout must be > 0"):
        LocalCluster(2, ready_timeout=-1)
