"""The serving benchmark and demo (``mooncake_keys bench --serve``, ``demo --serve``) from the
command line: bad arguments refused before anything starts, the table and the targets printed
from what was measured, the plot only where asked; the figures a row is made of; and what
:mod:`mooncake_keys.bench.serve` reads of a server (its ``/metrics``) and starts it with. The runs
themselves, inside vLLM's real server, are tests/engine/test_serve.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mooncake_keys import cli
from mooncake_keys.bench import engine_bench, serve_bench, serve_demo
from mooncake_keys.bench.engine import MatchedCall
from mooncake_keys.bench.serve import Server, ServerSpec, Workload, kv_transfer_config, metric_sum, scrape


@pytest.mark.parametrize("argv, message", [
    (["bench", "--serve", "--quick", "--serve-plot", "serve.txt"], "must end in .png"),
    (["bench", "--serve", "--serve-plot", "/proc/serve.png"], "cannot write the plot"),
    (["bench", "--serve-plot", "serve.png"], "--serve-plot is the plot of --serve"),
    (["bench", "--serve", "--engine"], "--engine and --serve are two benchmarks"),
    (["bench", "--serve", "--repeat", "3"], "--serve takes --quick and --serve-plot only, not --repeat"),
    (["bench", "--serve", "--engine-plot", "e.png"], "not --engine-plot"),
    (["demo", "--serve", "--memory"], "--serve takes no --memory"),
    (["demo", "--serve", "--vllm"], "--vllm and --serve are two demos"),
])
def test_bad_arguments_are_refused_before_anything_starts(argv, message):
    out = subprocess.run([sys.executable, "-m", "mooncake_keys", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert message in out.stderr


EXPOSITION = """\
# HELP vllm:external_prefix_cache_hits External prefix cache hits.
# TYPE vllm:external_prefix_cache_hits counter
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 1248.0
vllm:external_prefix_cache_hits_created{engine="0",model_name="m"} 1.79e+09
# HELP vllm:mooncake_store_operation Store operations.
# TYPE vllm:mooncake_store_operation counter
vllm:mooncake_store_operation_total{engine="0",model_name="m",operation="lookup_exists",status="ok"} 3.0
vllm:mooncake_store_operation_total{engine="0",model_name="m",operation="save_put",status="ok"} 8.0
vllm:mooncake_store_operation_total{engine="1",model_name="m",operation="lookup_exists",status="ok"} 2.0
# HELP vllm:mooncake_keys_lookup_seconds Lookup latency.
# TYPE vllm:mooncake_keys_lookup_seconds histogram
vllm:mooncake_keys_lookup_seconds_bucket{engine="0",le="0.001",model_name="m",side="scheduler"} 2.0
vllm:mooncake_keys_lookup_seconds_bucket{engine="0",le="+Inf",model_name="m",side="scheduler"} 4.0
vllm:mooncake_keys_lookup_seconds_count{engine="0",model_name="m",side="scheduler"} 4.0
vllm:mooncake_keys_lookup_seconds_sum{engine="0",model_name="m",side="scheduler"} 0.01
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.0
"""


def test_a_scrape_reads_vllms_exposition():
    m = scrape(EXPOSITION)
    assert metric_sum(m, "vllm:external_prefix_cache_hits_total") == 1248
    assert "vllm:external_prefix_cache_hits_created" not in m
    assert metric_sum(m, "vllm:mooncake_store_operation_total", operation="lookup_exists") == 5
    assert metric_sum(m, "vllm:mooncake_store_operation_total", operation="lookup_exists", engine="1") == 2
    assert metric_sum(m, "vllm:mooncake_keys_lookup_seconds_count", side="scheduler") == 4
    assert metric_sum(m, "vllm:mooncake_keys_lookup_seconds_bucket", le="+Inf") == 4
    assert metric_sum(m, "vllm:kv_cache_usage_perc") == 0 and "vllm:kv_cache_usage_perc" in m
    assert metric_sum(m, "vllm:no_such_metric") == 0


def test_a_server_is_started_as_vllm_serve_with_the_connector_asked_for(tmp_path):
    assert kv_transfer_config("none") is None
    assert kv_transfer_config("vllm", {"lookup_async": True}) == {
        "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lookup_async": True}}
    fast = kv_transfer_config("fast")
    assert (fast["kv_connector"], fast["kv_connector_module_path"]) == ("FastMooncakeStoreConnector",
                                                                        "mooncake_keys.vllm")
    with pytest.raises(ValueError, match="connector must be"):
        kv_transfer_config("lmcache")
    cmd = ServerSpec("/m/tiny", "fast", {"lookup_in_scheduler": True}, args=["--foo"]).command("py", 8123)
    assert cmd[:3] == ["py", "-m", "vllm.entrypoints.openai.api_server"] and cmd[-1] == "--foo"
    assert cmd[cmd.index("--port") + 1] == "8123" and "--enable-prefix-caching" in cmd
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"] == {"lookup_in_scheduler": True}
    assert "--kv-transfer-config" not in ServerSpec("/m/tiny").command("py", 1)
    with pytest.raises(ValueError, match="needs a store"):
        Server(ServerSpec("/m/tiny", "vllm"), None)


def test_a_workload_is_vllms_prefix_repetition_dataset_greedy():
    w = Workload(num_prefixes=4, prompts_per_prefix=8, prefix_len=2048, suffix_len=128, seed=3, max_concurrency=1)
    args = w.args()
    assert w.num_prompts == 32
    for flag, value in (("--dataset-name", "prefix_repetition"), ("--num-prompts", "32"),
                        ("--prefix-repetition-num-prefixes", "4"), ("--prefix-repetition-prefix-len", "2048"),
                        ("--seed", "3"), ("--temperature", "0"), ("--max-concurrency", "1"),
                        ("--request-rate", "inf")):
        assert args[args.index(flag) + 1] == value, flag
    assert "--ignore-eos" in args


def fake_row(run, instance, workload, ttft, keys, calls_per=1.0):
    n = 32
    before = scrape(EXPOSITION)
    after = scrape(EXPOSITION.replace(' 3.0\n', f' {3 + calls_per * n}\n'))
    after.setdefault("vllm:mooncake_store_operation_keys_total", []).append(
        ({"operation": "lookup_exists"}, float(keys * n)))
    after["vllm:mooncake_store_operation_keys_total"].append(({"operation": "load_get"}, 64.0 * n))
    after["vllm:request_queue_time_seconds_sum"] = [({}, 0.032 * n)]
    after["vllm:request_queue_time_seconds_count"] = [({}, float(n))]
    after.setdefault("vllm:mooncake_keys_lookups_total", []).append(
        ({"side": "scheduler", "outcome": "hit"}, float(n if run.connector == "fast" else 0)))
    result = {"total_input_tokens": n * 2176, "median_ttft_ms": ttft, "p99_ttft_ms": 2 * ttft, "mean_ttft_ms": ttft,
              "request_throughput": 10.0, "duration": 3.2, "generated_texts": ["w1 w2"] * n}
    calls = [MatchedCall(1.0 + i, 7 + i // 16, 0.002, True, str(i)) for i in range(n)]
    return serve_bench.row(run, instance, workload, Workload(4, 8, 2048, 128), result, before, after, calls)


def measured():
    """Two rounds: vLLM's connector's B at 200 then 400 ms, the drop-in's at 100 then 300 ms."""
    vllm, ours = serve_bench.RUNS[0], serve_bench.RUNS[2]
    rows = []
    for r, slower in ((0, 0.0), (1, 200.0)):
        rows += [fake_row(vllm, "A", "burst", 300.0 + slower, 68), fake_row(vllm, "B", "burst", 200.0 + slower, 68),
                 fake_row(ours, "A", "burst", 290.0 + slower, 70),
                 fake_row(ours, "B", "burst", 100.0 + slower, 5.5, calls_per=0.125)]
        for row in rows[-4:]:
            row["round"] = r
    return rows


def test_a_row_is_what_the_servers_counters_gained_during_its_workload():
    row = measured()[3]
    assert (row["run"], row["instance"], row["answered_by"], row["requests"]) == (
        "drop-in in scheduler async", "B", "mk scheduler", 32)
    assert row["external_hits"] == 0  # unchanged between the two scrapes
    assert row["master_calls_per_request"] == pytest.approx(0.125)
    assert (row["master_keys_per_request"], row["loaded_keys_per_request"]) == (5.5, 64.0)
    assert (row["sched_calls"], row["sched_ms"]) == (32, pytest.approx(64.0))
    assert row["sched_ms_worst_step"] == pytest.approx(32.0)  # 16 calls of 2 ms in each of two steps
    assert (row["ttft_ms_p50"], row["ttft_ms_p99"]) == (100.0, 200.0)
    assert row["queue_ms"] == pytest.approx(32.0)  # vLLM's histogram: its sum over its count
    assert row["prefill_ms"] != row["prefill_ms"]  # no such histogram: nan, not 0
    assert measured()[1]["answered_by"] == "vLLM rank 0"


def test_the_summary_keeps_each_figures_median_over_rounds():
    got = {(r["run"], r["instance"]): r for r in serve_bench.summary(measured())}
    assert len(got) == 4 and all(r["rounds"] == 2 for r in got.values())
    assert got[("vLLM", "B")]["ttft_ms_p50"] == 300.0 and got[("drop-in in scheduler async", "B")]["ttft_ms_p50"] == 200.0
    assert [r["instance"] for r in serve_bench.summary(measured())] == ["A", "A", "B", "B"]


def test_the_targets_are_the_warm_instances_ratios_round_by_round():
    got = {t["figure"]: t for t in serve_bench.targets(measured())}
    p50 = got["TTFT p50"]
    assert p50["ratios"] == pytest.approx([0.5, 0.75]) and p50["ratio"] == pytest.approx(0.625) and p50["met"]
    assert (p50["ours"], p50["theirs"]) == (200.0, 300.0)
    assert got["TTFT p99"]["ratio"] == pytest.approx(0.625) and got["TTFT p99"]["met"]
    assert got["master keys per request"]["ratio"] == pytest.approx(5.5 / 68) and got["master keys per request"]["met"]
    rows = measured()
    rows[3]["ttft_ms_p99"] = rows[7]["ttft_ms_p99"] = 0.95 * rows[1]["ttft_ms_p99"]  # 0.95x and 0.475x
    assert [t["met"] for t in serve_bench.targets(rows) if t["figure"] == "TTFT p99"] == [True]
    rows[7]["ttft_ms_p99"] = 0.95 * rows[5]["ttft_ms_p99"]
    assert [t["met"] for t in serve_bench.targets(rows) if t["figure"] == "TTFT p99"] == [False]
    assert "0.95 0.95" in serve_bench.format_targets(rows)


@pytest.fixture
def serve_runs(monkeypatch):
    calls = []

    def fake_measure(**kw):
        calls.append(kw)
        return [dict(r, texts=None) for r in measured()]

    monkeypatch.setattr(serve_bench, "unavailable", lambda: None)
    monkeypatch.setattr(serve_bench, "measure", fake_measure)
    return calls


def test_the_serving_benchmark_prints_its_table_and_targets_and_plots_only_where_asked(serve_runs, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    assert cli.main(["bench", "--serve", "--quick"]) == 0
    out = capsys.readouterr().out
    assert serve_runs[0]["quick"] is True and os.listdir(tmp_path) == []
    assert "drop-in in scheduler async" in out and "mk scheduler" in out and "targets" in out
    assert "TTFT p99" in out and "master keys per request" in out and " yes" in out
    plot = tmp_path / "docs" / "serve.png"
    assert cli.main(["bench", "--serve", "--serve-plot", str(plot)]) == 0
    assert serve_runs[-1]["quick"] is False and f"plot: {plot}" in capsys.readouterr().out
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_serving_benchmark_says_why_it_cannot_run(serve_runs, monkeypatch, capsys):
    monkeypatch.setattr(serve_bench, "unavailable", lambda: "vLLM is not installed here")
    assert cli.main(["bench", "--serve"]) == 2
    err = capsys.readouterr().err
    assert "cannot run here: vLLM is not installed here" in err and "bash scripts/dev.sh bench --serve" in err
    assert serve_runs == []


def test_the_serving_demo_says_whether_the_outputs_were_the_same(monkeypatch, capsys):
    def fake_demo(same):
        def run(progress=None):
            first = {"instance": 1, "requests": 16, "prompt_tokens": 36864, "store_hits": 0, "local_hits": 28672,
                     "ttft_p50": 900.0, "ttft_p99": 1500.0, "answered_by": "mooncake_keys (rank 0)"}
            second = dict(first, instance=2, store_hits=36352, local_hits=0, ttft_p50=120.0, ttft_p99=200.0)
            return {"instances": [first, second], "same_outputs": same}
        return run

    monkeypatch.setattr(engine_bench, "unavailable", lambda: None)
    monkeypatch.setattr(serve_demo, "run_serve_demo", fake_demo(True))
    assert cli.main(["demo", "--serve"]) == 0
    out = capsys.readouterr().out
    assert "same outputs: yes" in out and "36,352" in out and "mooncake_keys (rank 0)" in out
    monkeypatch.setattr(serve_demo, "run_serve_demo", fake_demo(False))
    assert cli.main(["demo", "--serve"]) == 1
    assert "same outputs: NO" in capsys.readouterr().out
