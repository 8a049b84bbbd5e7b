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
* ``mooncake_keys_store_unavailable_seconds_total``: time the store could not be asked.

Extra ``labels`` (e.g. ``{"deployment": "llama-70b"}``) tell engines apart in one registry.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from .lookup.engine import LookupEngine, LookupRecord

__all__ = ["LookupMetrics", "LATENCY_BUCKETS"]

#: Lookup latency buckets (seconds), as the drop-in's in vLLM.
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

        def counter(name: str, doc: str, extra: tuple = ()) -> Any:
            return prom.Counter(f"{prefix}_{name}", doc, names + list(extra), **kw)

        self._lookups = counter("lookups", "Lookups by outcome (hit, miss, fault).", ("outcome",))
        self._tokens = counter("lookup_tokens", "Tokens asked by lookups.").labels(*values)
        self._hit_tokens = counter("lookup_hit_tokens", "Tokens hit by lookups.").labels(*values)
        self._keys = counter("lookup_keys", "Keys asked of the store.").labels(*values)
        self._calls = counter("lookup_calls", "Store calls (rounds) made by lookups.").labels(*values)
        self._present = counter("lookup_present_keys", "Keys found present (read leases taken).").labels(*values)
        self._unavailable = counter("store_unavailable_seconds", "Seconds the store could not be asked.").labels(*values)
        self._latency = prom.Histogram(f"{prefix}_lookup_seconds", "Lookup latency.", names,
                                       buckets=LATENCY_BUCKETS, **kw).labels(*values)
        self._values = values
        self.engine = engine
        engine.observer = self.observe

    def observe(self, rec: LookupRecord) -> None:
        """Count one lookup (the engine calls this after each)."""
        self._lookups.labels(*self._values, rec.outcome).inc()
        self._tokens.inc(rec.num_tokens)
        self._hit_tokens.inc(rec.hit_tokens)
        self._keys.inc(rec.keys)
        self._calls.inc(rec.calls)
        self._present.inc(rec.present_keys)
        if rec.unavailable_seconds > 0:
            self._unavailable.inc(rec.unavailable_seconds)
        self._latency.observe(rec.seconds)
