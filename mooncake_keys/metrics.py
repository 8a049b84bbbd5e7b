"""Prometheus metrics of a :class:`~mooncake_keys.LookupEngine`, for users of the library alone
(inside vLLM the drop-in reports the same through vLLM's own metrics: ``mooncake_keys.vllm.metrics``).

``LookupMetrics(engine)`` registers the metrics with ``prometheus_client`` (the ``prometheus``
extra) and becomes the engine's observer: every lookup updates them. Sizes in tokens and keys:

* ``mooncake_keys_lookups_total{outcome}``: lookups by outcome (``hit``, ``miss``, ``fault``);
* ``mooncake_keys_lookup_tokens_total`` / ``..._hit_tokens_total``: tokens asked and hit (their
  ratio is the hit rate);
* ``mooncake_keys_lookup_keys_total``, ``..._calls_total``, ``..._present_keys_total``: keys asked,
  store calls, keys found present (on Mooncake, read leases taken);
* ``mooncake_keys_lookup_seconds``: lookup latency (histogram);
* ``mooncake_keys_store_unavailable_seconds_total``: time the store could not be asked;
* ``mooncake_keys_lookup_leased_keys_total``: read leases the lookups took (with Mooncake 0.3.14's
  lease-free probes or the key-event mirror: exactly the keys the hits load);
* ``mooncake_keys_lookups_without_call_total`` and ``..._lookup_mirror_keys_total``: lookups the
  key-event mirror answered with no store call (misses), and keys it answered;
* the key-event mirror's state (``key_events``; absent without one): ``..._key_event_messages_total``
  (messages received), ``..._key_events_seen_total`` (every event in them),
  ``..._key_events_total`` (events of this deployment's keys applied),
  ``..._key_event_gaps_total`` (times the mirror was dropped: a gap, a reconnect, a restart or
  failover, events off, ...), ``..._key_mirror_rebuilds_total`` (snapshots loaded), and the
  gauges ``..._key_mirror_keys`` (keys held) and ``..._key_mirror_complete`` (1 while it answers).

Extra ``labels`` (e.g. ``{"deployment": "llama-70b"}``) tell engines apart in one registry.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from .lookup.engine import LookupEngine, LookupRecord

__all__ = ["LookupMetrics", "LATENCY_BUCKETS", "COUNTERS", "LOOKUPS_DOC", "LATENCY_DOC", "MIRROR_COUNTERS",
           "MIRROR_GAUGES"]

# The one owner of the lookup metrics' names and meanings: LookupMetrics registers them as
# "mooncake_keys_<name>", the drop-in (mooncake_keys.vllm.metrics) as "vllm:mooncake_keys_<name>"
# with vLLM's labels and a "side" label.

#: The counters every lookup adds to: (name, documentation, the LookupRecord field it adds).
COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("lookup_tokens", "Tokens asked by lookups.", "num_tokens"),
    ("lookup_hit_tokens", "Tokens hit by lookups.", "hit_tokens"),
    ("lookup_keys", "Keys asked of the store by lookups.", "keys"),
    ("lookup_calls", "Store calls (rounds) made by lookups.", "calls"),
    ("lookup_present_keys", "Keys found present by lookups (on Mooncake, read leases taken).", "present_keys"),
    ("store_unavailable_seconds", "Seconds the store could not be asked.", "unavailable_seconds"),
    ("lookup_leased_keys", "Read leases taken by lookups (with lease-free probes or key events: exactly the keys "
     "the hits load).", "leased_keys"),
    ("lookups_without_call", "Lookups the key-event mirror answered with no store call.", "answered_without_call"),
    ("lookup_mirror_keys", "Keys the key-event mirror answered instead of the store.", "mirror_keys"),
)
#: The key-event mirror's counters, from its ``MirrorStats`` (name, documentation, field); a
#: lookup's record carries the mirror's totals, the metrics add what grew since the last one.
MIRROR_COUNTERS: Tuple[Tuple[str, str, str], ...] = (
    ("key_event_messages", "Key-event messages the mirror received.", "messages"),
    ("key_events_seen", "Key events the mirror received (every deployment's, while complete).", "events_seen"),
    ("key_events", "Key events of this deployment's keys the mirror applied.", "events"),
    ("key_event_gaps", "Times the key-event mirror was dropped (a sequence gap, a reconnect, a master restart "
     "or failover, events off, ...); lookups ask the master until it is built again.", "gaps"),
    ("key_mirror_rebuilds", "Snapshots the key-event mirror loaded.", "rebuilds"),
)
#: Its gauges: (name, documentation, field).
MIRROR_GAUGES: Tuple[Tuple[str, str, str], ...] = (
    ("key_mirror_keys", "Keys the key-event mirror holds (0 while it is not complete).", "keys"),
    ("key_mirror_complete", "1 while the key-event mirror is complete and answers lookups.", "complete"),
)
#: ``lookups{outcome}``, counted one per lookup.
LOOKUPS_DOC = "Lookups by outcome (hit, miss, fault: a store call failed and the lookup answered 0)."
#: ``lookup_seconds``, a histogram of :attr:`LookupRecord.seconds`.
LATENCY_DOC = "Lookup latency, from its first key to its answer."
#: Its buckets (seconds): loopback lookups take 0.1-30 ms.
LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5)


class LookupMetrics:
    """The engine's lookups as Prometheus metrics (see the module docstring). ``registry``:
    prometheus_client's (default: its global one); ``prefix``: the metric names' start."""

    def __init__(self, engine: LookupEngine, *, registry: Any = None, prefix: str = "mooncake_keys",
                 labels: Optional[Dict[str, str]] = None) -> None:
        try:
            import prometheus_client as prom
        except ImportError as exc:
            raise ImportError("LookupMetrics needs prometheus_client: pip install 'mooncake-keys[prometheus]'") from exc
        if not isinstance(engine, LookupEngine):
            raise TypeError(f"engine must be a LookupEngine, got {type(engine).__name__}")
        labels = dict(labels or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in labels.items()):
            raise TypeError("labels must map str to str")
        kw: Dict[str, Any] = {} if registry is None else {"registry": registry}
        names = list(labels)
        values = list(labels.values())

        self._lookups = prom.Counter(f"{prefix}_lookups", LOOKUPS_DOC, names + ["outcome"], **kw)
        self._counters = [(prom.Counter(f"{prefix}_{name}", doc, names, **kw).labels(*values), field)
                          for name, doc, field in COUNTERS]
        self._latency = prom.Histogram(f"{prefix}_lookup_seconds", LATENCY_DOC, names,
                                       buckets=LATENCY_BUCKETS, **kw).labels(*values)
        self._mirror_counters = [(prom.Counter(f"{prefix}_{name}", doc, names, **kw).labels(*values), field)
                                 for name, doc, field in MIRROR_COUNTERS]
        self._mirror_gauges = [(prom.Gauge(f"{prefix}_{name}", doc, names, **kw).labels(*values), field)
                               for name, doc, field in MIRROR_GAUGES]
        self._mirror_seen: Dict[str, int] = {}
        self._values = values
        self.engine = engine
        engine.observer = self.observe

    def observe(self, rec: LookupRecord) -> None:
        """Count one lookup (the engine calls this after each)."""
        self._lookups.labels(*self._values, rec.outcome).inc()
        for metric, field in self._counters:
            value = getattr(rec, field)
            if value > 0:
                metric.inc(value)
        self._latency.observe(rec.seconds)
        if rec.mirror is not None:
            observe_mirror(rec.mirror, self._mirror_seen, self._mirror_counters, self._mirror_gauges)


def observe_mirror(stats: Any, seen: Dict[str, int], counters: Any, gauges: Any) -> None:
    """Add to each mirror counter what its total grew by since ``seen`` (updated), set the gauges.
    ``counters``/``gauges``: (metric, field) pairs; ``stats`` has the fields (a ``MirrorStats``,
    or a mapping)."""
    get = stats.get if isinstance(stats, dict) else (lambda f, d=0: getattr(stats, f, d))
    for metric, field in counters:
        total = int(get(field, 0))
        grown = total - seen.get(field, 0)
        if grown > 0:
            metric.inc(grown)
        seen[field] = total
    for metric, field in gauges:
        metric.set(float(get(field, 0)))
