"""asv benchmarks for mooncake_keys: see ../README.md, and mooncake_keys/bench/scenarios.py for the vocabulary."""
