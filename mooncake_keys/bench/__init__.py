"""Benchmark scenarios and baselines, shared by ``mooncake_keys bench`` and the asv suite.

``scenarios`` (seeded data builders, only appended), ``baselines`` (vLLM's lookup before and at
#46188, re-expressed in plain Python), ``sidebyside`` (every implementation timed in one run)."""
