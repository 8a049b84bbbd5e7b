"""The installed package holds the product and its commands; the test and benchmark harness (vLLM's
real workers built on a CPU machine) lives in tests/support/, and a plain install says what it
cannot measure without it."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import mooncake_keys

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_the_worker_harness_is_in_tests_not_in_the_package():
    package = Path(mooncake_keys.__file__).parent
    modules = {p.stem for p in package.rglob("*.py")}
    assert {"engine", "connector", "suite"} <= modules  # the walk saw the package
    assert "vllm_workers" not in modules
    spec = importlib.util.find_spec("support.vllm_workers")  # tests/conftest.py put tests/ on sys.path
    assert spec is not None and spec.origin == os.path.join(TESTS, "support", "vllm_workers.py")


def test_a_plain_install_says_the_vllm_column_needs_a_checkout():
    """Without tests/ on the path (an installed package), the vLLM baseline is left out with a
    reason naming the harness and the command that measures it; nothing imports vLLM for it."""
    code = ("import sys\n"
            "from mooncake_keys.bench import vllm_baseline\n"
            "print(vllm_baseline.unavailable())\n"
            "try:\n    vllm_baseline.workers()\nexcept ImportError as exc:\n    print('IMPORTERROR', exc.name, exc)\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'vllm', 'torch', 'support'}))\n")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                                        if p and os.path.abspath(p) != TESTS)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, env=env,
                         cwd="/")
    reason, error, imported = out.stdout.strip().splitlines()
    assert "tests/support/vllm_workers.py" in reason and "bash scripts/dev.sh bench" in reason
    assert error.startswith("IMPORTERROR support.vllm_workers ") and "tests/support/vllm_workers.py" in error
    assert imported == "[]"
