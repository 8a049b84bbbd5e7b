"""The SGLang plugin: SGLang's HiCache lookup on Mooncake, answered by mooncake_keys.

SGLang 0.5.23 loads every installed plugin of the entry-point group ``sglang.srt.plugins`` in
each scheduler process (``SGLANG_PLUGINS`` may whitelist them by name); mooncake_keys declares
``mooncake_keys = mooncake_keys.sglang.plugin:register``. :func:`register` hooks three methods of
SGLang's own ``MooncakeStore`` through SGLang's ``HookRegistry`` (so the backend stays
``--hicache-storage-backend mooncake``, with its DCP and draft rules; ``dynamic`` would change
them):

* ``batch_exists`` and ``batch_exists_v2`` (AROUND): answered by the store's
  :class:`~mooncake_keys.sglang.lookup.RankLookup`: the same answer, from fewer keys;
* ``_put_batch_zero_copy_impl`` (AFTER): pages this process stores leave the negative cache.

A store is accelerated when its extra config turns it on, the one line being
``--hicache-storage-backend-extra-config '{"master_server_address": "...", "mooncake_keys": true}'``
(or a dict of :class:`RankLookup` options instead of ``true``: ``strategy``,
``rounds_min_keys``, ``single_querier``, ``negative_ttl``, ``core``). Any other store calls
SGLang's own methods straight through. A store, pool or query the lookup cannot reproduce
(another SGLang release, the direct linker's keys, a pool kind not described, page hashes that
are not hex digests) keeps SGLang's own lookup, with one log line per store and reason.

The hooks make no collective call: every rank makes exactly the collective calls SGLang makes,
in the same order; only the values a non-writing MLA rank hands SGLang's own MIN change (a bound
the writer's answer is below).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any, Dict, List, Optional, Set

from .contract import get_contract
from .hits import KV, PoolAnswer
from .keys import SidecarPool
from .lookup import RankLookup
from .mapping import Unsupported, pool_query_of, rank_keys_of, value_of

__all__ = ["register", "lookup_of", "OPTION", "TARGET"]

logger = logging.getLogger("mooncake_keys.sglang")

#: The class whose methods are hooked.
TARGET = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store.MooncakeStore"
#: The key of the backend's extra config that turns the plugin on for a store.
OPTION = "mooncake_keys"
_OPTIONS = frozenset({"strategy", "rounds_min_keys", "single_querier", "negative_ttl", "core"})


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: hook SGLang's ``MooncakeStore`` (SGLang applies the
    hooks once every plugin has registered)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(f"{TARGET}.batch_exists", batch_exists, HookType.AROUND)
    HookRegistry.register(f"{TARGET}.batch_exists_v2", batch_exists_v2, HookType.AROUND)
    HookRegistry.register(f"{TARGET}._put_batch_zero_copy_impl", stored, HookType.AFTER)


class _State:
    """What the plugin decided for one store: its lookup (None: SGLang's own), the sidecar
    pools checked so far, the reasons already logged."""

    __slots__ = ("lookup", "pools", "logged")

    def __init__(self, lookup: Optional[RankLookup]) -> None:
        self.lookup = lookup
        self.pools: Dict[str, SidecarPool] = {}
        self.logged: Set[str] = set()


_states: "weakref.WeakKeyDictionary[Any, _State]" = weakref.WeakKeyDictionary()
_states_lock = threading.Lock()
#: Set while SGLang's own ``batch_exists_v2`` runs (a query ours did not answer): the
#: ``batch_exists`` it calls then asks even on a non-writing rank, because SGLang's v2 reads that
#: rank's own sidecar answers below the KV hit, which a bound would move.
_in_sglang_v2 = threading.local()


class _Backend:
    """What a lookup asks: the store's own ``_batch_exist`` (a weak reference: the lookup lives as
    long as the store does, never longer)."""

    __slots__ = ("_store",)

    def __init__(self, store: Any) -> None:
        self._store = weakref.ref(store)

    def batch_is_exist(self, keys: List[str]) -> Any:
        store = self._store()
        if store is None:
            raise RuntimeError("the SGLang store this lookup asked is gone")
        return store._batch_exist(keys)


def lookup_of(store: Any) -> Optional[RankLookup]:
    """The lookup answering ``store``'s queries (None: SGLang's own), deciding it on first use."""
    return _state_of(store).lookup


def _state_of(store: Any) -> _State:
    state = _states.get(store)
    if state is None:
        with _states_lock:
            state = _states.get(store)
            if state is None:
                state = _states[store] = _State(_decide(store))
    return state


def _decide(store: Any) -> Optional[RankLookup]:
    try:
        options = _options(store)
        if options is None:
            return None
        contract = get_contract(_sglang_release())
        rank = rank_keys_of(store)
        lookup = RankLookup(rank, _Backend(store), release=contract.name, **options)
    except (Unsupported, TypeError, ValueError) as exc:
        logger.warning("mooncake_keys: keeping SGLang's own HiCache lookup on this Mooncake store: %s", exc)
        return None
    r = lookup.rank
    logger.info("mooncake_keys: SGLang %s's HiCache lookup on Mooncake answered by mooncake_keys (TP rank %d/%d, "
                "PP %d/%d, %s, %s, %s, negative TTL %gs)", contract.name, r.tp_rank, r.tp_size, r.pp_rank, r.pp_size,
                "MLA" if r.mla else "MHA", lookup.strategy,
                "asks for its replicas" if r.mla and r.is_writer else
                "the writer asks for it" if not lookup.asks() else "asks", lookup.negative_ttl)
    return lookup


def _options(store: Any) -> Optional[Dict[str, Any]]:
    """The lookup's options from the store's extra config; None: the plugin is off for it."""
    cfg = getattr(store, "storage_config", None)
    extra = getattr(cfg, "extra_config", None) or {}
    value = extra.get(OPTION) if isinstance(extra, dict) else None
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise ValueError(f"extra config {OPTION!r} must be true or a dict of options, got {value!r}")
    unknown = sorted(set(value) - _OPTIONS)
    if unknown:
        raise ValueError(f"unknown {OPTION!r} options {unknown} (known: {sorted(_OPTIONS)})")
    return dict(value)


def _sglang_release() -> str:
    import sglang

    return str(getattr(sglang, "__version__", "unknown"))


def _keep_sglang(state: _State, reason: str) -> None:
    if reason not in state.logged:
        state.logged.add(reason)
        logger.warning("mooncake_keys: SGLang's own lookup answers this query: %s", reason)


# ---------------------------------------------------------------------- the hooks
def batch_exists(original: Any, store: Any, keys: Any, *args: Any, **kwargs: Any) -> int:
    """``MooncakeStore.batch_exists`` (AROUND): KV pages up to the first with an object missing."""
    state = _state_of(store)
    lookup = state.lookup
    if lookup is not None and not args[1:] and not kwargs.keys() - {"extra_info"}:
        try:
            return lookup.kv_pages(keys, bound=not getattr(_in_sglang_v2, "active", False))
        except ValueError as exc:  # checked before any store call
            _keep_sglang(state, f"batch_exists: {exc}")
    return original(store, keys, *args, **kwargs)


def batch_exists_v2(original: Any, store: Any, keys: Any, pool_transfers: Any = None, *args: Any,
                    **kwargs: Any) -> Any:
    """``MooncakeStore.batch_exists_v2`` (AROUND): the restorable stop points, every pool's own
    boundary, the longest stop point."""
    state = _state_of(store)
    lookup = state.lookup
    if lookup is not None and not args[1:] and not kwargs.keys() - {"extra_info"}:
        try:
            if getattr(getattr(store, "mem_pool_host", None), "kv_buffer", None) is None:
                raise Unsupported("a logical KV anchor (no KV objects)")
            queries = [pool_query_of(store, t, lookup.rank, lookup.contract, state.pools)
                       for t in pool_transfers or ()]
            answer = lookup.pool_answer(keys, queries)
        except (Unsupported, ValueError) as exc:
            _keep_sglang(state, f"batch_exists_v2: {exc}")
        else:
            return _transfer_result(answer, pool_transfers or ())
        _in_sglang_v2.active = True
        try:
            return original(store, keys, pool_transfers, *args, **kwargs)
        finally:
            _in_sglang_v2.active = False
    return original(store, keys, pool_transfers, *args, **kwargs)


def stored(result: Any, store: Any, key_strs: Any, *args: Any, **kwargs: Any) -> None:
    """``MooncakeStore._put_batch_zero_copy_impl`` (AFTER): the pages just stored are no longer
    absent. Returns None: SGLang's result stands."""
    state = _states.get(store)
    if state is None or state.lookup is None:
        return None
    try:
        state.lookup.written([k for k, code in zip(key_strs, result) if code == 0])
    except Exception as exc:  # never fail SGLang's write
        _keep_sglang(state, f"the negative cache missed a write: {type(exc).__name__}: {exc}")
    return None


def _transfer_result(answer: PoolAnswer, transfers: Any) -> Any:
    """SGLang's ``PoolTransferResult`` of an answer, keyed by SGLang's own pool names."""
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult

    names = {value_of(t.name): t.name for t in transfers}
    names[KV] = PoolName.KV
    return PoolTransferResult(answer.pages, {names[n]: v for n, v in answer.boundaries.items()},
                              list(answer.restorable))
