"""vLLM 0.33's own lookup as a benchmark baseline (``impl = "vllm"``).

A real ``MooncakeStoreWorker`` of the installed vLLM release, built by its own code for a
benchmark scenario, answering on the scenario's stub store; hashes reach it as vLLM's lookup
server hands them over (a ``BlobBlockHashes`` view of one buffer). The worker is built on a
CPU machine by the checkout's test harness, ``support.vllm_workers``
(``tests/support/vllm_workers.py``: only the GPU, rank and store parts replaced), which the
installed package does not carry: ``tests/conftest.py``, ``scripts/dev.sh bench`` and the asv
suite put ``tests/`` on ``sys.path``. Where the harness or vLLM 0.33 is missing,
:func:`unavailable` says why and the benchmarks leave this baseline out.
"""

from __future__ import annotations

import importlib.util
import logging
from types import ModuleType
from typing import Any, Dict, Optional

__all__ = ["VllmLookup", "scenario_cfg", "layout_difference", "unavailable", "workers", "HARNESS"]

#: The vLLM release the baseline is measured against.
RELEASE = "0.33"
#: The harness that builds vLLM's real workers on a CPU machine (a checkout's tests/support/).
HARNESS = "support.vllm_workers"
NO_HARNESS = ("vLLM's workers are built by a checkout's test harness (tests/support/vllm_workers.py), "
              "which an installed package does not carry: bash scripts/dev.sh bench, from a checkout, "
              "measures vLLM 0.33's own lookup")


def _harness_missing() -> bool:
    try:  # finds the module without importing it (it imports vLLM)
        return importlib.util.find_spec(HARNESS) is None
    except ImportError:  # no ``support`` package on sys.path at all
        return True


def workers() -> ModuleType:
    """The worker harness ``support.vllm_workers`` (importing it imports vLLM and torch);
    ``ImportError`` saying so where it is not on ``sys.path`` (a plain install)."""
    if _harness_missing():
        raise ImportError(NO_HARNESS, name=HARNESS)
    from support import vllm_workers

    return vllm_workers


def unavailable() -> Optional[str]:
    """Why vLLM's lookup cannot be the baseline here, or None when it can."""
    from importlib import metadata

    if _harness_missing():
        return NO_HARNESS
    try:
        version = metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "vLLM is not installed (bash scripts/dev.sh bench runs the benchmark in a vLLM 0.33 venv)"
    if not version.startswith(RELEASE + "."):
        return f"vLLM {version} is installed, the baseline is vLLM {RELEASE}.x"
    try:
        workers()
    except Exception as exc:  # noqa: BLE001 - any import failure leaves the baseline out
        return f"vLLM's Mooncake store code cannot be imported: {type(exc).__name__}: {exc}"
    return None


def scenario_cfg(scenario: Any) -> Dict[str, Any]:
    """The ``support.vllm_workers`` cfg of a benchmark scenario (see ``bench.scenarios.Scenario``)."""
    layout = scenario.layout
    groups = []
    for grp in scenario.groups:
        spec = grp.spec
        if hasattr(spec, "sliding_window"):
            groups.append({"type": "swa_mla" if layout.use_mla else "swa", "block_size": spec.block_size,
                           "sliding_window": spec.sliding_window, "is_eagle_group": grp.is_eagle_group})
        else:
            groups.append({"type": "mla" if layout.use_mla else "full", "block_size": spec.block_size,
                           "is_eagle_group": grp.is_eagle_group})
    cfg: Dict[str, Any] = {
        "model": scenario.model_name, "use_mla": layout.use_mla, "num_kv_heads": layout.num_kv_heads,
        "tp_size": layout.tp_size, "pp_size": layout.pp_size, "pcp_size": layout.pcp_size,
        "dcp_size": layout.dcp_size, "groups": groups, "use_eagle": scenario.use_eagle,
        "reuse_model_config": True,
    }
    if len(groups) > 1:
        cfg["hash_block_size"] = scenario.hash_block_size
    return cfg


def layout_difference(scenario: Any, worker: Any) -> Optional[str]:
    """How a scenario differs from the deployment of vLLM's ``worker`` (its groups, their block
    sizes and windows, the rank layout, the hash and scheduler block sizes, the key prefixes),
    or None when it is that deployment."""
    from ..lookup.engine import LookupEngine
    from ..store.recording import RecordingStore
    from ..vllm.worker import deployment_of_worker

    theirs = deployment_of_worker(worker, RELEASE)
    ours = scenario.deployment()

    def shape(dep: Any) -> Any:
        return ([(type(g.spec).__name__, g.spec.block_size, getattr(g.spec, "sliding_window", None),
                  g.spec.use_mla, g.is_eagle_group) for g in dep.groups],
                dep.layout, dep.hash_block_size, dep.scheduler_block_size)

    if shape(ours) != shape(theirs):
        return f"vLLM lays it out as {shape(theirs)}, the scenario as {shape(ours)}"
    prefixes = LookupEngine.for_deployment(ours, store=RecordingStore()).prefixes
    if prefixes != tuple(tuple(p) for p in worker._lookup_key_prefixes):
        return "its key prefixes differ from vLLM's"
    return None


class VllmLookup:
    """``lookup(token_len, blob, hash_len) -> hit`` by vLLM's own worker for one scenario: built
    from the scenario's groups, or, for a served model's layout (``scenario.vllm_model``), by
    the harness's model zoo from vLLM's own code, with vLLM's own connector; such a scenario
    must be that deployment (``RuntimeError`` otherwise)."""

    def __init__(self, scenario: Any, store: Any) -> None:
        reason = unavailable()
        if reason is not None:
            raise NotImplementedError(reason)
        vllm_workers = workers()
        vllm_workers.quiet(logging.CRITICAL)
        if getattr(scenario, "vllm_model", None) is None:
            self.worker = vllm_workers.build_worker(scenario_cfg(scenario), store)
        else:
            name, tp_size = scenario.vllm_model
            self.worker = vllm_workers.model_zoo().build_worker(name, tp_size, store, connector="vllm")
            difference = layout_difference(scenario, self.worker)
            if difference is not None:
                raise RuntimeError(f"scenario {scenario.name} is not vLLM {RELEASE}'s layout of {name} at TP "
                                   f"{tp_size}: {difference}")
        from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.data import BlobBlockHashes

        self._view = BlobBlockHashes

    def lookup(self, token_len: int, blob: bytes, hash_len: int) -> int:
        return self.worker.lookup(token_len, self._view(memoryview(blob), hash_len)).hit_length

    def candidate_keys(self, token_len: int, blob: bytes, hash_len: int) -> list:
        """The keys vLLM's lookup sends (its one ``batch_is_exist``), recorded on a store double."""
        from ..store.recording import RecordingStore

        saved = self.worker.store
        recorder = self.worker.store = RecordingStore()
        try:
            self.worker.lookup(token_len, self._view(memoryview(blob), hash_len))
        finally:
            self.worker.store = saved
        return recorder.calls[-1] if recorder.calls else []
