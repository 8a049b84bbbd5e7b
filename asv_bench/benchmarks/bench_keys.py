"""Key building: the candidate keys of one lookup (``LookupEngine.candidate_keys`` for c / py,
the baselines' key loops for seed / pre), without the store or the coordinator."""

from mooncake_keys.bench.scenarios import IMPLS, BenchState, burn_in, grid_scenario, lookup_bench, prime


class KeyBuild(BenchState):
    """Cold (a never-seen request every call) over sizes: hashes x namespaces (R); Full(64), 32 B."""

    params = [IMPLS, [256, 2048, 32768], [1, 8, 32]]
    param_names = ["impl", "hashes", "namespaces"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, hashes, r):
        def build():
            b = lookup_bench(impl, grid_scenario(hashes, r), answer=False)
            burn_in(b, b.impl.candidate_keys)
            return b

        self._enter(("KeyBuild", impl, hashes, r), build)


    def time_candidate_keys(self, impl, hashes, r):
        self.b.impl.candidate_keys(self.req)


class KeyBuildShapes(BenchState):
    """Cold, 2,048 hashes, R = 8: group sets (full, full+swa, DSv4-like under a lookup mask) x hash length."""

    params = [IMPLS, ["full", "full+swa", "dsv4"], [16, 32]]
    param_names = ["impl", "groups", "hash_len"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, groups, hash_len):
        def build():
            b = lookup_bench(impl, grid_scenario(2048, 8, groups, hash_len), answer=False)
            burn_in(b, b.impl.candidate_keys)
            return b

        self._enter(("KeyBuildShapes", impl, groups, hash_len), build)


    def time_candidate_keys(self, impl, groups, hash_len):
        self.b.impl.candidate_keys(self.req)


class KeyBuildWarm(BenchState):
    """Warm (the same request again, in steady state), 2,048 hashes, Full(64), 32 B."""

    params = [IMPLS, [1, 8, 32]]
    param_names = ["impl", "namespaces"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, r):
        def build():
            b = lookup_bench(impl, grid_scenario(2048, r), answer=False)
            prime(b, b.impl.candidate_keys)
            return b

        self._enter(("KeyBuildWarm", impl, r), build, "warm")


    def time_candidate_keys(self, impl, r):
        self.b.impl.candidate_keys(self.req)
