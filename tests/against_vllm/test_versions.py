"""Which vLLM version follows which contract (mooncake_keys.vllm.versions: the rule in its
docstring), and the drop-in's parts that act only where it runs: share_loads and the worker's
lookup stay vLLM's on a release the rule refuses (pre-releases and development builds included)."""

from __future__ import annotations

import logging

import pytest

import mooncake_keys as mk
from support import vllm_workers
from mooncake_keys.vllm.versions import contract_for, contract_for_installed, parse_version, unsupported_reason
from mooncake_keys.vllm.worker import FastLookup
from support.vllm_cases import Release

vllm_workers.quiet(logging.CRITICAL)

RULE = [
    # final releases of a supported minor, post-releases and local labels: that minor's contract
    ("0.33.0", "0.33"), ("0.33.2", "0.33"), ("0.33", "0.33"), ("0.25.1", "0.25"), ("0.32.0+cpu", "0.32"),
    ("0.33.0+cpu", "0.33"), ("0.33.0.post1", "0.33"), ("0.33.0-1", "0.33"), ("v0.33.0", "0.33"),
    (" 0.33.0 ", "0.33"), ("00.33.0", "0.33"), ("0.033.0", "0.33"), ("0.33.0+rocm624.cu12", "0.33"),
    # pre-releases and development builds (nightlies): none
    ("0.33.0rc1", None), ("0.33rc1", None), ("0.33.0.rc1", None), ("0.33.0a1", None), ("0.33.0b2", None),
    ("0.33.0RC1", None), ("0.33.1.dev12+g1a2b3c4", None), ("0.33.0.dev0", None), ("0.33.0rc1.dev3", None),
    ("0.33.0rc1+cpu", None), ("0.25.0.dev1", None),
    # other minors and what is not a version
    ("0.34.0", None), ("0.24.9", None), ("1.0.0", None), ("1.33.0", None), ("0", None), ("33", None), ("dev", None),
    ("garbage", None), ("", None), ("0.33.0 extra", None), ("0.33.x", None), ("0..33", None), ("+cpu", None),
]


@pytest.mark.parametrize("version, contract", RULE)
def test_the_version_rule(version, contract):
    assert contract_for(version) == contract
    reason = unsupported_reason(version)
    assert (reason is None) == (contract is not None)
    if contract is None and parse_version(version) is not None and parse_version(version)[0][:2] in ((0, 33), (0, 25)):
        assert "pre-release or development build" in reason


@pytest.mark.parametrize("bad", [None, 33, 0.33, b"0.33.0"])
def test_a_version_that_is_not_text_follows_none(bad):
    assert contract_for(bad) is None and parse_version(bad) is None


def test_the_installed_release_follows_its_own_contract():
    release = Release.installed()
    assert contract_for_installed() == f"{release.version[0]}.{release.version[1]}"


SCHEDULER = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm",
             "groups": [{"type": "full", "block_size": 16}], "reuse_model_config": True,
             "extra_config": {"lookup_async": True}}


@pytest.mark.parametrize("version", ["0.33.0rc1", "0.33.1.dev12+g1a2b3c4", "0.34.0", "garbage"])
def test_on_a_release_the_rule_refuses_share_loads_and_the_lookup_stay_vllms(version, monkeypatch, caplog):
    """share_loads is on by default with lookup_async and load_async; on a release the version
    check refuses, the drop-in does not run, and neither does share_loads (one log line)."""
    import vllm

    connector = vllm_workers.build_scheduler_connector(SCHEDULER)
    try:
        assert connector._shared_loads is not None  # the installed release: on
    finally:
        connector.connector_scheduler.client.close()
    monkeypatch.setattr(vllm, "__version__", version)
    ours = logging.getLogger("mooncake_keys")  # it may not propagate: inside vLLM it joins vLLM's stream
    ours.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="mooncake_keys"):
            connector = vllm_workers.build_scheduler_connector(SCHEDULER)
            try:
                assert connector._shared_loads is None
            finally:
                connector.connector_scheduler.client.close()
            worker = vllm_workers.build_worker({**SCHEDULER, "extra_config": {}}, mk.RecordingStore(1))
            try:
                assert not isinstance(worker.lookup, FastLookup)
            finally:
                vllm_workers.release(worker)
    finally:
        ours.removeHandler(caplog.handler)
    assert f"share_loads is off: {unsupported_reason(version)}" in caplog.text
    assert "keeping vLLM's own Mooncake lookup" in caplog.text
