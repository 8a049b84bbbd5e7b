"""Lookups against a real ``mooncake_master``: keys sent, round trips and time by hit fraction.

On a real master the client is no longer the cost: every key asked costs the master about a
microsecond. This module measures what a lookup costs end to end for the strategies of
:class:`mooncake_keys.LookupEngine` (``oneshot``: every key in one ``batch_is_exist``, as vLLM;
``rounds``: :mod:`mooncake_keys.lookup.rounds`) and, where vLLM 0.33 is installed, for vLLM's
own ``MooncakeStoreWorker.lookup``, on standard scenarios with the first 0, 10, 50, 90 or 100 %
of a request's prefix stored (every group, every namespace).

Set-up: a :class:`~mooncake_keys.store.local_master.LocalMaster` on 127.0.0.1 (or the master
given), one client holding a segment that stores the prefixes (64-byte values), and one
lookup-only client (Mooncake's ``rpc_only``, as a scheduler-side lookup uses) that every
implementation asks, through a counter of calls and keys. Each (scenario, fraction) has its own
request; the implementations take turns on it, round after round (interleaved, so a noisy
machine slows them alike), and the figure kept is the median. The engines run without a key
cache (each lookup builds its keys; the client side is a few percent of a lookup here).
All implementations must agree on every hit, or :func:`run_on_master` raises.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import mooncake_keys as mk

from .scenarios import SCENARIOS as BY_NAME
from .scenarios import Request, Scenario, keys_of, make_request
from .table import text_table

__all__ = ["HIT_FRACTIONS", "SCENARIOS", "IMPLS", "MasterSession", "available_impls",
           "run_on_master", "format_table", "check_targets", "plot", "store_keys", "put_keys",
           "master_for_vllm"]

#: Fractions of the prefix stored.
HIT_FRACTIONS = (0.0, 0.1, 0.5, 0.9, 1.0)
#: The scenarios measured: standard ones (``scenarios.STANDARD``) and the flagship layouts
#: (``scenarios.FLAGSHIP``: DeepSeek-V4-Flash's, Qwen3-Next's).
SCENARIOS = "abdefg"
IMPLS = ("oneshot", "rounds", "vllm")
#: The targets for rounds (docs/benchmarks.md), on scenarios a, b and e at every fraction:
#: keys at most this many times the floor (the keys the answer depends on) ...
FLOOR_RATIO_TARGET = 1.1
#: ... plus this many keys;
FLOOR_SLACK_KEYS = 600
#: at most 2 calls with full attention alone, 3 with a sliding-window group beside it;
CALLS_TARGET = {False: 2, True: 3}
#: time at a full hit at most this many times the one-shot time, and at a 10 % hit this many.
FULL_HIT_RATIO_TARGET = 1.05
TENTH_HIT_RATIO_TARGET = 0.5
#: A DeepSeek-V4 lookup (scenario f) at a 10 % hit: at most this many times vLLM 0.33's time.
DSV4_TENTH_HIT_VS_VLLM_TARGET = 0.2

Progress = Optional[Callable[[str], Any]]


def store_keys(holder: Any, keys: List[str], ptr: int, size: int, batch: int = 4096) -> None:
    """Put every key (``size`` bytes from registered memory at ``ptr``), in batches; raise on a failed put."""
    for i in range(0, len(keys), batch):
        part = keys[i:i + batch]
        rc = holder.batch_put_from(part, [ptr] * len(part), [size] * len(part))
        failed = sum(1 for x in rc if x)
        if failed:
            raise RuntimeError(f"{failed} of {len(part)} puts failed (codes {sorted(set(rc))})")


def put_keys(holder: Any, keys: List[str], size: int = 64) -> None:
    """Put every key with a ``size``-byte value (a buffer registered for the call); raise on a
    failed put."""
    buf = ctypes.create_string_buffer(size)
    ptr = ctypes.addressof(buf)
    if holder.register_buffer(ptr, size) != 0:
        raise RuntimeError("register_buffer failed")
    try:
        store_keys(holder, keys, ptr, size)
    finally:
        holder.unregister_buffer(ptr)


@contextlib.contextmanager
def master_for_vllm(segment_bytes: int = 256 << 20) -> Iterator[Tuple[Any, Any]]:
    """A ``LocalMaster`` that vLLM's Mooncake connectors find (``MOONCAKE_CONFIG_PATH`` names its
    JSON config meanwhile) and a holder client owning the store's memory: yields (master,
    holder). Everything is undone on the way out."""
    from ..store.local_master import LocalMaster
    from ..store.mooncake import MooncakeStore

    with tempfile.TemporaryDirectory() as tmp, LocalMaster(log_path=os.path.join(tmp, "master.log")) as master:
        config = os.path.join(tmp, "mooncake.json")
        with open(config, "w") as f:
            json.dump({"metadata_server": "P2PHANDSHAKE", "master_server_address": master.master_address,
                       "protocol": "tcp", "device_name": "", "global_segment_size": 64 << 20,
                       "local_buffer_size": 16 << 20}, f)
        old = os.environ.get("MOONCAKE_CONFIG_PATH")
        os.environ["MOONCAKE_CONFIG_PATH"] = config
        holder = None
        try:
            holder = MooncakeStore.connect(master.master_address, global_segment_size=segment_bytes)
            yield master, holder
        finally:
            if holder is not None:
                holder.close()
            if old is None:
                os.environ.pop("MOONCAKE_CONFIG_PATH", None)
            else:
                os.environ["MOONCAKE_CONFIG_PATH"] = old


def floor_keys(sc: Scenario, req: Request, stored_tokens: int, hit: int) -> int:
    """The keys the answer depends on, with the first ``stored_tokens`` stored in every
    namespace: every namespace of every full-attention chunk up to and including the first
    absent one (none past the request's hashes), and of the sliding window's chunks at the hit."""
    dep = sc.deployment()
    total = 0
    for g, grp in enumerate(dep.store_groups):
        bs, r = grp.spec.block_size, len(dep.heads[g])
        have = dep.chunks_with_hash(g, req.token_len, req.n)
        if isinstance(grp.spec, mk.SlidingWindowSpec):
            total += min(grp.spec.blocks_needed(False), hit // bs) * r
        elif isinstance(grp.spec, mk.MambaSpec):  # its state at the hit
            total += min(1, hit // bs) * r
        else:
            total += min(stored_tokens // bs + 1, have) * r
    return total


class _Runner:
    """One implementation on one scenario: ``lookup(request) -> hit`` through a counter."""

    def __init__(self, impl: str, scenario: Scenario, store: Any) -> None:
        self.impl = impl
        #: Passes ``batch_is_exist`` on to the lookup-only client, counting calls and keys (and,
        #: while ``record_keys`` is set, the keys found present: the read leases taken).
        self.counter = mk.RecordingStore(store, record_keys=False)
        if impl == "vllm":
            from .vllm_baseline import VllmLookup

            vllm = VllmLookup(scenario, self.counter)
            self.lookup = lambda req: vllm.lookup(req.token_len, req.blob, req.hash_len)
        else:
            engine = mk.LookupEngine.for_deployment(scenario.deployment(), store=self.counter, strategy=impl,
                                                    key_cache_bytes=0)
            self.lookup = lambda req: engine.lookup(req.token_len, mk.BlockHashes.from_blob(req.blob, req.hash_len))


def _fraction_request(sc: Scenario, fraction: float) -> Request:
    # Request numbers 1000+ are this module's, one per fraction, none shared with another one.
    return make_request(sc, 1000 + int(round(fraction * 100)))


def _stored_tokens(sc: Scenario, fraction: float) -> int:
    sbs = sc.scheduler_block_size
    return int(sc.token_len * fraction) // sbs * sbs


class MasterSession:
    """A master (started here unless an address is given), a client holding the stored prefixes
    and a lookup-only client that the implementations ask. Use as a context manager."""

    def __init__(self, master_address: Optional[str] = None) -> None:
        self.master_address = master_address
        self.master: Any = None
        self.holder: Any = None
        self.looker: Any = None
        self._value: Any = None
        self._ptr = 0
        self._stored: Dict[tuple, Request] = {}

    def __enter__(self) -> "MasterSession":
        from ..store.local_master import LocalMaster
        from ..store.mooncake import MooncakeStore

        try:
            if self.master_address is None:
                self.master = LocalMaster().start()
                self.master_address = self.master.master_address
            self.holder = MooncakeStore.connect(self.master_address, global_segment_size=512 << 20)
            self.looker = MooncakeStore.connect(self.master_address, lookup_only=True)
            self._value = ctypes.create_string_buffer(4096)
            self._ptr = ctypes.addressof(self._value)
            if self.holder.register_buffer(self._ptr, len(self._value)) != 0:
                raise RuntimeError("register_buffer failed")
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        for store in (self.looker, self.holder):
            if store is not None:
                store.close()
        self.looker = self.holder = None
        if self.master is not None:
            self.master.stop()
            self.master = None

    def stored_request(self, sname: str, fraction: float) -> Request:
        """The request of (scenario, fraction), its first ``fraction`` of the prefix stored
        (every group, every namespace); stored once per session."""
        key = (sname, fraction)
        if key not in self._stored:
            sc = BY_NAME[sname]
            req = _fraction_request(sc, fraction)
            store_keys(self.holder, keys_of(sc, req, _stored_tokens(sc, fraction)), self._ptr, 64)
            self._stored[key] = req
        return self._stored[key]

    def runner(self, impl: str, sname: str) -> "_Runner":
        return _Runner(impl, BY_NAME[sname], self.looker)


def available_impls() -> List[str]:
    """``IMPLS`` without ``vllm`` where vLLM 0.33 is not installed."""
    from ..bench.vllm_baseline import unavailable

    return [i for i in IMPLS if i != "vllm" or unavailable() is None]


def run_on_master(*, scenarios: str = SCENARIOS, fractions: Sequence[float] = HIT_FRACTIONS, repeat: int = 15,
                  master_address: Optional[str] = None, progress: Progress = None) -> List[Dict[str, Any]]:
    """Measure; one row per (scenario, fraction, impl) with ``keys`` and ``calls`` per lookup,
    ``ms`` (median), ``ratio_vs_oneshot``, ``hit`` (tokens) and ``stored_tokens``.

    Starts a :class:`LocalMaster` unless ``master_address`` is given (then the prefixes are
    stored there too). Raises RuntimeError when implementations disagree on a hit.
    """
    impls = available_impls()
    rows: List[Dict[str, Any]] = []
    with MasterSession(master_address) as session:
        for sname in scenarios:
            runners = {impl: session.runner(impl, sname) for impl in impls}
            for fraction in fractions:
                req = session.stored_request(sname, fraction)
                stored = _stored_tokens(BY_NAME[sname], fraction)
                rows += _measure(sname, fraction, stored, req, runners, repeat)
                if progress:
                    progress(f"scenario {sname}, {fraction:.0%} stored")
    return rows


def _measure(sname: str, fraction: float, stored: int, req: Request, runners: Dict[str, _Runner],
             repeat: int) -> List[Dict[str, Any]]:
    hits: Dict[str, int] = {}
    counts: Dict[str, tuple] = {}
    for impl, r in runners.items():  # once untimed: the answer, keys, calls and leases of one lookup
        c0, k0, p0 = r.counter.num_calls, r.counter.keys_asked, r.counter.keys_present
        r.counter.record_keys = True
        hits[impl] = r.lookup(req)
        r.counter.record_keys = False
        r.counter.calls.clear()
        counts[impl] = (r.counter.num_calls - c0, r.counter.keys_asked - k0, r.counter.keys_present - p0)
    if len(set(hits.values())) != 1:
        raise RuntimeError(f"scenario {sname}, {fraction:.0%} stored: implementations disagree: {hits}")
    times: Dict[str, List[float]] = {impl: [] for impl in runners}
    order = list(runners)
    for rnd in range(repeat):
        for impl in order[rnd % len(order):] + order[:rnd % len(order)]:  # a new first one each round
            t0 = time.perf_counter()
            runners[impl].lookup(req)
            times[impl].append((time.perf_counter() - t0) * 1e3)
    median = {impl: statistics.median(t) for impl, t in times.items()}
    floor = floor_keys(BY_NAME[sname], req, stored, hits["oneshot"])
    return [dict(scenario=sname, fraction=fraction, stored_tokens=stored, token_len=req.token_len, impl=impl,
                 hit=hits[impl], calls=counts[impl][0], keys=counts[impl][1], leases=counts[impl][2],
                 floor=floor, ms=median[impl], ratio_vs_oneshot=median[impl] / median["oneshot"])
            for impl in runners]


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    return text_table(
        [("scenario", "8"), ("stored", "6.0%"), ("impl", "8"), ("hit", "7d"), ("calls", "5d"), ("keys", "7d"),
         ("floor", "6d"), ("keys/floor", "10.2f"), ("leases", "7d"), ("ms", "8.2f"), ("vs oneshot", "10.3f")],
        [(r["scenario"], r["fraction"], r["impl"], r["hit"], r["calls"], r["keys"], r["floor"],
          r["keys"] / max(1, r["floor"]), r["leases"], r["ms"], r["ratio_vs_oneshot"]) for r in rows])


def check_targets(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The targets for rounds (docs/benchmarks.md), each 'met' or 'NOT met' with the figures:
    per scenario, keys within the floor's bound and calls at every fraction, and the time at a
    full and at a 10 % hit."""
    out = []
    rounds = [r for r in rows if r["impl"] == "rounds" and r["scenario"] in "abe"]
    for sname in sorted({r["scenario"] for r in rounds}):
        mine = [r for r in rounds if r["scenario"] == sname]
        swa = any(isinstance(g.spec, mk.SlidingWindowSpec) for g in BY_NAME[sname].groups)
        worst = max(mine, key=lambda r: r["keys"] / (FLOOR_RATIO_TARGET * r["floor"] + FLOOR_SLACK_KEYS))
        ok = all(r["keys"] <= FLOOR_RATIO_TARGET * r["floor"] + FLOOR_SLACK_KEYS for r in mine)
        out.append(f"target {sname}: keys <= {FLOOR_RATIO_TARGET:g} x floor + {FLOOR_SLACK_KEYS} at every fraction: "
                   f"closest at {worst['fraction']:.0%} ({worst['keys']} keys, floor {worst['floor']}), "
                   f"{'met' if ok else 'NOT met'}")
        calls = max(r["calls"] for r in mine)
        out.append(f"target {sname}: at most {CALLS_TARGET[swa]} calls: {calls}, "
                   f"{'met' if calls <= CALLS_TARGET[swa] else 'NOT met'}")
        for fraction, target in ((1.0, FULL_HIT_RATIO_TARGET), (0.1, TENTH_HIT_RATIO_TARGET)):
            row = next((r for r in mine if r["fraction"] == fraction), None)
            if row is not None:
                verdict = "met" if row["ratio_vs_oneshot"] <= target else "NOT met"
                out.append(f"target {sname}: time at a {fraction:.0%} hit <= {target:g}x one-shot: "
                           f"{row['ratio_vs_oneshot']:.3f}x, {verdict}")
    by = {(r["scenario"], r["fraction"], r["impl"]): r for r in rows}
    mine, theirs = by.get(("f", 0.1, "rounds")), by.get(("f", 0.1, "vllm"))
    if mine is not None and theirs is not None:
        ratio = mine["ms"] / theirs["ms"]
        verdict = "met" if ratio <= DSV4_TENTH_HIT_VS_VLLM_TARGET else "NOT met"
        out.append(f"target f (DeepSeek-V4-Flash): time at a 10% hit <= {DSV4_TENTH_HIT_VS_VLLM_TARGET:g}x vLLM 0.33: "
                   f"{ratio:.3f}x ({mine['ms']:.2f} ms against {theirs['ms']:.2f} ms), {verdict}")
    return out


def plot(rows: Sequence[Dict[str, Any]], path: str) -> Optional[str]:
    """One column per scenario, against the stored fraction: lookup time (top) and keys asked,
    keys found present (the leases) and the floor (bottom, log scale); None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import os

    names = sorted({r["scenario"] for r in rows})
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 7.0), dpi=110, squeeze=False)
    styles = {"oneshot": ("o-", "mooncake_keys one-shot"), "rounds": ("s-", "mooncake_keys rounds"),
              "vllm": ("D--", "vLLM 0.33 (its own lookup)")}
    for col, sname in enumerate(names):
        top, bottom = axes[0][col], axes[1][col]
        mine = [r for r in rows if r["scenario"] == sname]
        for impl, (style, label) in styles.items():
            pts = [r for r in mine if r["impl"] == impl]
            if pts:
                top.plot([r["fraction"] * 100 for r in pts], [r["ms"] for r in pts], style, label=label)
        for impl, field, style, label in (("oneshot", "keys", "o-", "keys asked, one-shot (and vLLM)"),
                                          ("rounds", "keys", "s-", "keys asked, rounds"),
                                          ("oneshot", "leases", "o:", "present: leases, one-shot"),
                                          ("rounds", "leases", "s:", "present: leases, rounds"),
                                          ("rounds", "floor", "--", "floor (keys the answer needs)")):
            pts = [r for r in mine if r["impl"] == impl and r[field] > 0]
            if pts:
                bottom.plot([r["fraction"] * 100 for r in pts], [r[field] for r in pts], style, label=label,
                            color="black" if field == "floor" else None, alpha=0.8)
        keys = max(r["keys"] for r in mine)
        top.set_title(f"scenario {sname} ({keys} keys one-shot)", fontsize=9)
        top.set_ylabel("ms per lookup (median)")
        top.set_ylim(bottom=0)
        bottom.set_yscale("log")
        bottom.set_ylabel("keys per lookup")
        for ax in (top, bottom):
            ax.set_xlabel("prefix stored (%)")
            ax.grid(True, alpha=0.3)
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=6)
    fig.suptitle("Lookups on a real mooncake_master (loopback), one run side by side", fontsize=10)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path
