"""SGLang's own lookup code as the oracle, built on this CPU machine; shared by the tests (rank 0)
and the gloo peer (rank 1, ``gloo_peer.py``).

What is SGLang's own here: ``MooncakeStore`` (its ``__init__``: config, key prefix and suffixes,
warmup put and get; ``batch_exists``, ``batch_exists_v2``, ``_get_hybrid_page_component_keys``,
``_tag_keys``, ``register_mem_host_pool_v2``), the page hash (``get_storage_hash_str`` on a
``RadixKey``, SGLang's native extension), ``PrefetchOperation``, ``PoolTransfer``, and the
controller's ``_storage_hit_query`` / ``_sync_prefetch_hit_query`` / ``_all_reduce``, borrowed
onto :class:`MiniController` (the controller's constructor needs GPU pools and streams).

What stands in (docs/sglang.md): each process sets its Mooncake client up once and every store
shares it (:class:`OracleStore`: a client per store would hold 32 MB each and take 1-2 s to
close); host pools are plain objects with only the attributes the key builders read
(``conv_buffer``, ``temporal_state_elem_size``, ``v_buffer``) and no buffers; the anchor pool is
an object whose ``kv_buffer`` is not None.
"""

from __future__ import annotations

import inspect
import json
import os
import random
from array import array
from dataclasses import asdict, dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (  # noqa: E402
    HybridCacheController,
    PrefetchOperation,
)
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402

from mooncake_keys.sglang.hits import RankResult  # noqa: E402
from mooncake_keys.sglang.keys import RankKeys  # noqa: E402

PAGE_SIZES = (1, 4, 16, 64)


def sglang_batch_exists(store: Any, hashes: List[str]) -> int:
    """SGLang's own ``batch_exists``, whatever hooks the plugin put around it (looked up at each
    call: SGLang's hook registry rebinds module names that hold the original)."""
    return inspect.unwrap(MooncakeStore.batch_exists)(store, hashes)


class MiniController:
    """SGLang's query and rank reduction, without the GPU-bound constructor."""

    _storage_hit_query = HybridCacheController._storage_hit_query
    _sync_prefetch_hit_query = HybridCacheController._sync_prefetch_hit_query
    _all_reduce = HiCacheController._all_reduce

    def __init__(self, backend: Any, page_size: int, groups: Any = ()) -> None:
        self.storage_backend, self.page_size = backend, page_size
        self.prefetch_hits_sync_groups = list(groups)


class _SharedClient:
    """The process's one Mooncake client, handed to every store: set up already."""

    def __init__(self, client: Any) -> None:
        self._client = client

    def setup(self, *args: Any, **kwargs: Any) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


class OracleStore(MooncakeStore):
    """SGLang's own ``MooncakeStore``, whose Mooncake client is the process's shared one."""

    client: Any = None

    def _import_mooncake_store(self) -> Any:
        return lambda: _SharedClient(OracleStore.client)


# ---------------------------------------------------------------------- cases
@dataclass
class Pool:
    name: str  # "mamba" / "swa"
    policy: str  # "all_pages" / "trailing_pages"
    window: int = 1
    conv: int = 1
    temporal: bool = True
    kv_pair: bool = True


@dataclass
class Case:
    """A deployment, a request and a store's holes, reproducible from its fields."""

    seed: int
    mla: bool = False
    tp: int = 1
    pp: int = 1
    cp: int = 1
    dcp: int = 1
    tp_lcm: Optional[int] = None
    page: int = 4
    model: Optional[str] = "org/model"
    tag: Optional[str] = None
    pages: int = 8
    salt: Optional[str] = None
    extra_key: Optional[str] = None
    bigram: bool = False
    pools: List[Pool] = field(default_factory=list)
    #: KV objects: every one below ``kv_cut`` pages stored, the others with ``kv_p``; sidecars
    #: the same with ``pool_cut`` and ``pool_p``.
    kv_cut: int = 0
    kv_p: float = 0.0
    pool_cut: int = 0
    pool_p: float = 0.0

    def ranks(self) -> List[Tuple[int, int, int]]:
        """Every rank (tp, pp, cp) of the deployment."""
        return [(t, p, c) for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "Case":
        d = json.loads(text)
        d["pools"] = [Pool(**p) for p in d["pools"]]
        return cls(**d)


def random_case(rnd: random.Random, *, max_ranks: int = 8, two_ranks: bool = False) -> Case:
    """A random deployment SGLang 0.5.23 accepts, a request, and holes."""
    mla = rnd.random() < 0.45
    if two_ranks:
        tp, pp, cp = rnd.choice([(2, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)])
    else:
        while True:
            tp, pp, cp = rnd.choice([1, 2, 4, 8]), rnd.choice([1, 1, 2, 4]), rnd.choice([1, 1, 1, 2])
            if tp * pp * cp <= max_ranks:
                break
    dcp = 1
    page = rnd.choice(PAGE_SIZES)
    if mla and tp > 1 and rnd.random() < 0.4:
        dcp = rnd.choice([d for d in (2, 4, 8) if tp % d == 0])
        page = rnd.choice([p for p in (8, 16, 64) if p % dcp == 0])
    tp_lcm = tp * rnd.choice([2, 4]) if not mla and rnd.random() < 0.2 else None
    pools: List[Pool] = []
    for _ in range(rnd.choice([0, 0, 1, 1, 2])):  # at most one pool of each name, as a deployment has
        if rnd.random() < 0.5 and not any(p.name == "mamba" for p in pools):
            pools.append(Pool("mamba", "trailing_pages", 1, conv=rnd.randrange(3), temporal=rnd.random() < 0.8))
            if not pools[-1].conv and not pools[-1].temporal:
                pools[-1].conv = 1
        elif not any(p.name == "swa" for p in pools):
            pools.append(Pool("swa", rnd.choice(["trailing_pages", "trailing_pages", "all_pages"]),
                              rnd.randrange(1, 6), kv_pair=True))
    pages = rnd.choice([1, 2, 8, 30, 100, 300]) if rnd.random() < 0.9 else rnd.choice([700, 1500])
    return Case(
        seed=rnd.randrange(2**31), mla=mla, tp=tp, pp=pp, cp=cp, dcp=dcp, tp_lcm=tp_lcm, page=page,
        model=rnd.choice([None, "m", "org/model-x", "meta-llama/Llama-3.1-8B-Instruct", "deepseek-ai/DeepSeek-V3"]),
        tag=rnd.choice([None, None, "prodA", "t_1"]), pages=pages,
        salt=rnd.choice([None, None, "tenantA"]), extra_key=rnd.choice([None, None, "lora-1"]),
        bigram=rnd.random() < 0.15, pools=pools,
        kv_cut=rnd.choice([0, rnd.randrange(pages + 1), pages]), kv_p=rnd.choice([0.0, 0.5, 0.97, 1.0]),
        pool_cut=rnd.choice([0, rnd.randrange(pages + 1), pages]), pool_p=rnd.choice([0.0, 0.3, 0.8, 1.0]),
    )


# ---------------------------------------------------------------------- SGLang's objects
def storage_config(case: Case, rank: Tuple[int, int, int], master: str,
                   accelerated: Optional[dict] = None) -> HiCacheStorageConfig:
    tp_rank, pp_rank, cp_rank = rank
    extra: Dict[str, Any] = {"master_server_address": master, "protocol": "tcp", "metadata_server": "P2PHANDSHAKE",
                             "global_segment_size": (16 << 20) * case.tp * case.pp}
    if case.tag is not None:
        extra["extra_backend_tag"] = case.tag
    if accelerated is not None:
        extra["mooncake_keys"] = accelerated
    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=case.tp, pp_rank=pp_rank, pp_size=case.pp, attn_cp_rank=cp_rank,
        attn_cp_size=case.cp, is_mla_model=case.mla, enable_storage_metrics=False, is_page_first_layout=False,
        model_name=case.model, tp_lcm_size=case.tp_lcm, should_split_heads=case.tp_lcm is not None,
        extra_config=extra, dcp_size=case.dcp, dcp_rank=tp_rank % case.dcp,
        logical_page_size=case.page if case.dcp > 1 else None,
    )


def _host_pool(pool: Pool) -> Any:
    none = lambda: []  # noqa: E731 - no buffers to register
    if pool.name == "mamba":
        return SimpleNamespace(conv_buffer=[None] * pool.conv, temporal_state_elem_size=int(pool.temporal),
                               get_hybrid_pool_buffer=none, page_size=1)
    attrs = dict(v_buffer=None) if pool.kv_pair else {}
    return SimpleNamespace(get_hybrid_pool_buffer=none, page_size=1, **attrs)


def build_store(case: Case, rank: Tuple[int, int, int], master: str, accelerated: Optional[dict] = None,
                ) -> OracleStore:
    """SGLang's own store for ``rank`` of ``case``, its ``_batch_exist`` calls recorded in
    ``store.calls``; ``accelerated``: the ``mooncake_keys`` extra config (None: SGLang's lookup)."""
    store = OracleStore(storage_config(case, rank, master, accelerated), mem_pool=None)
    store.mem_pool_host = SimpleNamespace(kv_buffer=object(), page_size=case.page)
    for pool in case.pools:
        store.register_mem_host_pool_v2(_host_pool(pool), PoolName(pool.name))
    calls: List[List[str]] = []
    inner = store._batch_exist

    def recorded(keys: List[str]) -> List[int]:
        calls.append(list(keys))
        return inner(keys)

    store._batch_exist = recorded
    store.calls = calls
    return store


def tokens(case: Case) -> array:
    rnd = random.Random(case.seed)
    return array("q", [rnd.randrange(1, 150_000) for _ in range(case.pages * case.page + 1)])


def radix_key(case: Case) -> RadixKey:
    toks = tokens(case)
    n = case.pages * case.page
    return RadixKey(toks if case.bigram else toks[:n], extra_key=case.extra_key, is_bigram=case.bigram,
                    cache_salt=case.salt).page_aligned(case.page)


def page_hashes(case: Case) -> List[str]:
    """The request's page hashes, as SGLang's query computes them (its native hash)."""
    return get_storage_hash_str(radix_key(case), None, page_size=case.page)


def transfers(case: Case, hashes: List[str]) -> Optional[List[PoolTransfer]]:
    if not case.pools:
        return None
    out = []
    for pool in case.pools:
        window = pool.window if pool.policy == "trailing_pages" else 1
        out.append(PoolTransfer(name=PoolName(pool.name), keys=(hashes * window)[:window] or ["x"] * window,
                                hit_policy=PoolHitPolicy(pool.policy)))
    return out


def operation(case: Case, hashes: List[str], rid: str = "r") -> PrefetchOperation:
    return PrefetchOperation(CacheRequestHandle(rid, 0), radix_key(case), None,
                             pool_transfers=transfers(case, hashes))


# ---------------------------------------------------------------------- SGLang's keys, stored with holes
def sglang_keys(store: OracleStore, case: Case, hashes: List[str]) -> Tuple[List[str], List[List[str]]]:
    """Every KV key of the span (as SGLang's own batch_exists asks them, recorded on a store that
    holds none of them yet), and every sidecar pool's keys (SGLang's own builders)."""
    before = len(store.calls)
    sglang_batch_exists(store, hashes)
    kv = [k for call in store.calls[before:] for k in call]
    del store.calls[before:]
    pools = []
    for t in transfers(case, hashes) or ():
        keys, _ = store._get_hybrid_page_component_keys(hashes, t)
        pools.append(store._tag_keys(keys))
    return kv, pools


def chosen(keys: List[str], per_page: int, cut: int, p: float, rnd: random.Random) -> List[str]:
    """The keys stored: every object of a page below ``cut``, each other one with ``p``."""
    return [k for i, k in enumerate(keys) if i // per_page < cut or rnd.random() < p]


def result_of(store: OracleStore, case: Case, hashes: List[str]) -> Dict[str, Any]:
    """One rank's query through SGLang's own ``_storage_hit_query``: everything it sets."""
    op = operation(case, hashes)
    before = len(store.calls)
    got, hit = MiniController(store, case.page)._storage_hit_query(op)
    return {
        "hash_value": got, "hit_tokens": hit,
        "kv_hit_pages": op.pool_storage_result.kv_hit_pages,
        "restorable": op.pool_storage_result.restorable_prefix_pages,
        "verdicts": {str(k): v for k, v in op.query_pool_hit_pages.items()},
        "all_hash_values": op.all_hash_values,
        "calls": store.calls[before:],
    }


def rank_result(r: Dict[str, Any]) -> RankResult:
    return RankResult(r["hit_tokens"], r["restorable"], r["verdicts"])


def trailing(case: Case) -> bool:
    return any(p.policy == "trailing_pages" for p in case.pools)


def our_rank_keys(case: Case, rank: Tuple[int, int, int]) -> RankKeys:
    tp_rank, pp_rank, cp_rank = rank
    return RankKeys(case.model, tag=case.tag, tp_rank=tp_rank, tp_size=case.tp, pp_rank=pp_rank, pp_size=case.pp,
                    cp_rank=cp_rank, cp_size=case.cp, dcp_rank=tp_rank % case.dcp, dcp_size=case.dcp,
                    page_size=case.page if case.dcp > 1 else None, mla=case.mla,
                    split=case.tp_lcm // case.tp if case.tp_lcm else 1)


def synced(store: OracleStore, case: Case, hashes: List[str], groups: Any) -> Dict[str, Any]:
    """One rank's query and SGLang's own reduction over ``groups`` (real gloo groups), counting
    the collective calls made."""
    op = operation(case, hashes)
    ctl = MiniController(store, case.page, groups)
    count = [0]
    real = torch.distributed.all_reduce

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    torch.distributed.all_reduce = counted
    try:
        got, hit = ctl._storage_hit_query(op)
        reduced = ctl._sync_prefetch_hit_query(op, hit)
    finally:
        torch.distributed.all_reduce = real
    return {"hit_tokens": reduced, "hash_value": got[: reduced // case.page],
            "verdicts": {str(k): v for k, v in op.query_pool_hit_pages.items()}, "collectives": count[0]}
