"""Many lookups at once: their keys asked together, one store call per round for all of them.

A scheduler that lets lookups run while it goes on (vLLM's ``lookup_async``) hands them to a
:class:`LookupBatcher`: :meth:`~LookupBatcher.submit` starts one and returns at once,
:meth:`~LookupBatcher.poll` answers None until it is decided, :meth:`~LookupBatcher.discard`
drops one (a request aborted while its lookup was pending costs nothing more). A background
thread builds the keys, takes every lookup waiting for a call, asks the union of their keys in
one ``batch_is_exist`` (a key several of them need, such as a shared system prompt's, is asked
once; a key the last call answered, less than :data:`REUSE_S` ago, is not asked again) and
hands each lookup its own answers: each answer is exactly the one its lookup would
have alone (the same steps, :meth:`LookupEngine.steps`, fed the same answer per key). Lookups
submitted while a call is in flight go together in the next one.

Lookups in a batch ask in rounds (:mod:`.rounds`, where the engine's strategy allows), at any
size: their calls are shared, so a round costs no extra trip of its own. Each lookup's first
round also probes where its hashes stop being shared with the other recent requests (a shared
system prompt ends there, and usually the stored prefix too): the keys past it that each
request asks are few, whatever the length of its own part.

The caller's thread only records the request and reads finished answers: no key building, no
store call, no waiting on the master.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Any, Dict, Hashable, List, Optional, Tuple

from .engine import LookupEngine, LookupResult, Steps
from .hashes import as_block_hashes

#: How many recent requests' hashes tell a shared prefix from a request's own part.
RECENT_REQUESTS = 256
#: A burst arrives within one scheduler pass: the thread, woken by a first lookup while idle,
#: waits until no lookup came for GATHER_QUIET_S (at most GATHER_MAX_S), so that the burst's
#: lookups start together and know the hashes they share.
GATHER_QUIET_S = 0.001
GATHER_MAX_S = 0.004
#: The answers of the last call serve the next one's keys for this long (a burst that came in
#: two parts asks its shared prompt once). On Mooncake a key answered present holds a read
#: lease (``--default_kv_lease_ttl``, 10 s by default) that keeps it from eviction meanwhile;
#: a key answered absent may have been saved since: the lookup then hits a little less.
REUSE_S = 1.0

__all__ = ["LookupBatcher", "BatchStats"]

logger = logging.getLogger("mooncake_keys.lookup")


class BatchStats:
    """Counters since the batcher started: store calls, keys asked in them (each distinct key
    of a call once), keys the lookups wanted (with repeats across lookups), lookups answered
    and discarded."""

    __slots__ = ("calls", "keys_asked", "keys_wanted", "answered", "discarded")

    def __init__(self) -> None:
        self.calls = self.keys_asked = self.keys_wanted = self.answered = self.discarded = 0

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


class _Lookup:
    __slots__ = ("steps", "keys")

    def __init__(self, steps: Steps, keys: List[str]) -> None:
        self.steps = steps
        self.keys = keys  # the keys of its next call


class LookupBatcher:
    """Lookups of ``engine`` run together by one background thread (see the module docstring).

    Lookups are named by a hashable key of the caller's (vLLM: the request id). The thread
    starts with the first lookup and stops at :meth:`close`.
    """

    def __init__(self, engine: LookupEngine, *, name: str = "mooncake_keys-lookups") -> None:
        if not isinstance(engine, LookupEngine):
            raise TypeError(f"engine must be a LookupEngine, got {type(engine).__name__}")
        self.engine = engine
        self.stats = BatchStats()
        self._name = name
        self._cond = threading.Condition()
        self._submitted: Dict[Hashable, Tuple[int, Any, int]] = {}  # not started yet
        self._running: Dict[Hashable, _Lookup] = {}  # started, waiting for their next call
        self._done: Dict[Hashable, LookupResult] = {}
        self._inflight: Dict[Hashable, _Lookup] = {}  # in the store call under way
        self._discarded: set = set()  # discarded while their call was in flight
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        # The thread's own: the hashes of recent requests (how many of them hold each hash), and
        # the last call's answers (key -> answer) with its time.
        self._recent: "OrderedDict[Hashable, List[bytes]]" = OrderedDict()
        self._seen: Counter = Counter()
        self._last: Dict[str, Any] = {}
        self._last_at = 0.0

    # ------------------------------------------------------------------ the caller's side
    def submit(self, key: Hashable, num_tokens: int, block_hashes: Any, skip_tokens: int = 0) -> None:
        """Start the lookup named ``key`` (a lookup of that name already under way is
        replaced). Its arguments are checked in the background: a bad one answers 0, logged."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            self._forget(key)
            self._submitted[key] = (num_tokens, block_hashes, skip_tokens)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def poll(self, key: Hashable) -> Optional[LookupResult]:
        """The answer of lookup ``key`` once decided (it is then forgotten), else None."""
        with self._cond:
            return self._done.pop(key, None)

    def pending(self, key: Hashable) -> bool:
        """Whether lookup ``key`` is under way (submitted, not yet answered)."""
        with self._cond:
            return key in self._submitted or key in self._running or key in self._inflight

    def discard(self, key: Hashable) -> None:
        """Forget lookup ``key``: it asks no more keys, its answer is dropped."""
        with self._cond:
            self._forget(key)

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (after the call in flight, if any); lookups under way are dropped."""
        with self._cond:
            self._closed = True
            self._submitted.clear()
            self._running.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _forget(self, key: Hashable) -> None:
        dropped = (self._submitted.pop(key, None) is not None) | (self._running.pop(key, None) is not None)
        if key in self._inflight:
            self._discarded.add(key)
            dropped = True
        self._done.pop(key, None)
        if dropped:
            self.stats.discarded += 1

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._submitted or self._running):
                    self._cond.wait()
                if not self._running:  # idle until now: let the burst come in
                    deadline = time.monotonic() + GATHER_MAX_S
                    seen = len(self._submitted)
                    while not self._closed and time.monotonic() < deadline:
                        self._cond.wait(GATHER_QUIET_S)
                        if len(self._submitted) == seen:
                            break
                        seen = len(self._submitted)
                if self._closed:
                    return
                submitted, self._submitted = self._submitted, {}
            own = {key: self._remember(key, hashes) for key, (_, hashes, _) in submitted.items()}
            for key, (num_tokens, hashes, skip) in submitted.items():
                self._start(key, num_tokens, hashes, skip, self._first_own(own[key]))
            with self._cond:
                batch, self._running = self._running, {}
                self._inflight = batch
            if batch:
                self._call(batch)

    def _remember(self, key: Hashable, block_hashes: Any) -> List[bytes]:
        """Count request ``key``'s hashes among the recent ones; its hashes."""
        try:
            hashes = as_block_hashes(block_hashes)
            blob, hl = hashes.blob, hashes.hash_len
            mine = [bytes(blob[i * hl:(i + 1) * hl]) for i in range(len(hashes))]
        except Exception:  # noqa: BLE001 - checked (and answered) by the lookup itself
            return []
        old = self._recent.pop(key, None)
        if old is not None:
            self._seen.subtract(set(old))
        self._recent[key] = mine
        self._seen.update(set(mine))
        while len(self._recent) > RECENT_REQUESTS:
            _, gone = self._recent.popitem(last=False)
            self._seen.subtract(set(gone))
        return mine

    def _first_own(self, hashes: List[bytes]) -> Tuple[int, ...]:
        """Where (tokens) a request's hashes stop being shared with another recent request."""
        seen = self._seen
        for i, h in enumerate(hashes):
            if seen[h] <= 1:
                return (i * self.engine.deployment.hash_block_size,) if i else ()
        return ()

    def _start(self, key: Hashable, num_tokens: int, block_hashes: Any, skip_tokens: int,
               hints: Tuple[int, ...] = ()) -> None:
        """Begin one lookup: its first keys, or its answer if it needs no call."""
        try:
            steps = self.engine.steps(num_tokens, block_hashes, skip_tokens, rounds_min_keys=0, hints=hints)
            self._advance(key, steps, next(steps))
        except StopIteration as done:
            self._finish(key, done.value)
        except Exception as exc:  # noqa: BLE001 - a scheduler must never crash on a lookup
            logger.warning("lookup %r answered 0: %s: %s", key, type(exc).__name__, exc)
            self._finish(key, None)

    def _advance(self, key: Hashable, steps: Steps, keys: List[str]) -> None:
        with self._cond:
            if key in self._discarded or self._closed:
                return
            self._running[key] = _Lookup(steps, keys)

    def _call(self, batch: Dict[Hashable, _Lookup]) -> None:
        """One store call for every lookup of ``batch``, each key once."""
        wanted = [k for lk in batch.values() for k in lk.keys]
        last = self._last if time.monotonic() - self._last_at < REUSE_S else {}
        merged = [k for k in dict.fromkeys(wanted) if k not in last]  # each key once, not just answered
        known: Optional[Dict[str, Any]] = dict(last)
        if merged:
            answers = self.engine.call_store(merged)
            self.stats.calls += 1
            self.stats.keys_asked += len(merged)
            if answers is None:
                known = None
            else:
                known.update(zip(merged, answers))
                self._last, self._last_at = dict(zip(merged, answers)), time.monotonic()
        self.stats.keys_wanted += len(wanted)
        for key, lk in batch.items():
            own = None if known is None else [known[k] for k in lk.keys]
            try:
                self._advance(key, lk.steps, lk.steps.send(own))
            except StopIteration as done:
                self._finish(key, done.value)
            except Exception as exc:  # noqa: BLE001
                logger.warning("lookup %r answered 0: %s: %s", key, type(exc).__name__, exc)
                self._finish(key, None)
        with self._cond:
            self._inflight = {}
            self._discarded.clear()

    def _finish(self, key: Hashable, answer: Any) -> None:
        result = self.engine.result_of(answer)
        with self._cond:
            if key in self._discarded or self._closed:
                return
            self._done[key] = result
            self.stats.answered += 1
