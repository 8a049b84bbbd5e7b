"""The whole client-side lookup (key building, one ``batch_is_exist`` on a stub store that returns
a precomputed answer, reduction, coordinator), and the keys a lookup sends."""

from mooncake_keys.bench.scenarios import IMPLS, STANDARD, BenchState, _minor_faults, burn_in, grid_scenario, lookup_bench, prime


class LookupGrid(BenchState):
    """Cold, Full(64), 32 B hashes, 75 % of the prefix stored: hashes x namespaces (R)."""

    params = [IMPLS, [256, 2048, 32768], [1, 8, 32]]
    param_names = ["impl", "hashes", "namespaces"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, hashes, r):
        def build():
            b = lookup_bench(impl, grid_scenario(hashes, r))
            burn_in(b, b.impl.lookup)
            return b

        self._enter(("LookupGrid", impl, hashes, r), build)


    def time_lookup(self, impl, hashes, r):
        self.b.impl.lookup(self.req)


class LookupShapes(BenchState):
    """Cold, 2,048 hashes, R = 8: group sets x hash length."""

    params = [IMPLS, ["full", "full+swa", "dsv4"], [16, 32]]
    param_names = ["impl", "groups", "hash_len"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, groups, hash_len):
        def build():
            b = lookup_bench(impl, grid_scenario(2048, 8, groups, hash_len))
            burn_in(b, b.impl.lookup)
            return b

        self._enter(("LookupShapes", impl, groups, hash_len), build)


    def time_lookup(self, impl, groups, hash_len):
        self.b.impl.lookup(self.req)


class StandardScenarios(BenchState):
    """The standard scenarios (docs/benchmarks.md): (a) Full(64), TP4 x PP2, 2,048 hashes; (b) (a) + SWA(64, 4096);
    (c) MLA on TP8, 8,192 hashes. Cold = a never-seen request every lookup; warm = the same
    request again (steady state)."""

    params = [list(STANDARD), ["cold", "warm"], IMPLS]
    param_names = ["scenario", "mode", "impl"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, scenario, mode, impl):
        def build():
            b = lookup_bench(impl, STANDARD[scenario])
            b.extra["hit"] = prime(b, b.impl.lookup)
            if mode == "cold":
                burn_in(b, b.impl.lookup)
            return b

        self._enter(("StandardScenarios", scenario, mode, impl), build, mode)


    def time_lookup(self, scenario, mode, impl):
        self.b.impl.lookup(self.req)

    def track_hit_tokens(self, scenario, mode, impl):
        """The hit length the lookup answers (tokens); equal for every impl."""
        return self.b.extra["hit"]

    track_hit_tokens.unit = "tokens"


class StandardColdFaults(BenchState):
    """Minor page faults per cold lookup on the standard scenarios, after the burn-in (see
    ``scenarios.burn_in``): non-zero when the allocator unmaps and maps arenas on every lookup, a
    state that can persist for the life of the process and slows cold lookups by about 1 us per
    fault. Read it beside ``StandardScenarios.time_lookup``."""

    params = [list(STANDARD), IMPLS]
    param_names = ["scenario", "impl"]
    timeout = 300

    def setup(self, scenario, impl):
        def build():
            b = lookup_bench(impl, STANDARD[scenario])
            prime(b, b.impl.lookup)
            burn_in(b, b.impl.lookup)
            return b

        self._enter(("StandardColdFaults", scenario, impl), build)


    def track_minor_faults_per_lookup(self, scenario, impl):
        total = calls = 0
        for _ in range(20):
            req = self.b.fresh_request()
            self.b.impl.forget_shapes()
            f0 = _minor_faults()
            self.b.impl.lookup(req)
            f1 = _minor_faults()
            if f0 is None:
                raise NotImplementedError("no resource module: minor faults unknown")
            total += f1 - f0
            calls += 1
        return total / calls

    track_minor_faults_per_lookup.unit = "faults"


class KeysPerLookup(BenchState):
    """Keys one lookup sends on the standard scenarios, without and with ``skip_tokens`` = half
    the prompt (chunks the engine holds locally are not asked)."""

    params = [list(STANDARD), ["none", "half"]]
    param_names = ["scenario", "skip_tokens"]

    def setup(self, scenario, skip):
        self._enter(("KeysPerLookup", scenario), lambda: lookup_bench("py", STANDARD[scenario], answer=False), "warm")


    def track_keys_sent(self, scenario, skip):
        req = self.req
        return len(self.b.impl.candidate_keys(req, skip_tokens=req.token_len // 2 if skip == "half" else 0))

    track_keys_sent.unit = "keys"
