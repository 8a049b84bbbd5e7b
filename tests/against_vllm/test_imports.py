"""Importing the drop-in, or the module that builds vLLM's workers, does nothing but import."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap


def test_imports_change_no_environment_and_make_no_directory():
    code = textwrap.dedent("""
        import glob, os, sys, tempfile
        # vLLM and torch set variables of their own when imported: import them first.
        import vllm.config, vllm.distributed.kv_transfer.kv_connector.factory
        import vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector
        before = dict(os.environ)
        made = lambda: set(glob.glob(os.path.join(tempfile.gettempdir(), "mooncake_keys_vllm_workers_*")))
        dirs = made()
        import mooncake_keys.vllm
        assert dict(os.environ) == before, "mooncake_keys.vllm changed the environment"
        from support import vllm_workers
        assert dict(os.environ) == before, "vllm_workers changed the environment on import"
        assert made() == dirs and vllm_workers._workdir is None
        workdir = vllm_workers._prepare_process()
        assert vllm_workers._prepare_process() == workdir and os.path.isdir(workdir)
        assert os.environ["VLLM_RPC_BASE_PATH"].startswith(workdir)
        print("OK")
    """)
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_HOST_IP", "VLLM_CACHE_ROOT", "VLLM_RPC_BASE_PATH", "HF_HUB_OFFLINE",
                        "TRANSFORMERS_OFFLINE")}
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # support.vllm_workers
    env["PYTHONPATH"] = os.pathsep.join(p for p in (tests, env.get("PYTHONPATH")) if p)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-2000:]


def test_the_dropin_package_holds_only_production_modules():
    """The builders of vLLM's workers live with the tests (``support.vllm_workers``), not in the
    package vLLM imports."""
    from pathlib import Path

    import mooncake_keys.vllm as mv

    modules = sorted(p.stem for p in Path(mv.__file__).parent.glob("*.py"))
    assert modules == ["__init__", "connector", "contracts", "handshake", "logs", "mapping", "metrics", "scheduler",
                       "versions", "worker"]
