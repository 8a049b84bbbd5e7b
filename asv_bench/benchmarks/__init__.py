"""asv benchmarks for mooncake_keys: see ../README.md, and common.py for the vocabulary."""
