"""The drop-in's metrics, through vLLM's own KV-connector metrics: on vLLM's ``/metrics`` and in
its "KV Transfer metrics" log line.

vLLM's Mooncake store connector records one row per store operation in a
``MooncakeStoreConnectorStats`` (``data[operation] -> [record, ...]``); vLLM carries the rows
from the workers (and the scheduler) to its front end, rebuilds them with the connector class's
``build_kv_connector_stats`` and hands them to ``build_prom_metrics``'s ``observe``. The drop-in
adds its own rows under :data:`LOOKUP` (one per lookup mooncake_keys answered, on rank 0's
worker or in the scheduler) and :data:`FALLBACK` (one per reason vLLM's own lookup was kept),
and its classes (:class:`ConnectorStats`, :class:`PromMetrics`) read them beside vLLM's own.

Metrics, each with vLLM's ``model_name``/``engine`` labels (sizes in tokens and keys; the names
and meanings are :mod:`mooncake_keys.metrics`' table, shared with ``LookupMetrics``):

* ``vllm:mooncake_keys_lookups_total{outcome, side}``: lookups answered, by outcome (``hit``,
  ``miss``, ``fault``: a store call failed and the lookup answered 0) and where (``worker``:
  rank 0, asked over vLLM's ZMQ channel; ``scheduler``: in the scheduler);
* ``vllm:mooncake_keys_lookup_tokens_total{side}`` and ``..._hit_tokens_total{side}``: the
  tokens asked and hit (their ratio is the hit rate vLLM reports for those lookups);
* ``vllm:mooncake_keys_lookup_keys_total{side}``, ``..._calls_total{side}`` and
  ``..._present_keys_total{side}``: keys asked, store calls (rounds), keys found present (on
  Mooncake each took a read lease);
* ``vllm:mooncake_keys_lookup_seconds{side}``: lookup latency (histogram);
* ``vllm:mooncake_keys_store_unavailable_seconds_total{side}``: time the store could not be asked;
* ``vllm:mooncake_keys_lookup_leased_keys_total{side}``: read leases the lookups took (with
  Mooncake 0.3.14's lease-free probes or key events: exactly the keys the hits load);
* ``vllm:mooncake_keys_lookups_without_call_total{side}`` and ``..._lookup_mirror_keys_total{side}``:
  lookups the key-event mirror answered with no store call, and keys it answered;
* with ``"key_events"`` configured, the mirror's state: ``vllm:mooncake_keys_key_event_messages_total``,
  ``..._key_events_seen_total``,
  ``..._key_events_total``, ``..._key_event_gaps_total``, ``..._key_mirror_rebuilds_total``
  (``{side}``) and the gauges ``..._key_mirror_keys`` and ``..._key_mirror_complete``;
* ``vllm:mooncake_keys_fallback_info{reason}``: 1 for each reason vLLM's own lookup was kept;
* ``vllm:mooncake_keys_shared_load_waits_total{outcome}`` and
  ``..._shared_load_wait_seconds_total``: requests that waited for another request's load of
  their blocks (``share_loads``), by how the wait ended (``landed``: that load landed;
  ``dropped``: that load ended without landing, its request aborted or its end not reported in
  time; ``expired``: it waited the most it may; in the last two it loads itself), and the time
  they waited.

The rows travel as plain dicts of numbers and strings (vLLM serializes them between processes);
a lookup row also has the fields of vLLM's own rows, so vLLM's classes read it without failing.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List

from vllm.distributed.kv_transfer.kv_connector.v1.mooncake.store.metrics import (
    MooncakeStoreConnectorStats,
    MooncakeStorePromMetrics,
)

from ..lookup.engine import LookupRecord
from ..lookup.shared_loads import OUTCOMES
from ..metrics import (COUNTERS, LATENCY_BUCKETS, LATENCY_DOC, LOOKUPS_DOC, MIRROR_COUNTERS, MIRROR_GAUGES,
                       observe_mirror)

__all__ = ["LOOKUP", "FALLBACK", "SHARED_WAIT", "MAX_ROWS", "ConnectorStats", "PromMetrics", "add_row", "lookup_row", "record_of_row",
           "fallback_row", "shared_wait_row", "recorder"]

#: The stats key of the drop-in's lookup rows, and of its fallback rows.
LOOKUP = "mooncake_keys_lookup"
FALLBACK = "mooncake_keys_fallback"
#: The stats key of the rows of requests that waited for another request's load (share_loads).
SHARED_WAIT = "mooncake_keys_shared_load_wait"
OURS = (LOOKUP, FALLBACK, SHARED_WAIT)

#: The most rows of one kind kept between two reads of the stats: vLLM reads them every step,
#: but an engine that never asks (stats off) must not grow without bound; past it, rows drop.
MAX_ROWS = 100_000

def lookup_row(rec: LookupRecord, side: str) -> Dict[str, Any]:
    """The stats row of one lookup (``side``: "worker" or "scheduler")."""
    return {
        # vLLM's own row fields (so MooncakeStoreConnectorStats.reduce reads it)
        "duration_seconds": rec.seconds, "num_keys": rec.keys, "num_bytes": 0,
        "status": "error" if rec.outcome == "fault" else "ok",
        "num_failed_keys": rec.keys if rec.outcome == "fault" else 0,
        # the drop-in's
        "side": side, "outcome": rec.outcome, "num_tokens": rec.num_tokens, "hit_tokens": rec.hit_tokens,
        "calls": rec.calls, "present_keys": rec.present_keys, "unavailable_seconds": rec.unavailable_seconds,
        "leased_keys": rec.leased_keys, "mirror_keys": rec.mirror_keys, "answered_without_call": rec.answered_without_call,
        # the key-event mirror's totals (None without one): plain numbers, they cross processes
        "mirror": None if rec.mirror is None else {f: int(getattr(rec.mirror, f)) for _, _, f in
                                                    MIRROR_COUNTERS + MIRROR_GAUGES},
    }


def record_of_row(row: Dict[str, Any]) -> LookupRecord:
    """The lookup a :func:`lookup_row` describes (rows cross processes as plain dicts)."""
    return LookupRecord(int(row["num_tokens"]), int(row["hit_tokens"]), int(row["num_keys"]), int(row["calls"]),
                        int(row["present_keys"]), str(row["outcome"]), float(row["duration_seconds"]),
                        float(row["unavailable_seconds"]), int(row.get("leased_keys", 0)), int(row.get("mirror_keys", 0)),
                        int(row.get("answered_without_call", 0)), row.get("mirror"))


def fallback_row(reason: str) -> Dict[str, Any]:
    """The stats row saying vLLM's own lookup was kept, and why (one line of text)."""
    return {"duration_seconds": 0.0, "num_keys": 0, "num_bytes": 0, "status": "ok", "num_failed_keys": 0,
            "reason": reason[:200]}


def shared_wait_row(seconds: float, outcome: str) -> Dict[str, Any]:
    """The stats row of a request that waited ``seconds`` for another request's load, ended
    with ``outcome`` (one of :data:`mooncake_keys.lookup.shared_loads.OUTCOMES`)."""
    if outcome not in OUTCOMES:
        raise ValueError(f"outcome must be one of {OUTCOMES}, got {outcome!r}")
    return {"seconds": float(seconds), "outcome": outcome}


def add_row(data: Dict[str, List[Dict[str, Any]]], operation: str, row: Dict[str, Any]) -> None:
    """Append ``row`` to ``data[operation]``, unless :data:`MAX_ROWS` rows wait there already."""
    rows = data.setdefault(operation, [])
    if len(rows) < MAX_ROWS:
        rows.append(row)


def recorder(append: Callable[[str, Dict[str, Any]], None], side: str) -> Callable[[LookupRecord], None]:
    """An engine observer appending each lookup's row with ``append(LOOKUP, row)``."""
    def observe(rec: LookupRecord) -> None:
        append(LOOKUP, lookup_row(rec, side))

    return observe


class ConnectorStats(MooncakeStoreConnectorStats):
    """vLLM's Mooncake stats with the drop-in's rows: its summary for vLLM's log line reads
    them apart (lookups, hit rate, keys and calls per lookup, leases) from vLLM's operations."""

    def reduce(self) -> Dict[str, Any]:
        ours = {k: self.data.pop(k) for k in OURS if k in self.data}
        try:
            reduced: Dict[str, Any] = super().reduce()
        finally:
            self.data.update(ours)
        rows: List[Dict[str, Any]] = ours.get(LOOKUP, [])
        if rows:
            n = len(rows)
            tokens = sum(int(r["num_tokens"]) for r in rows)
            reduced.update({
                "mooncake_keys_lookups": n,
                "mooncake_keys_hit_rate": round(sum(int(r["hit_tokens"]) for r in rows) / tokens, 4) if tokens else 0.0,
                "mooncake_keys_keys_per_lookup": round(sum(int(r["num_keys"]) for r in rows) / n, 1),
                "mooncake_keys_calls_per_lookup": round(sum(int(r["calls"]) for r in rows) / n, 2),
                "mooncake_keys_present_keys": sum(int(r["present_keys"]) for r in rows),
                "mooncake_keys_leased_keys": sum(int(r.get("leased_keys", 0)) for r in rows),
                "mooncake_keys_faults": sum(1 for r in rows if r["outcome"] == "fault"),
            })
            mirrors = [r["mirror"] for r in rows if r.get("mirror")]
            if mirrors:
                reduced.update({
                    "mooncake_keys_without_call": sum(int(r.get("answered_without_call", 0)) for r in rows),
                    "mooncake_keys_mirror_keys": mirrors[-1]["keys"],
                    "mooncake_keys_mirror_gaps": mirrors[-1]["gaps"],
                })
        waits = ours.get(SHARED_WAIT, [])
        if waits:
            reduced["mooncake_keys_shared_load_waits"] = len(waits)
            reduced["mooncake_keys_shared_load_wait_ms"] = round(sum(float(r["seconds"]) for r in waits)
                                                                  * 1e3 / len(waits), 1)
        for r in ours.get(FALLBACK, []):
            reduced[f"mooncake_keys_fallback: {r['reason']}"] = 1
        return reduced


class PromMetrics(MooncakeStorePromMetrics):
    """vLLM's Mooncake Prometheus metrics, and the drop-in's (see the module docstring)."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: List[str],
                 per_engine_labelvalues: Dict[int, List[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        side = labelnames + ["side"]
        counter, histogram, gauge = self._counter_cls, self._histogram_cls, self._gauge_cls
        self._lookups = counter(name="vllm:mooncake_keys_lookups_total", labelnames=labelnames + ["outcome", "side"],
                                documentation=f"mooncake_keys: {LOOKUPS_DOC}")
        self._counters = [(counter(name=f"vllm:mooncake_keys_{name}_total", labelnames=side,
                                   documentation=f"mooncake_keys: {doc}"), field) for name, doc, field in COUNTERS]
        self._latency = histogram(name="vllm:mooncake_keys_lookup_seconds", labelnames=side,
                                  buckets=list(LATENCY_BUCKETS), documentation=f"mooncake_keys: {LATENCY_DOC}")
        self._fallback = gauge(name="vllm:mooncake_keys_fallback_info", labelnames=labelnames + ["reason"],
                               documentation="1 for each reason vLLM's own Mooncake lookup was kept.",
                               multiprocess_mode="mostrecent")
        self._shared_waits = counter(name="vllm:mooncake_keys_shared_load_waits_total",
                                     labelnames=labelnames + ["outcome"],
                                     documentation="mooncake_keys: requests that waited for another request's load "
                                                   "of their blocks (share_loads), by how the wait ended (landed, "
                                                   "dropped: that load did not land, expired: waited 1 s).")
        self._mirror_counters = [(counter(name=f"vllm:mooncake_keys_{name}_total", labelnames=side,
                                          documentation=f"mooncake_keys: {doc}"), field)
                                 for name, doc, field in MIRROR_COUNTERS]
        self._mirror_gauges = [(gauge(name=f"vllm:mooncake_keys_{name}", labelnames=side,
                                      documentation=f"mooncake_keys: {doc}", multiprocess_mode="mostrecent"), field)
                               for name, doc, field in MIRROR_GAUGES]
        self._mirror_seen: Dict[tuple, Dict[str, int]] = {}  # per (engine, side): the totals counted
        self._shared_wait_seconds = counter(name="vllm:mooncake_keys_shared_load_wait_seconds_total",
                                            labelnames=labelnames,
                                            documentation="mooncake_keys: seconds requests waited for another "
                                                          "request's load of their blocks (share_loads).")

    def observe(self, transfer_stats_data: Any, engine_idx: int = 0) -> None:
        if not transfer_stats_data:
            return
        data = dict(transfer_stats_data)
        ours = {k: data.pop(k) for k in OURS if k in data}
        super().observe(data, engine_idx)
        labels = list(self.per_engine_labelvalues[engine_idx])
        for r in ours.get(LOOKUP, []):
            side = labels + [str(r["side"])]
            rec = record_of_row(r)
            self._lookups.labels(*labels, rec.outcome, str(r["side"])).inc()
            for metric, field in self._counters:
                value = getattr(rec, field)
                if value > 0:
                    metric.labels(*side).inc(value)
            self._latency.labels(*side).observe(rec.seconds)
            if r.get("mirror"):
                observe_mirror(r["mirror"], self._mirror_seen.setdefault((engine_idx, str(r["side"])), {}),
                               [(m.labels(*side), f) for m, f in self._mirror_counters],
                               [(m.labels(*side), f) for m, f in self._mirror_gauges])
        for r in ours.get(FALLBACK, []):
            self._fallback.labels(*labels, str(r["reason"])).set(1)
        for r in ours.get(SHARED_WAIT, []):
            self._shared_waits.labels(*labels, str(r["outcome"])).inc()
            if float(r["seconds"]) > 0:
                self._shared_wait_seconds.labels(*labels).inc(float(r["seconds"]))
