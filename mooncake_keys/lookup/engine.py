"""The lookup engine: block hashes in, hit length in tokens out, asking the store ``batch_is_exist``.

A lookup (vLLM's ``MooncakeStoreWorker.lookup``, as the chosen vLLM release has it):

1. the lookup length: ``num_tokens`` floored to the alignment (vLLM 0.33; vLLM 0.25 wants it
   aligned already);
2. the deployment's plan: per store group, the chunks to ask (those with a hash, below the
   length, allowed by the group's lookup mask, not wholly below ``skip_tokens``);
3. one key per (group, chunk, namespace), ordered group -> chunk -> namespace (memoised for a
   repeated request by the key cache);
4. ``store.batch_is_exist(keys)``: once with every key (``strategy="oneshot"``, vLLM's way), or
   in rounds that stop when the answer is decided (``strategy="rounds"``, the default for
   lookups of ``rounds_min_keys`` keys or more; see :mod:`.rounds`), with the same answer;
5. a chunk is present when every namespace of its group answered 1 (the core's reduction);
6. the coordinator turns per-group chunk presence into the longest usable hit; under vLLM 0.33
   a hit covering all of ``num_tokens`` is re-derived one alignment step shorter (the last
   token must be computed), and each store group gets its tail key boundary.

The store-fault policy is :class:`~.store_calls.StoreCalls`' (every call goes through
:meth:`LookupEngine.call_store`): whatever the store does, the lookup answers 0 with one warning
line on the ``mooncake_keys.lookup`` logger (a child of ``mooncake_keys``).

**Leases = keys loaded.** With a store that probes without leases (``store.lease_probes()``:
Mooncake 0.3.14's ``batch_probe_key``, client and master), or with answers from a key-event
mirror (``key_events``, :mod:`mooncake_keys.events`), a lookup in rounds ends with one call that
leases exactly the keys its hit loads, all or none (:meth:`LookupEngine.call_lease`); a key gone
by then makes the lookup go on without it and lease again (:mod:`.rounds`). A miss answered by
the mirror asks the master nothing; a hit it answers is verified by that lease call.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Generator, List, Optional, Sequence, Tuple

from .._checks import int_arg, skip_tokens_arg, tokens_arg
from .contract import Contract
from .deployment import Deployment, DeploymentViews, GroupLike, LookupPlan
from .explain import Explanation, explain
from .hashes import BlockHashes, as_block_hashes
from .keycache import DEFAULT_KEY_CACHE_BYTES, DEFAULT_SPARE_BYTES, KeyCache, key_bytes
from .layout import ParallelLayout
from .rounds import ALL, MIN_KEYS as ROUNDS_MIN_KEYS, Rounds, Segment
from .store_calls import StoreCalls

__all__ = ["LookupEngine", "LookupRecord", "LookupResult", "LookupStats", "LeaseKeys", "STRATEGIES", "TailKeyBoundary"]

#: How a lookup asks the store: every key in one call (vLLM's way), or in rounds (.rounds).
STRATEGIES = ONESHOT, ROUNDS = ("oneshot", "rounds")
#: How a short lookup asks a store without leases: every key in the first round, then its lease.
EVERYTHING_FIRST = "everything first"

logger = logging.getLogger("mooncake_keys.lookup")

#: ``batch_probe_key`` policy of the lease call: the last (here the only) candidate group of keys
#: that all exist is leased (Mooncake 0.3.14).
LAST_HIT_ONLY = "LastHitOnly"
#: Lease calls one lookup may make before it gives up (each found a key of its hit gone).
MAX_LEASE_CALLS = 4


class LeaseKeys(list):
    """The keys of a hit's lease call, as :meth:`LookupEngine.steps` yields them when asked to
    (``share_leases``) instead of making the call: every key the hit loads, to be leased all or
    none (:meth:`LookupEngine.call_lease`). The caller asks them alone or with other lookups'
    (their union, one all-or-nothing candidate: :class:`~.batch.LookupBatcher`) and sends back
    per key whether it exists; every key answered 1 promises that all of them are leased."""

    __slots__ = ()


@dataclass(frozen=True)
class TailKeyBoundary:
    """The token boundary whose hash keys the last chunk of a store group that a load reads
    (vLLM 0.33's ``TailKeyBoundary``): ``group_id`` as in ``@group:<g>``, ``num_tokens`` in tokens."""

    group_id: int
    num_tokens: int


@dataclass(frozen=True)
class LookupResult:
    """A lookup's answer: ``hit_length`` in tokens and, per store group in order, its tail key
    boundary (empty for a hit of 0, and under ``vllm_compat="0.25"``, which had none)."""

    hit_length: int
    tail_key_boundaries: Tuple[TailKeyBoundary, ...] = ()


_NO_HIT = LookupResult(0, ())


@dataclass(frozen=True)
class LookupStats:
    """Counters since the engine was made (sizes in tokens and keys)."""

    #: Lookups answered (a store fault answers 0: it counts).
    lookups: int
    #: ``batch_is_exist`` calls made, and those that failed (their lookup answered 0).
    store_calls: int
    store_failures: int
    #: Keys asked.
    keys_sent: int
    #: Tokens of the hits, summed.
    hit_tokens: int
    #: Lookups whose hit was more than 0 tokens.
    hits: int = 0
    #: Keys the store answered present. On Mooncake each took a read lease, which keeps that
    #: object from eviction and removal for ``--default_kv_lease_ttl`` (docs/mooncake.md).
    present_keys: int = 0
    #: The ``num_tokens`` of every lookup, summed: ``hit_tokens / tokens_asked`` is the hit rate.
    tokens_asked: int = 0
    #: Seconds from a failed store call to the next answered one (to now while it lasts).
    unavailable_seconds: float = 0.0
    #: Read leases the lookups took: the keys ``batch_is_exist`` answered present, plus those the
    #: lease calls leased (with lease-free probes or the key-event mirror, exactly the keys the
    #: hits load).
    leased_keys: int = 0
    #: Lease calls that found a key of the hit gone (the lookup went on without it).
    lease_misses: int = 0
    #: Keys the key-event mirror answered instead of the master, and lookups it answered with no
    #: store call at all (misses).
    mirror_keys: int = 0
    answered_without_call: int = 0


@dataclass(frozen=True)
class LookupRecord:
    """One lookup, as :attr:`LookupEngine.observer` sees it (sizes in tokens and keys)."""

    num_tokens: int
    hit_tokens: int
    keys: int
    calls: int
    present_keys: int
    #: "hit", "miss" or "fault" (a store call failed and the lookup answered 0, or an error
    #: code, such as Mooncake's -900 for a master it cannot reach, ended the hit).
    outcome: str
    seconds: float
    #: Seconds the store has been unavailable since the last record (summed over records,
    #: :attr:`LookupStats.unavailable_seconds` up to this lookup).
    unavailable_seconds: float = 0.0
    #: Read leases this lookup took (see :attr:`LookupStats.leased_keys`).
    leased_keys: int = 0
    #: Keys the key-event mirror answered, and 1 when it answered the lookup with no store call.
    mirror_keys: int = 0
    answered_without_call: int = 0
    #: The key-event mirror's state at this lookup (``mooncake_keys.events.MirrorStats``), or None.
    mirror: Any = None


#: What a lookup step by step returns: (hit, number of hashes, per-group presence).
Answer = Tuple[int, int, List[bytearray]]
Steps = Generator[List[str], Optional[list], Optional[Answer]]
#: A lookup's checked arguments: (num_tokens, lookup length, hashes, plan, skip_tokens).
Prepared = Tuple[int, int, BlockHashes, LookupPlan, int]


class LookupEngine(DeploymentViews):
    """Prefix-cache lookups for one deployment (model, KV-cache groups, rank layout), asking
    ``store``.

    Built from a :class:`Deployment` (:meth:`for_deployment`), or from the deployment's own
    arguments: ``LookupEngine(model_name, groups, layout, store=..., hash_block_size=...)`` takes
    every argument of :class:`Deployment` (documented there: sizes in tokens, ``vllm_compat``,
    ``store_namespace``, ``partial_hash_hits``, ``core``, ...), with its type and default, beside
    the engine's own, and builds the deployment itself (``tests/test_signatures.py`` keeps the
    two signatures equal).

    The engine's own: ``store`` is anything with ``batch_is_exist(list[str]) -> list[int]``; one
    that declares ``mutates_keys = False`` (it neither changes nor keeps the list) is handed a
    repeated request's memoised key list itself, not a copy. ``strategy`` is how the store is
    asked: ``"rounds"`` (default) asks a few chunks first and stops where the answer is decided:
    the one-shot answer, from far fewer keys on a miss (:mod:`mooncake_keys.lookup.rounds`);
    lookups of fewer than ``rounds_min_keys`` keys, and those where rounds cannot be exact
    (partial hash hits, some EAGLE hybrids: then :attr:`strategy` is ``"oneshot"``), ask every
    key in one call. ``"oneshot"`` always does, as vLLM does. ``key_cache_bytes`` bounds the
    memoised keys of repeated requests and ``spare_key_bytes`` the strings kept for reuse (0
    turns either off; see :mod:`mooncake_keys.lookup.keycache`).

    ``key_events``: the master's key events, mirrored (:mod:`mooncake_keys.events`; off by
    default): a :class:`~mooncake_keys.events.KeyMirror` (used as it is), or where to read them
    (``{"endpoint": "tcp://host:port", "http": "http://host:metrics_port"}``, or a list of those,
    one per HA master): the engine then keeps a mirror of its own deployment's keys and closes
    it with :meth:`close`. While the mirror is complete, lookups in rounds are answered from it:
    a miss asks the master nothing, a hit is verified and leased in one call of exactly its
    keys. A store with ``lease_probes()`` true (Mooncake 0.3.14, :class:`MooncakeStore`) is
    asked without leases, and each hit leased so, too.
    """

    def __init__(
        self,
        model_name: str,
        groups: Sequence[GroupLike],
        layout: ParallelLayout,
        *,
        store: Any,
        # The Deployment's arguments, as Deployment.__init__ has them (a test compares the two).
        hash_block_size: int,
        scheduler_block_size: Optional[int] = None,
        use_eagle: bool = False,
        cache_prefix: str = "",
        store_namespace: str = "",
        partial_hash_hits: bool = False,
        vllm_compat: Optional[str] = None,
        contract: Optional[Contract] = None,
        allow_ambiguous_names: bool = False,
        core: Optional[str] = None,
        # The engine's own, as for_deployment has them.
        strategy: str = "rounds",
        rounds_min_keys: int = ROUNDS_MIN_KEYS,
        key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES,
        spare_key_bytes: int = DEFAULT_SPARE_BYTES,
        key_events: Any = None,
    ) -> None:
        deployment = Deployment(
            model_name, groups, layout, hash_block_size=hash_block_size,
            scheduler_block_size=scheduler_block_size, use_eagle=use_eagle, cache_prefix=cache_prefix,
            store_namespace=store_namespace, partial_hash_hits=partial_hash_hits, vllm_compat=vllm_compat,
            contract=contract, allow_ambiguous_names=allow_ambiguous_names, core=core,
        )
        self._start(deployment, store, strategy, rounds_min_keys, key_cache_bytes, spare_key_bytes, key_events)

    @classmethod
    def for_deployment(
        cls,
        deployment: Deployment,
        *,
        store: Any,
        strategy: str = "rounds",
        rounds_min_keys: int = ROUNDS_MIN_KEYS,
        key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES,
        spare_key_bytes: int = DEFAULT_SPARE_BYTES,
        key_events: Any = None,
    ) -> "LookupEngine":
        """The engine of ``deployment``, asking ``store``, with the engine's own arguments (see
        the class docstring)."""
        engine = cls.__new__(cls)
        engine._start(deployment, store, strategy, rounds_min_keys, key_cache_bytes, spare_key_bytes, key_events)
        return engine

    def _start(self, deployment: Deployment, store: Any, strategy: str, rounds_min_keys: int,
               key_cache_bytes: int, spare_key_bytes: int, key_events: Any) -> None:
        if not isinstance(deployment, Deployment):
            raise TypeError(f"deployment must be a Deployment, got {type(deployment).__name__}")
        self._calls = StoreCalls(store, logger)  # the store-fault policy (TypeError: not a store)
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        #: A lookup of fewer keys than this asks one-shot even with strategy "rounds".
        self.rounds_min_keys = int_arg("rounds_min_keys", rounds_min_keys, min=0)
        self.deployment = deployment
        #: "oneshot" (every key in one call, as vLLM) or "rounds" (only the keys the answer
        #: needs). Rounds stop early only where the hit grows with the store's answers, so
        #: partial hash hits and the EAGLE hybrids of Coordinator.hit_is_monotone ask one-shot.
        rounds_exact = not deployment.partial_hash_hits and deployment.coordinator.hit_is_monotone
        self.strategy = strategy if rounds_exact else "oneshot"
        # A store that never changes the key list may be handed the memoised one itself.
        self._share_memo = getattr(store, "mutates_keys", True) is False
        self.key_cache = KeyCache(key_cache_bytes, spare_key_bytes, reuse=deployment.core.REUSES_STRINGS)
        heads = deployment.heads
        # The longest key head of each group (characters): key sizes are estimated from it.
        self._head_chars = tuple(max(map(len, hs)) for hs in heads)
        # The namespaces per chunk when every group has the same number (one reduction), else 0.
        counts = {len(hs) for hs in heads}
        self._uniform_r = counts.pop() if len(counts) == 1 else 0
        probes = getattr(store, "lease_probes", None)
        # Whether the store asks without leases now (Mooncake 0.3.14: found out by the store).
        self._lease_probes: Callable[[], bool] = probes if callable(probes) else (lambda: False)
        self._stats_lock = threading.Lock()
        self._counts = [0] * 12  # LookupStats fields, in order, but the unavailable seconds
        #: Called with a :class:`LookupRecord` after every lookup (metrics); None: not.
        self.observer: Optional[Callable[[LookupRecord], None]] = None
        #: The key-event mirror lookups are answered from (None: off), and whether it is ours.
        self.mirror: Any = None
        self._own_mirror = False
        if key_events is not None:
            self._start_mirror(key_events, strategy)

    def _start_mirror(self, key_events: Any, requested: str) -> None:
        from ..events.mirror import KeyMirror

        if requested != ROUNDS:
            raise ValueError("key_events needs lookups in rounds (strategy 'rounds'): a one-shot lookup asks "
                             "every key of the master anyway")
        if self.strategy != ROUNDS:  # rounds are not exact here (partial hash hits, some EAGLE hybrids)
            logger.warning("key_events is not used: this deployment's lookups ask one-shot (rounds are not exact "
                           "with partial hash hits or this EAGLE hybrid), and every key of them at the master")
            return
        if isinstance(key_events, KeyMirror):
            self.mirror = key_events
            return
        self.mirror = KeyMirror(key_events, prefixes=[p for ps in self.deployment.prefixes for p in ps])
        self._own_mirror = True

    def close(self) -> None:
        """Stop the key-event mirror the engine made (a given one is the giver's to close)."""
        if self._own_mirror and self.mirror is not None:
            self.mirror.close()

    @property
    def store(self) -> Any:
        """The store asked (anything with ``batch_is_exist``); may be replaced."""
        return self._calls.store

    @store.setter
    def store(self, store: Any) -> None:
        if not callable(getattr(store, "batch_is_exist", None)):
            raise TypeError("store must have a batch_is_exist(list[str]) -> list[int] method")
        self._calls.store = store

    # --------------------------------------------------------------------------- steps
    def _prepare(self, num_tokens: int, block_hashes: Any, skip_tokens: Any, name: str = "num_tokens"
                 ) -> Optional[Prepared]:
        """``(num_tokens, the lookup length, the hashes, the plan, skip_tokens)``, checked; None
        when there is nothing to look up. Every entry point's arguments are checked here:
        ``num_tokens`` a token count in ``[0, 2**32 - 1]`` (vLLM's wire format: a larger one is
        made up), ``skip_tokens`` in ``[0, num_tokens]``; ``name``: the caller's name of
        ``num_tokens``, for error messages."""
        dep = self.deployment
        num_tokens = tokens_arg(name, num_tokens)
        skip_tokens = skip_tokens_arg(skip_tokens, num_tokens, name)
        hashes = as_block_hashes(block_hashes)
        if dep.contract.aligns_lookup_length:
            token_len = dep.coordinator.align(num_tokens)
        else:
            token_len = num_tokens
            sbs = dep.scheduler_block_size
            if token_len > 0 and token_len % sbs:
                raise ValueError(
                    f"{name} ({token_len}) must be a multiple of the scheduler block size ({sbs})"
                )
        if not len(hashes) or token_len <= 0:
            return None
        return num_tokens, token_len, hashes, dep.plan(token_len, len(hashes), skip_tokens), skip_tokens

    def _keys(self, token_len: int, skip_tokens: int, hashes: BlockHashes, plan: LookupPlan,
              for_store: bool = False) -> List[str]:
        """The keys of a lookup, group -> chunk -> namespace (memoised for a repeated request;
        ``for_store``: only the store will read the list)."""
        cache = self.key_cache
        hl = hashes.hash_len
        blob = hashes.blob
        fingerprint = (token_len, skip_tokens, hl, len(hashes), blob[-hl:].tobytes())  # token_len aligned
        keys = cache.get(fingerprint, blob, copy=not (for_store and self._share_memo))
        if keys is not None:
            return keys
        dep = self.deployment
        n = plan.num_keys
        keys = cache.take_spare() if for_store else None  # the last key list, to write over
        if keys is None:
            keys = [None] * n
        elif len(keys) > n:
            del keys[n:]
        else:
            keys += [None] * (n - len(keys))
        pos = size = 0
        for g, p in enumerate(plan.groups):
            if len(p.asked):
                heads = dep.heads[g]
                pos = dep.fill_keys(keys, pos, heads, hashes, p.index)
                size += key_bytes(len(p.asked) * len(heads), self._head_chars[g] + 2 * hl)
        if keys:
            cache.keep(fingerprint, blob, keys, size, spare=for_store)
        return keys

    # --------------------------------------------------------------------------- the store
    def call_store(self, keys: List[str]) -> Optional[list]:
        """One existence call of ``keys``: the answers, a list as long as ``keys``, or None.

        The call is ``batch_is_exist`` (each present key takes a read lease on Mooncake), or,
        when the store asks without leases (``store.lease_probes()``), ``batch_probe_key``:
        the lookup then ends with :meth:`call_lease`. The store-fault policy (:class:`~.store_calls.StoreCalls`): an exception, an
        answer that is not a list or tuple, or one of the wrong length gives None (the lookup
        answers 0) and one warning line. Time from a failed call to the next answered one
        counts as the store being unavailable.
        """
        if self._lease_probes():
            return self._calls.call(keys, "batch_probe_key", self.store.batch_probe_key)
        return self._calls.call(keys)

    def call_lease(self, keys: List[str]) -> Optional[list]:
        """The lease call of a hit: ``keys`` (every key its load reads) leased all or none, and
        per key whether it exists (1), or None (the fault policy of :meth:`call_store`). A
        lookup makes it itself (Mooncake leases one all-or-nothing set per call), or yields it
        (:meth:`steps` with ``share_leases``: a batch of lookups leases the union of its hits'
        keys in one call); without lease-free probes the lease call is an existence call the
        lookup yields.

        ``batch_probe_key(keys, "LastHitOnly", len(keys))`` where the store has lease-free
        probes (one candidate of every key: leased exactly when all exist); else
        ``batch_is_exist(keys)``, which leases the keys it finds (all of them when the hit
        stands)."""
        if self._lease_probes():
            store = self.store
            return self._calls.call(keys, "batch_probe_key", lambda k: store.batch_probe_key(k, LAST_HIT_ONLY, len(k)))
        return self._calls.call(keys)

    def _error_codes(self, answers: list, n: int) -> bool:
        """Whether ``answers`` (the first absent chunk's, one per namespace) hold an error code:
        then one warning line, and the store counts as unavailable from now (a master that
        cannot answer answers every key -900) until a call is answered without one."""
        codes = sorted({x for x in answers if type(x) is int and x < 0})
        if not codes:
            return False
        logger.warning("lookup: batch_is_exist answered error code %s for %d keys (counted "
                       "absent; -900: the master is unreachable)", codes, n)
        self._calls.mark_down()
        return True

    def _read(self, results: list, pieces: Sequence[Tuple[int, int]]) -> Optional[Tuple[List[Any], int, bool]]:
        """Per piece ``(chunks, namespaces)`` of a call, in key order, one flag per chunk (1 when
        every namespace answered exactly 1), how many answers were exactly 1 (keys found
        present), and whether an error code is why the first absent chunk is absent. None
        (logged) when the answers cannot be read.

        Error codes (Mooncake's negative ``ErrorCode``, -900 when its master is unreachable)
        count as absent, as in vLLM; when they are why the first absent chunk is absent, one
        warning line says so (only that chunk's answers are read: a master that cannot answer
        answers every key so, and a code elsewhere does not end the hit there).
        """
        dep = self.deployment
        try:
            if len(pieces) == 1:  # one reduction for the whole call
                r = pieces[0][1]
                flags, present = dep.reduce(results, r)
                first = flags.find(0)
                codes = first >= 0 and self._error_codes(results[first * r:(first + 1) * r], len(results))
                return [flags], present, codes
            # One reduction by the namespaces every piece's count is a multiple of, then each
            # piece's chunks by strided slices: slicing the answers per piece copied them all
            # (Qwen3-Next at TP 8: 17,758 answers, its Mamba groups in 8 namespaces, its
            # attention in 2).
            unit = math.gcd(*(r for _, r in pieces))
            flags, present = dep.reduce(results, unit)
            out, off = [], 0
            for n, r in pieces:
                m = r // unit
                part = flags[off:off + n * m]
                if m > 1:
                    acc = int.from_bytes(part[0::m], "little")
                    for t in range(1, m):
                        acc &= int.from_bytes(part[t::m], "little")
                    part = bytearray(acc.to_bytes(n, "little"))
                out.append(part)
                off += n * m
            off, codes = 0, False
            for (n, r), f in zip(pieces, out):
                first = f.find(0)
                if first >= 0:  # the first absent chunk of the call: an error code?
                    codes = self._error_codes(results[off + first * r:off + (first + 1) * r], len(results))
                    break
                off += n * r
            return out, present, codes
        except Exception as exc:  # an answer the core cannot read
            logger.warning("lookup answered 0: the answer of batch_is_exist could not be read: %s: %s",
                           type(exc).__name__, exc)
            return None

    # --------------------------------------------------------------------------- public
    def candidate_keys(self, token_len: int, block_hashes: Any, *, skip_tokens: int = 0) -> List[str]:
        """The keys :meth:`lookup` sends, in order (group, then chunk, then namespace)."""
        prepared = self._prepare(token_len, block_hashes, skip_tokens, "token_len")
        if prepared is None:
            return []
        _, aligned, hashes, plan, skip_tokens = prepared
        return self._keys(aligned, skip_tokens, hashes, plan)

    def lookup(self, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0) -> int:
        """Hit length in tokens (0 .. ``num_tokens``) of the longest usable stored prefix.

        ``num_tokens`` is the request's length in tokens: under vLLM 0.33 it is floored to the
        scheduler block size (the hash unit with partial hash hits), and a hit covering all of
        it is shortened so that the last token is computed; under vLLM 0.25 it must be a
        multiple of the scheduler block size; it must be in ``0 .. 2**32 - 1`` (vLLM's wire
        format; ValueError otherwise). ``block_hashes`` are the request's hashes at
        ``hash_block_size`` granularity (a sequence of bytes-like, or a :class:`BlockHashes`).
        Chunks wholly below ``skip_tokens`` (tokens of the prompt the engine holds locally, at
        most ``num_tokens``: ValueError otherwise) are not asked and count as present. A store
        fault answers 0, logged.
        """
        answer = self._lookup(num_tokens, block_hashes, skip_tokens)
        return answer[0] if answer is not None else 0

    def lookup_result(self, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0) -> LookupResult:
        """:meth:`lookup` with vLLM 0.33's whole answer: the hit length and, per store group,
        its tail key boundary (see :class:`LookupResult`)."""
        return self.result_of(self._lookup(num_tokens, block_hashes, skip_tokens))

    def result_of(self, answer: Optional[Answer]) -> LookupResult:
        """The :class:`LookupResult` of what :meth:`steps` returned."""
        if answer is None:
            return _NO_HIT
        hit, num_hashes, presence = answer
        dep = self.deployment
        if not dep.contract.tail_key_boundaries:
            return LookupResult(hit, ())
        boundaries = dep.tail_boundaries(hit, presence, num_hashes)
        return LookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in boundaries))

    def plan_of(self, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0) -> Optional[LookupPlan]:
        """What :meth:`lookup` of these arguments would ask (checked as by it), before a key is
        built: per store group the chunks asked and presumed, and ``num_keys``, the one-shot
        lookup's keys; None when it asks nothing."""
        prepared = self._prepare(int_arg("num_tokens", num_tokens), block_hashes, skip_tokens)
        return None if prepared is None else prepared[3]

    def explain(self, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0) -> Explanation:
        """Why :meth:`lookup_result` of these arguments hits what it hits, on the store as it is
        now: an :class:`~mooncake_keys.lookup.explain.Explanation` (every answer of the one-shot
        keys, per group and namespace, and the coordinator's steps; the same hit); printed by
        :mod:`mooncake_keys.report`. A lookup of more than :data:`~mooncake_keys.lookup.explain.MAX_KEYS` keys raises
        :class:`~mooncake_keys.lookup.explain.ExplanationTooLarge` (a ``ValueError``) first."""
        return explain(self, num_tokens, block_hashes, skip_tokens=skip_tokens, lookup_logger=logger)

    def _lookup(self, num_tokens: Any, block_hashes: Any, skip_tokens: Any) -> Optional[Answer]:
        """(hit, number of hashes, per-group presence), or None for no hit at all: the lookup
        :meth:`steps` describes, driven here with this engine's store (a one-shot lookup without
        the generator: its fixed cost is a few microseconds of a short prompt's lookup)."""
        start, tally, prepared, mode = self._begin(num_tokens, block_hashes, skip_tokens)
        answer: Optional[Answer] = None
        if mode == ONESHOT:
            keys = self._oneshot_keys(prepared)
            answer = self._oneshot_answer(prepared, keys, self.call_store(keys) if keys else None, tally)
        elif mode is not None:
            steps = self._in_rounds(prepared, tally, (), mode == EVERYTHING_FIRST)
            try:
                keys = next(steps)
                while True:
                    keys = steps.send(self.call_store(keys))
            except StopIteration as done:
                answer = done.value
        self._finish(tally, answer, start)
        return answer

    def steps(self, num_tokens: Any, block_hashes: Any, skip_tokens: Any = 0, *,
              rounds_min_keys: Optional[int] = None, hints: Sequence[int] = (),
              share_leases: bool = False) -> Steps:
        """One lookup, step by step: a generator that yields the keys of each store call it
        needs and takes that call's answers (a list as long as the keys, or None for a failed
        call: see :meth:`call_store`); it returns (hit, number of hashes, per-group presence),
        or None for no hit. :meth:`lookup` asks this engine's store; a caller running many
        lookups at once can ask their keys together (``mooncake_keys.lookup.batch``): it may
        ask in rounds from fewer keys than :attr:`rounds_min_keys` (its calls are shared) and
        hint where the stored prefix may end (``hints``, tokens: see :class:`.rounds.Rounds`).
        A hit's lease call with lease-free probes (:meth:`call_lease`'s ``LastHitOnly``) is
        made by the generator itself, unless ``share_leases``: then it is yielded too, as a
        :class:`LeaseKeys`, for the caller to lease together with other lookups' (an answer of
        all 1 must mean that every one of its keys is leased). Argument errors are raised by
        the first ``next``."""
        start, tally, prepared, mode = self._begin(num_tokens, block_hashes, skip_tokens, rounds_min_keys)
        answer: Optional[Answer] = None
        if mode == ONESHOT:
            keys = self._oneshot_keys(prepared)
            answer = self._oneshot_answer(prepared, keys, (yield keys) if keys else None, tally)
        elif mode is not None:
            answer = yield from self._in_rounds(prepared, tally, hints, mode == EVERYTHING_FIRST, share_leases)
        self._finish(tally, answer, start)
        return answer

    def _begin(self, num_tokens: Any, block_hashes: Any, skip_tokens: Any, rounds_min_keys: Optional[int] = None
               ) -> Tuple[float, List[int], Optional[Prepared], Optional[str]]:
        """A lookup's start: its clock, its tally (tokens asked, keys, calls, present keys,
        failed calls, whether an error code ended the hit, leased keys, lease misses, keys the
        mirror answered), its length, hashes and plan, and how it asks: ``ONESHOT``,
        ``ROUNDS``, ``EVERYTHING_FIRST`` (a short lookup asked one-shot, without leases, then
        leased) or None (nothing to ask and nothing presumed: no hit, as vLLM answers with no
        candidates)."""
        start = time.perf_counter()
        prepared = self._prepare(num_tokens, block_hashes, skip_tokens)
        tally = [num_tokens, 0, 0, 0, 0, False, 0, 0, 0]
        mode = None
        if prepared is not None:
            n = prepared[3].num_keys
            if n or prepared[3].presumes_any:
                least = self.rounds_min_keys if rounds_min_keys is None else rounds_min_keys
                if self.strategy != ROUNDS:
                    mode = ONESHOT
                elif n >= least:
                    mode = ROUNDS
                elif self.mirror is not None and self.mirror.ready:
                    mode = ROUNDS  # answered locally: rounds cost no trips
                elif self._lease_probes():
                    mode = EVERYTHING_FIRST  # one-shot, then the lease call of the hit
                else:
                    mode = ONESHOT
        return start, tally, prepared, mode

    def _oneshot_keys(self, prepared: Prepared) -> List[str]:
        _, token_len, hashes, plan, skip_tokens = prepared
        return self._keys(token_len, skip_tokens, hashes, plan, for_store=True)

    def _oneshot_answer(self, prepared: Prepared, keys: List[str], results: Optional[list], tally: List[int]
                        ) -> Optional[Answer]:
        num_tokens, _, hashes, plan, _ = prepared
        if keys:
            if self._uniform_r:  # one reduction for the whole call
                pieces = [(plan.chunks_asked, self._uniform_r)]
            else:
                pieces = [(len(p.asked), len(h)) for p, h in zip(plan.groups, self.deployment.heads)]
            flags = self._answered(results, pieces, len(keys), tally)
            if flags is None:
                return None
            presence = plan.presence(flags[0] if len(flags) == 1 else b"".join(flags))
        else:
            presence = plan.presence(b"")
        return self._hit(num_tokens, len(hashes), plan, presence), len(hashes), presence

    def _in_rounds(self, prepared: Prepared, tally: List[Any], hints: Sequence[int] = (),
                   ask_everything: bool = False, share_leases: bool = False) -> Steps:
        """The one-shot answer, asking only until the bounds of the hit meet (see .rounds); the
        rounds answered by the key-event mirror while it is complete, and the hit then leased
        (and so verified) in one call of its keys, if a round was asked without leases (that
        call yielded as :class:`LeaseKeys` with ``share_leases``)."""
        num_tokens, _, hashes, plan, _ = prepared
        dep = self.deployment
        state = Rounds(dep, plan, hints, ask_everything=ask_everything)
        n = len(hashes)
        mirror = self.mirror
        unleased = False  # a round was answered without leases: the hit must be leased
        leases = 0
        while True:
            low = self._hit(num_tokens, n, plan, state.low)
            high = self._hit(num_tokens, n, plan, state.high)
            if low == high:
                if low == 0 or not (unleased or self._lease_probes()):
                    return low, n, state.low
                picked = state.loaded_slots(low, lambda p: self._hit(num_tokens, n, plan, p))
                segments = [Segment(g, slots, state.heads[g], ALL) for g, slots in enumerate(picked) if len(slots)]
                if not segments:  # the hit is held below skip_tokens: nothing to load, nothing to lease
                    return low, n, state.low
                keys = self._segment_keys(state, segments, hashes)
                mark = mirror.mark() if mirror is not None else None
                if self._lease_probes():
                    if share_leases:  # leased with other lookups' hits, their union one candidate
                        results = yield LeaseKeys(keys)
                    else:  # LastHitOnly: this lookup's own all-or-nothing set
                        results = self.call_lease(keys)
                else:
                    # batch_is_exist leases what it finds: an existence call like any other, which
                    # a batch of lookups asks together (a shared prompt's keys once).
                    results = yield keys
                sizes = [(len(seg.slots), len(seg.heads)) for seg in segments]
                flags = self._answered(results, sizes, len(keys), tally, lease=True)
                if flags is None:
                    return None
                if all(f.find(0) < 0 for f in flags):
                    return low, n, state.low  # every key the hit loads exists, and is leased
                tally[7] += 1
                leases += 1
                if mirror is not None:  # what the mirror took for present and is not
                    mirror.forget([k for k, r in zip(keys, results) if r != 1], mark)
                if leases >= MAX_LEASE_CALLS:
                    logger.warning("lookup answered 0: the keys of its hit kept vanishing (%d lease calls found "
                                   "some gone)", leases)
                    return None
                if unleased and mirror is not None and tally[8]:
                    # The mirror's other answers may be as stale: the rest is asked of the master.
                    state = Rounds(dep, plan, hints)
                    mirror = None
                for seg, f in zip(segments, flags):
                    state.learn(seg.group, seg.slots, f)
                continue
            segments = state.next_round(low, high)
            keys = self._segment_keys(state, segments, hashes)
            sizes = [(len(seg.slots), len(seg.heads)) for seg in segments]
            answers = mirror.answer(keys) if mirror is not None else None
            if answers is not None:  # the mirror is complete: no store call
                flags = self._answered(answers, sizes, len(keys), tally, mirror=True)
                unleased = True
            else:
                unleased = unleased or self._lease_probes()
                results = yield keys
                flags = self._answered(results, sizes, len(keys), tally)
            if flags is None:
                return None
            state.record(segments, flags)

    def _segment_keys(self, state: Rounds, segments: Sequence[Segment], hashes: BlockHashes) -> List[str]:
        """The keys of ``segments``, in order (group, chunk, namespace)."""
        dep = self.deployment
        heads = dep.heads
        keys: List[Any] = [None] * sum(len(seg.slots) * len(seg.heads) for seg in segments)
        pos = 0
        for seg in segments:
            group_heads = heads[seg.group]
            hs = group_heads if seg.mode == ALL else tuple(group_heads[h] for h in seg.heads)
            index = state.groups[seg.group].index
            slots = seg.slots
            idx = index[slots.start:slots.stop] if isinstance(slots, range) else array("q", [index[s] for s in slots])
            pos = dep.fill_keys(keys, pos, hs, hashes, idx)
        return keys

    def _answered(self, results: Optional[list], pieces: Sequence[Tuple[int, int]], n: int,
                  tally: List[Any], *, lease: bool = False, mirror: bool = False) -> Optional[List[Any]]:
        """A call of ``n`` keys, its answers read (see :meth:`_read`) and counted; None for a
        failed call. ``lease``: the lease call (its keys are leased when all exist);
        ``mirror``: answers of the key-event mirror (no call)."""
        if mirror:
            tally[8] += n
            read = self._read(results, pieces)
            return None if read is None else read[0]
        tally[1] += n
        tally[2] += 1
        read = self._read(results, pieces) if results is not None else None
        if read is None:
            tally[4] += 1
            return None
        tally[3] += read[1]
        tally[5] |= read[2]
        if lease:
            probes = self._lease_probes()
            tally[6] += (n if read[1] == n else 0) if probes else read[1]
        elif not self._lease_probes():
            tally[6] += read[1]  # batch_is_exist: each key found took a lease
        return read[0]

    def _hit(self, num_tokens: int, num_hashes: int, plan: LookupPlan, presence: List[bytearray]) -> int:
        dep = self.deployment
        hit = dep.hit_length(presence, plan.token_len, num_hashes)
        if dep.contract.rederives_full_hit and hit >= num_tokens:
            # vLLM 0.33: the last token must be computed, so a hit of every token is found again
            # one alignment step shorter, from the same answers (vllm#55113).
            usable = dep.coordinator.align(num_tokens - 1)
            hit = dep.hit_length(presence, usable, num_hashes) if usable > 0 else 0
        return hit

    def _finish(self, tally: List[int], answer: Optional[Answer], start: float) -> None:
        """Count one lookup (and hand its record to :attr:`observer`, if any)."""
        hit = answer[0] if answer is not None else 0
        tokens, keys, calls, present, failed, codes, leased, lease_misses, mirror_keys = tally
        without_call = int(mirror_keys > 0 and calls == 0)
        with self._stats_lock:
            c = self._counts
            c[0] += 1
            c[1] += calls
            c[2] += failed
            c[3] += keys
            c[4] += hit
            c[5] += hit > 0
            c[6] += present
            c[7] += tokens
            c[8] += leased
            c[9] += lease_misses
            c[10] += mirror_keys
            c[11] += without_call
        observer = self.observer
        if observer is not None:
            outcome = "fault" if failed or codes else "hit" if hit else "miss"
            mirror = self.mirror.stats() if self.mirror is not None else None
            observer(LookupRecord(tokens, hit, keys, calls, present, outcome, time.perf_counter() - start,
                                  self._calls.take_unavailable(), leased, mirror_keys, without_call, mirror))

    def stats(self) -> LookupStats:
        """Counters since creation (see :class:`LookupStats`)."""
        with self._stats_lock:
            c = list(self._counts)
        return LookupStats(*c[:8], unavailable_seconds=self._calls.unavailable_seconds(), leased_keys=c[8],
                           lease_misses=c[9], mirror_keys=c[10], answered_without_call=c[11])
