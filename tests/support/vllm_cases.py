"""Random deployments, stores and requests for the comparisons with vLLM's own lookup.

``random_cfg`` draws a deployment as a plain dict that ``support.vllm_workers.build_worker``
turns into vLLM's real worker; ``engine_for`` turns the same dict into a mooncake_keys
``LookupEngine``, following the mapping documented in docs/architecture.md ("From a vLLM
config"). The mapping reads the dict, never the vLLM worker, except for a store layout: its
namespace string and store TP size are what vLLM resolved (``describe``), and the mapping says
how to express them.

Every draw is for one vLLM release (:class:`Release`: its version and its mooncake_keys
contract): only what that release's connector accepts is drawn, with the options it has
(mixed MLA/GQA groups, extra retained tokens, dropped groups, store layouts, hybrid + DCP,
partial hash hits), and Mamba-align and chunked-local hybrids in every release.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import mooncake_keys as mk
from mooncake_keys.lookup.contract import Contract
from mooncake_keys.vllm.contracts import get_contract

ERROR_CODES = (-900, -704, -1, 2, 0)


@dataclass(frozen=True)
class Release:
    """A vLLM release: its (major, minor) version and the contract of its lookup."""

    version: Tuple[int, int]
    contract: Contract

    @classmethod
    def installed(cls) -> "Release":
        from mooncake_keys.vllm.versions import contract_for, installed_version

        version = installed_version()
        name = contract_for(version)
        assert name is not None, f"vLLM {version} is not a supported release"
        return cls(tuple(int(x) for x in name.split(".")), get_contract(name))  # type: ignore[arg-type]

    # What the release's specs and engine core have (the contract holds the lookup's rules).
    @property
    def extra_retained_tokens(self) -> bool:
        return self.version >= (0, 28)

    @property
    def dcp_sharded_field(self) -> bool:
        return self.version >= (0, 31)

    @property
    def drops_circular_groups(self) -> bool:
        return self.version >= (0, 30)

    @property
    def engine_resolves_hit_alignment(self) -> bool:
        """Partial hash hits come from ``cache_hit_alignment_tokens`` (0.32+), else from the
        store's own rule (0.27-0.31: an align Mamba group whose block is larger than the hash)."""
        return self.version >= (0, 32)

    @property
    def swa_takes_partial_hits(self) -> bool:
        return not self.contract.swa_rejects_partial_hits


def _bs_choices(rng: random.Random, hbs: int) -> int:
    return hbs * rng.choice([1, 1, 2, 4])


def _parallel(rng: random.Random, mla: bool, allow_cp: bool) -> Dict[str, int]:
    tp = rng.choice([1, 1, 2, 2, 4, 8])
    pp = rng.choice([1, 1, 1, 2, 3])
    heads = rng.choice([1, 8, 16] if mla else [h for h in (1, 2, 4, 8, 16) if tp % h == 0 or h % tp == 0])
    pcp = dcp = 1
    mode = rng.random()
    if allow_cp and mode < 0.15 and tp > 1:
        # DCP: vLLM needs tp % dcp == 0, and with GQA tp > heads.
        dcps = [d for d in (2, 4) if tp % d == 0 and (mla or tp > heads)]
        if dcps:
            dcp = rng.choice(dcps)
    elif allow_cp and mode < 0.25:
        pcp = 2
    return dict(tp_size=tp, pp_size=pp, num_kv_heads=heads, pcp_size=pcp, dcp_size=dcp)


def _attention_groups(rng: random.Random, rel: Release, mla: bool, hbs: int, single: bool,
                      dcp: int) -> List[Dict[str, Any]]:
    c = rel.contract
    groups: List[Dict[str, Any]] = []
    for _ in range(1 if single else rng.choice([1, 1, 2, 2, 3])):
        bs = _bs_choices(rng, hbs)
        mla_group = mla if rng.random() < 0.9 else not mla  # MLA and GQA groups in one model
        if rng.random() < 0.6 or not groups and rng.random() < 0.5:
            g: Dict[str, Any] = {"type": "mla" if mla_group else "full", "block_size": bs}
            if not mla_group and rng.random() < 0.05:
                g["type"] = "sink_full"  # full attention by another spec class: never merged
                g["sink_len"] = bs
        else:
            g = {"type": "swa_mla" if mla_group else "swa", "block_size": bs,
                 "sliding_window": rng.randint(1, 4 * bs)}
            if rel.extra_retained_tokens and rng.random() < 0.2:
                g["extra_retained_tokens"] = rng.choice([1, bs // 2 or 1, bs])
            if dcp > 1 and rel.dcp_sharded_field:
                g["spec_kwargs"] = {"dcp_sharded": False}  # vLLM sizes DCP-sharded SWA as an error
        if not mla_group and g["type"] != "sink_full" and rng.random() < 0.15:
            g["head_size"] = 64  # same block size, another spec: not merged
        if c.dropped_groups and groups and rng.random() < 0.1:
            g["enable_kv_transfer"] = False
        groups.append(g)
    if rel.drops_circular_groups and not single and rng.random() < 0.15:
        groups.insert(rng.randrange(len(groups) + 1), {"type": "circular", "block_size": _bs_choices(rng, hbs)})
    return groups


def _mamba_groups(rng: random.Random, rel: Release, bs: int, hbs: int) -> List[Dict[str, Any]]:
    """A Mamba-align hybrid: every group on one block size (vLLM aligns them), full attention
    first, one or two Mamba groups (equal specs: one attention group), maybe a sliding window."""
    groups: List[Dict[str, Any]] = [{"type": "full", "block_size": bs}]
    groups += [{"type": "mamba", "block_size": bs}] * rng.choice([1, 1, 2])
    partial = rel.contract.partial_hash_hits and hbs < bs
    if rng.random() < 0.3 and (not partial or rel.swa_takes_partial_hits):
        groups.append({"type": "swa", "block_size": bs, "sliding_window": rng.randint(1, 4 * bs)})
    if rng.random() < 0.15:
        groups = [g for g in groups if g["type"] == "mamba"][:1]  # a pure Mamba model
    rng.shuffle(groups)
    return groups


def _chunked_groups(rng: random.Random, bs: int) -> List[Dict[str, Any]]:
    """A chunked-local hybrid (Llama 4): full attention beside chunked local attention, one block size."""
    groups: List[Dict[str, Any]] = [
        {"type": "full", "block_size": bs},
        {"type": "chunked_local", "block_size": bs, "attention_chunk_size": bs * rng.choice([2, 3, 4, 8])},
    ]
    rng.shuffle(groups)
    return groups


def random_cfg(rng: random.Random, rel: Release) -> Dict[str, Any]:
    """One random deployment the release is likely to accept (vLLM may still refuse it)."""
    c = rel.contract
    kind = rng.random()
    mla = rng.random() < 0.3 and kind >= 0.25
    par = _parallel(rng, mla, allow_cp=kind >= 0.25)
    hbs = rng.choice([8, 16, 32])
    cfg: Dict[str, Any] = {
        "model": rng.choice(["org/test-model", "deepseek-ai/DeepSeek-V4", "/models/llama/", "Модель-日本"]),
        "use_mla": mla, **par, "reuse_model_config": True,
    }
    if kind < 0.15:
        bs = hbs * rng.choice([1, 2, 4])
        cfg["groups"] = _mamba_groups(rng, rel, bs, hbs)
        if len(cfg["groups"]) > 1:
            cfg["hash_block_size"] = hbs
    elif kind < 0.25:
        cfg["groups"] = _chunked_groups(rng, hbs)
    else:
        single = par["pcp_size"] > 1 or (par["dcp_size"] > 1 and not c.hybrid_dcp)
        cfg["groups"] = _attention_groups(rng, rel, mla, hbs, single, par["dcp_size"])
        if len(cfg["groups"]) > 1 and rng.random() < 0.5:
            cfg["hash_block_size"] = hbs
    groups = cfg["groups"]
    chunked = any(g["type"] == "chunked_local" for g in groups)
    if not chunked and rng.random() < 0.2 and (c.per_group_namespaces or par["pp_size"] == 1):
        cfg["use_eagle"] = True
        for g in groups:
            if rng.random() < 0.3 and g["type"] != "mamba":
                g["is_eagle_group"] = True
    elif not chunked and rng.random() < 0.1:
        attention = [g for g in groups if g["type"] != "mamba"]
        if attention:
            rng.choice(attention)["is_eagle_group"] = True
    if rng.random() < 0.3:
        cfg["cache_prefix"] = rng.choice(["depA", None, 5, "tenant@B"])
    if c.store_namespaces and kind >= 0.25 and rng.random() < 0.15:
        cfg["extra_config"] = {"store_tp_size": rng.choice([par["tp_size"], 2 * par["tp_size"], 3])}
        cfg["kv_cache_layout"] = rng.choice(["LBHNC", "LBNHC", "BLHNC"])
    if rel.engine_resolves_hit_alignment:
        if kind >= 0.25 and rng.random() < 0.15:
            sbs, unit = sizes(cfg, rel)
            if unit < sbs:  # partial hash hits, as vLLM's engine core turns them on: alignment = unit
                cfg["cache_hit_alignment_tokens"] = unit
        elif kind < 0.15 and rng.random() < 0.3:
            cfg["cache_hit_alignment_tokens"] = None  # the engine core left it unset: hits on the block
    return cfg


def model_name(model: str) -> str:
    return mk.model_name_from_path(model)


def _effective_block_size(g: Dict[str, Any], cfg: Dict[str, Any], rel: Release, single: bool) -> int:
    """The block size the store sees. 0.25 scaled a single group by dcp x pcp, 0.26-0.28 by dcp;
    0.29 and 0.30 scale every attention group by dcp (not Mamba); 0.31+ every DCP-sharded spec."""
    bs, dcp = g["block_size"], cfg["dcp_size"]
    if rel.version >= (0, 31):
        sharded = (g.get("spec_kwargs") or {}).get("dcp_sharded", g["type"] != "mamba")
        return bs * dcp if sharded else bs
    if rel.version >= (0, 29):
        return bs * dcp if g["type"] != "mamba" else bs
    if not single:
        return bs
    return bs * dcp * (cfg["pcp_size"] if rel.version < (0, 26) else 1)


def our_groups(cfg: Dict[str, Any], rel: Release) -> List[mk.KVCacheGroup]:
    single = len(cfg["groups"]) == 1
    out = []
    for g in cfg["groups"]:
        bs = _effective_block_size(g, cfg, rel, single)
        mla = g["type"] in ("mla", "swa_mla")
        head = g.get("head_size")
        kind = g["type"]
        if kind in ("swa", "swa_mla"):
            extra = g.get("extra_retained_tokens", 0) if rel.contract.window_adds_extra_retained else 0
            spec: Any = mk.SlidingWindowSpec(bs, g["sliding_window"] + extra, head_size=head, use_mla=mla)
        elif kind == "mamba":
            spec = mk.MambaSpec(bs)
        elif kind == "chunked_local":
            spec = mk.ChunkedLocalAttentionSpec(bs, g["attention_chunk_size"], head_size=head, use_mla=False)
        else:
            spec = mk.FullAttentionSpec(bs, head_size=head, use_mla=mla, variant="sink" if kind == "sink_full" else None)
        cacheable = kind != "circular" and g.get("enable_kv_transfer", True)
        out.append(mk.KVCacheGroup(spec, is_eagle_group=bool(g.get("is_eagle_group")), prefix_cacheable=cacheable))
    return out


def sizes(cfg: Dict[str, Any], rel: Release) -> Tuple[int, int]:
    """(scheduler block size, hash block size) as vLLM resolves them."""
    groups = our_groups(cfg, rel)
    all_bs = [g.spec.block_size for g in groups]
    # The hash unit is the gcd over prefix-cacheable specs; a non-transferred group counts.
    cacheable = [g.spec.block_size for g, d in zip(groups, cfg["groups"]) if d["type"] != "circular"] or all_bs
    sbs = math.lcm(*all_bs)
    if len(groups) == 1:
        return sbs, sbs
    hbs = cfg.get("hash_block_size") or math.gcd(*(cacheable if rel.contract.dropped_groups else all_bs))
    return sbs, hbs


def partial_hash_hits(cfg: Dict[str, Any], rel: Release) -> bool:
    """Whether vLLM turns partial hash hits on for ``cfg``: from the engine core's hit alignment
    (0.32+: set in ``cfg``, or resolved like the engine core: an align Mamba group larger than the
    hash unit, and every other group full attention or of the hash unit's size), else the
    store's own rule (0.27-0.31: an align Mamba group larger than the hash unit)."""
    if not rel.contract.partial_hash_hits:
        return False
    sbs, hbs = sizes(cfg, rel)
    groups = [g for g in cfg["groups"] if g["type"] != "circular" and g.get("enable_kv_transfer", True)]
    mamba = any(g["type"] == "mamba" and g["block_size"] > hbs for g in groups)
    if not rel.engine_resolves_hit_alignment:
        return mamba
    align = cfg.get("cache_hit_alignment_tokens", "auto")
    if align == "auto":
        fine = all(g["type"] in ("full", "mla", "sink_full", "mamba") or g["block_size"] == hbs for g in cfg["groups"])
        return mamba and fine and hbs < sbs
    return isinstance(align, int) and align < sbs


def deployment_kind(cfg: Dict[str, Any], rel: Release) -> str:
    """"mamba", "chunked" or "attention", with "+partial" when partial hash hits are on."""
    types = {g["type"] for g in cfg["groups"]}
    kind = "mamba" if "mamba" in types else "chunked" if "chunked_local" in types else "attention"
    return kind + ("+partial" if partial_hash_hits(cfg, rel) else "")


def engine_for(cfg: Dict[str, Any], rel: Release, store: Any, described: Dict[str, Any],
               **kw: Any) -> mk.LookupEngine:
    """A LookupEngine for the deployment ``cfg`` (see the module docstring)."""
    sbs, hbs = sizes(cfg, rel)
    layout = mk.ParallelLayout(tp_size=cfg["tp_size"], pp_size=cfg["pp_size"], pcp_size=cfg["pcp_size"],
                               dcp_size=cfg["dcp_size"], num_kv_heads=cfg["num_kv_heads"], use_mla=cfg["use_mla"])
    extra: Dict[str, Any] = {}
    if rel.contract.store_namespaces:
        ns = described.get("store_namespace", "")
        if "@store_format:tp_shared_lb" in ns:  # a TP-sharded store layout: the store's TP
            layout = mk.ParallelLayout(tp_size=described["store_tp_size"], pp_size=cfg["pp_size"],
                                       num_kv_heads=cfg["num_kv_heads"])
        extra["store_namespace"] = ns
    if rel.contract.partial_hash_hits:
        extra["partial_hash_hits"] = partial_hash_hits(cfg, rel)
    return mk.LookupEngine(
        model_name(cfg["model"]), our_groups(cfg, rel), layout, hash_block_size=hbs,
        scheduler_block_size=sbs, use_eagle=bool(cfg.get("use_eagle")),
        cache_prefix=str(cfg["cache_prefix"]) if "cache_prefix" in cfg else "",
        store=store, vllm_compat=rel.contract.name, allow_ambiguous_names=True, **extra, **kw,
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
    # Some groups hold only scattered chunks below their cut (as Mamba states are stored).
    sparse = {g for g in cut if rng.random() < 0.25}
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
        if i < cut.get(g, 0) and r >= hole_rate and (g not in sparse or r > 0.7):
            return one
        return 0

    fault = rng.choices([None, ConnectionError("master unreachable"), "short"], [0.94, 0.03, 0.03])[0]
    return mk.RecordingStore(present=answer, fault=fault)


def random_request(rng: random.Random, cfg: Dict[str, Any], rel: Release) -> Tuple[int, List[bytes]]:
    """(num_tokens, hashes): as vLLM's scheduler sends them, hashes cover num_tokens // hbs
    (one request in ten has fewer)."""
    sbs, hbs = sizes(cfg, rel)
    n = rng.choice([0, 1, 2, 3, 5, 8, 13, 24, 40, 64])
    hash_len = rng.choice([32, 32, 16])
    hashes = [rng.randbytes(hash_len) for _ in range(n)]
    tokens = n * hbs + rng.choice([0, 0, 0, 1, hbs - 1])
    if rng.random() < 0.1:  # a caller sending fewer hashes than num_tokens covers
        hashes = hashes[: rng.randrange(len(hashes) + 1)]
    if not rel.contract.aligns_lookup_length:
        tokens -= tokens % sbs  # before 0.27 the scheduler floors to the scheduler block size
    return tokens, hashes
