"""The workload of ``mooncake_keys demo``: a simulated serving workload through save, lookup and load.

A hybrid model (full attention, 256-token chunks + sliding window of 128 tokens, 64-token
chunks) on TP 4 x PP 2: eight ranks, each with its own small KV-cache tensors and
:class:`~mooncake_keys.kvpool.KVPool`, and one lookup engine, all built from one
:class:`~mooncake_keys.Deployment`. A few hundred prompts share a dozen system prompts.
For each request, as vLLM's connector would: the scheduler looks the prefix up, every rank
loads the hit into zeroed blocks (and the bytes are checked), "computes" the rest, and saves.
"""

from __future__ import annotations

import hashlib
import random
import time
from array import array
from typing import Any, Callable, Dict, List

from ..lookup import _core
from ..lookup.deployment import Deployment
from ..lookup.engine import LookupEngine
from ..lookup.layout import ParallelLayout
from ..lookup.specs import FullAttentionSpec, KVCacheGroup, SlidingWindowSpec

MODEL = "demo-hybrid-8B"
GROUPS = (KVCacheGroup(FullAttentionSpec(256)), KVCacheGroup(SlidingWindowSpec(64, 128)))
LAYOUT = ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=8)
HASH_BLOCK_SIZE = 64  # tokens per request hash (the gcd of the group block sizes)
BLOCK_BYTES = 64  # bytes of one block of one group on one rank: a stand-in for real KV
NONE_HASH = hashlib.sha256(b"PYTHONHASHSEED=0").digest()


def block_hashes(tokens: array, block: int = HASH_BLOCK_SIZE) -> List[bytes]:
    """vLLM-style chained hashes: one per full ``block`` of tokens."""
    out, parent = [], NONE_HASH
    for i in range(len(tokens) // block):
        parent = hashlib.sha256(parent + tokens[i * block:(i + 1) * block].tobytes()).digest()
        out.append(parent)
    return out


def make_workload(num_requests: int, seed: int) -> List[array]:
    """Token ids of ``num_requests`` prompts: a shared system prompt (Zipf-ish), then a tail."""
    rnd = random.Random(seed)
    systems = [array("I", (rnd.randrange(32000) for _ in range(rnd.choice([1024, 2048, 4096, 6144, 8192]))))
               for _ in range(12)]
    weights = [1 / (i + 1) for i in range(len(systems))]
    prompts = []
    for _ in range(num_requests):
        system = rnd.choices(systems, weights)[0]
        tail = array("I", (rnd.randrange(32000) for _ in range(rnd.randint(64, 3000))))
        prompts.append(system + tail)
    return prompts


class _TimedStore:
    """Times ``batch_is_exist`` (the RPC) so the client-side share can be reported."""

    def __init__(self, store: Any) -> None:
        self.store = store
        self.rpc_ns = 0

    def batch_is_exist(self, keys: List[str]) -> List[int]:
        t = time.perf_counter_ns()
        try:
            return self.store.batch_is_exist(keys)
        finally:
            self.rpc_ns += time.perf_counter_ns() - t


class _Ranks:
    """The eight ranks: their KV-cache tensors and KV pools, and the bytes each block must hold."""

    def __init__(self, deployment: Deployment, store: Any, max_tokens: int) -> None:
        import torch

        from ..kvpool import KVPool

        self.torch = torch
        self.caches = [[torch.zeros((max_tokens // g.spec.block_size + 1, BLOCK_BYTES), dtype=torch.uint8)
                        for g in GROUPS] for _ in LAYOUT.ranks()]
        self.pools = [KVPool.for_deployment(deployment, rank=r, kv_caches=c, store=store)
                      for r, c in zip(LAYOUT.ranks(), self.caches)]
        self._expected: Dict[Any, Any] = {}
        self.verified = self.bad = self.failed_loads = 0

    def expected(self, ns: Any, g: int, h: bytes) -> Any:
        """The bytes rank namespace ``ns`` keeps for group ``g``'s block of hash ``h``."""
        key = (ns, g, h)
        t = self._expected.get(key)
        if t is None:
            d = hashlib.sha256(repr((ns, g)).encode() + h).digest()
            t = self.torch.frombuffer(bytearray((d * (BLOCK_BYTES // len(d) + 1))[:BLOCK_BYTES]),
                                      dtype=self.torch.uint8)
            self._expected[key] = t
        return t

    def serve(self, hit: int, token_len: int, hashes: List[bytes]) -> None:
        """Every rank: load the hit into zeroed blocks and check the bytes, "compute" the rest
        of the prompt (``token_len`` tokens), save it."""
        block_ids = [list(range(token_len // g.spec.block_size)) for g in GROUPS]
        for pool, cache in zip(self.pools, self.caches):
            for tensor in cache:
                tensor.zero_()
            if hit:
                res = pool.load(hit, hashes, block_ids)
                self.failed_loads += not res.ok
                for g, statuses in enumerate(res.chunks):
                    scale = GROUPS[g].spec.block_size // HASH_BLOCK_SIZE
                    for st in statuses:
                        if st.ok:
                            want = self.expected(pool.writer_namespace, g, hashes[st.chunk_id * scale + scale - 1])
                            same = self.torch.equal(cache[g][st.chunk_id], want)
                            self.verified += same
                            self.bad += not same
            for g, grp in enumerate(GROUPS):  # "prefill": every block of the prompt holds this rank's KV
                scale = grp.spec.block_size // HASH_BLOCK_SIZE
                for j in range(token_len // grp.spec.block_size):
                    cache[g][j].copy_(self.expected(pool.writer_namespace, g, hashes[j * scale + scale - 1]))
            if token_len:
                pool.save(token_len, hashes, block_ids)

    def close(self) -> None:
        for pool in self.pools:
            pool.close()


def run_demo(num_requests: int = 300, seed: int = 0, store: Any = None,
             out: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run the workload on ``store`` (default: :func:`open_store`); return the figures."""
    from ..store.default import open_store

    opened = None
    if store is None:
        opened = open_store()
        store = opened.store
        out(f"store: {opened.describe()}")
    impl = "compiled (Cython)" if _core.ACCELERATED else "pure Python"
    out(f"model {MODEL}: groups {[type(g.spec).__name__ + str(vars(g.spec)) for g in GROUPS]}, "
        f"TP {LAYOUT.tp_size} x PP {LAYOUT.pp_size}, core: {impl}")
    prompts = make_workload(num_requests, seed)
    timed = _TimedStore(store)
    deployment = Deployment(MODEL, GROUPS, LAYOUT, hash_block_size=HASH_BLOCK_SIZE)
    engine = LookupEngine.for_deployment(deployment, store=timed)
    ranks = None
    try:
        ranks = _Ranks(deployment, store, max(map(len, prompts)))
        figures = _serve(engine, ranks, prompts, out)
        figures.update(_warm_pass(engine, timed, prompts, figures.pop("hashes")))
    finally:
        if ranks is not None:
            ranks.close()
        if opened is not None:
            opened.close()
    return _report(engine, ranks, prompts, figures, impl, out)


def _serve(engine: LookupEngine, ranks: _Ranks, prompts: List[array], out: Callable[[str], None]) -> Dict[str, Any]:
    """Each request as vLLM's connector serves it: look up (``num_tokens``: the whole prompt,
    vLLM 0.33 keeps its last token to compute), load the hit on every rank, save the prompt."""
    sched = engine.scheduler_block_size
    hits: List[int] = []
    hashes_of = []
    lookups = lookup_ns = 0
    t_start = time.perf_counter()
    for i, tokens in enumerate(prompts):
        hashes = block_hashes(tokens)
        hashes_of.append(hashes)
        hit = 0
        if len(tokens) >= sched:
            t = time.perf_counter_ns()
            hit = engine.lookup(len(tokens), hashes)
            lookup_ns += time.perf_counter_ns() - t
            lookups += 1
        hits.append(hit)
        ranks.serve(hit, len(tokens) // sched * sched, hashes)
        if (i + 1) % 50 == 0 or i + 1 == len(prompts):
            out(f"  served {i + 1}/{len(prompts)} requests, {sum(hits)} hit tokens so far")
    return {"hits": hits, "hashes": hashes_of, "lookups": lookups, "lookup_ns": lookup_ns,
            "serve_seconds": time.perf_counter() - t_start}


def _warm_pass(engine: LookupEngine, timed: _TimedStore, prompts: List[array],
               hashes_of: List[List[bytes]]) -> Dict[str, Any]:
    """Every request looked up again, as a scheduler does while requests wait. The engine keeps
    a request's keys from its second sight on: one untimed pass first."""
    todo = [(len(t), h) for t, h in zip(prompts, hashes_of) if len(t) >= engine.scheduler_block_size]
    for num_tokens, hashes in todo:
        engine.lookup(num_tokens, hashes)
    timed.rpc_ns = 0
    t = time.perf_counter_ns()
    for num_tokens, hashes in todo:
        engine.lookup(num_tokens, hashes)
    return {"warm": len(todo), "warm_ns": time.perf_counter_ns() - t, "warm_rpc_ns": timed.rpc_ns}


def _report(engine: LookupEngine, ranks: _Ranks, prompts: List[array], f: Dict[str, Any], impl: str,
            out: Callable[[str], None]) -> Dict[str, Any]:
    sched = engine.scheduler_block_size
    hits = f["hits"]
    stats = engine.stats()
    prompt_tokens = sum(map(len, prompts))
    hit_tokens = sum(hits)
    full = sum(1 for h, p in zip(hits, prompts) if h and h >= (len(p) - 1) // sched * sched)
    summary = {
        "requests": len(prompts), "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
        "requests_with_hit": sum(1 for h in hits if h), "requests_full_hit": full,
        "lookups": f["lookups"], "keys_per_lookup": stats.keys_sent / max(stats.lookups, 1),
        "calls_per_lookup": stats.store_calls / max(stats.lookups, 1),
        "lookup_us": f["lookup_ns"] / max(f["lookups"], 1) / 1e3,
        "warm_lookup_us": f["warm_ns"] / max(f["warm"], 1) / 1e3,
        "warm_client_share": (f["warm_ns"] - f["warm_rpc_ns"]) / max(f["warm_ns"], 1),
        "blocks_verified": ranks.verified, "blocks_wrong": ranks.bad, "failed_loads": ranks.failed_loads,
        "serve_seconds": f["serve_seconds"], "accelerated": _core.ACCELERATED,
    }
    out("")
    out(f"requests: {summary['requests']}, prompt tokens: {prompt_tokens}, hit tokens: {hit_tokens} "
        f"({hit_tokens / max(prompt_tokens, 1):.1%} of the prompt tokens)")
    out(f"requests with a hit: {summary['requests_with_hit']}, of which {full} hit their whole aligned prompt")
    qs = sorted(hits)
    out("hit tokens per request: min {} / p25 {} / median {} / p75 {} / max {}".format(
        qs[0], qs[len(qs) // 4], qs[len(qs) // 2], qs[3 * len(qs) // 4], qs[-1]))
    out(f"loads: {ranks.verified} blocks loaded and byte-checked on {len(ranks.pools)} ranks, {ranks.bad} wrong, "
        f"{ranks.failed_loads} failed loads")
    out(f"lookup ({impl}, strategy {engine.strategy}): {summary['keys_per_lookup']:.0f} keys in "
        f"{summary['calls_per_lookup']:.2f} calls per lookup, "
        f"{summary['lookup_us']:.0f} us per lookup cold ({1e6 / max(summary['lookup_us'], 1e-9):.0f} lookups/s), "
        f"{summary['warm_lookup_us']:.0f} us warm ({1e6 / max(summary['warm_lookup_us'], 1e-9):.0f} lookups/s); "
        f"client-side share of a warm lookup: {summary['warm_client_share']:.1%}")
    return summary
