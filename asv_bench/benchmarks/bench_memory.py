"""Memory of a 1M-key lookup: R = 8 (TP4 x PP2), 131,072 hashes of 32 B, Full(64), 75 % stored.

``peakmem_lookup_1M`` is the process's peak RSS after one cold lookup (asv's peakmem: setup
included, so compare it with ``KeyStrings1M.peakmem_setup_only``, the same setup without a
lookup); ``track_tracemalloc_peak`` is the peak of Python allocations *during* the lookup alone;
``KeyStrings1M.track_key_string_bytes`` is the sum of ``sys.getsizeof`` over the 1,048,576 keys.
The stub's answer is computed in a forked child so that its key strings do not count here.
"""

import sys
import tracemalloc

from mooncake_keys.bench.scenarios import IMPLS, BenchState, grid_scenario, keys_of, lookup_bench, make_request

HASHES_1M = 131072
R_1M = 8


def scenario_1m():
    return grid_scenario(HASHES_1M, R_1M)


class PeakMem1M(BenchState):
    params = [IMPLS]
    param_names = ["impl"]
    timeout = 600

    def setup(self, impl):
        self._enter(("PeakMem1M", impl), lambda: lookup_bench(impl, scenario_1m(), isolate=True))


    def peakmem_lookup_1M(self, impl):
        self.b.impl.lookup(self.req)

    def track_tracemalloc_peak(self, impl):
        req = self.req
        tracemalloc.start()
        try:
            self.b.impl.lookup(req)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    track_tracemalloc_peak.unit = "bytes"


class KeyStrings1M(BenchState):
    timeout = 600

    def setup(self):
        self._enter(("KeyStrings1M",), lambda: lookup_bench("py", scenario_1m(), isolate=True))


    def peakmem_setup_only(self):
        """The RSS floor of the PeakMem1M setup (hashes, stub answer, engine), without a lookup."""

    def track_key_string_bytes(self):
        keys = keys_of(self.b.scenario, make_request(self.b.scenario, 0), self.b.scenario.token_len)
        return sum(map(sys.getsizeof, keys))

    track_key_string_bytes.unit = "bytes"
