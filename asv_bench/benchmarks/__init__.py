"""asv benchmarks for mooncake_keys: see ../README.md, and mooncake_keys/bench/scenarios.py for the vocabulary.

The ``vllm`` implementation's workers are built by the checkout's test harness
(``support.vllm_workers``, tests/support/vllm_workers.py), not by the installed package: this
suite always runs from a checkout, so its ``tests/`` goes on ``sys.path`` (after what is there).
"""

import os
import sys

TESTS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tests")
if TESTS not in sys.path:
    sys.path.append(TESTS)
