"""What the tests share and are not tests themselves: the two cores loaded directly (``cores``), a
plain reference lookup (``reference``), the real-master fixtures (``mooncake_fixtures``), random
deployments for the comparisons with vLLM (``vllm_cases``), vLLM's real workers built on a CPU
machine (``vllm_workers``, also the benchmarks' vLLM columns), code run in a child process
(``child``), and the scripts a test runs as its own process (``rank_worker``,
``failover_driver``). ``tests/conftest.py`` puts ``tests/`` on ``sys.path``, so they are
imported as ``support.<module>``."""
