"""Shared, seeded data builders for the benchmarks and ``sidebyside``. Only appended, never changed:
a result recorded today must mean the same thing next year, so add a new scenario rather than
editing one.

Vocabulary (sizes in tokens unless said otherwise):

* a *scenario* is a deployment (model, KV-cache groups, rank layout, hash block size) plus a
  request shape (number of hashes, hash length) and the fraction of the prefix that is stored;
* a *request* is one seeded blob of hashes, as vLLM's lookup server receives it (#45969);
* an *impl* is one of ``IMPLS``: ``"c"`` / ``"py"`` = ``mooncake_keys.LookupEngine`` on the
  compiled / pure-Python core, asking one-shot as vLLM does (the stub answers whole key lists), ``"seed"`` / ``"pre"`` = the vLLM re-expressions in ``baselines``,
  ``"vllm"`` = the installed vLLM 0.33's own lookup (``vllm_baseline``; absent without vLLM);
* *cold* = every lookup is a request the engine has never seen: a fresh seeded request, made
  before the timed call (asv re-runs ``setup`` before every sample, and that is where it is
  made), with the engine's per-shape caches (plan, lookup mask) cleared as for a request of a
  new length. A pool of requests cycled would not do: mooncake_keys admits a request into its
  key cache on *second sight*, so a cycled request is a repeat, not a cold one;
* *warm* = the same request again, in steady state (looked up twice before timing, so that the
  key cache holds it).

:func:`stub_store` answers ``batch_is_exist`` with one precomputed list, so that only client-side
work is timed. The list is computed once per scenario by a real set-membership pass over the keys
of a request (the keys of the stored prefix are put in a set, then every key is looked up). The
answer depends only on the position of a key (group, chunk, namespace), never on the hash, so
every request of a scenario gets the same list. ``batch_is_exist`` returns that list object itself,
not a copy: a real client builds a fresh list, but that cost belongs to the store, not to us.

This module imports mooncake_keys but not asv.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import mooncake_keys as mk

from . import baselines
from ..lookup import _core, keycache

__all__ = [
    "IMPLS", "LAYOUTS", "GROUPS", "STANDARD", "FLAGSHIP", "SCENARIOS", "Scenario", "Request", "stub_store", "Impl",
    "build_impl", "grid_scenario", "make_request", "count_keys", "keys_of",
    "membership_answer", "memo", "Bench", "lookup_bench", "prime", "burn_in", "BenchState",
]

IMPLS = ["c", "py", "seed", "pre", "vllm"]
MODEL = "DeepSeek-V4"
#: The engine's default key-cache budget: the benchmarks run the engine as users get it.
DEFAULT_KEY_CACHE_BYTES = keycache.DEFAULT_KEY_CACHE_BYTES

#: Rank layouts by R, the number of namespaces a chunk is looked up in.
LAYOUTS: Dict[int, dict] = {
    1: dict(tp_size=1, pp_size=1, num_kv_heads=8),
    8: dict(tp_size=4, pp_size=2, num_kv_heads=8),
    32: dict(tp_size=8, pp_size=4, num_kv_heads=8),
}

#: KV-cache group sets, each with its hash block size.
GROUPS: Dict[str, Tuple[Callable[[], list], int]] = {
    "full": (lambda: [mk.KVCacheGroup(mk.FullAttentionSpec(64))], 64),
    # need = ceil(4095/64) = 64 >= lcm/bs = 1: the sliding-window group asks every chunk.
    "full+swa": (lambda: [mk.KVCacheGroup(mk.FullAttentionSpec(64)),
                          mk.KVCacheGroup(mk.SlidingWindowSpec(64, 4096))], 64),
    # DeepSeek-V4-like: big full block (4 hashes per chunk, compact view), small SWA block under
    # a lookup mask (need 2 of every 4 chunks).
    "dsv4": (lambda: [mk.KVCacheGroup(mk.FullAttentionSpec(256)),
                      mk.KVCacheGroup(mk.SlidingWindowSpec(64, 128))], 64),
}


@dataclass(frozen=True)
class Scenario:
    """A deployment plus a request shape. ``present`` is the stored fraction of the prefix."""

    name: str
    groups: Tuple[Any, ...]
    layout: Any
    hash_block_size: int
    n_hashes: int
    hash_len: int = 32
    present: float = 0.75
    model_name: str = MODEL
    use_eagle: bool = False
    #: The served model whose layout this is, as ``support.vllm_zoo`` names it, and its TP size:
    #: the ``vllm`` impl builds that deployment's worker with vLLM's own code (and checks that
    #: this scenario is its layout). None: the worker is built from the groups here.
    vllm_model: Optional[Tuple[str, int]] = None
    #: The impls that can run it (``seed`` / ``pre`` re-express vLLM 0.25-era code: no Mamba groups).
    impls: Tuple[str, ...] = tuple(IMPLS)

    @property
    def scheduler_block_size(self) -> int:
        return math.lcm(*(g.spec.block_size for g in self.groups))

    @property
    def token_len(self) -> int:
        """Tokens looked up: every hash, floored to the scheduler block size."""
        sbs = self.scheduler_block_size
        return self.n_hashes * self.hash_block_size // sbs * sbs

    @property
    def present_token_len(self) -> int:
        """Tokens of the stored prefix, floored to the scheduler block size."""
        sbs = self.scheduler_block_size
        return int(self.token_len * self.present) // sbs * sbs

    @property
    def namespaces(self) -> int:
        return len(self.layout.lookup_namespaces())

    def deployment(self, core: Optional[str] = None) -> mk.Deployment:
        """The scenario's deployment (vLLM 0.33's contract, the default), on ``core``."""
        return mk.Deployment(self.model_name, self.groups, self.layout, hash_block_size=self.hash_block_size,
                             use_eagle=self.use_eagle, core=core)


#: The standard scenarios (docs/benchmarks.md); token_len = hashes * 64.
STANDARD: Dict[str, Scenario] = {
    # (a) Full(64), TP 4 x PP 2, 8 KV heads: 8 namespaces; 2,048 hashes of 32 B.
    "a": Scenario("a", tuple(GROUPS["full"][0]()), mk.ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=8),
                  64, 2048),
    # (b) the same with a sliding-window group beside it.
    "b": Scenario("b", tuple(GROUPS["full+swa"][0]()), mk.ParallelLayout(tp_size=4, pp_size=2, num_kv_heads=8),
                  64, 2048),
    # (c) MLA on TP 8: 1 namespace; Full(64); 8,192 hashes.
    "c": Scenario("c", tuple(GROUPS["full"][0]()), mk.ParallelLayout(tp_size=8, num_kv_heads=8, use_mla=True),
                  64, 8192),
    # (d) a short prompt: Full(16) on TP 2, 2 namespaces; 256 hashes of 16 tokens (512 keys).
    "d": Scenario("d", (mk.KVCacheGroup(mk.FullAttentionSpec(16)),), mk.ParallelLayout(tp_size=2, num_kv_heads=2),
                  16, 256),
    # (e) hashes of 16 tokens under a Full(64) group (compact: 4 hashes a chunk) and a SWA(16, 128)
    # group, TP 4 (4 namespaces); 2,048 hashes (10,240 keys).
    "e": Scenario("e", (mk.KVCacheGroup(mk.FullAttentionSpec(64)), mk.KVCacheGroup(mk.SlidingWindowSpec(16, 128))),
                  mk.ParallelLayout(tp_size=4, num_kv_heads=4), 16, 2048),
}


def _mla_swa(bs: int, window: int, head_size: int) -> mk.KVCacheGroup:
    return mk.KVCacheGroup(mk.SlidingWindowSpec(bs, window, head_size=head_size, use_mla=True))


#: The layouts where lookups cost most, as vLLM 0.33's own code lays them out for a CUDA
#: deployment (``tests/support/vllm_zoo.py``; docs/benchmarks.md "The flagship layouts"): the
#: groups, block sizes, windows, hash block and rank layout its planning gives these models at
#: TP 8. The ``vllm`` impl builds the very deployment with vLLM's code and refuses to run where
#: this data is not its layout. 32-byte hashes (vLLM's sha256).
FLAGSHIP: Dict[str, Scenario] = {
    # (f) DeepSeek-V4-Flash, TP 8 (MLA: 1 namespace): the 128-token window of every layer (two
    # groups, SWA(64, 128)), the compressed MLA states (256-token blocks: states of 4 and 128
    # tokens), the ratio-4 compressors' states (SWA(4, 8)) and the ratio-128 ones' (SWA(8, 128));
    # hashes of 4 tokens, scheduler block 256; 16,384 hashes (65,536 tokens).
    "f": Scenario("f", (_mla_swa(64, 128, 512), _mla_swa(64, 128, 512),
                        mk.KVCacheGroup(mk.FullAttentionSpec(256, head_size=512, use_mla=True)),
                        _mla_swa(4, 8, 2048), _mla_swa(8, 128, 1024)),
                  mk.ParallelLayout(tp_size=8, num_kv_heads=1, use_mla=True), 4, 16384,
                  model_name="DeepSeek-V4-Flash", vllm_model=("DeepSeek-V4-Flash", 8), impls=("c", "py", "vllm")),
    # (g) Qwen3-Next-80B, TP 8: three Gated DeltaNet groups (Mamba, align mode: a namespace per
    # TP rank) and full attention (2 KV heads: 2 namespaces), one 192-token block size (vLLM
    # makes the attention page as large as a Mamba state's); 683 hashes (131,136 tokens).
    "g": Scenario("g", (mk.KVCacheGroup(mk.MambaSpec(192)),) * 3
                  + (mk.KVCacheGroup(mk.FullAttentionSpec(192, head_size=256)),),
                  mk.ParallelLayout(tp_size=8, num_kv_heads=2), 192, 683,
                  model_name="Qwen3-Next-80B-A3B-Instruct", vllm_model=("Qwen3-Next-80B", 8), impls=("c", "py", "vllm")),
}
#: Every scenario by name.
SCENARIOS: Dict[str, Scenario] = {**STANDARD, **FLAGSHIP}


def grid_scenario(n_hashes: int, r: int, groups: str = "full", hash_len: int = 32) -> Scenario:
    """A scenario of the size grid: ``r`` namespaces (1, 8, 32), a group set of ``GROUPS``."""
    make, hbs = GROUPS[groups]
    return Scenario(f"grid-{groups}-n{n_hashes}-r{r}-h{hash_len}", tuple(make()),
                    mk.ParallelLayout(**LAYOUTS[r]), hbs, n_hashes, hash_len)


# ------------------------------------------------------------------------------------ requests
@dataclass(frozen=True)
class Request:
    """One request's hashes as one blob (``n`` hashes of ``hash_len`` bytes), and its token_len."""

    blob: bytes
    hash_len: int
    token_len: int

    @property
    def n(self) -> int:
        return len(self.blob) // self.hash_len


def make_request(scenario: Scenario, index: int) -> Request:
    """Request number ``index`` of ``scenario``: seeded random hashes (distinct with certainty)."""
    rng = random.Random(f"mooncake_keys-bench:{scenario.name}:{scenario.hash_len}:{index}")
    return Request(rng.randbytes(scenario.n_hashes * scenario.hash_len), scenario.hash_len, scenario.token_len)


def _baseline(scenario: Scenario, store: Any = None) -> Any:
    return baselines.make_lookup(scenario.model_name, scenario.groups, scenario.layout, scenario.hash_block_size,
                                 scenario.use_eagle, store)


def count_keys(scenario: Scenario) -> int:
    """Keys one lookup of a full request of ``scenario`` sends (without skip_tokens)."""
    masks = _baseline(scenario).coord.lookup_mask(scenario.token_len)
    total = 0
    for grp, mask in zip(scenario.groups, masks):
        scale = grp.spec.block_size // scenario.hash_block_size
        chunks = min(scenario.n_hashes // scale, scenario.token_len // grp.spec.block_size)
        total += chunks if mask is None else sum(mask[:chunks])
    return total * scenario.namespaces


# ------------------------------------------------------------------------------------ store
def keys_of(scenario: Scenario, request: Request, token_len: int) -> List[str]:
    """The keys a lookup of ``token_len`` tokens of ``request`` sends. Built by mooncake_keys
    when it has its compiled core (fast) or the scenario is one the ``seed`` baseline cannot
    express (a flagship layout), else by that baseline (:mod:`.baselines`): the two give the
    very same strings (``check_baselines.py`` checks it on these scenarios and on random ones)."""
    if token_len <= 0:
        return []
    if _core.ACCELERATED or "seed" not in scenario.impls:
        eng = mk.LookupEngine.for_deployment(scenario.deployment(), store=mk.RecordingStore(), key_cache_bytes=0,
                                             spare_key_bytes=0)
        return eng.candidate_keys(token_len, mk.BlockHashes.from_blob(request.blob, request.hash_len))
    return _baseline(scenario).candidate_keys(token_len, baselines.BlobBlockHashes(request.blob, request.hash_len))


def _membership_answer(scenario: Scenario, request: Request) -> List[int]:
    stored = set(keys_of(scenario, request, scenario.present_token_len))
    return [1 if k in stored else 0 for k in keys_of(scenario, request, request.token_len)]


def membership_answer(scenario: Scenario, request: Request, *, isolate: bool = False) -> List[int]:
    """The ``batch_is_exist`` answer for ``request`` when the first ``scenario.present`` of the
    prefix (every group, every namespace) is stored: the keys of that prefix go into a set, then
    every key of the lookup is looked up in it.

    ``isolate=True`` runs the pass in a forked child, so that the keys it builds do not raise
    this process's peak RSS (for ``peakmem_`` benchmarks).
    """
    if not isolate or not hasattr(os, "fork"):
        return _membership_answer(scenario, request)
    import multiprocessing

    with multiprocessing.get_context("fork").Pool(1) as pool:
        return pool.apply(_membership_answer, (scenario, request))


def stub_store(answer: List[int]) -> mk.RecordingStore:
    """A store answering ``answer`` (the very list) to every call, counting calls and keys
    without recording them: only client-side work is timed."""
    return mk.RecordingStore(answer, record_keys=False)


# ------------------------------------------------------------------------------------ impls
class Impl:
    """One implementation bound to one scenario and store, with a uniform call surface.

    ``"c"`` / ``"py"`` are a :class:`mooncake_keys.LookupEngine` pinned to that core.
    """

    def __init__(self, impl: str, scenario: Scenario, store: Any,
                 key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES) -> None:
        if impl not in IMPLS:
            raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
        self.name = impl
        self.scenario = scenario
        self.store = store
        self.vllm = None
        if impl in ("c", "py"):
            # One-shot, as vLLM asks: the stub answers the whole key list (rounds are measured
            # on a real master, in .on_master).
            self.engine = mk.LookupEngine.for_deployment(scenario.deployment(core=impl), store=store,
                                                         key_cache_bytes=key_cache_bytes, strategy="oneshot")
            self.baseline = None
        elif impl == "vllm":
            from .vllm_baseline import VllmLookup

            self.engine = self.baseline = None
            self.vllm = VllmLookup(scenario, store)
        else:
            self.engine = None
            self.baseline = baselines.make_lookup(scenario.model_name, scenario.groups, scenario.layout,
                                                  scenario.hash_block_size, scenario.use_eagle, store, state=impl)

    # -- calls: each wraps the request's blob as its lookup server would (a zero-copy view)
    def lookup(self, req: Request) -> int:
        if self.engine is not None:
            return self.engine.lookup(req.token_len, mk.BlockHashes.from_blob(req.blob, req.hash_len))
        if self.vllm is not None:
            return self.vllm.lookup(req.token_len, req.blob, req.hash_len)
        return self.baseline(req.token_len, baselines.BlobBlockHashes(req.blob, req.hash_len))

    def candidate_keys(self, req: Request, skip_tokens: int = 0) -> List[str]:
        if self.engine is not None:
            return self.engine.candidate_keys(req.token_len, mk.BlockHashes.from_blob(req.blob, req.hash_len),
                                              skip_tokens=skip_tokens)
        if skip_tokens:
            raise NotImplementedError("vLLM's lookup has no skip_tokens")
        if self.vllm is not None:
            return self.vllm.candidate_keys(req.token_len, req.blob, req.hash_len)
        return self.baseline.candidate_keys(req.token_len, baselines.BlobBlockHashes(req.blob, req.hash_len))

    def forget_shapes(self) -> None:
        """Clear the engine's per-shape caches (plan, lookup mask), as for a request of a new length.

        Private attributes of mooncake_keys, reached defensively: absent ones are skipped.
        """
        eng = self.engine
        if eng is None:
            return
        dep = eng.deployment
        for owner, name in ((dep, "plan"), (dep.coordinator, "_lookup_mask")):
            fn = getattr(owner, name, None)
            clear = getattr(fn, "cache_clear", None)
            if clear is not None:
                clear()

    def key_cache_hits(self) -> int:
        """Request hits of the engine's key cache so far (0 for the baselines)."""
        if self.engine is None:
            return 0
        return self.engine.key_cache.stats().request_hits


def build_impl(impl: str, scenario: Scenario, store: Any, key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES) -> Impl:
    return Impl(impl, scenario, store, key_cache_bytes)


# ------------------------------------------------------------------------------------ memo
_MEMO: Dict[str, Any] = {}


def memo(key: Any, build: Callable[[], Any]) -> Any:
    """A one-entry cache: asv re-runs ``setup`` before every sample, and each parameter set runs
    in its own process, so the expensive state of the current parameters is built once."""
    if _MEMO.get("key") != key:
        _MEMO.clear()
        _MEMO["key"] = key
        _MEMO["value"] = build()
    return _MEMO["value"]


@dataclass
class Bench:
    """The state of one parameterised lookup benchmark: scenario, impl, store, the warm request."""

    scenario: Scenario
    impl: Impl
    store: Any
    pool: List[Request]  # pool[0]: the warm request (and the one the stub's answer was made from)
    answer: List[int]
    issued: int = 0  # fresh requests made so far
    extra: Dict[str, Any] = field(default_factory=dict)

    def fresh_request(self) -> Request:
        """A request never made before in this process (request indices 1, 2, ...)."""
        self.issued += 1
        return make_request(self.scenario, self.issued)


def lookup_bench(impl: str, scenario: Scenario, *, isolate: bool = False, answer: bool = True,
                 key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES) -> Bench:
    """Scenario state for ``impl``: engine or baseline on a stub store answering the stored prefix.

    ``answer=False`` skips the store answer (key-building benchmarks: the stub then holds []).
    """
    first = make_request(scenario, 0)
    ans = membership_answer(scenario, first, isolate=isolate) if answer else []
    store = stub_store(ans)
    return Bench(scenario, build_impl(impl, scenario, store, key_cache_bytes), store, [first], ans)


def prime(b: Bench, call: Callable[[Request], Any], times: int = 2) -> Any:
    """Run ``call`` on the warm request ``times`` times (the engine keeps a request on its
    second sight) with the impl's core; return the last result."""
    out = None
    for _ in range(times):
        out = call(b.pool[0])
    return out


def _minor_faults() -> Optional[int]:
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def burn_in(b: Bench, call: Callable[[Request], Any], *, settled_calls: int = 10, max_faults: int = 8,
            max_seconds: float = 0.5) -> int:
    """Run ``call`` on never-seen requests, untimed, until the allocator has settled.

    Cold lookups can pay page faults: CPython's allocator unmaps an arena that a lookup's freed
    keys left empty, and the next lookup maps and touches it again (~250 minor faults per lookup
    of standard scenario (a), about +40 % time; ~500 for (b)). In a young process this goes on
    for some hundreds of lookups, until long-lived objects pin the arenas; in some heap histories
    it never stops. The cold benchmarks run this first, to measure the settled state when there
    is one: until ``settled_calls`` calls in a row took at most ``max_faults`` minor faults
    each, or for ``max_seconds`` (at least one call). Returns the number of calls made.
    ``StandardColdFaults`` reports the faults per lookup that remain.
    """
    import time

    end = time.perf_counter() + max_seconds
    n = quiet = 0
    while True:
        b.impl.forget_shapes()
        req = b.fresh_request()
        f0 = _minor_faults()
        call(req)
        f1 = _minor_faults()
        n += 1
        quiet = quiet + 1 if f0 is None or f1 - f0 <= max_faults else 0
        if quiet >= settled_calls or time.perf_counter() >= end:
            return n


class BenchState:
    """Base of the lookup benchmark classes. ``_enter`` (from ``setup``, which asv re-runs before
    every sample) fetches the memoised :class:`Bench` of the current parameters into ``self.b``
    and picks ``self.req``, the request of the next timed call: for "cold" a fresh one (and the
    engine forgets its per-shape caches), for "warm" the warm one."""

    b: Bench
    req: Request

    def _enter(self, key: Any, build: Callable[[], Bench], mode: str = "cold") -> None:
        self.b = memo(key, build)
        if mode == "cold":
            self.req = self.b.fresh_request()
            self.b.impl.forget_shapes()
        elif mode == "warm":
            self.req = self.b.pool[0]
        else:
            raise ValueError(f"mode must be cold or warm, got {mode!r}")
