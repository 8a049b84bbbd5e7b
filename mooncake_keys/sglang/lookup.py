"""One rank's HiCache storage lookup: SGLang's page hashes in, its ``batch_exists`` answers out.

:class:`RankLookup` gives exactly what SGLang's ``MooncakeStore.batch_exists`` (KV pages) and
``batch_exists_v2`` (stop points, per-pool boundaries) give on the same store, asking only the
keys the answer needs:

* **Rounds.** The KV pages are one full-attention group of one page per chunk, with one
  namespace per object of a page (``_k``/``_v``, split heads' pairs): asked in rounds by
  :mod:`mooncake_keys.lookup.rounds` (first pages, probes spread over the span, then every
  object below the first absent probe), one-shot below ``rounds_min_keys`` keys. Sidecar pools
  are asked once the KV hit is known, and only below it (SGLang asks every page of the span).
* **The single querier.** Where every object a query reads is rank-replicated (MLA KV and SWA:
  the same keys on every TP rank of a PP stage and DCP shard), only the writing rank asks; the
  others answer the span itself (every page, every stop point, every pool at the span), a bound
  that SGLang's own MIN over the ranks turns into the writer's answer. Off with PP > 1: SGLang's
  PP path allocates host buffers for a rank's own hit before that MIN.
* **The negative cache.** A page found absent is remembered for ``negative_ttl`` seconds: a
  re-poll of a miss within it asks nothing at or past that page (a total miss: nothing at all).
  A page this process writes is forgotten at once (:meth:`RankLookup.written`); another
  writer's page is seen when its entry expires. Present pages are never cached: every key the
  answer counts present was answered so (and leased) by this query.

The keys are :mod:`.keys`' (head + page hash + tail, built by the compiled core), the hit rules
:mod:`.hits`'. Store faults follow :class:`~mooncake_keys.lookup.store_calls.StoreCalls` (one
warning line) and raise :class:`StoreFault`: SGLang's query path turns any backend error into a
hit of 0 pages with no pool verdict, on that rank, inside the same collectives.
"""

from __future__ import annotations

import logging
import threading
import time
from array import array
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Sequence, Tuple

from .._checks import bool_arg, int_arg, str_arg
from ..lookup import _core
from ..lookup.deployment import GroupPlan, LookupPlan
from ..lookup.rounds import ALL, MIN_KEYS as ROUNDS_MIN_KEYS, Rounds, RoundsGroup
from ..lookup.specs import FullAttentionSpec
from ..lookup.store_calls import StoreCalls
from .contract import DEFAULT_SGLANG, get_contract
from .hits import ALL_PAGES, KV, TRAILING_PAGES, PoolAnswer, kv_pages, pool_answer
from .keys import RankKeys, SidecarPool

__all__ = ["PoolQuery", "RankLookup", "RankLookupStats", "StoreFault", "MIN_KEYS", "NEGATIVE_TTL"]

logger = logging.getLogger("mooncake_keys.sglang")

#: A query of fewer KV keys than this is asked one-shot: vLLM's threshold (``lookup/rounds.py``), for
#: the same reason: a round trip costs the master about as much as 100-200 keys, so a full hit of a
#: shorter query pays more for its second round than its miss saves (measured through SGLang's own
#: query path: a 1,024-key full hit took 1.3x as long in rounds; docs/benchmarks.md).
MIN_KEYS = ROUNDS_MIN_KEYS
#: Seconds a page found absent answers absent without asking (SGLang re-polls a miss every 8
#: scheduling passes, up to 8 times).
NEGATIVE_TTL = 1.0
#: Pages remembered absent at most (the oldest go first).
NEGATIVE_CAPACITY = 65536
#: One page per chunk: rounds count in pages.
_PAGE = FullAttentionSpec(1)


class StoreFault(RuntimeError):
    """The store could not be asked (raised, answered something other than a list, or a list of
    the wrong length): logged once, and raised so that SGLang's query path answers 0 hits."""


class PoolQuery(NamedTuple):
    """One sidecar pool of a ``batch_exists_v2`` query: its name (SGLang's ``PoolName`` value), its
    objects, its hit policy (``"all_pages"``, ``"trailing_pages"``) and, for trailing pages, its
    window in pages."""

    name: str
    pool: SidecarPool
    policy: str
    window: int = 1


@dataclass(frozen=True)
class RankLookupStats:
    """Counters since the lookup was made (sizes in keys and pages)."""

    #: ``batch_exists`` / ``batch_exists_v2`` queries answered.
    queries: int
    #: ``batch_is_exist`` calls made, and those that failed.
    store_calls: int
    store_failures: int
    #: Keys asked, and those answered present (on Mooncake, the read leases taken).
    keys_sent: int
    present_keys: int
    #: Queries answered with the span as a bound, without asking (not the writing rank).
    bound_answers: int
    #: Queries whose span the negative cache cut short, and the pages it cut.
    negative_hits: int
    negative_pages: int


class RankLookup:
    """The storage lookup of one rank, whose keys ``rank`` describes, asking ``store`` (anything
    with ``batch_is_exist(list[str]) -> list[int]``).

    ``release``: the SGLang release reproduced (:mod:`.contract`). ``core``: the key-building
    core (``"c"``, ``"py"``, None: the active one). ``strategy``: ``"rounds"`` (only the keys
    the answer needs) or ``"oneshot"`` (every KV key in one call, as SGLang asks).
    ``rounds_min_keys``: queries of fewer KV keys ask one-shot. ``single_querier``: a rank that
    does not write rank-replicated objects answers with a bound instead of asking.
    ``negative_ttl``: seconds a page found absent is remembered (0: never), at most
    ``negative_capacity`` pages. ``clock``: seconds, monotonic (tests).
    """

    def __init__(self, rank: RankKeys, store: Any, *, release: str = DEFAULT_SGLANG, core: Optional[str] = None,
                 strategy: str = "rounds", rounds_min_keys: int = MIN_KEYS, single_querier: bool = True,
                 negative_ttl: float = NEGATIVE_TTL, negative_capacity: int = NEGATIVE_CAPACITY,
                 clock: Optional[Callable[[], float]] = None) -> None:
        if not isinstance(rank, RankKeys):
            raise TypeError(f"rank must be a RankKeys, got {type(rank).__name__}")
        self.contract = get_contract(release)
        self.rank = rank
        self._calls = StoreCalls(store, logger)
        self.core = _core.get_core(core)
        if strategy not in ("rounds", "oneshot"):
            raise ValueError(f"strategy must be 'rounds' or 'oneshot', got {strategy!r}")
        self.strategy = strategy
        self.rounds_min_keys = int_arg("rounds_min_keys", rounds_min_keys, min=0)
        self.single_querier = bool_arg("single_querier", single_querier)
        if isinstance(negative_ttl, bool) or not isinstance(negative_ttl, (int, float)):
            raise TypeError(f"negative_ttl must be a number of seconds, got {type(negative_ttl).__name__}")
        if not 0 <= negative_ttl <= 3600:  # nan fails it too
            raise ValueError(f"negative_ttl must be in [0, 3600] seconds, got {negative_ttl!r}")
        self.negative_ttl = float(negative_ttl)
        self.negative_capacity = int_arg("negative_capacity", negative_capacity, min=1)
        self._clock = clock or time.monotonic
        self.head = rank.head
        self.kv_tails = rank.kv_suffixes
        self._kv_heads = (self.head,) * len(self.kv_tails)
        self._pool_tails: Dict[SidecarPool, Tuple[str, ...]] = {}
        self._index = array("q")
        self._lock = threading.Lock()
        self._negative: Dict[str, float] = {}  # page hash -> when its absence expires
        self._hash_chars = 64
        self._counts = [0] * 8

    # ------------------------------------------------------------------ who asks
    def asks(self, pools: Sequence[PoolQuery] = ()) -> bool:
        """Whether this rank asks the store for a query of ``pools``: unless the single querier
        lets the writing rank answer for it (every object replicated, this rank not the writer,
        one PP stage)."""
        rank = self.rank
        if not self.single_querier or rank.is_writer or rank.pp_size > 1 or not rank.replicated():
            return True
        return not all(rank.replicated(q.pool) for q in pools)

    # ------------------------------------------------------------------ queries
    def kv_pages(self, page_hashes: Sequence[str], bound: bool = True) -> int:
        """``batch_exists``: pages of ``page_hashes`` up to the first with a KV object missing;
        ``bound=False``: this rank asks even where the single querier would answer the span (a
        caller that reads this rank's own answers below the hit: SGLang's own v2)."""
        self._count(0)
        if bound and not self.asks():
            return self._bound(len(page_hashes))
        return self._kv_hit(page_hashes)

    def pool_answer(self, page_hashes: Sequence[str], pools: Sequence[PoolQuery]) -> PoolAnswer:
        """``batch_exists_v2``: the stop points every pool of ``pools`` (in order) can restore,
        below the KV hit of ``page_hashes``; see :mod:`.hits`."""
        self._count(0)
        pools = tuple(self._check_query(q) for q in pools)
        n = len(page_hashes)
        if not self.asks(pools):
            self._bound(n)
            if not n:
                return PoolAnswer(0, {}, [])
            return PoolAnswer(n, dict([(KV, n)] + [(q.name, n) for q in pools]), list(range(1, n + 1)))
        kv = self._kv_hit(page_hashes)
        if not kv or not pools:
            return pool_answer(kv, ())
        blob, hash_len = self._blob(page_hashes[:kv])
        index = self._range(kv)
        tails = [self._tails(q.pool) for q in pools]
        keys: List[Any] = [None] * (kv * sum(map(len, tails)))
        pos = 0
        for ts in tails:
            pos = self.core.fill_keys(keys, pos, (self.head,) * len(ts), blob, hash_len, index, ts)
        results = self._ask(keys)
        read, off = [], 0
        for q, ts in zip(pools, tails):
            flags, present = self.core.reduce_presence(results[off:off + kv * len(ts)], len(ts))
            self._count(4, present)
            off += kv * len(ts)
            read.append((q.name, q.policy, q.window, flags))
        return pool_answer(kv, read)

    def written(self, keys: Iterable[str]) -> None:
        """Keys this process has just stored: their pages are absent no longer."""
        if not self._negative:
            return
        head, w = self.head, self._hash_chars
        n = len(head)
        with self._lock:
            for key in keys:
                if type(key) is str and key.startswith(head):
                    self._negative.pop(key[n:n + w], None)

    def stats(self) -> RankLookupStats:
        with self._lock:
            c = list(self._counts)
        return RankLookupStats(c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7])

    # ------------------------------------------------------------------ the KV hit
    def _kv_hit(self, page_hashes: Sequence[str]) -> int:
        n = len(page_hashes)
        if not n:
            return 0
        stop = self._negative_stop(page_hashes)
        found = 0
        if stop:
            blob, hash_len = self._blob(page_hashes[:stop])
            found = self._oneshot(blob, hash_len, stop) if self._one_shot(stop) else self._rounds(blob, hash_len, stop)
        if found < stop:
            self._remember_absent(page_hashes[found])
        return found

    def _one_shot(self, pages: int) -> bool:
        return self.strategy == "oneshot" or pages * len(self.kv_tails) < self.rounds_min_keys

    def _oneshot(self, blob: bytes, hash_len: int, n: int) -> int:
        r = len(self.kv_tails)
        keys: List[Any] = [None] * (n * r)
        self.core.fill_keys(keys, 0, self._kv_heads, blob, hash_len, self._range(n), self.kv_tails)
        flags, present = self.core.reduce_presence(self._ask(keys), r)
        self._count(4, present)
        return kv_pages(flags)

    def _rounds(self, blob: bytes, hash_len: int, n: int) -> int:
        r = len(self.kv_tails)
        index = self._range(n)
        plan = LookupPlan(n, (GroupPlan(n, range(n), index, range(0)),), n, n, n * r, False)
        state = Rounds.for_groups([RoundsGroup(_PAGE, r)], plan, alignment=1)
        heads, tails = self._kv_heads, self.kv_tails
        while True:
            low, high = kv_pages(state.low[0]), kv_pages(state.high[0])
            if low == high:
                return low
            segments = state.next_round(low, high)
            keys: List[Any] = [None] * sum(len(seg.slots) * len(seg.heads) for seg in segments)
            pos = 0
            for seg in segments:
                hs, ts = (heads, tails) if seg.mode == ALL else (
                    tuple(heads[h] for h in seg.heads), tuple(tails[h] for h in seg.heads))
                slots = seg.slots
                idx = index[slots.start:slots.stop] if isinstance(slots, range) else slots
                pos = self.core.fill_keys(keys, pos, hs, blob, hash_len, idx, ts)
            results = self._ask(keys)
            flags, off = [], 0
            for seg in segments:
                size = len(seg.slots) * len(seg.heads)
                f, present = self.core.reduce_presence(results[off:off + size], len(seg.heads))
                self._count(4, present)
                flags.append(f)
                off += size
            state.record(segments, flags)

    # ------------------------------------------------------------------ pieces
    def _ask(self, keys: List[str]) -> list:
        self._count(1)
        self._count(3, len(keys))
        results = self._calls.call(keys)
        if results is None:
            self._count(2)
            raise StoreFault(f"batch_is_exist of {len(keys)} keys failed (see the warning above)")
        return results

    def _bound(self, n: int) -> int:
        self._count(5)
        return n

    def _blob(self, page_hashes: Sequence[str]) -> Tuple[bytes, int]:
        """The page hashes as one bytes object of equal-length digests, and that length; ValueError
        for hashes our keys could not spell byte for byte (not lowercase hex of one even length)."""
        try:
            joined = "".join(page_hashes)
        except TypeError:
            raise ValueError("page_hashes must be str") from None
        widths = set(map(len, page_hashes))
        width = widths.pop()
        if widths or not width or width % 2:
            raise ValueError("page_hashes must be hex digests of one even length")
        try:
            blob = bytes.fromhex(joined)
        except ValueError:
            raise ValueError("page_hashes must be hex digests") from None
        if 2 * len(blob) != len(joined) or any(c in joined for c in "ABCDEF"):  # not .lower(): 4x slower
            raise ValueError("page_hashes must be lowercase hex digests")
        self._hash_chars = width
        return blob, width // 2

    def _range(self, n: int) -> array:
        """``array('q', range(n))``, sliced from one grown by doubling."""
        if len(self._index) < n:
            self._index = array("q", range(max(n, 2 * len(self._index), 1024)))
        return self._index[:n]

    def _tails(self, pool: SidecarPool) -> Tuple[str, ...]:
        tails = self._pool_tails.get(pool)
        if tails is None:
            tails = self._pool_tails[pool] = self.rank.pool_suffixes(pool)
        return tails

    def _check_query(self, q: Any) -> PoolQuery:
        if not isinstance(q, PoolQuery):
            raise TypeError(f"pools must hold PoolQuery items, got {type(q).__name__}")
        str_arg("name", q.name)
        if q.name == KV:
            raise ValueError("pools are the sidecar pools; the KV pool is always asked")
        if q.pool.name not in self.contract.sidecar_pools:
            raise ValueError(f"pool {q.pool.name!r} is not reproduced (SGLang {self.contract.name})")
        if q.policy not in (ALL_PAGES, TRAILING_PAGES):
            raise ValueError(f"policy must be {ALL_PAGES!r} or {TRAILING_PAGES!r}, got {q.policy!r}")
        int_arg("window", q.window, min=1)
        self._tails(q.pool)  # ValueError for a pool these ranks' keys cannot name
        return q

    # ------------------------------------------------------------------ the negative cache
    def _negative_stop(self, page_hashes: Sequence[str]) -> int:
        """The first page remembered absent (its entry unexpired), else the span's length."""
        neg = self._negative
        if not neg:
            return len(page_hashes)
        now = self._clock()
        with self._lock:
            for i, h in enumerate(page_hashes):
                expiry = neg.get(h)
                if expiry is None:
                    continue
                if expiry > now:
                    self._counts[6] += 1
                    self._counts[7] += len(page_hashes) - i
                    return i
                del neg[h]
        return len(page_hashes)

    def _remember_absent(self, page_hash: str) -> None:
        if self.negative_ttl <= 0:
            return
        with self._lock:
            neg = self._negative
            neg.pop(page_hash, None)
            while len(neg) >= self.negative_capacity:
                del neg[next(iter(neg))]
            neg[page_hash] = self._clock() + self.negative_ttl

    def _count(self, i: int, n: int = 1) -> None:
        with self._lock:
            self._counts[i] += n
