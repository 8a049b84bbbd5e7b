"""End to end against a real ``mooncake_master`` on 127.0.0.1: standard scenario (a) (16,384 keys
per lookup) with 75 % of the prefix stored (``MooncakeLookup``), and scenarios a, b, d by
fraction of the prefix stored, one-shot / rounds / vLLM 0.33 (``MasterHitFraction``).

Skipped (NotImplementedError in ``setup``, reason printed) when ``mooncake`` cannot be imported
or when the master does not start. One master and one client per benchmark process, started on first use and stopped at
exit. Modes: cold = keys built from scratch (the engine as users get it, its key cache and
plan caches cleared before each lookup, as for a request it has never seen); warm = the key
cache holds the request. ``track_client_share`` is the client-side share of a
lookup: (lookup time with the stub store answering the same list) / (lookup time with the real
store), both the minimum of interleaved runs.
"""

import atexit
import ctypes
import sys
import time

from mooncake_keys.bench.scenarios import (DEFAULT_KEY_CACHE_BYTES, STANDARD, BenchState, Bench, build_impl, make_request,
                                           membership_answer, memo, stub_store)

_ENV = {}


def _skip(reason):
    print(f"bench_mooncake skipped: {reason}", file=sys.stderr)
    raise NotImplementedError(reason)


def _classes():
    try:
        import mooncake.store  # noqa: F401
    except Exception as exc:  # ImportError, or a missing system library
        _skip(f"mooncake cannot be imported ({type(exc).__name__}: {exc})")
    from mooncake_keys.store.local_master import LocalMaster
    from mooncake_keys.store.mooncake import MooncakeStore

    return LocalMaster, MooncakeStore


def _stop():
    env = dict(_ENV)
    _ENV.clear()
    store, master = env.get("store"), env.get("master")
    try:
        if store is not None:
            if env.get("buffer_ptr"):
                store.unregister_buffer(env["buffer_ptr"])
            store.close()
    finally:
        if master is not None:
            master.stop()


def _env():
    """The master, a client, and scenario (a)'s request 0 with its stored prefix, started once."""
    if _ENV.get("error"):
        _skip(_ENV["error"])
    if _ENV:
        return _ENV
    master_cls, store_cls = _classes()
    sc = STANDARD["a"]
    req = make_request(sc, 0)
    answer = membership_answer(sc, req)
    try:
        master = master_cls().start()
        _ENV["master"] = master
        atexit.register(_stop)
        store = store_cls.connect(master.master_address, global_segment_size=256 << 20)
        _ENV["store"] = store
        probe = build_impl("py", sc, stub_store(answer), key_cache_bytes=0)
        keys = probe.candidate_keys(req)
        present = [k for k, a in zip(keys, answer) if a == 1]
        buf = ctypes.create_string_buffer(4096)
        ptr = ctypes.addressof(buf)
        if store.register_buffer(ptr, len(buf)) != 0:
            raise RuntimeError("register_buffer failed")
        _ENV.update(buffer=buf, buffer_ptr=ptr)
        rc = store.batch_put_from(present, [ptr] * len(present), [64] * len(present))
        if any(rc):
            raise RuntimeError(f"{sum(1 for x in rc if x)} of {len(present)} puts failed")
        if store.batch_is_exist(keys) != answer:
            raise RuntimeError("the store does not answer what was put")
    except NotImplementedError:
        raise
    except Exception as exc:  # the master did not start, or the client could not connect
        _ENV["error"] = f"mooncake_master / client not usable ({type(exc).__name__}: {exc})"
        _skip(_ENV["error"])
    _ENV.update(scenario=sc, request=req, answer=answer)
    return _ENV


def _forget(runner):
    """Make the next lookup a first sight: plan caches and the engine's key cache cleared."""
    runner.forget_shapes()
    engine = getattr(runner, "engine", None)
    if engine is not None:
        engine.key_cache.clear()


class MooncakeLookup(BenchState):
    params = [["c", "py", "seed"], ["cold", "warm"]]
    param_names = ["impl", "mode"]
    repeat = (3, 25, 10.0)
    timeout = 300

    def setup(self, impl, mode):
        env = _env()

        def build():
            sc, req = env["scenario"], env["request"]
            real = build_impl(impl, sc, env["store"], key_cache_bytes=DEFAULT_KEY_CACHE_BYTES)
            stub = build_impl(impl, sc, stub_store(env["answer"]), key_cache_bytes=DEFAULT_KEY_CACHE_BYTES)
            for _ in range(2):  # warm: the engine keeps a request on its second sight
                hit = real.lookup(req)
                stub_hit = stub.lookup(req)
            if hit != stub_hit:
                raise RuntimeError(f"real store hit {hit} != stub hit {stub_hit}")
            return Bench(sc, real, env["store"], [req], env["answer"], extra={"stub": stub, "hit": hit})

        # Only request 0 is stored, so "cold" repeats it with the engine's caches cleared.
        self._enter(("MooncakeLookup", impl, mode), build, "warm")
        if mode == "cold":
            _forget(self.b.impl)

    def time_lookup(self, impl, mode):
        if mode == "cold":
            _forget(self.b.impl)
        self.b.impl.lookup(self.req)

    def track_client_share(self, impl, mode):
        """Client-side time / total time of one lookup (min of 15 interleaved runs each)."""
        req = self.b.pool[0]
        real, stub = self.b.impl, self.b.extra["stub"]
        best = {"real": float("inf"), "stub": float("inf")}
        for _ in range(15):
            for name, runner in (("stub", stub), ("real", real)):
                if mode == "cold":
                    _forget(runner)
                t0 = time.perf_counter_ns()
                runner.lookup(req)
                best[name] = min(best[name], time.perf_counter_ns() - t0)
        return best["stub"] / best["real"]

    track_client_share.unit = "fraction"


_SESSION = {}


def _session():
    """One master session per benchmark process (see ``mooncake_keys.bench.on_master``)."""
    if _SESSION.get("error"):
        _skip(_SESSION["error"])
    if "session" not in _SESSION:
        _classes()
        from mooncake_keys.bench.on_master import MasterSession

        try:
            _SESSION["session"] = MasterSession().__enter__()
        except Exception as exc:  # the master did not start, or a client could not connect
            _SESSION["error"] = f"mooncake_master / client not usable ({type(exc).__name__}: {exc})"
            _skip(_SESSION["error"])
        atexit.register(_SESSION["session"].close)
    return _SESSION["session"]


class MasterHitFraction:
    """A lookup on a real master by fraction of the prefix stored (docs/benchmarks.md): the
    engine one-shot (vLLM's way of asking), in rounds (the default), and vLLM 0.33's own lookup
    (skipped where vLLM 0.33 is not installed). ``track_keys`` / ``track_calls``: what one lookup
    sends. Engines run without a key cache (each lookup builds its keys)."""

    params = [["a", "b", "d"], [0.0, 0.1, 0.5, 0.9, 1.0], ["oneshot", "rounds", "vllm"]]
    param_names = ["scenario", "stored", "impl"]
    repeat = (3, 15, 10.0)
    timeout = 300

    def setup(self, scenario, stored, impl):
        from mooncake_keys.bench.on_master import available_impls

        if impl not in available_impls():
            _skip("vLLM 0.33 is not installed (bash scripts/dev.sh bench runs in a vLLM 0.33 venv)")
        session = _session()
        self.req = session.stored_request(scenario, stored)
        self.runner = memo(("MasterHitFraction", scenario, impl), lambda: session.runner(impl, scenario))
        self.runner.lookup(self.req)

    def time_lookup(self, scenario, stored, impl):
        self.runner.lookup(self.req)

    def _count(self, attr):
        c = self.runner.counter
        before = getattr(c, attr)
        self.runner.lookup(self.req)
        return getattr(c, attr) - before

    def track_keys(self, scenario, stored, impl):
        return self._count("keys_asked")

    def track_calls(self, scenario, stored, impl):
        return self._count("num_calls")

    track_keys.unit = "keys"
    track_calls.unit = "calls"
