"""What the serving tests share (tests/engine/test_serve.py): a tiny random model of another kind
vLLM serves (built offline, with the tiny Llama's word-level tokenizer), instances run
together, and one workload served and read back from the server's own ``/metrics``."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Sequence

from mooncake_keys.bench.engine import VOCAB, save_model_once
from mooncake_keys.bench.serve import Server, Workload, bench_serve, metric_sum

__all__ = ["tiny_gemma3", "running", "Served", "serve", "serve_together", "DROP_IN_SERIES"]

#: The drop-in's series on a server's /metrics once it has answered a lookup, hit or miss (each
#: with ``side``; the hit tokens and present keys appear with the first hit).
DROP_IN_SERIES = ("vllm:mooncake_keys_lookups_total", "vllm:mooncake_keys_lookup_tokens_total",
                  "vllm:mooncake_keys_lookup_keys_total", "vllm:mooncake_keys_lookup_calls_total",
                  "vllm:mooncake_keys_lookup_seconds_count", "vllm:mooncake_keys_lookup_seconds_bucket")


def tiny_gemma3(folder: str, max_positions: int = 8192, sliding_window: int = 128, seed: int = 0) -> str:
    """A random ``Gemma3ForCausalLM`` (text only: 2 layers, the first a sliding-window layer of
    ``sliding_window`` tokens, the second full attention; hidden 256, 4 heads, 2 KV heads,
    head_dim 64; untied embeddings: tied ones make this random model repeat one token) and the
    word-level tokenizer, in ``folder`` (built once)."""

    def build():
        from transformers import Gemma3ForCausalLM, Gemma3TextConfig

        config = Gemma3TextConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, query_pre_attn_scalar=64,
                                  sliding_window=sliding_window, layer_types=["sliding_attention", "full_attention"],
                                  max_position_embeddings=max_positions, rms_norm_eps=1e-6, bos_token_id=1,
                                  eos_token_id=2, pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32")
        config.architectures = ["Gemma3ForCausalLM"]
        return Gemma3ForCausalLM(config)

    return save_model_once(folder, max_positions, seed, build)


@contextlib.contextmanager
def running(*servers: Server) -> Iterator[Sequence[Server]]:
    """Start every server (side by side), wait until each is ready, and stop them all on exit,
    whatever happens (a server that fails to start raises with its log's tail)."""
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        yield servers
    finally:
        for s in servers:
            s.close()


@dataclass
class Served:
    """One workload served by one instance: the generated texts (in the dataset's order), vLLM's
    benchmark result, and the server's metrics once idle, as totals (``metrics``) and as what this
    workload added (:meth:`added`)."""

    texts: List[str]
    result: Dict[str, Any]
    before: Dict[str, Any]
    metrics: Dict[str, Any]

    def added(self, name: str, **labels: str) -> float:
        return metric_sum(self.metrics, name, **labels) - metric_sum(self.before, name, **labels)


def serve(server: Server, workload: Workload) -> Served:
    """``workload`` through vLLM's own ``vllm bench serve`` against ``server``, then its metrics
    once every request and save is done."""
    before = server.metrics()
    result = bench_serve(server, workload)
    return Served(list(result["generated_texts"]), result, before, server.wait_idle())


def serve_together(pairs: Sequence[tuple]) -> List[Served]:
    """Each ``(server, workload)`` served at the same time, one load generator each."""
    before = [s.metrics() for s, _ in pairs]
    out: List[Any] = [None] * len(pairs)

    def run(i: int, server: Server, workload: Workload) -> None:
        try:
            out[i] = bench_serve(server, workload)
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, s, w)) for i, (s, w) in enumerate(pairs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in out:
        if isinstance(r, BaseException):
            raise r
    return [Served(list(r["generated_texts"]), r, b, s.wait_idle()) for r, b, (s, _) in zip(out, before, pairs)]
