"""vLLM's real workers built on a CPU machine, for the tests and the benchmarks.

It builds vLLM's real ``MooncakeStoreWorker`` (and the scheduler-role connector) on a machine
without a GPU, so that tests/against_vllm/ and the benchmarks' vLLM columns
(``mooncake_keys.bench.vllm_baseline``, ``in_scheduler``, ``burst``) compare mooncake_keys with
vLLM's own lookup (it calls vLLM, copies none of it). It is a test harness, kept with the tests
as vLLM keeps its own (``tests/v1/kv_connector/unit/utils.py``), not in the installed package:
imported as ``support.vllm_workers`` with ``tests/`` on ``sys.path`` (``tests/conftest.py``,
``scripts/dev.sh bench`` and ``asv_bench/benchmarks`` put it there).

Importing this module imports vLLM and torch, nothing more. The first build prepares the
process once (:func:`_prepare_process`: a few environment defaults, below, and a private temp
dir).

The worker is constructed by vLLM's own code path (``KVConnectorFactory`` ->
``MooncakeStoreConnector.__init__`` -> ``MooncakeStoreWorker.__init__``, or the
worker constructor directly) from real vLLM config objects (``ModelConfig``,
``CacheConfig``, ``ParallelConfig``, ``KVTransferConfig``, ``SpeculativeConfig``,
``VllmConfig``, ``KVCacheConfig`` / ``KVCacheGroupSpec`` / the real spec classes).
Only three things are replaced, and only while the worker is being built:

PATCHES (all reverted when ``build_worker`` returns):

1. ``vllm.distributed.parallel_state._TP`` / ``_PCP`` / ``_DCP`` are set to
   ``_RankGroup`` objects (``rank_in_group`` + ``world_size``, the only two
   attributes the worker reads through ``get_tensor_model_parallel_rank()``,
   ``get_tensor_model_parallel_world_size()``, ``get_pcp_group()`` and
   ``get_dcp_group()``).  Why: the real groups need ``torch.distributed`` process
   groups with one process per rank.
2. ``mooncake.store.MooncakeDistributedStore`` is replaced by
   ``_PlaceholderMooncakeClient`` (its ``setup(...)`` returns 0 and records its
   arguments).  Why: the real client connects to a Mooncake master.  After the
   constructor returns, ``worker.store`` is set to the caller's ``store`` object,
   so every ``batch_is_exist`` of ``worker.lookup`` goes to the caller's store.
   ``ReplicateConfig`` stays the real one when the ``mooncake`` package is
   importable; if it is not, a minimal stand-in module is put in ``sys.modules``.
3. ``LookupKeyServer`` in vLLM's ``store/worker.py`` module is replaced by
   ``_NoLookupServer`` unless ``cfg["lookup_server"]`` is true.  Why: the real one
   binds a ZMQ REP socket and starts a thread on every rank-0 build.  With
   ``lookup_server=True`` the real server is built (on an IPC path under
   ``VLLM_RPC_BASE_PATH``) so that a scheduler-role connector can call it.

NOT patched: the platform.  ``VllmConfig`` gets ``DeviceConfig(device="cpu")``
(an ordinary config value), so vLLM's platform stays the ``UnspecifiedPlatform``
it detects on this machine and no platform hook rewrites the configs (vLLM's
``CpuPlatform`` would, e.g. MLA -> block_size 16).

Environment (set by the first build, ``os.environ.setdefault`` only, so a caller can override):
``VLLM_HOST_IP=127.0.0.1`` (``get_ip()`` returns it instead of probing the
network), ``HF_HUB_OFFLINE=1`` / ``TRANSFORMERS_OFFLINE=1``, ``VLLM_CACHE_ROOT``
(one per vLLM version, see below), ``VLLM_RPC_BASE_PATH`` (a private temp dir).
``MOONCAKE_CONFIG_PATH`` points, while a worker is built, to a JSON file the
first build writes (vLLM parses it; the placeholder client never connects).

Models: a small HF ``config.json`` (no weights) is written under a private temp
dir whose last path component is the model name asked for, so
``ModelConfig.model`` ends with that name and ``get_total_num_kv_heads()`` /
``use_mla`` come from vLLM reading that config.  GQA models use
``LlamaForCausalLM``; ``use_mla`` models use ``DeepseekV3ForCausalLM``.  EAGLE
uses a real ``SpeculativeConfig`` (``method="eagle"`` with a generated
``EagleLlamaForCausalLM`` draft dir, or ``"mtp"`` for MLA models).

Engine-core steps redone here with vLLM's own functions, because a real
worker gets them from the engine core: ``cache_config.block_size`` is set to the
block size the worker sees (default: the smallest prefix-cacheable group block
size, as ``EngineCore`` sets it; before 0.30 the smallest of all groups); from
0.32 ``KVCacheConfig.hash_block_size`` / ``cache_hit_alignment_tokens`` come
from ``resolve_kv_cache_block_sizes`` / ``resolve_cache_hit_alignment_tokens``,
asked of the scheduler's copy of the config as the engine core asks them
(:func:`resolve_engine_core_sizes`); from 0.29 the KV cache layout is adopted
with ``record_kv_cache_layout``.  The KV-cache groups are given by the caller
(the engine's layer-grouping step is not run here; ``support.vllm_zoo``, reached
through :func:`model_zoo`, runs it, from real architectures' layers, and builds
workers with :func:`worker_from_configs`). The module's switches
(``PREFIX_MATCH_UNIT``, ``KV_CACHE_LAYOUT``, ``HIT_ALIGNMENT``, ...) name the
first release of each step.

cfg keys (all optional; see ``_DEFAULTS``): ``model``, ``num_kv_heads`` (model
total), ``num_attention_heads``, ``head_size``, ``use_mla``, ``num_layers``,
``hf_overrides``; ``tp_size``/``tp_rank``, ``pp_size``/``pp_rank``,
``pcp_size``/``pcp_rank``, ``dcp_size``/``dcp_rank``, ``rank``,
``dp_size``/``dp_rank``; ``block_size`` (the worker's cache block size),
``hash_block_size`` (vLLM's ``prefix_match_unit``, 0.25's ``hash_block_size``;
None lets vLLM resolve), ``enable_prefix_caching``; ``groups`` (list of dicts,
see ``_make_spec``); ``use_eagle``, ``spec_method``, ``num_speculative_tokens``,
``disable_eagle_block_drop`` (0.30+); ``cache_prefix`` (put in the extra config
only when present: None -> "None"), ``kv_role``, ``extra_config`` (any
``kv_connector_extra_config`` entries), ``kv_connector_module_path``;
0.29+: ``kv_cache_layout``, ``prefix_cache_retention_interval``; 0.32+:
``cache_hit_alignment_tokens`` ("auto" = resolved like the engine core);
this module's own: ``num_blocks``, ``via`` ("connector" | "worker"), ``validate``,
``lookup_server``, ``reuse_model_config``.

Works with every vLLM release from 0.25 to 0.33 (``vllm.__version__`` decides).
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import threading
import time
import types
from typing import Any

# Mooncake reads its log level once, when ``mooncake.store`` is first imported, and vLLM's
# connector modules may import it before any store of ours: keep its INFO lines out of the
# benchmarks' and the tests' output (a value you set wins).
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch
import vllm
import vllm.distributed.parallel_state as _ps
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import (
    KVConnectorFactory,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
    connector as _connector_mod,
)
from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store import (
    worker as _worker_mod,
)
from vllm.v1 import kv_cache_interface as _kvi
from vllm.v1.core import kv_cache_utils as _kvu

VLLM_VERSION: str = vllm.__version__
VERSION_TUPLE: tuple[int, int] = tuple(int(x) for x in re.findall(r"\d+", VLLM_VERSION)[:2])  # type: ignore[assignment]
if not (0, 25) <= VERSION_TUPLE <= (0, 33):
    logging.getLogger(__name__).warning(
        "support.vllm_workers supports vLLM 0.25 to 0.33; found %s",
        VLLM_VERSION,
    )
# What the engine core does before it builds a worker changed between releases; each switch is
# the first release that does it (the builders redo those steps as that release does).
#: ``CacheConfig(prefix_match_unit=...)`` (0.25: ``hash_block_size``); DCP groups take
#: consecutive (tp, pcp) pairs, pcp fastest (0.25: consecutive world ranks).
PREFIX_MATCH_UNIT = VERSION_TUPLE >= (0, 26)
#: The KV-cache layout is recorded, ``KVCacheConfig`` carries it and the retention interval,
#: ``CacheConfig(prefix_cache_retention_interval=...)``; groups may skip transfer.
KV_CACHE_LAYOUT = VERSION_TUPLE >= (0, 29)
#: ``KVCacheConfig.hash_block_size`` / ``cache_hit_alignment_tokens``, resolved by the engine core.
HIT_ALIGNMENT = VERSION_TUPLE >= (0, 32)
#: The default worker block size is the smallest prefix-cacheable group's (0.29 and before: any group's).
CACHEABLE_BLOCK_SIZE = VERSION_TUPLE >= (0, 30)

MooncakeStoreWorker = _worker_mod.MooncakeStoreWorker
MooncakeStoreConnector = _connector_mod.MooncakeStoreConnector

_build_lock = threading.RLock()
_prepare_lock = threading.Lock()
_workdir: str | None = None


def _prepare_process() -> str:
    """Once per process, before the first build (idempotent): the environment defaults vLLM
    reads while it builds (see the module docstring; ``setdefault`` only) and a private temp
    dir for the model configs, the Mooncake JSON and the RPC sockets, removed at exit.
    Returns that dir."""
    global _workdir
    with _prepare_lock:
        if _workdir is None:
            os.environ.setdefault("VLLM_HOST_IP", "127.0.0.1")
            # vLLM caches model-class inspection under VLLM_CACHE_ROOT/modelinfos, one file per
            # class whatever the vLLM version: two versions sharing ~/.cache/vllm keep
            # invalidating each other (~8 s per architecture per process). One root per version:
            os.environ.setdefault(
                "VLLM_CACHE_ROOT", os.path.expanduser(f"~/.cache/mooncake_keys/vllm-cache-{VLLM_VERSION}")
            )
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
            # huggingface_hub read HF_HUB_OFFLINE when vLLM imported it; vLLM reads the result
            # from huggingface_hub.constants at each call, so that is where the default must go.
            import huggingface_hub.constants as hf_constants

            if os.environ["HF_HUB_OFFLINE"].upper() in ("1", "ON", "YES", "TRUE"):
                hf_constants.HF_HUB_OFFLINE = True
            workdir = tempfile.mkdtemp(prefix="mooncake_keys_vllm_workers_")
            atexit.register(shutil.rmtree, workdir, ignore_errors=True)
            os.environ.setdefault("VLLM_RPC_BASE_PATH", os.path.join(workdir, "rpc"))
            os.makedirs(os.environ["VLLM_RPC_BASE_PATH"], exist_ok=True)
            _workdir = workdir
        return _workdir


class ConfigRejected(ValueError):
    """vLLM itself refused the configuration (config validation, connector
    validation or the worker constructor).  ``stage`` says where."""

    def __init__(self, stage: str, error: BaseException):
        super().__init__(f"[{stage}] {type(error).__name__}: {error}")
        self.stage = stage
        self.error = error


# ---------------------------------------------------------------------------
# Stand-ins (the only replaced parts)
# ---------------------------------------------------------------------------


class _RankGroup:
    """Stand-in for a ``GroupCoordinator``: the worker reads only these two."""

    def __init__(self, rank_in_group: int, world_size: int):
        self.rank_in_group = rank_in_group
        self.world_size = world_size

    def __repr__(self) -> str:
        return f"_RankGroup(rank_in_group={self.rank_in_group}, world_size={self.world_size})"


class _PlaceholderMooncakeClient:
    """Replaces ``MooncakeDistributedStore`` during the constructor only."""

    def __init__(self) -> None:
        self.setup_args: tuple | None = None
        self.setup_kwargs: dict | None = None

    def setup(self, *args: Any, **kwargs: Any) -> int:
        self.setup_args, self.setup_kwargs = args, kwargs
        return 0

    def close(self) -> None:
        pass


class _NoLookupServer:
    """Replaces ``LookupKeyServer`` (no ZMQ socket, no thread)."""

    def __init__(self, store_worker: Any, vllm_config: Any) -> None:
        self.store_worker = store_worker

    def close(self) -> None:
        pass


# ---------------------------------------------------------------------------
# cfg normalisation
# ---------------------------------------------------------------------------

_DEFAULTS: dict[str, Any] = {
    "model": "test-model",
    "num_kv_heads": 8,
    "num_attention_heads": None,
    "head_size": 128,
    "use_mla": False,
    "num_layers": None,
    "hf_overrides": None,
    "tp_size": 1,
    "tp_rank": 0,
    "pp_size": 1,
    "pp_rank": 0,
    "pcp_size": 1,
    "pcp_rank": 0,
    "dcp_size": 1,
    "dcp_rank": None,
    "rank": None,
    "dp_size": 1,
    "dp_rank": 0,
    "block_size": None,
    "hash_block_size": None,
    "enable_prefix_caching": True,
    "groups": None,
    "use_eagle": False,
    "spec_method": None,
    "num_speculative_tokens": 1,
    "disable_eagle_block_drop": None,
    "kv_role": "kv_both",
    "kv_connector": "MooncakeStoreConnector",
    "extra_config": None,
    "kv_connector_module_path": None,
    "kv_cache_layout": "LBNHC",
    "prefix_cache_retention_interval": None,
    "cache_hit_alignment_tokens": "auto",
    "num_blocks": 1024,
    "via": "connector",
    "validate": True,
    "lookup_server": False,
    "reuse_model_config": False,
}
_CFG_KEYS = set(_DEFAULTS) | {"cache_prefix"}


def _normalize(cfg: dict) -> dict:
    unknown = set(cfg) - _CFG_KEYS
    if unknown:
        raise KeyError(f"unknown cfg keys: {sorted(unknown)}")
    c = {**_DEFAULTS, **cfg}
    if c["groups"] is None:
        c["groups"] = [{"type": "mla" if c["use_mla"] else "full"}]
    c["groups"] = [dict(g) for g in c["groups"]]
    return c


def rank_layout(cfg: dict) -> dict[str, int]:
    """Ranks of the worker being built, laid out as vLLM's
    ``initialize_model_parallel`` does: world ranks reshape to
    ``(dp, pp, pcp, tp)`` (tp fastest), so within one engine
    ``rank = (pp_rank * pcp_size + pcp_rank) * tp_size + tp_rank``.
    DCP groups: 0.25 takes consecutive world ranks (``rank % dcp``); 0.33 takes
    consecutive ``(tp, pcp)`` pairs with pcp fastest
    (``(tp_rank * pcp_size + pcp_rank) % dcp``).  ``cfg["rank"]`` /
    ``cfg["dcp_rank"]`` override the derived values."""
    c = {**_DEFAULTS, **cfg}
    tp, pcp, dcp = c["tp_size"], c["pcp_size"], c["dcp_size"]
    tp_rank, pp_rank, pcp_rank = c["tp_rank"], c["pp_rank"], c["pcp_rank"]
    rank = c["rank"]
    if rank is None:
        rank = (pp_rank * pcp + pcp_rank) * tp + tp_rank
    dcp_rank = c["dcp_rank"]
    if dcp_rank is None:
        dcp_rank = ((tp_rank * pcp + pcp_rank) if PREFIX_MATCH_UNIT else rank) % dcp
    return {
        "rank": rank,
        "tp_rank": tp_rank,
        "pp_rank": pp_rank,
        "pcp_rank": pcp_rank,
        "dcp_rank": dcp_rank,
    }


# ---------------------------------------------------------------------------
# Model directories (HF config.json only) and ModelConfig / SpeculativeConfig
# ---------------------------------------------------------------------------


def _hf_config(c: dict) -> dict:
    kv = int(c["num_kv_heads"])
    tp = int(c["tp_size"])
    n_heads = c["num_attention_heads"]
    if n_heads is None:
        n_heads = math.lcm(kv, tp, 8)
    layers = c["num_layers"] or max(4, 2 * c["pp_size"])
    if c["use_mla"]:
        hf = {
            "architectures": ["DeepseekV3ForCausalLM"],
            "model_type": "deepseek_v3",
            "hidden_size": 512,
            "intermediate_size": 1024,
            "moe_intermediate_size": 256,
            "n_routed_experts": 8,
            "n_shared_experts": 1,
            "num_experts_per_tok": 2,
            "first_k_dense_replace": 1,
            "num_attention_heads": n_heads,
            "num_key_value_heads": kv,
            "kv_lora_rank": 512,
            "q_lora_rank": 1536,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "num_nextn_predict_layers": 1,
        }
    else:
        hf = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 512,
            "intermediate_size": 1024,
            "num_attention_heads": n_heads,
            "num_key_value_heads": kv,
            "head_dim": int(c["head_size"]),
        }
    hf.update(
        num_hidden_layers=layers,
        vocab_size=1024,
        max_position_embeddings=1 << 17,
        torch_dtype="bfloat16",
        rms_norm_eps=1e-6,
    )
    hf.update(c["hf_overrides"] or {})
    return hf


def model_dir(model: str, hf: dict, kind: str = "target") -> str:
    """``<workdir>/models/<digest>/<model path>``: the last component of the
    returned path is the last component of ``model``; a trailing ``/`` is kept."""
    parts = [p for p in model.split("/") if p]
    if not parts or any(p in (".", "..") for p in parts):
        raise ValueError(f"model name {model!r} cannot be laid out as a directory")
    blob = json.dumps(hf, sort_keys=True)
    digest = hashlib.sha1((kind + blob).encode()).hexdigest()[:12]
    path = os.path.join(_prepare_process(), "models", digest, *parts)
    cfg_file = os.path.join(path, "config.json")
    if not os.path.exists(cfg_file):
        os.makedirs(path, exist_ok=True)
        with open(cfg_file + ".tmp", "w") as f:
            f.write(blob)
        os.replace(cfg_file + ".tmp", cfg_file)
    return path + ("/" if model.endswith("/") else "")


def _draft_dir(c: dict, method: str) -> str:
    arch = "Eagle3LlamaForCausalLM" if method == "eagle3" else "EagleLlamaForCausalLM"
    hf = {
        "architectures": [arch],
        "model_type": "llama",
        "hidden_size": 512,
        "intermediate_size": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "num_hidden_layers": 1,
        "vocab_size": 1024,
        "max_position_embeddings": 1 << 17,
        "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-6,
    }
    return model_dir(f"draft/{method}-draft", hf, kind="draft")


_MODEL_CONFIGS: dict[str, ModelConfig] = {}


def _model_config(c: dict) -> ModelConfig:
    """A fresh ``ModelConfig`` (~70% of a build's time: HF config parsing), or,
    with ``cfg["reuse_model_config"]``, a shallow copy of one built earlier for
    the same config.json (the worker reads only ``model``,
    ``get_num_layers(parallel_config)`` and ``get_total_num_kv_heads()``)."""
    path = model_dir(c["model"], _hf_config(c))
    if not c["reuse_model_config"]:
        return ModelConfig(model=path, skip_tokenizer_init=True, max_model_len=8192)
    cached = _MODEL_CONFIGS.get(path)
    if cached is None:
        cached = _MODEL_CONFIGS[path] = ModelConfig(
            model=path, skip_tokenizer_init=True, max_model_len=8192
        )
    return copy.copy(cached)


def _speculative_config(
    c: dict, model_config: ModelConfig, parallel_config: ParallelConfig
) -> SpeculativeConfig | None:
    if not c["use_eagle"]:
        return None
    method = c["spec_method"] or ("mtp" if c["use_mla"] else "eagle")
    kwargs: dict[str, Any] = dict(
        method=method,
        num_speculative_tokens=c["num_speculative_tokens"],
        target_model_config=model_config,
        target_parallel_config=parallel_config,
    )
    if method in ("eagle", "eagle3"):
        kwargs["model"] = _draft_dir(c, method)
    if c["disable_eagle_block_drop"] is not None:
        kwargs["disable_eagle_block_drop"] = c["disable_eagle_block_drop"]
    return SpeculativeConfig(**kwargs)


# ---------------------------------------------------------------------------
# KV cache groups
# ---------------------------------------------------------------------------

_SPEC_CLASSES = {
    "full": "FullAttentionSpec",
    "swa": "SlidingWindowSpec",
    "mla": "MLAAttentionSpec",
    "swa_mla": "SlidingWindowMLASpec",
    "mamba": "MambaSpec",
    "chunked_local": "ChunkedLocalAttentionSpec",
    "sink_full": "SinkFullAttentionSpec",
    "cross": "CrossAttentionSpec",
    "encoder_only": "EncoderOnlyAttentionSpec",
    "circular": "CircularBufferSpec",  # 0.33: prefix_cacheable = False
}
_GROUP_KEYS = {
    "type", "block_size", "sliding_window", "attention_chunk_size", "sink_len",
    "num_kv_heads", "head_size", "dtype", "is_eagle_group", "enable_kv_transfer",
    "extra_retained_tokens", "bounded_replay", "mamba_cache_mode", "spec_kwargs",
    "layer_names", "specs", "spec", "group_kwargs",
}


def _make_spec(g: dict, c: dict, default_bs: int) -> Any:  # long: one branch per spec type, the doc is the reference
    """A real vLLM ``KVCacheSpec`` from a group dict.

    ``type``: full | swa | mla | swa_mla | mamba | chunked_local | sink_full |
    cross | encoder_only | circular (0.33) | uniform (``specs``: list of inner
    group dicts -> ``UniformTypeKVCacheSpecs``); or ``spec``: a ready spec
    object.  Fields: ``block_size`` (default cfg ``block_size`` or 16),
    ``sliding_window`` (swa/swa_mla; on full it records a window),
    ``attention_chunk_size``, ``sink_len``, ``num_kv_heads`` (per rank; default
    1 for MLA, else max(1, num_kv_heads // tp)), ``head_size`` (MLA default
    576), ``dtype``, ``mamba_cache_mode`` (default "align"),
    ``extra_retained_tokens`` / ``bounded_replay`` (0.33), ``spec_kwargs``
    (any other spec field, e.g. ``dcp_sharded``).  Group-level:
    ``is_eagle_group``, ``enable_kv_transfer`` (0.33), ``layer_names``,
    ``group_kwargs`` (other ``KVCacheGroupSpec`` fields)."""
    unknown = set(g) - _GROUP_KEYS
    if unknown:
        raise KeyError(f"unknown group keys: {sorted(unknown)}")
    if "spec" in g:
        return g["spec"]
    kind = g.get("type", "full")
    bs = int(g.get("block_size", default_bs))
    if kind == "uniform":
        inner = {
            f"uniform.layers.{i}": _make_spec({**sub, "block_size": bs}, c, bs)
            for i, sub in enumerate(g["specs"])
        }
        return _kvi.UniformTypeKVCacheSpecs(block_size=bs, kv_cache_specs=inner)
    if kind not in _SPEC_CLASSES:
        raise ValueError(f"unknown group type {kind!r}; known: {sorted(_SPEC_CLASSES)}")
    cls = getattr(_kvi, _SPEC_CLASSES[kind], None)
    if cls is None:
        raise ValueError(f"group type {kind!r} does not exist in vLLM {VLLM_VERSION}")
    kw: dict[str, Any] = {"block_size": bs}
    if kind == "mamba":
        kw.update(
            shapes=((16, 4), (8, 16)),
            dtypes=(torch.bfloat16, torch.float32),
            mamba_cache_mode=g.get("mamba_cache_mode", "align"),
        )
    else:
        mla = kind in ("mla", "swa_mla")
        tp = c["tp_size"]
        kw.update(
            num_kv_heads=int(g.get("num_kv_heads", 1 if mla else max(1, c["num_kv_heads"] // tp))),
            head_size=int(g.get("head_size", 576 if mla else c["head_size"])),
            dtype=g.get("dtype", torch.bfloat16),
        )
        if kind in ("swa", "swa_mla"):
            kw["sliding_window"] = int(g["sliding_window"])
        elif g.get("sliding_window") is not None:  # full attention that records a window
            kw["sliding_window"] = int(g["sliding_window"])
        if kind == "chunked_local":
            kw["attention_chunk_size"] = int(g["attention_chunk_size"])
        if kind == "sink_full":
            kw["sink_len"] = g.get("sink_len")
        for opt in ("extra_retained_tokens", "bounded_replay"):
            if opt in g:
                kw[opt] = g[opt]
    kw.update(g.get("spec_kwargs") or {})
    try:
        return cls(**kw)
    except TypeError as e:  # a field this vLLM version does not have
        raise ValueError(f"cannot build {cls.__name__} in vLLM {VLLM_VERSION}: {e}") from e


def _kv_cache_groups(c: dict) -> list:
    default_bs = c["block_size"] or 16
    groups = []
    for i, g in enumerate(c["groups"]):
        spec = _make_spec(g, c, default_bs)
        layer_names = g.get("layer_names")
        if layer_names is None:
            if isinstance(spec, _kvi.UniformTypeKVCacheSpecs):
                layer_names = list(spec.kv_cache_specs)
            else:
                layer_names = [f"model.layers.{i}.attn"]
        gkw: dict[str, Any] = {"is_eagle_group": bool(g.get("is_eagle_group", False))}
        if "enable_kv_transfer" in g:
            gkw["enable_kv_transfer"] = g["enable_kv_transfer"]
        gkw.update(g.get("group_kwargs") or {})
        try:
            groups.append(_kvi.KVCacheGroupSpec(layer_names, spec, **gkw))
        except TypeError as e:
            raise ValueError(f"cannot build KVCacheGroupSpec in vLLM {VLLM_VERSION}: {e}") from e
    return groups


def _prefix_cacheable(spec: Any) -> bool:
    return bool(getattr(spec, "prefix_cacheable", True))


# ---------------------------------------------------------------------------
# VllmConfig + KVCacheConfig
# ---------------------------------------------------------------------------


def build_configs(cfg: dict) -> tuple[VllmConfig, Any]:
    """Return ``(vllm_config, kv_cache_config)`` as a rank's worker would see
    them.  Raises ``ConfigRejected`` when vLLM's config validation refuses."""
    _prepare_process()
    c = _normalize(cfg)
    ranks = rank_layout(c)
    groups = _kv_cache_groups(c)
    cacheable = [g.kv_cache_spec.block_size for g in groups
                 if _prefix_cacheable(g.kv_cache_spec) or not CACHEABLE_BLOCK_SIZE]
    worker_block_size = c["block_size"] or min(cacheable or [g.kv_cache_spec.block_size for g in groups])

    extra = dict(c["extra_config"] or {})
    if "cache_prefix" in c:
        extra["cache_prefix"] = c["cache_prefix"]
    try:
        model_config = _model_config(c)
        parallel_config = ParallelConfig(
            tensor_parallel_size=c["tp_size"],
            pipeline_parallel_size=c["pp_size"],
            prefill_context_parallel_size=c["pcp_size"],
            decode_context_parallel_size=c["dcp_size"],
            data_parallel_size=c["dp_size"],
            data_parallel_rank=c["dp_rank"],
            rank=ranks["rank"],
        )
        cache_kwargs: dict[str, Any] = dict(
            block_size=worker_block_size,
            enable_prefix_caching=c["enable_prefix_caching"],
        )
        if c["hash_block_size"] is not None:
            cache_kwargs["prefix_match_unit" if PREFIX_MATCH_UNIT else "hash_block_size"] = c["hash_block_size"]
        if KV_CACHE_LAYOUT and c["prefix_cache_retention_interval"] is not None:
            cache_kwargs["prefix_cache_retention_interval"] = c["prefix_cache_retention_interval"]
        cache_config = CacheConfig(**cache_kwargs)
        kv_kwargs: dict[str, Any] = dict(
            kv_connector=c["kv_connector"],
            kv_role=c["kv_role"],
            kv_connector_extra_config=extra,
        )
        if c["kv_connector_module_path"] is not None:
            kv_kwargs["kv_connector_module_path"] = c["kv_connector_module_path"]
        kv_transfer_config = KVTransferConfig(**kv_kwargs)
        speculative_config = _speculative_config(c, model_config, parallel_config)
        vllm_config = VllmConfig(
            model_config=model_config,
            cache_config=cache_config,
            parallel_config=parallel_config,
            kv_transfer_config=kv_transfer_config,
            speculative_config=speculative_config,
            device_config=DeviceConfig(device="cpu"),
        )
    except ConfigRejected:
        raise
    except Exception as e:  # pydantic ValidationError, ValueError, AssertionError...
        raise ConfigRejected("VllmConfig", e) from e

    vllm_config.cache_config.block_size = worker_block_size
    return vllm_config, _kv_cache_config(c, vllm_config, groups)


def _kv_cache_config(c: dict, vllm_config: VllmConfig, groups: list) -> Any:
    """What the engine core / worker do after KV-cache planning (see module doc)."""
    kv_kwargs2: dict[str, Any] = dict(num_blocks=c["num_blocks"], kv_cache_tensors=[], kv_cache_groups=groups)
    if KV_CACHE_LAYOUT:
        from vllm.v1.attention.backends.utils import record_kv_cache_layout

        if c["kv_cache_layout"] is not None:
            record_kv_cache_layout(vllm_config.cache_config, c["kv_cache_layout"])
        kv_kwargs2.update(
            prefix_cache_retention_interval=vllm_config.cache_config.prefix_cache_retention_interval,
            kv_cache_layout=vllm_config.cache_config.kv_cache_layout,
        )
    kv_cache_config = _kvi.KVCacheConfig(**kv_kwargs2)
    if HIT_ALIGNMENT:
        resolve_engine_core_sizes(vllm_config, [kv_cache_config], c["cache_hit_alignment_tokens"])
    return kv_cache_config


def resolve_engine_core_sizes(vllm_config: VllmConfig, kv_cache_configs: list, align: Any = "auto") -> Any:
    """What vLLM's engine core (0.32+) resolves once the workers' KV-cache configs are planned
    (0.33: ``vllm/v1/engine/core.py`` 333-365): the hash block size and the hit alignment are
    resolved on the *scheduler's* copy of the configs (``generate_scheduler_kv_cache_config``:
    uniform-type groups unwrapped to their first layer spec), then set on every worker's config
    and the scheduler's. Resolved on a worker's config instead, a deployment whose groups are
    ``UniformTypeKVCacheSpecs`` (DeepSeek-V4: every group) is refused although vLLM serves it.
    ``align``: ``"auto"`` (as the engine core), or a value set as it is (None: left unset).
    Returns the scheduler's config."""
    sched = _kvu.generate_scheduler_kv_cache_config(kv_cache_configs)
    try:
        sched_bs, hash_bs = _kvu.resolve_kv_cache_block_sizes(sched, vllm_config)
        if align == "auto":
            align = _kvu.resolve_cache_hit_alignment_tokens(sched, vllm_config, sched_bs, hash_bs)
    except Exception as e:
        raise ConfigRejected("resolve_kv_cache_block_sizes", e) from e
    for kv_cache_config in (*kv_cache_configs, sched):
        kv_cache_config.hash_block_size = hash_bs
        kv_cache_config.cache_hit_alignment_tokens = align
    vllm_config.cache_config.hash_block_size = hash_bs
    vllm_config.cache_config.cache_hit_alignment_tokens = align
    return sched


# ---------------------------------------------------------------------------
# Building the worker
# ---------------------------------------------------------------------------


def _mooncake_store_module() -> tuple[types.ModuleType, dict[str, types.ModuleType]]:
    """The real ``mooncake.store`` module, or a stand-in to put in sys.modules."""
    try:
        import mooncake.store as ms  # type: ignore

        return ms, {}
    except ImportError:
        ms = types.ModuleType("mooncake.store")

        class ReplicateConfig:  # minimal stand-in (only when mooncake is absent)
            preferred_segment = None

        ms.ReplicateConfig = ReplicateConfig  # type: ignore[attr-defined]
        ms.MooncakeDistributedStore = _PlaceholderMooncakeClient  # type: ignore[attr-defined]
        pkg = types.ModuleType("mooncake")
        pkg.store = ms  # type: ignore[attr-defined]
        return ms, {"mooncake": pkg, "mooncake.store": ms}


_MOONCAKE_JSON = {
    "metadata_server": "P2PHANDSHAKE",
    "master_server_address": "127.0.0.1:50051",
    "protocol": "tcp",
    "device_name": "",
    "global_segment_size": 1 << 20,
    "local_buffer_size": 1 << 20,
}


@contextlib.contextmanager
def parallel_groups(tp_size: int = 1, tp_rank: int = 0, pcp_size: int = 1, pcp_rank: int = 0,
                    dcp_size: int = 1, dcp_rank: int = 0):
    """vLLM's TP, PCP and DCP groups stood in (patch 1 of the module docstring) while the body
    runs: what a rank's layers and worker read of them (the rank and the size)."""
    with _build_lock:
        saved = (_ps._TP, _ps._PCP, _ps._DCP)
        try:
            _ps._TP = _RankGroup(tp_rank, tp_size)
            _ps._PCP = _RankGroup(pcp_rank, pcp_size)
            _ps._DCP = _RankGroup(dcp_rank, dcp_size)
            yield
        finally:
            _ps._TP, _ps._PCP, _ps._DCP = saved


@contextlib.contextmanager
def _worker_environment(c: dict, ranks: dict[str, int]):
    cfg_path = os.path.join(_prepare_process(), "mooncake.json")
    if not os.path.exists(cfg_path):
        with open(cfg_path, "w") as f:
            json.dump(_MOONCAKE_JSON, f)
    ms, fake_modules = _mooncake_store_module()
    saved_mods = {k: sys.modules.get(k) for k in fake_modules}
    saved_client = getattr(ms, "MooncakeDistributedStore", None)
    saved_server = _worker_mod.LookupKeyServer
    saved_env = os.environ.get("MOONCAKE_CONFIG_PATH")
    with _build_lock, parallel_groups(c["tp_size"], ranks["tp_rank"], c["pcp_size"], ranks["pcp_rank"],
                                      c["dcp_size"], ranks["dcp_rank"]):
        try:
            sys.modules.update(fake_modules)
            ms.MooncakeDistributedStore = _PlaceholderMooncakeClient
            if not c["lookup_server"]:
                _worker_mod.LookupKeyServer = _NoLookupServer
            os.environ["MOONCAKE_CONFIG_PATH"] = cfg_path
            yield
        finally:
            ms.MooncakeDistributedStore = saved_client
            _worker_mod.LookupKeyServer = saved_server
            if saved_env is None:
                os.environ.pop("MOONCAKE_CONFIG_PATH", None)
            else:
                os.environ["MOONCAKE_CONFIG_PATH"] = saved_env
            for k, v in saved_mods.items():
                if v is None:
                    sys.modules.pop(k, None)
                else:
                    sys.modules[k] = v


def build_worker(cfg: dict, store: Any) -> Any:
    """Build vLLM's real ``MooncakeStoreWorker`` for ``cfg`` and attach ``store``.

    ``cfg["via"]``: ``"connector"`` (default) goes through
    ``KVConnectorFactory.create_connector(vllm_config, KVConnectorRole.WORKER,
    kv_cache_config)`` exactly as ``ensure_kv_transfer_initialized`` does, and
    returns ``connector.connector_worker`` (the connector is kept alive as
    ``worker._built_connector``: its ``__del__`` closes the worker).
    ``"worker"`` calls ``MooncakeStoreWorker(vllm_config, kv_cache_config)``
    directly, after ``MooncakeStoreConnector._validate_kv_cache_config`` unless
    ``cfg["validate"]`` is false.

    Raises ``ConfigRejected`` when vLLM refuses the configuration.
    """
    c = _normalize(cfg)
    vllm_config, kv_cache_config = build_configs(c)
    return worker_from_configs(c, vllm_config, kv_cache_config, store)


def worker_from_configs(cfg: dict, vllm_config: Any, kv_cache_config: Any, store: Any) -> Any:
    """``build_worker`` on configs built elsewhere (``support.vllm_zoo``: a real architecture's
    layout planned by vLLM's own code). ``cfg`` gives the rank (``tp_rank``, ...) and the
    module's own switches (``via``, ``validate``, ``lookup_server``); its sizes must be those
    of ``vllm_config``."""
    c = _normalize(cfg)
    ranks = rank_layout(c)
    with _worker_environment(c, ranks):
        if c["via"] == "connector":
            try:
                connector = KVConnectorFactory.create_connector(
                    vllm_config, KVConnectorRole.WORKER, kv_cache_config
                )
            except Exception as e:
                raise ConfigRejected("MooncakeStoreConnector(WORKER)", e) from e
            worker = connector.connector_worker
            worker._built_connector = connector
        elif c["via"] == "worker":
            if c["validate"]:
                try:
                    MooncakeStoreConnector._validate_kv_cache_config(vllm_config, kv_cache_config)
                except Exception as e:
                    raise ConfigRejected("_validate_kv_cache_config", e) from e
            try:
                worker = MooncakeStoreWorker(vllm_config, kv_cache_config)
            except Exception as e:
                raise ConfigRejected("MooncakeStoreWorker", e) from e
        else:
            raise ValueError(f"cfg['via'] must be 'connector' or 'worker', not {c['via']!r}")
    worker._placeholder_client = worker.store
    worker.store = store
    worker._built_cfg = c
    worker._built_vllm_config = vllm_config
    worker._built_kv_cache_config = kv_cache_config
    return worker


def build_scheduler_connector(cfg: dict) -> Any:
    """Build a scheduler-role ``MooncakeStoreConnector`` the way the engine core
    does: ``KVConnectorFactory.create_connector(vllm_config,
    KVConnectorRole.SCHEDULER, kv_cache_config)`` with ``kv_cache_config =
    generate_scheduler_kv_cache_config([worker kv_cache_config])`` (vLLM's own
    function: a deep copy with ``UniformTypeKVCacheSpecs`` unwrapped to their
    first layer spec).  The config is built for global rank 0 (the engine core's
    ``parallel_config.rank`` is 0).

    Its ``LookupKeyClient`` connects (lazily, ZMQ) to the IPC path
    ``get_zmq_rpc_path_lookup(vllm_config)``; a worker built from the same cfg
    with ``lookup_server=True`` (and, if several coexist, the same
    ``extra_config["lookup_rpc_port"]``) answers it.  No rank patches are
    needed: the scheduler role reads no process group.  Close it with
    ``connector.connector_scheduler.client.close()``."""
    c = _normalize(cfg)
    c.update(tp_rank=0, pp_rank=0, pcp_rank=0, dcp_rank=None, rank=None)
    vllm_config, kv_cache_config = build_configs(c)
    sched_kv_cache_config = _kvu.generate_scheduler_kv_cache_config([kv_cache_config])
    try:
        return KVConnectorFactory.create_connector(
            vllm_config, KVConnectorRole.SCHEDULER, sched_kv_cache_config
        )
    except Exception as e:
        raise ConfigRejected("MooncakeStoreConnector(SCHEDULER)", e) from e


def rank0_worker_from_scheduler(connector: Any, store: Any) -> Any:
    """Run vLLM's ``MooncakeStoreWorker.__init__`` on what a scheduler-role
    connector holds (its ``VllmConfig`` and scheduler ``KVCacheConfig``), with
    the rank-0 stand-ins sized from ``parallel_config``.  Comparing its
    ``_lookup_key_prefixes`` with a real rank-0 worker's shows whether the
    scheduler process knows enough to build the lookup keys itself."""
    vllm_config = connector._vllm_config
    kv_cache_config = connector._kv_cache_config
    pc = vllm_config.parallel_config
    c = _normalize({
        "tp_size": pc.tensor_parallel_size,
        "pcp_size": pc.prefill_context_parallel_size,
        "dcp_size": pc.decode_context_parallel_size,
    })
    ranks = {"rank": 0, "tp_rank": 0, "pp_rank": 0, "pcp_rank": 0, "dcp_rank": 0}
    with _worker_environment(c, ranks):
        worker = MooncakeStoreWorker(vllm_config, kv_cache_config)
    worker.store = store
    worker._built_vllm_config = vllm_config
    return worker


def make_request(request_id: str, token_ids: list[int], hash_block_size: int) -> Any:
    """A real ``vllm.v1.request.Request`` whose ``block_hashes`` vLLM computes
    itself (``get_request_block_hasher`` + ``sha256``, ``init_none_hash``).  Set
    ``PYTHONHASHSEED`` for hashes that repeat across processes."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.request import Request

    if not getattr(make_request, "_none_hash_done", False):
        _kvu.init_none_hash(sha256)
        make_request._none_hash_done = True  # type: ignore[attr-defined]
    return Request(
        request_id,
        list(token_ids),
        SamplingParams(max_tokens=1),
        None,
        block_hasher=_kvu.get_request_block_hasher(hash_block_size, sha256),
    )


def wait_verified(client: Any, seconds: float = 10.0) -> bool:
    """Wait until an in-scheduler lookup client has verified its namespaces with rank 0 (the
    check runs on a background thread; until it is done, lookups go over ZMQ). True when
    verified (or the client has no such check), False after ``seconds``."""
    deadline = time.monotonic() + seconds
    while getattr(client, "verified", True) is False:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.01)
    return True


def release(worker: Any) -> None:
    """Detach the caller's store and close what the build opened (the real
    ``LookupKeyServer`` if one was built).  Safe to call more than once."""
    worker.store = None  # makes vLLM's worker.close() a no-op
    server = getattr(worker, "lookup_server", None)
    if server is not None and not isinstance(server, _NoLookupServer):
        # The server thread owns its socket and blocks in recv: wake it with one
        # request it answers with RESP_ERR (unknown tag), let it see
        # running=False and exit, then close the socket from here.
        import zmq

        server.running = False
        path = _worker_mod.get_zmq_rpc_path_lookup(worker._built_vllm_config)
        sock = zmq.Context.instance().socket(zmq.REQ)
        try:
            sock.setsockopt(zmq.RCVTIMEO, 5000)
            sock.connect(path)
            sock.send(b"mooncake_keys-stop")
            sock.recv()
        except zmq.ZMQError:
            pass
        finally:
            sock.close(linger=0)
        server.thread.join(timeout=5)
        if not server.thread.is_alive():
            server.close()
            # libzmq unlinks the ipc path again when its I/O thread closes the listener, which
            # may come after the next worker bound the same path, leaving that worker's server
            # unreachable (a CI run: the next test's handshake never answered). term() waits for
            # that close, so the path is free before the next bind.
            ctx = getattr(server, "ctx", None)
            if ctx is not None:
                ctx.term()
        worker.lookup_server = None


def model_zoo() -> types.ModuleType:
    """``support.vllm_zoo``: the KV-cache layouts of real architectures, built by vLLM 0.33's own
    code (a module of its own; reached from here so that the benchmarks, which see only this
    harness, can use it)."""
    from support import vllm_zoo

    return vllm_zoo


def hit_length(result: Any) -> int:
    """``worker.lookup`` returns an int in 0.25 and a ``MooncakeLookupResult`` in 0.33."""
    return int(getattr(result, "hit_length", result))


# ---------------------------------------------------------------------------
# describe()
# ---------------------------------------------------------------------------


def _spec_summary(spec: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"type": type(spec).__name__, "block_size": spec.block_size}
    for name in (
        "sliding_window", "attention_chunk_size", "num_kv_heads", "head_size",
        "extra_retained_tokens", "bounded_replay", "mamba_cache_mode", "dcp_sharded",
    ):
        if hasattr(spec, name):
            d[name] = getattr(spec, name)
    if hasattr(type(spec), "prefix_cacheable"):
        d["prefix_cacheable"] = spec.prefix_cacheable
    if isinstance(spec, _kvi.UniformTypeKVCacheSpecs):
        d["inner"] = [_spec_summary(s) for s in spec.kv_cache_specs.values()]
    return d


def describe(worker: Any) -> dict[str, Any]:  # long: a flat list of fields, one place to read them
    """The worker state that feeds ``lookup`` (for debugging / diffing)."""
    w = worker
    out: dict[str, Any] = {"vllm_version": VLLM_VERSION}
    for name in (
        "kv_role", "tp_rank", "tp_size", "pp_rank", "pp_size", "pcp_rank", "pcp_size",
        "dcp_rank", "dcp_size", "dp_rank", "block_size", "hash_block_size", "num_kv_head",
        "use_mla", "put_step", "head_or_tp_rank", "_capacity_only", "store_tp_size",
        "_group_tp_replication_factors", "_lookup_expected_per_key",
    ):
        if hasattr(w, name):
            out[name.lstrip("_")] = getattr(w, name)
    if getattr(w, "metadata", None) is not None:
        out["metadata"] = dataclasses.asdict(w.metadata)
    out["input_groups"] = [
        {**_spec_summary(g.kv_cache_spec), "is_eagle_group": g.is_eagle_group,
         **({"enable_kv_transfer": g.enable_kv_transfer} if hasattr(g, "enable_kv_transfer") else {})}
        for g in w._kv_cache_config.kv_cache_groups
    ]
    if getattr(w, "_kv_cache_config", None) is not None:
        kc = w._kv_cache_config
        fields = ("hash_block_size", "cache_hit_alignment_tokens", "prefix_cache_retention_interval",
                  "kv_cache_layout", "prefix_cacheable_group_ids")
        out["kv_cache_config"] = {name: getattr(kc, name) for name in fields if hasattr(kc, name)}
    coord = getattr(w, "coord", None)
    if coord is None:
        return out
    out["groups"] = [
        {**_spec_summary(g.kv_cache_spec), "is_eagle_group": g.is_eagle_group}
        for g in w._kv_cache_groups
    ]
    out["coord"] = {
        "lcm_block_size": coord.lcm_block_size,
        "hash_block_size": coord.hash_block_size,
        "use_eagle": coord.use_eagle,
        "eagle_group_ids": sorted(coord.eagle_group_ids),
        "retention_interval": coord.retention_interval,
        "enable_partial_hash_hits": getattr(coord, "enable_partial_hash_hits", False),
        "attention_groups": [
            {"spec": type(ag[0]).__name__, "block_size": ag[0].block_size,
             "group_ids": list(ag[1]), "manager": ag[2].__name__,
             **({"use_eagle": ag[3]} if len(ag) > 3 else {})}
            for ag in coord.attention_groups
        ],
    }
    out["token_dbs"] = [
        {
            "metadata": dataclasses.asdict(db.metadata),
            "block_size": db.block_size,
            "hash_block_size": db.hash_block_size,
            **({"store_layout": type(db.store_layout).__name__} if hasattr(db, "store_layout") else {}),
        }
        for db in w.token_dbs
    ]
    out["store_namespace"] = (
        w.token_dbs[0].metadata.store_namespace
        if w.token_dbs and hasattr(w.token_dbs[0].metadata, "store_namespace")
        else ""
    )
    out["lookup_key_prefixes"] = [list(p) for p in w._lookup_key_prefixes]
    return out


def quiet(level: int = logging.ERROR) -> None:
    """Silence vLLM's per-build log lines (useful for thousands of builds)."""
    logging.getLogger("vllm").setLevel(level)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("vllm"):
            logging.getLogger(name).setLevel(level)
