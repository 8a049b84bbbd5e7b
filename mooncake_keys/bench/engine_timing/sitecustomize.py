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

It also writes the KV-cache groups the scheduler holds, once it is built, to
``<folder>/groups-<pid>.json`` (per group: its spec's class, block size, sliding window, layers,
and the manager vLLM's coordinator runs for it, with the coordinator's class): whether vLLM's
hybrid KV-cache manager really keeps a model's groups apart.
"""

import importlib.abc
import importlib.util
import json
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


def _write_groups(scheduler):
    coordinator = scheduler.kv_cache_manager.coordinator
    managers = getattr(coordinator, "single_type_managers", ())
    groups = []
    for i, group in enumerate(scheduler.kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        groups.append({"spec": type(spec).__name__, "block_size": spec.block_size,
                       "sliding_window": getattr(spec, "sliding_window", None), "layers": len(group.layer_names),
                       "manager": type(managers[i]).__name__ if i < len(managers) else None,
                       "coordinator": type(coordinator).__name__})
    with open(os.path.join(_OUT, f"groups-{os.getpid()}.json"), "w") as f:
        json.dump(groups, f)


def _count_steps(module):
    cls = module.Scheduler
    inner = cls.schedule
    init = cls.__init__

    def counted(self, *args, **kwargs):
        _step[0] += 1
        return inner(self, *args, **kwargs)

    def built(self, *args, **kwargs):
        init(self, *args, **kwargs)
        try:
            _write_groups(self)
        except Exception as exc:  # noqa: BLE001 - never the engine's failure; the reader sees why
            with open(os.path.join(_OUT, f"groups-{os.getpid()}.json"), "w") as f:
                json.dump({"error": f"{type(exc).__name__}: {exc}"}, f)

    cls.schedule = counted
    cls.__init__ = built


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
