"""Tests against the real vLLM package's own code (a vLLM release installed in this interpreter).

``scripts/dev.sh test`` runs this folder once per vLLM release (0.25.1 ... 0.33.0, each release's
package on ``PYTHONPATH`` in one dependency venv), once on the compiled core and once with
``MOONCAKE_KEYS_NO_EXTENSIONS=1``, with ``MK_REQUIRE_VLLM`` set to the release: then a missing
or different vLLM fails the run instead of skipping it.
Elsewhere (no vLLM installed) nothing in this folder is collected.
"""

from __future__ import annotations

import os
import sys

import pytest

REQUIRED = os.environ.get("MK_REQUIRE_VLLM", "")


def _vllm_version() -> str:
    """``vllm.__version__``, as vLLM reads it (whatever distribution installed the package)."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        return ""
    import vllm

    return str(vllm.__version__)


VLLM_VERSION = _vllm_version()

if REQUIRED and VLLM_VERSION != REQUIRED:
    raise pytest.UsageError(
        f"MK_REQUIRE_VLLM={REQUIRED} but this interpreter has vLLM {VLLM_VERSION or 'not installed'}"
    )


# Without vLLM there is nothing to compare against: nothing here is collected. The lookup in
# the scheduler needs the store coordinator vLLM's scheduler holds from 0.32 on.
collect_ignore_glob = [] if VLLM_VERSION else ["test_*.py"]
if VLLM_VERSION and not VLLM_VERSION.startswith(("0.32.", "0.33.")):
    collect_ignore_glob.append("test_in_scheduler.py")
# The model zoo's layouts are built by vLLM 0.33's own layer classes and planning.
if VLLM_VERSION and not VLLM_VERSION.startswith("0.33."):
    collect_ignore_glob.append("test_model_zoo.py")


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    """Under MK_REQUIRE_VLLM nothing here may be skipped: a skip would hide a test not run."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped") if reporter is not None else None
    if REQUIRED and skipped and session.exitstatus == 0:
        print(f"\nerror: {len(skipped)} test(s) skipped under MK_REQUIRE_VLLM={REQUIRED}", file=sys.stderr)
        session.exitstatus = 1
