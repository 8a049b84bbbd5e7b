"""Random deployments, stores and requests for the comparisons with vLLM's own lookup.

``random_cfg`` draws a deployment as a plain dict that ``mooncake_keys.bench.vllm_workers.build_worker`` turns into
vLLM's real worker; ``engine_for`` turns the same dict into a mooncake_keys ``LookupEngine``,
following the mapping documented in docs/architecture.md ("From a vLLM config"). The mapping
reads the dict, never the vLLM worker, except for a store layout: its namespace string and
store TP size are what vLLM resolved (``describe``), and the mapping says how to express them.
"""

from __future__ import annotations

import math
import random
from typing import Any, Dict, List, Tuple

import mooncake_keys as mk

ERROR_CODES = (-900, -704, -1, 2, 0)


def _bs_choices(rng: random.Random, hbs: int) -> int:
    return hbs * rng.choice([1, 1, 2, 4])


def random_cfg(rng: random.Random, v033: bool) -> Dict[str, Any]:
    """One random deployment vLLM is likely to accept (vLLM may still refuse it)."""
    mla = rng.random() < 0.3
    tp = rng.choice([1, 1, 2, 2, 4, 8])
    pp = rng.choice([1, 1, 1, 2, 3])
    heads = rng.choice([1, 8, 16] if mla else [h for h in (1, 2, 4, 8, 16) if tp % h == 0 or h % tp == 0])
    pcp = dcp = 1
    mode = rng.random()
    if mode < 0.15 and tp > 1:
        # DCP: vLLM needs tp % dcp == 0, and with GQA tp > heads.
        dcps = [d for d in (2, 4) if tp % d == 0 and (mla or tp > heads)]
        if dcps:
            dcp = rng.choice(dcps)
    elif mode < 0.25:
        pcp = 2
    hbs = rng.choice([8, 16, 32])
    single = pcp > 1 or (dcp > 1 and not v033)
    n_groups = 1 if single else rng.choice([1, 1, 2, 2, 3])
    groups: List[Dict[str, Any]] = []
    for _ in range(n_groups):
        bs = _bs_choices(rng, hbs)
        mla_group = mla if not v033 or rng.random() < 0.9 else not mla  # 0.33: MLA and GQA mixed
        if rng.random() < 0.6 or not groups and rng.random() < 0.5:
            g: Dict[str, Any] = {"type": "mla" if mla_group else "full", "block_size": bs}
        else:
            g = {"type": "swa_mla" if mla_group else "swa", "block_size": bs,
                 "sliding_window": rng.randint(1, 4 * bs)}
            if v033 and rng.random() < 0.2:
                g["extra_retained_tokens"] = rng.choice([1, bs // 2 or 1, bs])
            if dcp > 1 and v033:
                g["spec_kwargs"] = {"dcp_sharded": False}  # vLLM sizes DCP-sharded SWA as an error
        if not mla_group and rng.random() < 0.15:
            g["head_size"] = 64  # same block size, another spec: not merged
        if v033 and groups and rng.random() < 0.1:
            g["enable_kv_transfer"] = False
        groups.append(g)
    if v033 and not single and rng.random() < 0.15:
        groups.insert(rng.randrange(len(groups) + 1), {"type": "circular", "block_size": _bs_choices(rng, hbs)})
    cfg: Dict[str, Any] = {
        "model": rng.choice(["org/test-model", "deepseek-ai/DeepSeek-V4", "/models/llama/", "Модель-日本"]),
        "use_mla": mla, "num_kv_heads": heads, "tp_size": tp, "pp_size": pp, "pcp_size": pcp,
        "dcp_size": dcp, "groups": groups, "reuse_model_config": True,
    }
    if n_groups > 1 and rng.random() < 0.5:
        cfg["hash_block_size"] = hbs
    if rng.random() < 0.2 and (v033 or pp == 1):
        cfg["use_eagle"] = True
        for g in groups:
            if rng.random() < 0.3:
                g["is_eagle_group"] = True
    elif rng.random() < 0.1:
        groups[rng.randrange(len(groups))]["is_eagle_group"] = True
    if rng.random() < 0.3:
        cfg["cache_prefix"] = rng.choice(["depA", None, 5, "tenant@B"])
    if v033 and rng.random() < 0.15:
        cfg["extra_config"] = {"store_tp_size": rng.choice([tp, 2 * tp, 3])}
        cfg["kv_cache_layout"] = rng.choice(["LBHNC", "LBNHC", "BLHNC"])
    if v033 and rng.random() < 0.15:
        sbs, unit = sizes(cfg, v033)
        if unit < sbs:  # partial hash hits, as vLLM's engine core turns them on: alignment = unit
            cfg["cache_hit_alignment_tokens"] = unit
    return cfg


def model_name(model: str) -> str:
    return mk.model_name_from_path(model)


def _effective_block_size(g: Dict[str, Any], cfg: Dict[str, Any], v033: bool, single: bool) -> int:
    """The block size the store sees: vLLM 0.33 scales a DCP-sharded spec by dcp; 0.25 scaled a
    single group by dcp x pcp."""
    bs = g["block_size"]
    if v033:
        sharded = (g.get("spec_kwargs") or {}).get("dcp_sharded", True)
        return bs * cfg["dcp_size"] if sharded else bs
    return bs * cfg["dcp_size"] * cfg["pcp_size"] if single else bs


def our_groups(cfg: Dict[str, Any], v033: bool) -> List[mk.KVCacheGroup]:
    single = len(cfg["groups"]) == 1
    out = []
    for g in cfg["groups"]:
        bs = _effective_block_size(g, cfg, v033, single)
        mla = g["type"] in ("mla", "swa_mla")
        head = g.get("head_size")
        if g["type"] in ("swa", "swa_mla"):
            spec: Any = mk.SlidingWindowSpec(bs, g["sliding_window"] + g.get("extra_retained_tokens", 0),
                                             head_size=head, use_mla=mla)
        else:
            spec = mk.FullAttentionSpec(bs, head_size=head, use_mla=mla)
        cacheable = g["type"] != "circular" and g.get("enable_kv_transfer", True)
        out.append(mk.KVCacheGroup(spec, is_eagle_group=bool(g.get("is_eagle_group")), prefix_cacheable=cacheable))
    return out


def sizes(cfg: Dict[str, Any], v033: bool) -> Tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM resolves them."""
    groups = our_groups(cfg, v033)
    all_bs = [g.spec.block_size for g in groups]
    # The hash unit is the gcd over prefix-cacheable specs; a non-transferred group counts.
    cacheable = [g.spec.block_size for g, d in zip(groups, cfg["groups"]) if d["type"] != "circular"] or all_bs
    sbs = math.lcm(*all_bs)
    if len(groups) == 1:
        return sbs, sbs
    hbs = cfg.get("hash_block_size") or math.gcd(*(cacheable if v033 else all_bs))
    return sbs, hbs


def engine_for(cfg: Dict[str, Any], v033: bool, store: Any, described: Dict[str, Any],
               **kw: Any) -> mk.LookupEngine:
    """A LookupEngine for the deployment ``cfg`` (see the module docstring)."""
    sbs, hbs = sizes(cfg, v033)
    layout = mk.ParallelLayout(tp_size=cfg["tp_size"], pp_size=cfg["pp_size"], pcp_size=cfg["pcp_size"],
                               dcp_size=cfg["dcp_size"], num_kv_heads=cfg["num_kv_heads"], use_mla=cfg["use_mla"])
    extra: Dict[str, Any] = {}
    if v033:
        ns = described.get("store_namespace", "")
        if "@store_format:tp_shared_lb" in ns:  # a TP-sharded store layout: the store's TP
            layout = mk.ParallelLayout(tp_size=described["store_tp_size"], pp_size=cfg["pp_size"],
                                       num_kv_heads=cfg["num_kv_heads"])
        extra["store_namespace"] = ns
        align = cfg.get("cache_hit_alignment_tokens")
        extra["partial_hash_hits"] = isinstance(align, int) and align < sbs
    use_eagle = bool(cfg.get("use_eagle"))
    return mk.LookupEngine(
        model_name(cfg["model"]), our_groups(cfg, v033), layout, hash_block_size=hbs,
        scheduler_block_size=sbs, use_eagle=use_eagle,
        cache_prefix=str(cfg["cache_prefix"]) if "cache_prefix" in cfg else "",
        store=store, vllm_compat="0.33" if v033 else "0.25", allow_ambiguous_names=True, **extra, **kw,
    )


def same_answers(store: mk.RecordingStore) -> mk.RecordingStore:
    """A store answering (and failing) as ``store`` does, with no call recorded yet: vLLM's
    worker and our engine each ask their own, and see the very same answers."""
    return mk.RecordingStore(present=store.present, fault=store.fault)


def random_store(rng: random.Random, hashes: List[bytes], cfg: Dict[str, Any]) -> mk.RecordingStore:
    """A store holding a random prefix of the request in every group and namespace, with
    random holes, odd codes, or a fault."""
    index = {h.hex(): i for i, h in enumerate(hashes)}
    cut = {g: rng.randint(0, len(hashes) + 1) for g in range(len(cfg["groups"]))}
    hole_rate = rng.choice([0.0, 0.0, 0.02, 0.1, 0.4])
    code_rate = rng.choice([0.0, 0.0, 0.05])
    one = rng.choice([1, 1, 1, True])
    salt = rng.random()

    def answer(key: str) -> Any:
        head, hx = key.rsplit("@", 1)
        g = int(head.rsplit("@group:", 1)[1])
        i = index.get(hx, len(hashes))
        r = random.Random(f"{salt}:{key}").random()
        if r < code_rate:
            return ERROR_CODES[int(r * 1000) % len(ERROR_CODES)]
        if i < cut.get(g, 0) and r >= hole_rate:
            return one
        return 0

    fault = rng.choices([None, ConnectionError("master unreachable"), "short"], [0.94, 0.03, 0.03])[0]
    return mk.RecordingStore(present=answer, fault=fault)


def random_request(rng: random.Random, cfg: Dict[str, Any], v033: bool) -> Tuple[int, List[bytes]]:
    """(num_tokens, hashes): as vLLM's scheduler sends them, hashes cover num_tokens // hbs
    (one request in ten has fewer)."""
    sbs, hbs = sizes(cfg, v033)
    n = rng.choice([0, 1, 2, 3, 5, 8, 13, 24, 40, 64])
    hash_len = rng.choice([32, 32, 16])
    hashes = [rng.randbytes(hash_len) for _ in range(n)]
    tokens = n * hbs + rng.choice([0, 0, 0, 1, hbs - 1])
    if rng.random() < 0.1:  # a caller sending fewer hashes than num_tokens covers
        hashes = hashes[: rng.randrange(len(hashes) + 1)]
    if not v033:
        tokens -= tokens % sbs  # 0.25's scheduler floors to the scheduler block size
    return tokens, hashes
