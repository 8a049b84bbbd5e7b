"""Rank reduction: from ``batch_is_exist`` results (R per candidate, 75 % of the prefix present)
to per-candidate presence. c / py: ``_core.reduce_presence``; seed: the ``all()`` over
``res[i*R:(i+1)*R]`` into an exists set; pre: the ``present_count`` dict over one meta per key."""

from mooncake_keys.bench import baselines
from mooncake_keys.lookup._core import get_core
from mooncake_keys.bench.scenarios import IMPLS, grid_scenario, make_request, membership_answer, memo


class Reduce:
    params = [IMPLS, [256, 2048, 32768], [1, 8, 32]]
    param_names = ["impl", "hashes", "namespaces"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, hashes, r):
        def build():
            sc = grid_scenario(hashes, r)
            req = make_request(sc, 0)
            results = membership_answer(sc, req)
            meta = None
            if impl in ("seed", "pre"):
                lk = baselines.make_lookup(sc.model_name, sc.groups, sc.layout, sc.hash_block_size, False, None,
                                           state=impl)
                _, meta = lk._build(sc.token_len, baselines.BlobBlockHashes(req.blob, req.hash_len))
            core = get_core(impl) if impl in ("c", "py") else None
            return results, meta, core, sc.namespaces

        self.results, self.meta, self.core, self.r = memo(("Reduce", impl, hashes, r), build)

    def time_reduce(self, impl, hashes, r):
        if self.core is not None:
            self.core.reduce_presence(self.results, self.r)
        elif impl == "seed":
            baselines.seed_reduce(self.results, self.meta, self.r)
        else:
            baselines.pre_reduce(self.results, self.meta, self.r)
