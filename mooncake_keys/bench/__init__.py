"""What the commands run and the benchmarks measure, shared by ``mooncake_keys {demo,bench}``, the
asv suite and the tests.

``scenarios`` (seeded data builders, only appended), ``baselines`` (vLLM's lookup before and at
#46188, re-expressed in plain Python), ``vllm_baseline`` (vLLM 0.33's own lookup, where it is
installed and a checkout's worker harness ``support.vllm_workers`` is on the path: the installed
package carries no test harness), ``sidebyside`` (every implementation timed in one run),
``on_master`` (lookups on a real ``mooncake_master`` by hit fraction), ``in_scheduler`` (the
in-scheduler lookup against the ZMQ round trip), ``burst`` (a burst of requests sharing a system
prompt, in vLLM's scheduler), ``engine``/``engine_run`` (vLLM's real CPU engine with a real
master, in a child process), ``serve``/``vllm_bench_serve`` (``vllm serve`` instances and vLLM's own
``vllm bench serve``; ``serve_bench`` and ``serve_demo`` run them), ``table`` (the text tables they print), ``suite`` (the whole ``mooncake_keys bench`` run: the side-by-side table,
the sweep, the scaling, the plots) and ``demo`` (the serving workload of ``mooncake_keys
demo``)."""
