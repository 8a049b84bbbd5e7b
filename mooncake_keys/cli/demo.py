"""``mooncake_keys demo``: a simulated serving workload through save, lookup and load.

A hybrid model (full attention, 256-token chunks + sliding window of 128 tokens, 64-token
chunks) on TP 4 x PP 2: eight ranks, each with its own small KV-cache tensors and
:class:`~mooncake_keys.kvpool.KVPool`. A few hundred prompts share a dozen system prompts.
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


def run_demo(num_requests: int = 300, seed: int = 0, store: Any = None,
             out: Callable[[str], None] = print) -> Dict[str, Any]:
    """Run the workload on ``store`` (default: :func:`open_store`); return the figures."""
    import torch

    from ..kvpool import KVPool
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
    engine = LookupEngine(MODEL, GROUPS, LAYOUT, hash_block_size=HASH_BLOCK_SIZE, store=timed)
    sched = engine.scheduler_block_size
    max_tokens = max(map(len, prompts))
    ranks = LAYOUT.ranks()
    caches = [[torch.zeros((max_tokens // g.spec.block_size + 1, BLOCK_BYTES), dtype=torch.uint8)
               for g in GROUPS] for _ in ranks]
    pools = [KVPool(MODEL, GROUPS, LAYOUT, rank=r, kv_caches=c, hash_block_size=HASH_BLOCK_SIZE, store=store)
             for r, c in zip(ranks, caches)]
    expected_cache: Dict[Any, torch.Tensor] = {}

    def expected(ns: Any, g: int, h: bytes) -> torch.Tensor:
        key = (ns, g, h)
        t = expected_cache.get(key)
        if t is None:
            d = hashlib.sha256(repr((ns, g)).encode() + h).digest()
            t = torch.frombuffer(bytearray((d * (BLOCK_BYTES // len(d) + 1))[:BLOCK_BYTES]), dtype=torch.uint8)
            expected_cache[key] = t
        return t

    hits: List[int] = []
    prompt_tokens = lookups = lookup_ns = 0
    verified = bad = failed_loads = 0
    t_start = time.perf_counter()
    hashes_of = []
    try:
        for i, tokens in enumerate(prompts):
            num_tokens = len(tokens)
            hashes = block_hashes(tokens)
            hashes_of.append(hashes)
            prompt_tokens += num_tokens
            token_len = num_tokens // sched * sched
            hit = 0
            if token_len >= sched:
                t = time.perf_counter_ns()
                hit = engine.lookup(token_len, hashes)
                lookup_ns += time.perf_counter_ns() - t
                lookups += 1
                if hit == num_tokens:  # vLLM's scheduler keeps one token to compute
                    hit = max(0, (num_tokens - 1) // sched * sched)
            hits.append(hit)
            block_ids = [list(range(token_len // g.spec.block_size)) for g in GROUPS]
            for pool, cache in zip(pools, caches):
                for tensor in cache:
                    tensor.zero_()
                if hit:
                    res = pool.load(hit, hashes, block_ids)
                    if not res.ok:
                        failed_loads += 1
                    for g, statuses in enumerate(res.chunks):
                        scale = GROUPS[g].spec.block_size // HASH_BLOCK_SIZE
                        for st in statuses:
                            if st.ok:
                                h = hashes[st.chunk_id * scale + scale - 1]
                                same = torch.equal(cache[g][st.chunk_id], expected(pool.namespace, g, h))
                                verified += same
                                bad += not same
                # "Prefill": every block of the prompt now holds this rank's KV.
                for g, grp in enumerate(GROUPS):
                    scale = grp.spec.block_size // HASH_BLOCK_SIZE
                    for j in range(token_len // grp.spec.block_size):
                        cache[g][j].copy_(expected(pool.namespace, g, hashes[j * scale + scale - 1]))
                if token_len:
                    pool.save(token_len, hashes, block_ids)
            if (i + 1) % 50 == 0 or i + 1 == len(prompts):
                out(f"  served {i + 1}/{len(prompts)} requests, {sum(hits)} hit tokens so far")
        serve_s = time.perf_counter() - t_start
        # Warm pass: every request looked up again, as a scheduler does while requests wait.
        # The engine keeps a request's keys from its second sight on: one untimed pass first.
        todo = [(len(t) // sched * sched, h) for t, h in zip(prompts, hashes_of) if len(t) >= sched]
        for token_len, hashes in todo:
            engine.lookup(token_len, hashes)
        timed.rpc_ns = 0
        t = time.perf_counter_ns()
        for token_len, hashes in todo:
            engine.lookup(token_len, hashes)
        warm = len(todo)
        warm_ns = time.perf_counter_ns() - t
        warm_rpc_ns = timed.rpc_ns
    finally:
        for pool in pools:
            pool.close()
        if opened is not None:
            opened.close()

    keys_sent = engine.stats().keys_sent
    hit_tokens = sum(hits)
    full = sum(1 for h, p in zip(hits, prompts) if h and h >= (len(p) - 1) // sched * sched)
    summary = {
        "requests": len(prompts), "prompt_tokens": prompt_tokens, "hit_tokens": hit_tokens,
        "requests_with_hit": sum(1 for h in hits if h), "requests_full_hit": full,
        "lookups": lookups, "keys_per_lookup": keys_sent / max(engine.stats().lookups, 1),
        "lookup_us": lookup_ns / max(lookups, 1) / 1e3, "warm_lookup_us": warm_ns / max(warm, 1) / 1e3,
        "warm_client_share": (warm_ns - warm_rpc_ns) / max(warm_ns, 1),
        "blocks_verified": verified, "blocks_wrong": bad, "failed_loads": failed_loads,
        "serve_seconds": serve_s, "accelerated": _core.ACCELERATED,
    }
    out("")
    out(f"requests: {summary['requests']}, prompt tokens: {prompt_tokens}, hit tokens: {hit_tokens} "
        f"({hit_tokens / max(prompt_tokens, 1):.1%} of the prompt tokens)")
    out(f"requests with a hit: {summary['requests_with_hit']}, of which {full} hit their whole aligned prompt")
    qs = sorted(hits)
    out("hit tokens per request: min {} / p25 {} / median {} / p75 {} / max {}".format(
        qs[0], qs[len(qs) // 4], qs[len(qs) // 2], qs[3 * len(qs) // 4], qs[-1]))
    out(f"loads: {verified} blocks loaded and byte-checked on {len(ranks)} ranks, {bad} wrong, "
        f"{failed_loads} failed loads")
    out(f"lookup ({impl}): {summary['keys_per_lookup']:.0f} keys per lookup, "
        f"{summary['lookup_us']:.0f} us per lookup cold ({1e6 / max(summary['lookup_us'], 1e-9):.0f} lookups/s), "
        f"{summary['warm_lookup_us']:.0f} us warm ({1e6 / max(summary['warm_lookup_us'], 1e-9):.0f} lookups/s); "
        f"client-side share of a warm lookup: {summary['warm_client_share']:.1%}")
    return summary
