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

The store-fault policy lives here, in :meth:`LookupEngine._ask`: whatever the store does, the
lookup answers 0 with one warning line on the ``mooncake_keys.lookup`` logger (a child of
``mooncake_keys``).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

from .._checks import int_arg
from .deployment import Deployment, DeploymentViews, GroupLike, LookupPlan
from .hashes import BlockHashes, as_block_hashes
from .keycache import DEFAULT_KEY_CACHE_BYTES, DEFAULT_SPARE_BYTES, KeyCache, key_bytes
from .layout import ParallelLayout
from .rounds import MIN_KEYS as ROUNDS_MIN_KEYS, Rounds

__all__ = ["LookupEngine", "LookupResult", "LookupStats", "STRATEGIES", "TailKeyBoundary"]

#: How a lookup asks the store: every key in one call (vLLM's way), or in rounds (.rounds).
STRATEGIES = ("oneshot", "rounds")

logger = logging.getLogger("mooncake_keys.lookup")


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
    """Counters since the engine was made: lookups answered, store calls, keys sent, hit tokens."""

    lookups: int
    store_calls: int
    store_failures: int
    keys_sent: int
    hit_tokens: int


class LookupEngine(DeploymentViews):
    """Prefix-cache lookups for one deployment (model, KV-cache groups, rank layout), asking
    ``store``.

    Built from a :class:`Deployment` (:meth:`for_deployment`), or from the deployment's own
    arguments: ``LookupEngine(model_name, groups, layout, hash_block_size=..., store=...)`` takes
    every keyword argument of :class:`Deployment` (sizes in tokens, ``vllm_compat``,
    ``store_namespace``, ``partial_hash_hits``, ``core``, ...) beside the engine's own, and builds
    the deployment itself.

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
    """

    def __init__(self, model_name: str, groups: Sequence[GroupLike], layout: ParallelLayout, *,
                 store: Any, **options: Any) -> None:
        self._start(Deployment.from_options(model_name, groups, layout, options), store, **options)

    @classmethod
    def for_deployment(cls, deployment: Deployment, *, store: Any, **options: Any) -> "LookupEngine":
        """The engine of ``deployment``, asking ``store``; ``options`` are the engine's own
        (``strategy``, ``rounds_min_keys``, ``key_cache_bytes``, ``spare_key_bytes``)."""
        engine = cls.__new__(cls)
        engine._start(deployment, store, **options)
        return engine

    def _start(
        self,
        deployment: Deployment,
        store: Any,
        *,
        strategy: str = "rounds",
        rounds_min_keys: int = ROUNDS_MIN_KEYS,
        key_cache_bytes: int = DEFAULT_KEY_CACHE_BYTES,
        spare_key_bytes: int = DEFAULT_SPARE_BYTES,
    ) -> None:
        if not isinstance(deployment, Deployment):
            raise TypeError(f"deployment must be a Deployment, got {type(deployment).__name__}")
        if not callable(getattr(store, "batch_is_exist", None)):
            raise TypeError("store must have a batch_is_exist(list[str]) -> list[int] method")
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
        #: A lookup of fewer keys than this asks one-shot even with strategy "rounds".
        self.rounds_min_keys = int_arg("rounds_min_keys", rounds_min_keys, min=0)
        self.deployment = deployment
        self.store = store
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
        self._stats_lock = threading.Lock()
        self._counts = [0, 0, 0, 0, 0]  # LookupStats fields, in order

    # --------------------------------------------------------------------------- steps
    def _prepare(self, num_tokens: Any, block_hashes: Any, skip_tokens: Any, name: str = "num_tokens"
                 ) -> Optional[Tuple[int, BlockHashes, LookupPlan]]:
        """The lookup length, the hashes and the plan; None when there is nothing to look up.
        ``name``: the caller's name of ``num_tokens``, for error messages."""
        dep = self.deployment
        num_tokens = int_arg(name, num_tokens)
        skip_tokens = int_arg("skip_tokens", skip_tokens, min=0)
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
        return token_len, hashes, dep.plan(token_len, len(hashes), skip_tokens)

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
        n = self._keys_of(plan)
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

    def _ask(self, keys: List[str], chunks: Sequence[int]) -> Optional[Any]:
        """One ``batch_is_exist`` of ``keys`` (``chunks[g]`` chunks of each group, one key per
        namespace); per chunk 1 when all its namespaces answered 1.

        The store-fault policy: an exception, an answer that is not a list or tuple, or one of
        the wrong length gives None (the lookup answers 0) and one warning line. Error codes in
        the answer (Mooncake's negative ``ErrorCode``, -900 when its master is unreachable)
        count as absent, as in vLLM; when they are why the first absent chunk is absent, one
        warning line says so.
        """
        try:
            results = self.store.batch_is_exist(keys)
        except Exception as exc:  # the scheduler must never crash on a store fault
            logger.warning("lookup answered 0: batch_is_exist of %d keys raised %s: %s",
                           len(keys), type(exc).__name__, exc)
            return None
        if not isinstance(results, (list, tuple)):
            logger.warning("lookup answered 0: batch_is_exist returned %s, not a list",
                           type(results).__name__)
            return None
        try:
            if type(results) is not list:
                results = list(results)  # a tuple, or a subclass: its items, read once
            if len(results) != len(keys):
                logger.warning("lookup answered 0: batch_is_exist returned %d results for %d keys",
                               len(results), len(keys))
                return None
            flags = self._reduce(results, chunks)
            first = flags.find(0)
            if first >= 0:  # something is absent: say so if an error code is why
                self._log_error_codes(results, first, chunks)
            return flags
        except Exception as exc:  # a list subclass that fails to iterate, ...
            logger.warning("lookup answered 0: the answer of batch_is_exist could not be read: %s: %s",
                           type(exc).__name__, exc)
            return None

    def _log_error_codes(self, results: list, first: int, chunks: Sequence[int]) -> None:
        """One warning line when the answers of chunk ``first`` (the first absent one, counted
        across groups in key order) hold an error code.

        Only that chunk's answers are read (a few per lookup, whatever its size): a master that
        cannot answer answers every key so, and a code elsewhere does not end the hit there."""
        off = 0
        for g, c in enumerate(chunks):
            r = len(self.deployment.heads[g])
            if first < c:
                answers = results[off + first * r:off + (first + 1) * r]
                codes = sorted({x for x in answers if type(x) is int and x < 0})
                if codes:
                    logger.warning("lookup: batch_is_exist answered error code %s for %d keys (counted "
                                   "absent; -900: the master is unreachable)", codes, len(results))
                return
            first -= c
            off += c * r

    def _reduce(self, results: list, chunks: Sequence[int]) -> Any:
        dep = self.deployment
        if self._uniform_r:
            return dep.reduce(results, self._uniform_r)
        flags = bytearray()
        off = 0
        for g, c in enumerate(chunks):
            n = c * len(dep.heads[g])
            if n:
                flags += dep.reduce(results[off:off + n], len(dep.heads[g]))
            off += n
        return bytes(flags)

    # --------------------------------------------------------------------------- public
    def candidate_keys(self, token_len: int, block_hashes: Any, *, skip_tokens: int = 0) -> List[str]:
        """The keys :meth:`lookup` sends, in order (group, then chunk, then namespace)."""
        prepared = self._prepare(token_len, block_hashes, skip_tokens, "token_len")
        if prepared is None:
            return []
        aligned, hashes, plan = prepared
        return self._keys(aligned, skip_tokens, hashes, plan)

    def lookup(self, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0) -> int:
        """Hit length in tokens (0 .. ``num_tokens``) of the longest usable stored prefix.

        ``num_tokens`` is the request's length in tokens: under vLLM 0.33 it is floored to the
        scheduler block size (the hash unit with partial hash hits), and a hit covering all of
        it is shortened so that the last token is computed; under vLLM 0.25 it must be a
        multiple of the scheduler block size. ``block_hashes`` are the request's hashes at
        ``hash_block_size`` granularity (a sequence of bytes-like, or a :class:`BlockHashes`).
        Chunks wholly below ``skip_tokens`` (tokens the engine holds locally) are not asked and
        count as present. A store fault answers 0, logged.
        """
        answer = self._lookup(num_tokens, block_hashes, skip_tokens)
        return answer[0] if answer is not None else 0

    def lookup_result(self, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0) -> LookupResult:
        """:meth:`lookup` with vLLM 0.33's whole answer: the hit length and, per store group,
        its tail key boundary (see :class:`LookupResult`)."""
        answer = self._lookup(num_tokens, block_hashes, skip_tokens)
        if answer is None:
            return _NO_HIT
        hit, num_hashes, presence = answer
        dep = self.deployment
        if not dep.contract.tail_key_boundaries:
            return LookupResult(hit, ())
        boundaries = dep.tail_boundaries(hit, presence, num_hashes)
        return LookupResult(hit, tuple(TailKeyBoundary(g, n) for g, n in boundaries))

    def _lookup(self, num_tokens: Any, block_hashes: Any, skip_tokens: Any
                ) -> Optional[Tuple[int, int, List[bytearray]]]:
        """(hit, number of hashes, per-group presence), or None for no hit at all."""
        prepared = self._prepare(num_tokens, block_hashes, skip_tokens)
        if prepared is None:
            self._count(0, 0, 0)
            return None
        aligned, hashes, plan = prepared
        if self.strategy == "rounds" and self._keys_of(plan) >= self.rounds_min_keys:
            return self._lookup_in_rounds(num_tokens, hashes, plan)
        keys = self._keys(aligned, skip_tokens, hashes, plan, for_store=True)
        if keys:
            flags = self._ask(keys, [len(p.asked) for p in plan.groups])
            if flags is None:
                self._count(len(keys), 1, 0)
                return None
        elif not plan.presumes_any:
            self._count(0, 0, 0)
            return None  # nothing to ask and nothing presumed: no hit (vLLM: no candidates)
        else:
            flags = b""
        presence = plan.presence(flags)
        hit = self._hit(num_tokens, len(hashes), plan, presence)
        self._count(len(keys), 0, hit)
        return hit, len(hashes), presence

    def _keys_of(self, plan: LookupPlan) -> int:
        """Keys a one-shot lookup of ``plan`` sends."""
        heads = self.deployment.heads
        return sum(len(p.asked) * len(heads[g]) for g, p in enumerate(plan.groups))

    def _lookup_in_rounds(self, num_tokens: int, hashes: BlockHashes, plan: LookupPlan
                          ) -> Optional[Tuple[int, int, List[bytearray]]]:
        """The one-shot answer, asking only until the bounds of the hit meet (see .rounds)."""
        dep = self.deployment
        heads = dep.heads
        state = Rounds(dep, plan)
        n = len(hashes)
        sent = calls = 0
        while True:
            low = self._hit(num_tokens, n, plan, state.low)
            high = self._hit(num_tokens, n, plan, state.high)
            if low == high:
                self._count_rounds(sent, calls, 0, low)
                return low, n, state.low
            chosen = state.next_round(low, high)
            chunks = [sum(b - a for a, b in slices) for slices in chosen]
            keys: List[Any] = [None] * sum(c * len(heads[g]) for g, c in enumerate(chunks))
            pos = 0
            for g, slices in enumerate(chosen):
                index = state.groups[g].index
                for a, b in slices:
                    pos = dep.fill_keys(keys, pos, heads[g], hashes, index[a:b])
            flags = self._ask(keys, chunks)
            sent += len(keys)
            calls += 1
            if flags is None:
                self._count_rounds(sent, calls, 1, 0)
                return None
            off = 0
            per_group = []
            for c in chunks:
                per_group.append(flags[off:off + c])
                off += c
            state.record(chosen, per_group)

    def _hit(self, num_tokens: int, num_hashes: int, plan: LookupPlan, presence: List[bytearray]) -> int:
        dep = self.deployment
        hit = dep.hit_length(presence, plan.token_len, num_hashes)
        if dep.contract.rederives_full_hit and hit >= num_tokens:
            # vLLM 0.33: the last token must be computed, so a hit of every token is found again
            # one alignment step shorter, from the same answers (vllm#55113).
            usable = dep.coordinator.align(num_tokens - 1)
            hit = dep.hit_length(presence, usable, num_hashes) if usable > 0 else 0
        return hit

    def _count(self, keys: int, failed: int, hit: int) -> None:
        self._count_rounds(keys, 1 if keys else 0, failed, hit)

    def _count_rounds(self, keys: int, calls: int, failed: int, hit: int) -> None:
        with self._stats_lock:
            c = self._counts
            c[0] += 1
            c[1] += calls
            c[2] += failed
            c[3] += keys
            c[4] += hit

    def stats(self) -> LookupStats:
        """Counters since creation (see :class:`LookupStats`)."""
        with self._stats_lock:
            return LookupStats(*self._counts)
