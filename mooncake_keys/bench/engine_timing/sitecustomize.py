"""Benchmark instrumentation for vLLM's engine processes, loaded by Python's ``site`` when this
folder is on ``PYTHONPATH`` (only the engine benchmark puts it there, with
``MOONCAKE_KEYS_ENGINE_TIMING`` naming an output folder).

It times every ``get_num_new_matched_tokens`` of vLLM's Mooncake store connector class (the
drop-in inherits it): the scheduler's time spent in the connector's lookup per call, in the
engine-core process that runs the scheduler. Each call appends one line (``seconds``) to
``<folder>/matched-<pid>.txt``, outside the timed region: the engine core is killed at shutdown,
so nothing waits for an exit hook.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_OUT = os.environ.get("MOONCAKE_KEYS_ENGINE_TIMING")
_TARGET = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"


def _patch(cls):
    inner = cls.get_num_new_matched_tokens
    path = os.path.join(_OUT, f"matched-{os.getpid()}.txt")

    def timed(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return inner(self, *args, **kwargs)
        finally:
            spent = time.perf_counter() - t0
            with open(path, "a") as f:
                f.write(f"{spent:.9f}\n")

    cls.get_num_new_matched_tokens = timed


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module.MooncakeStoreConnector)

        spec.loader.exec_module = exec_module
        return spec


if _OUT:
    sys.meta_path.insert(0, _Finder())
