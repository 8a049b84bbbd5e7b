"""Benchmark instrumentation for vLLM's engine processes, loaded by Python's ``site`` when this
folder is on ``PYTHONPATH`` (only the engine benchmark puts it there, with
``MOONCAKE_KEYS_ENGINE_TIMING`` naming an output folder).

It times every ``get_num_new_matched_tokens`` of vLLM's Mooncake store connector class (the
drop-in inherits it): the scheduler's time spent in the connector's lookup per call, in the
engine-core process that runs the scheduler, and counts the scheduler's steps (its
``schedule()`` calls) so that calls can be grouped by step. Each call appends one line
(``start step seconds answered request``: wall-clock start, the step it ran in, its duration,
1 if it answered or 0 if its asynchronous lookup was still pending, the request's id) to
``<folder>/matched-<pid>.txt``, outside the timed region: the engine core is killed at
shutdown, so nothing waits for an exit hook.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

_OUT = os.environ.get("MOONCAKE_KEYS_ENGINE_TIMING")
_CONNECTOR = "vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.connector"
_SCHEDULER = "vllm.v1.core.sched.scheduler"
_step = [0]


def _time_lookups(module):
    cls = module.MooncakeStoreConnector
    inner = cls.get_num_new_matched_tokens
    path = os.path.join(_OUT, f"matched-{os.getpid()}.txt")

    def timed(self, request, *args, **kwargs):
        start = time.time()
        t0 = time.perf_counter()
        answer = None
        try:
            answer = inner(self, request, *args, **kwargs)
            return answer
        finally:
            spent = time.perf_counter() - t0
            answered = int(answer is not None and answer[0] is not None)
            with open(path, "a") as f:
                f.write(f"{start:.6f} {_step[0]} {spent:.9f} {answered} {request.request_id}\n")

    cls.get_num_new_matched_tokens = timed


def _count_steps(module):
    cls = module.Scheduler
    inner = cls.schedule

    def counted(self, *args, **kwargs):
        _step[0] += 1
        return inner(self, *args, **kwargs)

    cls.schedule = counted


_PATCHES = {_CONNECTOR: _time_lookups, _SCHEDULER: _count_steps}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.pop(name, None)
        if patch is None:
            return None
        if not _PATCHES:
            sys.meta_path.remove(self)
        # The real spec, found past this finder (it has let go of ``name``).
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _OUT:
    sys.meta_path.insert(0, _Finder())
