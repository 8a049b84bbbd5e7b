"""The KV-cache layouts of the models people serve, built by vLLM 0.33's own code on a CPU machine.

A row of :data:`ARCHITECTURES` is a model as it is served: its Hugging Face repository, the
``config.json`` values (written out as data here, no download; each row cites its source), the
builder of its KV-cache layers and the attention backend an NVIDIA Hopper (H100/H200)
deployment runs it with. :func:`layout` turns a row and a TP size into what vLLM's engine
core hands a worker, the way a CUDA deployment gets it:

1. vLLM's ``ModelConfig`` reads the ``config.json`` (vLLM's and transformers' own config
   classes: layer types, windows, compression rates are derived there), and ``VllmConfig``
   resolves the deployment (block size, KV-cache dtype, the hybrid KV-cache manager);
2. under ``set_current_vllm_config``, the model's KV-cache layer classes are built as the
   model file builds them (each builder cites its file and lines): the small ones by their
   real constructors (``Attention``, ``ChunkedLocalAttention``, DeepSeek's SWA, indexer and
   compressor-state caches), the big ones only by the attributes their constructors set and
   their ``get_kv_cache_spec`` reads (``DeepseekV4Attention``, ``MLAAttention``,
   ``QwenGatedDeltaNetAttention``: their constructors build projection weights and kernels
   this machine has no use for);
3. the worker's block-size rules (``Platform.update_block_size_for_backend``, as
   ``vllm/v1/executor/uniproc_executor.py`` 75 calls it after loading the model) and its
   ``get_kv_cache_spec`` (``vllm/v1/worker/gpu/attn_utils.py`` 138);
4. the engine core's planning (``vllm/v1/engine/core.py`` 251-365: the KV-cache layout,
   ``get_global_kv_cache_groups``, ``get_kv_cache_configs``, the scheduler's copy, the block
   size, and the hash block size and hit alignment resolved on the scheduler's copy,
   :func:`support.vllm_workers.resolve_engine_core_sizes`).

:func:`build_worker` then builds the deployment's rank-0 ``MooncakeStoreWorker`` from those
configs (``support.vllm_workers.worker_from_configs``), through vLLM's connector factory.

What stands in for the GPU, and only while a layout is built:

* ``support_hybrid_kv_cache()`` answers True, as vLLM's CUDA platform does
  (``vllm/platforms/cuda.py`` 683; the platform this machine gets, ``UnspecifiedPlatform``,
  answers False, and ``VllmConfig`` would then turn the hybrid KV-cache manager off and
  collapse every sliding-window and Mamba model into one full-attention group,
  ``vllm/config/vllm.py`` 2228-2294). vLLM's other rules still apply: Llama 4's chunked local
  attention keeps the hybrid manager off unless its row sets
  ``VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE=1``.
* The attention backend: each row selects one by name, as ``--attention-backend`` does
  (``AttentionConfig.backend``), and the platform's ``get_attn_backend_cls`` answers with that
  backend's class, as CUDA's does for a selected backend that suits the GPU
  (``vllm/platforms/cuda.py`` 421-446). vLLM's own automatic choice cannot run here: it tries
  each backend's compiled kernels (FlashAttention's MLA path, FlashMLA's, FlashInfer's), which
  this machine does not have. The backends chosen are Hopper's (``_get_backend_priorities``,
  ``vllm/platforms/cuda.py`` 84-192): FlashAttention for GQA, FlashMLA for MLA (the second
  choice there, the first being FlashAttention's MLA kernel; DeepSeek's own kernel, chosen
  with ``--attention-backend FLASHMLA``), FlashMLA's sparse kernel for DeepSeek-V3.2; the
  DeepSeek-V4 layers carry their own (``vllm/models/deepseek_v4/nvidia/model.py`` 537-569).
* ``parallel_state``'s TP group (``support.vllm_workers.parallel_groups``), as for the workers.

Not modelled: speculative decoding (the MTP layers of DeepSeek and Qwen3-Next are built only
with it), quantized weights (the checkpoints' ``quantization_config`` is left out: it does not
change the KV cache, whose dtype stays vLLM's default, but it asks for kernels), and the vision
towers of Gemma 3 and Llama 4 (served here by their text architectures, whose layers and KV
cache are the multimodal models' language model's).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
import os
import threading
import types
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

import torch
import torch.nn as nn
from vllm.config import (
    AttentionConfig,
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    VllmConfig,
    set_current_vllm_config,
)
from vllm.platforms import current_platform
from vllm.v1.attention.backends.registry import AttentionBackendEnum
from vllm.v1.core import kv_cache_utils as _kvu

from support import vllm_workers

__all__ = ["Architecture", "ARCHITECTURES", "Layout", "layout", "build_worker", "TP_SIZES", "describe_layout"]

#: The TP sizes every architecture is built at (a node of 8 GPUs, and one GPU where it fits).
TP_SIZES = (1, 8)
#: ``max_model_len`` of every deployment (the models' own limits reach 10M tokens; a serving
#: deployment sets one). Only vLLM's memory check reads it.
MAX_MODEL_LEN = 131072
#: KV-cache memory of each GPU, bytes (an 80 GB H100 after the weights); only the number of
#: blocks follows from it, which no lookup reads.
GPU_KV_CACHE_BYTES = 48 << 30

_DROP_IN = {"kv_connector": "FastMooncakeStoreConnector", "kv_connector_module_path": "mooncake_keys.vllm"}
_VLLM = {"kv_connector": "MooncakeStoreConnector"}


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One served model: a row of :data:`ARCHITECTURES`."""

    #: As people call it.
    name: str
    #: The Hugging Face repository; its last component names vLLM's store keys.
    model: str
    #: The builder of its KV-cache layers: a key of :data:`LAYER_BUILDERS`.
    layers: str
    #: ``config.json`` values: those that shape the KV cache and those vLLM's config classes need.
    hf_config: Mapping[str, Any]
    #: Where the values come from.
    source: str
    #: ``AttentionBackendEnum`` name, as ``--attention-backend`` (None: the layers carry their own).
    attention_backend: Optional[str] = None
    #: Environment the deployment runs with.
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    #: What differs from the model card, in a line.
    note: str = ""


# ---------------------------------------------------------------------------
# KV-cache layers, as each model file builds them
# ---------------------------------------------------------------------------


def _tp() -> int:
    from vllm.distributed import get_tensor_model_parallel_world_size

    return get_tensor_model_parallel_world_size()


def _kv_heads(total: int) -> int:
    """KV heads per rank: ``max(1, total // tp)`` (replicated below TP; every GQA model file)."""
    return max(1, total // _tp())


def _attention(vc: VllmConfig, prefix: str, heads: int, head_dim: int, kv_heads: int, scale: float,
               **kwargs: Any) -> Any:
    from vllm.model_executor.layers.attention import Attention

    return Attention(heads // _tp(), head_dim, scale, num_kv_heads=_kv_heads(kv_heads),
                     cache_config=vc.cache_config, prefix=prefix, **kwargs)


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def llama_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/llama.py``: ``LlamaAttention`` 141-162 (heads, KV heads per
    rank, ``head_dim``), 185-221 (the window of a ``"sliding_attention"`` layer type, then
    ``Attention(..., prefix=f"{prefix}.attn")``); decoder layer prefix ``model.layers.{i}.self_attn``."""
    types_ = getattr(cfg, "layer_types", None)
    for i in range(cfg.num_hidden_layers):
        window = cfg.sliding_window if types_ and types_[i] == "sliding_attention" else None
        _attention(vc, f"model.layers.{i}.self_attn.attn", cfg.num_attention_heads, _head_dim(cfg),
                   cfg.num_key_value_heads, _head_dim(cfg) ** -0.5, per_layer_sliding_window=window)


def qwen3_moe_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/qwen3_moe.py``: ``Qwen3MoeAttention`` 263-281 (heads, KV heads
    per rank, ``head_dim``), 315-324 (``Attention`` without a window); 369 (the decoder layer's
    ``self_attn``)."""
    for i in range(cfg.num_hidden_layers):
        _attention(vc, f"model.layers.{i}.self_attn.attn", cfg.num_attention_heads, _head_dim(cfg),
                   cfg.num_key_value_heads, _head_dim(cfg) ** -0.5)


def minimax_m2_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/minimax_m2.py``: ``MiniMaxM2Attention`` 160-173 (KV heads per
    rank, ``head_dim``), 200-210 (``Attention``, ``attn_window_size`` None: the decoder layer,
    270-284, passes none)."""
    for i in range(cfg.num_hidden_layers):
        _attention(vc, f"model.layers.{i}.self_attn.attn", cfg.num_attention_heads, _head_dim(cfg),
                   cfg.num_key_value_heads, _head_dim(cfg) ** -0.5, per_layer_sliding_window=None)


def gpt_oss_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/gpt_oss.py``: ``OAIAttention`` 129-135 (attention sinks, one
    per local head), 155-156 (heads and KV heads per rank), 165-187 (``_build_attention``: the
    window on even layers, ``sinks``); 441-443 (the decoder layer's ``attn``)."""
    from vllm.model_executor.model_loader.weight_utils import make_attention_sink

    tp = _tp()
    for i in range(cfg.num_hidden_layers):
        window = cfg.sliding_window if i % 2 == 0 else None
        _attention(vc, f"model.layers.{i}.attn.attn", cfg.num_attention_heads, cfg.head_dim,
                   cfg.num_key_value_heads, cfg.head_dim ** -0.5, per_layer_sliding_window=window,
                   sinks=make_attention_sink(cfg.num_attention_heads // tp))


def gemma3_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/gemma3.py``: ``Gemma3Attention`` 113-130 (KV heads per rank,
    ``query_pre_attn_scalar``), 153-155 (the window of a ``"sliding_attention"`` layer type;
    transformers' ``Gemma3TextConfig`` derives the types from ``sliding_window_pattern``),
    176-187 (``Attention``, no soft cap: 230)."""
    for i in range(cfg.num_hidden_layers):
        window = cfg.sliding_window if cfg.layer_types[i] == "sliding_attention" else None
        _attention(vc, f"model.layers.{i}.self_attn.attn", cfg.num_attention_heads, cfg.head_dim,
                   cfg.num_key_value_heads, cfg.query_pre_attn_scalar ** -0.5,
                   per_layer_sliding_window=window, logits_soft_cap=None)


def llama4_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/llama4.py``: ``Llama4Attention`` 184-185 (a NoPE layer is one
    whose ``no_rope_layers`` entry is 0; transformers' ``Llama4TextConfig`` makes every fourth
    one), 187-204 (heads, KV heads per rank), 251-264 (``ChunkedLocalAttention`` on RoPE layers,
    ``Attention`` on NoPE ones); 338 (the decoder layer's ``self_attn``)."""
    from vllm.model_executor.layers.attention.chunked_local_attention import ChunkedLocalAttention

    tp = _tp()
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn.attn"
        nope = cfg.no_rope_layers[i] == 0
        if not nope and cfg.attention_chunk_size:
            ChunkedLocalAttention(cfg.num_attention_heads // tp, cfg.head_dim, cfg.head_dim ** -0.5,
                                  attention_chunk_size=cfg.attention_chunk_size,
                                  num_kv_heads=_kv_heads(cfg.num_key_value_heads),
                                  cache_config=vc.cache_config, prefix=prefix)
        else:
            _attention(vc, prefix, cfg.num_attention_heads, cfg.head_dim, cfg.num_key_value_heads,
                       cfg.head_dim ** -0.5)


def qwen3_next_layers(vc: VllmConfig, cfg: Any) -> None:
    """``vllm/model_executor/models/qwen3_next.py``: the decoder layer 496-516 (a
    ``"linear_attention"`` layer type is a ``QwenGatedDeltaNetAttention``, a ``"full_attention"``
    one a ``Qwen3NextAttention``), ``Qwen3NextAttention`` 294-311 and 353-362 (``Attention``).

    The Gated DeltaNet layer by the attributes its constructor sets
    (``vllm/model_executor/layers/mamba/gdn/base.py`` 31-47,
    ``.../gdn/qwen_gdn_linear_attn.py`` 566-571, 690-700, 730-733) and its state shape and dtype
    read: its constructor builds the projections, the conv weights and the kernels. On Hopper
    its prefill runs FlashInfer's kernel (``_resolve_gdn_prefill_backend``, 148-170: SM90, no
    further constraint), which exports align-mode checkpoints every
    ``FLASHINFER_GDN_CHECKPOINT_ALIGNMENT`` tokens."""
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention
    from vllm.v1.attention.backends.gdn_attn import FLASHINFER_GDN_CHECKPOINT_ALIGNMENT

    tp = _tp()
    forward_context = vc.compilation_config.static_forward_context
    for i in range(cfg.num_hidden_layers):
        if cfg.layer_types[i] == "full_attention":
            _attention(vc, f"model.layers.{i}.self_attn.attn", cfg.num_attention_heads, cfg.head_dim,
                       cfg.num_key_value_heads, cfg.head_dim ** -0.5)
            continue
        prefix = f"model.layers.{i}.linear_attn"
        gdn = object.__new__(QwenGatedDeltaNetAttention)
        nn.Module.__init__(gdn)
        gdn.prefix, gdn.tp_size, gdn.tp_rank, gdn.layer_idx = prefix, tp, 0, i
        gdn.model_config, gdn.cache_config, gdn.vllm_config = vc.model_config, vc.cache_config, vc
        gdn.speculative_config, gdn.num_spec = None, 0
        gdn.num_k_heads, gdn.num_v_heads = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        gdn.head_k_dim, gdn.head_v_dim = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        gdn.conv_kernel_size = cfg.linear_conv_kernel_dim
        gdn.gdn_prefill_backend = "flashinfer"
        gdn._checkpoint_alignment = (FLASHINFER_GDN_CHECKPOINT_ALIGNMENT
                                     if vc.cache_config.mamba_cache_mode == "align" else None)
        forward_context[prefix] = gdn


def _mla_attention(vc: VllmConfig, cfg: Any, prefix: str, indexer: Any = None) -> Any:
    """An ``MLAAttention`` (``vllm/model_executor/layers/attention/mla_attention.py``) by the
    attributes its constructor sets (476-486: the layer name, the indexer, the window; 489-547:
    the KV-cache dtype; 480: the head size ``kv_lora_rank + qk_rope_head_dim``; 567-569: the
    width of the model's top-k buffer, ``index_topk`` wide in DeepSeek-V3.2's,
    ``vllm/models/deepseek_v32/nvidia/model.py`` 188-195; 512-521: the backend) and its
    ``get_kv_cache_spec`` reads (1371-1400).
    Its constructor builds the backend's kernel wrapper, and FlashMLA's asserts its compiled
    kernel (``vllm/v1/attention/backends/mla/flashmla.py`` 242)."""
    from vllm.model_executor.layers.attention import MLAAttention

    attn = object.__new__(MLAAttention)
    nn.Module.__init__(attn)
    attn.layer_name = prefix
    attn.kv_cache_dtype = vc.cache_config.cache_dtype
    attn.head_size = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    attn.sliding_window = None
    attn.indexer = indexer
    attn.topk_buffer_width = cfg.index_topk if indexer is not None else None
    attn.non_causal_multi_token_decode = False
    attn.attn_backend = AttentionBackendEnum[vc.attention_config.backend.name].get_class()
    vc.compilation_config.static_forward_context[prefix] = attn
    return attn


def deepseek_mla_layers(vc: VllmConfig, cfg: Any) -> None:
    """DeepSeek-V3 and Kimi-K2 (``DeepseekV3ForCausalLM``, ``vllm/model_executor/models/deepseek_v2.py``):
    one MLA layer per decoder layer (1215-1240: ``MultiHeadLatentAttentionWrapper``, which builds
    the ``MLAAttention`` as ``{prefix}.attn``, ``vllm/model_executor/layers/mla.py`` 122-140;
    :func:`_mla_attention`)."""
    for i in range(cfg.num_hidden_layers):
        _mla_attention(vc, cfg, f"model.layers.{i}.self_attn.attn")


def deepseek_v32_layers(vc: VllmConfig, cfg: Any) -> None:
    """DeepSeek-V3.2 on CUDA (``vllm/models/deepseek_v32/__init__.py`` 15-19: the ``nvidia``
    model, whose attention is ``DeepseekV32Attention``, an ``MLAAttention``,
    ``vllm/models/deepseek_v32/attention.py`` 121): :func:`_mla_attention` with an indexer on
    every layer (162-176 and 188-198: ``index_topk_freq`` 1), whose K cache is a
    ``DeepseekV32IndexerCache`` built by its real constructor (93-97: ``index_head_dim`` fp8
    bytes plus a float32 scale per 128, uint8)."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.self_attn"
        index_head_dim = cfg.index_head_dim
        k_cache = DeepseekV32IndexerCache(head_dim=index_head_dim + index_head_dim // 128 * 4, dtype=torch.uint8,
                                          prefix=f"{prefix}.indexer.k_cache", cache_config=vc.cache_config)
        _mla_attention(vc, cfg, prefix, indexer=types.SimpleNamespace(k_cache=k_cache))


def deepseek_v4_layers(vc: VllmConfig, cfg: Any) -> None:
    """DeepSeek-V4 on CUDA (``vllm/models/deepseek_v4/__init__.py`` 41-48: the ``nvidia`` model;
    its decoder layer's attention is ``DeepseekV4FlashMLAAttention`` on every CUDA GPU but SM12,
    ``vllm/models/deepseek_v4/nvidia/model.py`` 537-569 and 596-601).

    ``DeepseekV4Attention`` (``vllm/models/deepseek_v4/attention.py``) by the attributes its
    constructor sets (228-251: ``head_dim``, the window, the layer's compression ratio from its
    layer type; 342-344: the KV-cache dtype of FlashMLA's ``fp8_ds_mla`` layout, which it writes
    back to the cache config; 357-361: its registration) and its ``get_kv_cache_spec`` reads
    (860-884): its constructor builds the projections, the rotary tables and CUDA events. The
    caches beside it by their real constructors: its ``DeepseekV4SWACache`` (346-353); for a
    compressed layer the compressor's ``CompressorStateCache`` (365-375, and
    ``vllm/models/deepseek_v4/compressor.py`` 281-286: ``2 * coff * head_dim`` floats per
    state, ``coff`` 2 at ratio 4); for a ratio-4 layer the indexer's K cache and its own
    compressor's state cache (``attention.py`` 291-309 and 1016-1042: MXFP4 or FP8 as
    ``dsa_indexer_uses_fp4`` says)."""
    from vllm.models.deepseek_v4 import attention as dsv4
    from vllm.models.deepseek_v4.compressor import CompressorStateCache
    from vllm.models.deepseek_v4.nvidia.flashmla import DeepseekV4FlashMLAAttention
    from vllm.v1.attention.backends.mla.indexer import dsa_indexer_uses_fp4
    from vllm.v1.attention.backends.mla.sparse_swa import DeepseekV4SWACache

    cc = vc.cache_config
    forward_context = vc.compilation_config.static_forward_context
    for i in range(cfg.num_hidden_layers):
        prefix = f"model.layers.{i}.attn"
        attn = object.__new__(DeepseekV4FlashMLAAttention)
        nn.Module.__init__(attn)
        attn.prefix = prefix
        attn.head_dim = cfg.head_dim
        attn.window_size = cfg.sliding_window
        attn.compress_ratio = max(1, cfg.compress_rates.get(cfg.layer_types[i], 0))
        attn.kv_cache_dtype, attn.kv_cache_torch_dtype = dsv4._resolve_dsv4_kv_cache_dtype(
            attn._uses_fp8_ds_mla_layout(), cc.cache_dtype, cc)
        attn.swa_cache_layer = DeepseekV4SWACache(
            head_dim=attn.head_dim, window_size=attn.window_size, dtype=attn.kv_cache_torch_dtype,
            prefix=f"{prefix}.swa_cache", cache_config=cc, backend_cls=attn.swa_backend_cls)
        forward_context[prefix] = attn
        if attn.compress_ratio > 1:
            coff = 1 + (attn.compress_ratio == 4)
            CompressorStateCache(state_dim=2 * coff * attn.head_dim, dtype=torch.float32,
                                 compress_ratio=attn.compress_ratio, prefix=f"{prefix}.compressor.state_cache")
        if attn.compress_ratio == 4:
            head_dim = cfg.index_head_dim
            k_head_dim = head_dim // 2 + head_dim // 32 if dsa_indexer_uses_fp4(vc) else head_dim + head_dim // 128 * 4
            dsv4.DeepseekV4IndexerCache(head_dim=k_head_dim, dtype=torch.uint8, prefix=f"{prefix}.indexer.k_cache",
                                        cache_config=cc, compress_ratio=attn.compress_ratio)
            CompressorStateCache(state_dim=2 * 2 * head_dim, dtype=torch.float32, compress_ratio=attn.compress_ratio,
                                 prefix=f"{prefix}.indexer.compressor.state_cache")


#: Builders of the KV-cache layers, by the name a row gives.
LAYER_BUILDERS: Dict[str, Callable[[VllmConfig, Any], None]] = {
    "llama": llama_layers,
    "qwen3_moe": qwen3_moe_layers,
    "minimax_m2": minimax_m2_layers,
    "gpt_oss": gpt_oss_layers,
    "gemma3": gemma3_layers,
    "llama4": llama4_layers,
    "qwen3_next": qwen3_next_layers,
    "deepseek_mla": deepseek_mla_layers,
    "deepseek_v32": deepseek_v32_layers,
    "deepseek_v4": deepseek_v4_layers,
}


# ---------------------------------------------------------------------------
# The models (config.json values as data; sources cited)
# ---------------------------------------------------------------------------

_DEEPSEEK_V3_BASE: Dict[str, Any] = {
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256,
    "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 8, "topk_group": 4, "first_k_dense_replace": 3,
    "moe_layer_freq": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True, "scoring_func": "sigmoid",
    "topk_method": "noaux_tc", "num_nextn_predict_layers": 1, "max_position_embeddings": 163840,
    "rope_theta": 10000, "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "rms_norm_eps": 1e-06, "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "tie_word_embeddings": False,
}

_ROWS: Tuple[Architecture, ...] = (
    Architecture(
        "DeepSeek-V4-Flash", "deepseek-ai/DeepSeek-V4-Flash", "deepseek_v4",
        {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 4096,
         "num_hidden_layers": 43, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
         "q_lora_rank": 1024, "o_lora_rank": 1024, "o_groups": 8, "qk_rope_head_dim": 64, "sliding_window": 128,
         "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512, "hc_eps": 1e-06, "hc_mult": 4,
         "hc_sinkhorn_iters": 20, "moe_intermediate_size": 2048, "n_routed_experts": 256, "n_shared_experts": 1,
         "num_experts_per_tok": 6, "num_hash_layers": 3, "norm_topk_prob": True, "routed_scaling_factor": 1.5,
         "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "swiglu_limit": 10.0,
         "num_nextn_predict_layers": 1, "max_position_embeddings": 1048576, "rope_theta": 10000,
         "compress_rope_theta": 160000,
         "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                          "beta_fast": 32, "beta_slow": 1},
         "rms_norm_eps": 1e-06, "vocab_size": 129280, "bos_token_id": 0, "eos_token_id": 1,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False,
         # 43 layers and the MTP layer's: two sliding-window-only layers, then CSA (4) and HCA (128) in turn.
         "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0]},
        "https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json",
        note="FlashMLA's fp8_ds_mla KV cache (the layer's default on CUDA); MTP layer not built"),
    Architecture(
        "DeepSeek-V3.2", "deepseek-ai/DeepSeek-V3.2", "deepseek_v32",
        {**_DEEPSEEK_V3_BASE, "architectures": ["DeepseekV32ForCausalLM"], "model_type": "deepseek_v32",
         "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048},
        "https://huggingface.co/deepseek-ai/DeepSeek-V3.2/blob/main/config.json",
        attention_backend="FLASHMLA_SPARSE", note="MTP layer not built"),
    Architecture(
        "DeepSeek-V3", "deepseek-ai/DeepSeek-V3", "deepseek_mla",
        {**_DEEPSEEK_V3_BASE, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"},
        "https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json",
        attention_backend="FLASHMLA", note="MTP layer not built"),
    Architecture(
        "Kimi-K2", "moonshotai/Kimi-K2-Instruct", "deepseek_mla",
        {**_DEEPSEEK_V3_BASE, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
         "num_attention_heads": 64, "num_key_value_heads": 64, "n_routed_experts": 384, "n_group": 1,
         "topk_group": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.827, "num_nextn_predict_layers": 0,
         "max_position_embeddings": 131072, "rope_theta": 50000.0, "vocab_size": 163840,
         "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                          "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
         "bos_token_id": 163584, "eos_token_id": 163585},
        "https://huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json",
        attention_backend="FLASHMLA"),
    Architecture(
        "Qwen3-Next-80B", "Qwen/Qwen3-Next-80B-A3B-Instruct", "qwen3_next",
        {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "hidden_size": 2048,
         "num_hidden_layers": 48, "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
         "full_attention_interval": 4, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
         "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
         "intermediate_size": 5120, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
         "num_experts": 512, "num_experts_per_tok": 10, "decoder_sparse_step": 1, "norm_topk_prob": True,
         "partial_rotary_factor": 0.25, "rope_theta": 10000000, "max_position_embeddings": 262144,
         "rms_norm_eps": 1e-06, "vocab_size": 151936, "torch_dtype": "bfloat16", "tie_word_embeddings": False},
        "https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json",
        attention_backend="FLASH_ATTN", note="Gated DeltaNet layers as Mamba groups in align mode (prefix caching on)"),
    Architecture(
        "gpt-oss-120b", "openai/gpt-oss-120b", "gpt_oss",
        {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "hidden_size": 2880,
         "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
         "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18,
         "intermediate_size": 2880, "num_local_experts": 128, "num_experts_per_tok": 4,
         "experts_per_token": 4, "swiglu_limit": 7.0, "initial_context_length": 4096, "rope_theta": 150000,
         "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                          "truncate": False, "original_max_position_embeddings": 4096},
         "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "vocab_size": 201088,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False},
        "https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json",
        attention_backend="FLASH_ATTN", note="MXFP4 weights' quantization_config left out"),
    Architecture(
        "Gemma-3-27B", "google/gemma-3-27b-it", "gemma3",
        {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 5376,
         "num_hidden_layers": 62, "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128,
         "query_pre_attn_scalar": 168, "sliding_window": 1024, "sliding_window_pattern": 6,
         "intermediate_size": 21504, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
         "rope_local_base_freq": 10000.0, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
         "rms_norm_eps": 1e-06, "vocab_size": 262208, "final_logit_softcapping": None,
         "attn_logit_softcapping": None, "torch_dtype": "bfloat16"},
        "https://huggingface.co/google/gemma-3-27b-it/blob/main/config.json (text_config)",
        attention_backend="FLASH_ATTN", note="the language model of Gemma3ForConditionalGeneration"),
    Architecture(
        "Llama-4-Scout", "meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4",
        {"architectures": ["Llama4ForCausalLM"], "model_type": "llama4_text", "hidden_size": 5120,
         "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
         "attention_chunk_size": 8192, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
         "num_local_experts": 16, "num_experts_per_tok": 1, "interleave_moe_layer_step": 1,
         "use_qk_norm": True, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 16.0, "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 8192},
         "max_position_embeddings": 10485760, "rms_norm_eps": 1e-05, "vocab_size": 202048,
         "torch_dtype": "bfloat16"},
        "https://huggingface.co/meta-llama/Llama-4-Scout-17B-16E-Instruct/blob/main/config.json (text_config)",
        attention_backend="FLASH_ATTN", env={"VLLM_ALLOW_CHUNKED_LOCAL_ATTN_WITH_HYBRID_KV_CACHE": "1"},
        note="the language model of Llama4ForConditionalGeneration; chunked local attention in the hybrid manager "
             "(vLLM's default turns the manager off for it: one full-attention group)"),
    Architecture(
        "MiniMax-M2", "MiniMaxAI/MiniMax-M2", "minimax_m2",
        {"architectures": ["MiniMaxM2ForCausalLM"], "model_type": "minimax_m2", "hidden_size": 3072,
         "num_hidden_layers": 62, "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128,
         "rotary_dim": 64, "intermediate_size": 1536, "num_local_experts": 256, "num_experts_per_tok": 8,
         "use_qk_norm": True, "qk_norm_type": "per_layer", "rope_theta": 5000000,
         "max_position_embeddings": 196608, "rms_norm_eps": 1e-06, "vocab_size": 200064,
         "torch_dtype": "bfloat16", "tie_word_embeddings": False},
        "https://huggingface.co/MiniMaxAI/MiniMax-M2/blob/main/config.json",
        attention_backend="FLASH_ATTN", note="FP8 weights' quantization_config left out"),
    Architecture(
        "Llama-3.1-70B", "meta-llama/Llama-3.1-70B-Instruct", "llama",
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
         "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
         "max_position_embeddings": 131072, "rope_theta": 500000.0,
         "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
         "rms_norm_eps": 1e-05, "vocab_size": 128256, "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009],
         "torch_dtype": "bfloat16", "tie_word_embeddings": False},
        "https://huggingface.co/meta-llama/Llama-3.1-70B-Instruct/blob/main/config.json",
        attention_backend="FLASH_ATTN"),
    Architecture(
        "Qwen3-235B", "Qwen/Qwen3-235B-A22B", "qwen3_moe",
        {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
         "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
         "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8,
         "decoder_sparse_step": 1, "norm_topk_prob": True, "rope_theta": 1000000.0,
         "max_position_embeddings": 40960, "max_window_layers": 94, "use_sliding_window": False,
         "sliding_window": None, "rms_norm_eps": 1e-06, "vocab_size": 151936, "torch_dtype": "bfloat16",
         "tie_word_embeddings": False},
        "https://huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json",
        attention_backend="FLASH_ATTN"),
)

#: The served models by name. A new architecture is one row (and, if its layers are built
#: like none of these, one function of :data:`LAYER_BUILDERS`).
ARCHITECTURES: Dict[str, Architecture] = {row.name: row for row in _ROWS}


# ---------------------------------------------------------------------------
# What stands in for a CUDA GPU while a layout is built
# ---------------------------------------------------------------------------

_lock = threading.Lock()


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@contextlib.contextmanager
def _cuda_answers() -> Iterator[None]:
    """The platform answers as vLLM's CUDA platform on Hopper does (module docstring): the hybrid
    KV-cache manager is supported, a selected attention backend is the one used, and
    FlashAttention (FA3) takes attention sinks."""
    from vllm.v1.attention.selector import _cached_get_attn_backend

    platform = type(current_platform)
    saved = {name: platform.__dict__.get(name) for name in ("support_hybrid_kv_cache", "get_attn_backend_cls")}

    def selected_backend(cls: type, selected: Any, attn_selector_config: Any, num_heads: Any = None) -> str:
        if selected is None:
            raise ValueError("support.vllm_zoo: every row selects its attention backend (vLLM's automatic choice "
                             "tries compiled kernels this machine does not have)")
        module, qualname = selected.get_class().full_cls_name()
        return f"{module}.{qualname}"

    platform.support_hybrid_kv_cache = classmethod(lambda cls: True)  # type: ignore[assignment]
    platform.get_attn_backend_cls = classmethod(selected_backend)  # type: ignore[assignment]
    # FlashAttention's layer asks whether its kernel takes attention sinks (gpt-oss): FA3 does,
    # on Hopper (vllm/v1/attention/backends/fa_utils.py 319-322); the probe is imported only
    # where the compiled kernel is (flash_attn.py 47-54).
    from vllm.v1.attention.backends import flash_attn

    probe = "flash_attn_supports_sinks"
    had_probe = probe in flash_attn.__dict__
    if not had_probe:
        setattr(flash_attn, probe, lambda: True)
    _cached_get_attn_backend.cache_clear()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(platform, name)
            else:
                setattr(platform, name, value)
        if not had_probe:
            delattr(flash_attn, probe)
        _cached_get_attn_backend.cache_clear()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """The model loader builds the model under the model's dtype (``set_default_torch_dtype``)."""
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


# ---------------------------------------------------------------------------
# The layout: what vLLM's engine core hands the workers
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Layout:
    """A deployment of an architecture at a TP size, as vLLM's engine core planned it."""

    arch: Architecture
    tp_size: int
    #: The deployment's ``VllmConfig`` (the engine core's, after planning).
    vllm_config: VllmConfig
    #: One per TP rank: what each worker's connector is built with.
    kv_cache_configs: List[Any]
    #: The scheduler's copy (uniform-type groups unwrapped).
    scheduler_kv_cache_config: Any
    #: The rank-0 worker's KV-cache spec per layer.
    specs: Dict[str, Any]

    @property
    def scheduler_block_size(self) -> int:
        return int(_kvu.resolve_kv_cache_block_sizes(self.scheduler_kv_cache_config, self.vllm_config)[0])

    @property
    def hash_block_size(self) -> int:
        return int(self.scheduler_kv_cache_config.hash_block_size)


def _hf_text(config: Any) -> Any:
    return getattr(config, "get_text_config", lambda: config)()


@functools.lru_cache(maxsize=None)
def layout(name: str, tp_size: int = 1, connector: str = "drop-in") -> Layout:
    """The layout of architecture ``name`` at ``tp_size`` (see the module docstring). Its
    ``kv_transfer_config`` names the drop-in (``connector="drop-in"``, ``FastMooncakeStoreConnector``)
    or vLLM's own (``"vllm"``); the layout is the same. Cached per process."""
    arch = ARCHITECTURES[name]
    kv_transfer = {"drop-in": _DROP_IN, "vllm": _VLLM}[connector]
    vllm_workers.quiet(logging.ERROR)
    hf = dict(arch.hf_config)
    path = vllm_workers.model_dir(arch.model, hf)
    max_len = min(int(hf.get("max_position_embeddings", MAX_MODEL_LEN)), MAX_MODEL_LEN)
    with _lock, _environment(arch.env), _cuda_answers():
        model_config = ModelConfig(model=path, skip_tokenizer_init=True, max_model_len=max_len)
        attention = {"backend": arch.attention_backend} if arch.attention_backend else {}
        vc = VllmConfig(
            model_config=model_config,
            cache_config=CacheConfig(enable_prefix_caching=True),
            parallel_config=ParallelConfig(tensor_parallel_size=tp_size),
            kv_transfer_config=KVTransferConfig(kv_role="kv_both", **kv_transfer),
            attention_config=AttentionConfig(**attention),
            device_config=DeviceConfig(device="cpu"),
        )
        # The worker builds the model, then the platform's block-size rules run.
        with vllm_workers.parallel_groups(tp_size=tp_size), set_current_vllm_config(vc), \
                _default_dtype(model_config.dtype):
            LAYER_BUILDERS[arch.layers](vc, _hf_text(model_config.hf_config))
            current_platform.update_block_size_for_backend(vc)
            from vllm.v1.worker.gpu.attn_utils import get_kv_cache_spec

            spec = get_kv_cache_spec(vc)
        kv_cache_configs, sched = _plan(vc, [spec] * tp_size)
    return Layout(arch, tp_size, vc, kv_cache_configs, sched, spec)


def _plan(vc: VllmConfig, specs: List[Dict[str, Any]]) -> Tuple[List[Any], Any]:
    """The engine core's planning (``vllm/v1/engine/core.py`` 251-365), for workers reporting
    ``specs``."""
    from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts, resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs

    layouts = [layout.name for layout in get_supported_kv_cache_layouts(get_current_attn_backends(vc))]
    resolve_kv_cache_layout(vc, [layouts] * len(specs), [s for spec in specs for s in spec.values()])
    groups = get_global_kv_cache_groups(vc, specs)
    vc.adjust_dcp_kv_cache_interleave_size(groups)
    kv_cache_configs = get_kv_cache_configs(vc, specs, [GPU_KV_CACHE_BYTES] * len(specs), groups)
    for kv_cache_config in kv_cache_configs:
        kv_cache_config.kv_cache_layout = vc.cache_config.kv_cache_layout
    sched = _kvu.generate_scheduler_kv_cache_config(kv_cache_configs)
    vc.cache_config.num_gpu_blocks = sched.num_blocks
    if sched.kv_cache_groups:
        participating = [g.kv_cache_spec.block_size for g in sched.kv_cache_groups if g.kv_cache_spec.prefix_cacheable]
        vc.cache_config.block_size = min(participating or [g.kv_cache_spec.block_size for g in sched.kv_cache_groups])
        _kvu.update_kv_cache_capacity(vc, sched)
    vc.validate_block_size()
    return kv_cache_configs, vllm_workers.resolve_engine_core_sizes(vc, kv_cache_configs)


def build_worker(name: str, tp_size: int, store: Any, *, connector: str = "drop-in", **cfg: Any) -> Any:
    """The rank-0 ``MooncakeStoreWorker`` of architecture ``name`` at ``tp_size``, built by vLLM's
    connector factory from the layout's configs (``connector``: the drop-in, default, which
    accelerates it as it is built; or ``"vllm"``, vLLM's own connector), asking ``store``.
    ``cfg``: further ``support.vllm_workers`` cfg keys (``lookup_server``, ...). Release it
    with ``support.vllm_workers.release``."""
    lay = layout(name, tp_size, connector)
    # Each worker gets its own KV-cache config, as each worker process holds its own; the
    # VllmConfig (the engine core's, after planning) is shared, and the worker only reads it.
    return vllm_workers.worker_from_configs({"tp_size": tp_size, "model": lay.arch.model, **cfg}, lay.vllm_config,
                                            copy.deepcopy(lay.kv_cache_configs[0]), store)


def describe_layout(lay: Layout) -> List[Dict[str, Any]]:
    """The groups of a layout, as the scheduler sees them: one dict each (spec kind, block size,
    window or chunk or tokens per state, KV heads per rank, layers)."""
    out = []
    for group in lay.scheduler_kv_cache_config.kv_cache_groups:
        spec = group.kv_cache_spec
        row: Dict[str, Any] = {"spec": type(spec).__name__, "block_size": spec.block_size,
                               "layers": len(group.layer_names)}
        for k in ("sliding_window", "attention_chunk_size", "tokens_per_state", "num_kv_heads", "mamba_cache_mode"):
            value = getattr(spec, k, None)
            if value is not None and not (k == "tokens_per_state" and value == 1):
                row[k] = value
        row["prefix_cacheable"] = spec.prefix_cacheable
        out.append(row)
    return out
