"""Hosts and partitions (issue 22): the store, its holder and its lookup clients on three hosts,
Linux network namespaces on one bridge (tests/support/netns.py), and the lookup host's cable
pulled and plugged back in.

* store host: etcd and two HA masters (LocalCluster), bound to its address;
* holder host: a client whose segment holds every saved key (tests/support/partition_holder.py);
* lookup host: two lookup engines, one on a lookup-only client, one on a loading client
  (tests/support/partition_driver.py), looking up every 20 ms and streaming every answer.

The lookup host's switch port is set down (no carrier: packets vanish, nothing refuses), held
down a few seconds, and set up again. Lookups must answer the full true hit or 0 at every
moment, every call must return within the lookup's own time limit (``call_timeout_s``), and
hits must come back after the heal with nothing restarted. The figures go to docs/mooncake.md
("Partitions between hosts"); each run writes them to ``figures.json`` in its log directory.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List

import pytest

from support import netns
from support.child import gone, wait_gone
from support.streamed import StreamedChild

pytest.importorskip("mooncake.store")
pytest.importorskip("torch")
pytestmark = pytest.mark.mooncake

from mooncake_keys.store.local_cluster import LocalCluster  # noqa: E402
from mooncake_keys.store.mooncake import DEFAULT_CALL_TIMEOUT_S  # noqa: E402
from support import partition_data as data  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parents[1]
SUPPORT = REPO_ROOT / "tests" / "support"

#: Seconds the cut is held, counted on the lookups' own clock (a scenario length, not a budget).
HOLD_S = 3.0
#: Scheduling slack (seconds) over a time limit the code sets, on a busy 2-core machine.
SLACK_S = 1.0
#: Generous deadlines (seconds): only a driver that never gets there fails on them.
START_DEADLINE_S = 180.0
HEAL_DEADLINE_S = 120.0


@pytest.fixture(scope="module")
def network() -> Iterator[netns.Network]:
    """The hosts; skipped where namespaces cannot be made (under MK_REQUIRE_REAL=1 conftest
    makes that an error before any test runs)."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"cannot make network namespaces: {reason}")
    if shutil.which("etcd") is None:
        pytest.skip("etcd is not installed (apt-get install etcd-server)")
    with netns.Network(["store", "holder", "lookup", "etcd", "m0", "m1"]) as net:
        yield net


def _env(**extra: str) -> Dict[str, str]:
    return dict(os.environ, PYTHONPATH=f"{REPO_ROOT}{os.pathsep}{SUPPORT}", MC_LOG_LEVEL="ERROR", **extra)


def _first(samples: List[Dict[str, Any]], after: float, hit: int, own: bool = False) -> Dict[str, float]:
    """Per engine: seconds from ``after`` to the end of its first call started after it that
    answered ``hit`` (``own``: from that call's own start, its duration)."""
    out: Dict[str, float] = {}
    for s in samples:
        if s["t"] >= after and s["hit"] == hit and s["s"] not in out:
            out[s["s"]] = round(s["dt"] if own else s["t"] + s["dt"] - after, 3)
    return out


ENGINES = ("lookup_only", "loader")


def _hit_after_zero(engine: str, after: float) -> Callable[[Dict[str, Any]], bool]:
    """A line predicate (lines are read in order): ``engine``'s first full hit, of a call
    started after ``after``, that follows a 0 answer of a call started after ``after``."""
    seen_zero = [False]

    def pred(line: Dict[str, Any]) -> bool:
        if line.get("s") != engine or line["t"] < after:
            return False
        seen_zero[0] = seen_zero[0] or line["hit"] == 0
        return seen_zero[0] and line["hit"] == data.TOKENS

    return pred


def _partition(network: netns.Network, cluster: LocalCluster, logs: Path, cut: str,
               heal_after_failover: bool = False) -> Dict[str, Any]:
    """The holder and the lookup driver started on their hosts, ``cut``'s cable pulled, then
    plugged back in: after HOLD_S of lookups, or (``heal_after_failover``) once both engines
    hit again while it is still out (another master took over). What the driver streamed, and
    the figures."""
    env = _env(MK_MASTER=cluster.master_address)
    holder = StreamedChild([sys.executable, str(SUPPORT / "partition_holder.py")],
                           env=dict(env, MK_HOST=network.address("holder")), netns=network.netns("holder"),
                           log_path=str(logs / "holder.log"))
    driver = None
    recovered: Dict[str, Any] = {}
    try:
        saved = holder.wait_for(lambda line: "ready" in line, START_DEADLINE_S, "holder's saves")
        driver = StreamedChild([sys.executable, str(SUPPORT / "partition_driver.py")],
                               env=dict(env, MK_HOST=network.address("lookup")), netns=network.netns("lookup"),
                               log_path=str(logs / "driver.log"))
        ready = driver.wait_for(lambda line: line.get("event") == "ready", START_DEADLINE_S, "lookups before")
        t0 = time.monotonic()
        driver.wait_for(lambda line: line.get("t", 0) > t0 + 0.3, START_DEADLINE_S, "lookups streamed")

        t_cut = time.monotonic()
        network.cut(cut)
        t_cut_done = time.monotonic()
        raws = []
        if cut == "lookup":
            driver.send("raw")  # answered whenever they return: during the cut, or after the heal
        for name in ENGINES:  # every call returns: the loop goes on for HOLD_S
            driver.wait_for(lambda line, n=name: line.get("s") == n and line["t"] > t_cut + HOLD_S,
                            HEAL_DEADLINE_S, f"{name} lookups {HOLD_S} s into the cut")
        if heal_after_failover:  # hits again, after 0 answers: the other master serves
            recovered = {name: driver.wait_for(_hit_after_zero(name, t_cut_done), HEAL_DEADLINE_S,
                                               f"{name} hits from the new leader")
                         for name in ENGINES}
        t_heal = time.monotonic()
        network.heal(cut)
        back = {name: driver.wait_for(lambda line, n=name: line.get("s") == n and line["t"] >= t_heal
                                      and line["hit"] == data.TOKENS, HEAL_DEADLINE_S, f"{name} hits after heal")
                for name in ENGINES}
        t_back = max(b["t"] + b["dt"] for b in back.values())
        if cut == "lookup":
            raws = [driver.wait_for(lambda line, n=n: line.get("raw") == n, HEAL_DEADLINE_S, f"bare {n} call")
                    for n in ENGINES]
        driver.wait_for(lambda line: line.get("t", 0) > t_back + 1.0, HEAL_DEADLINE_S, "lookups after heal")
        driver.send("stop")
        done = driver.wait_for(lambda line: line.get("event") == "done", START_DEADLINE_S, "lookups after")
        samples = [line for line in driver.lines if "s" in line]
    finally:
        if driver is not None:
            driver.close()
        holder.close()
    cut_samples = [s for s in samples if t_cut_done <= s["t"] < t_heal]
    figures = {
        "cut_command_s": round(t_cut_done - t_cut, 4),
        "to_zero_after_cut_s": _first(samples, t_cut_done, 0),
        "first_zero_call_s": _first(samples, t_cut_done, 0, own=True),
        "to_hits_after_heal_s": _first(samples, t_heal, data.TOKENS),
        "worst_call_s": round(max(s["dt"] for s in samples), 3),
        "worst_call_during_cut_s": round(max(s["dt"] for s in cut_samples), 3),
        "calls_during_cut": len(cut_samples),
        "zero_answers_during_cut": sum(1 for s in cut_samples if s["hit"] == 0),
        "bare_client_call_s": {r["raw"]: [round(r["dt"], 3), r["result"], r["t"] + r["dt"] < t_heal] for r in raws},
        "hits_again_during_cut_s": {n: round(r["t"] + r["dt"] - t_cut, 3) for n, r in recovered.items()},
        "lookups": len(samples),
    }
    (logs / "figures.json").write_text(json.dumps(figures, indent=1))
    print(f"\npartition figures, {cut} cut ({logs}): {json.dumps(figures)}")
    return {"saved": saved, "ready": ready, "done": done, "samples": samples, "raws": raws, "t_cut": t_cut,
            "t_cut_done": t_cut_done, "t_heal": t_heal, "figures": figures}


@pytest.fixture(scope="module")
def cut_and_heal(network: netns.Network, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """The lookup host cut off from everything (the masters' host included), then back."""
    logs = tmp_path_factory.mktemp("partitions")
    with LocalCluster(2, host=network.address("store"), netns=network.netns("store"), log_dir=str(logs),
                      ready_timeout=START_DEADLINE_S) as cluster:
        return _partition(network, cluster, logs, "lookup")


def test_lookups_and_loads_work_across_hosts(cut_and_heal):
    assert cut_and_heal["saved"]["ready"], cut_and_heal["saved"]
    for name, hits in cut_and_heal["ready"]["before"].items():
        assert hits == [data.TOKENS] * data.PROMPTS, name
    assert cut_and_heal["ready"]["loads_ok"]  # the holder host's bytes, byte for byte, over TCP


def test_no_answer_is_false(cut_and_heal):
    """At every moment, before, during and after the cut, a hit is the full true one or 0."""
    answers = {s["hit"] for s in cut_and_heal["samples"]}
    assert answers <= {0, data.TOKENS}, answers
    before = [s for s in cut_and_heal["samples"] if s["t"] + s["dt"] < cut_and_heal["t_cut"]]
    assert before and all(s["hit"] == data.TOKENS for s in before)


def test_a_cut_link_answers_0_within_the_call_limit_and_says_why(cut_and_heal):
    """No carrier, no RST: a call to the master would wait out the client's RPC timeout; the
    lookup gives up after its own call_timeout_s (0.5 s) and answers 0, and later ones are
    refused at once while the probe cannot reach the master. The driver asks its two engines
    one after the other, so the second one's first call after the cut starts when the
    first one's gave up: from the cut, each engine answers 0 within two call limits."""
    fig = cut_and_heal["figures"]
    assert set(fig["to_zero_after_cut_s"]) == {"lookup_only", "loader"}
    for name, seconds in fig["first_zero_call_s"].items():
        assert seconds < DEFAULT_CALL_TIMEOUT_S + SLACK_S, (name, seconds)
    for name, seconds in fig["to_zero_after_cut_s"].items():
        assert seconds < 2 * DEFAULT_CALL_TIMEOUT_S + SLACK_S, (name, seconds)
    assert fig["worst_call_s"] < DEFAULT_CALL_TIMEOUT_S + SLACK_S
    cut = [s for s in cut_and_heal["samples"] if cut_and_heal["t_cut_done"] <= s["t"] < cut_and_heal["t_heal"]]
    assert cut and all(s["hit"] == 0 for s in cut)  # nothing can be asked across a cut link
    lines = cut_and_heal["done"]["log_lines"]
    assert any("lookup answered 0" in line for line in lines), lines


def test_a_bare_client_call_across_the_cut_is_bounded_by_the_rpc_timeout(cut_and_heal):
    """What bounds a Mooncake call across the cut link: the client's own request timeout,
    MC_RPC_TIMEOUT_MS (ours 1000 ms, less than the cut): it returns an error code, never a hit
    (the key asked does not exist). One that outlives the cut (a longer MC_RPC_TIMEOUT_MS) is
    answered once TCP retransmits it after the heal."""
    assert len(cut_and_heal["raws"]) == len(ENGINES)
    for raw in cut_and_heal["raws"]:
        assert raw["result"] in ([0], [-900], [-901]), raw
        if raw["t"] + raw["dt"] < cut_and_heal["t_heal"]:
            assert raw["result"][0] < 0, raw  # an error code, not an answer


def test_hits_come_back_after_the_heal_with_nothing_restarted(cut_and_heal):
    fig = cut_and_heal["figures"]
    assert set(fig["to_hits_after_heal_s"]) == {"lookup_only", "loader"}
    for name, hits in cut_and_heal["done"]["after"].items():
        assert hits == [data.TOKENS] * data.PROMPTS, name
    assert cut_and_heal["done"]["loads_ok"]


def test_processes_in_a_namespace_die_with_their_parent():
    """A master started with ``ip netns exec`` (which execs: the PID stays, and so does the death
    signal spawn asked for) dies when the process that started it is SIGKILLed; the next
    Network deletes the namespaces that process left."""
    reason = netns.unavailable()
    if reason:
        pytest.skip(f"cannot make network namespaces: {reason}")
    code = f"""
        import json, sys, time
        sys.path.insert(0, {str(SUPPORT.parent)!r})
        from support.netns import Network
        from mooncake_keys.store.local_master import LocalMaster
        net = Network(["m"]).open()
        master = LocalMaster(host=net.address("m"), netns=net.netns("m")).start()
        print(json.dumps({{"pid": master.pid, "names": net.names()}}), flush=True)
        time.sleep(600)
    """
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True,
                            env=_env())
    try:
        line = proc.stdout.readline()
        assert line, "the child printed nothing"
        info = json.loads(line)
        assert not gone(info["pid"]) and len(info["names"]) == 2
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        assert wait_gone([info["pid"]], timeout=30.0) == []
        netns.sweep_stale()
        listed = netns.ip("netns", "list").stdout
        assert not any(name in listed for name in info["names"]), listed
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def leader_cut(network: netns.Network, tmp_path_factory: pytest.TempPathFactory) -> Dict[str, Any]:
    """etcd on a host of its own, each master on its own; the leader's host cut off until the
    other master serves and both engines hit again, then plugged back in."""
    logs = tmp_path_factory.mktemp("leader-partition")
    masters = ("m0", "m1")
    with LocalCluster(2, host=network.address("etcd"), netns=network.netns("etcd"), log_dir=str(logs),
                      master_hosts=[(network.address(m), network.netns(m)) for m in masters],
                      ready_timeout=START_DEADLINE_S) as cluster:
        leader = cluster.wait_leader()
        cut = masters[cluster.masters.index(leader)]
        out = _partition(network, cluster, logs, cut, heal_after_failover=True)
        out["serving_after_heal"] = [m.serving() for m in cluster.masters]
        out["old_leader"] = cluster.masters.index(leader)
        return out


def test_a_partitioned_leader_answers_nothing_false(leader_cut):
    answers = {s["hit"] for s in leader_cut["samples"]}
    assert answers <= {0, data.TOKENS}, answers
    before = [s for s in leader_cut["samples"] if s["t"] + s["dt"] < leader_cut["t_cut"]]
    assert before and all(s["hit"] == data.TOKENS for s in before)
    assert leader_cut["figures"]["worst_call_s"] < DEFAULT_CALL_TIMEOUT_S + SLACK_S


def test_the_follower_takes_over_from_a_partitioned_leader(leader_cut):
    """The cut-off leader loses its etcd lease; the other master serves, with every key (oplog),
    while the old one is still cut off; after the heal only the new one serves."""
    assert set(leader_cut["figures"]["hits_again_during_cut_s"]) == set(ENGINES)
    for name, hits in leader_cut["done"]["after"].items():
        assert hits == [data.TOKENS] * data.PROMPTS, name
    assert leader_cut["done"]["loads_ok"]
    serving = leader_cut["serving_after_heal"]
    assert serving[1 - leader_cut["old_leader"]] and not serving[leader_cut["old_leader"]], serving
