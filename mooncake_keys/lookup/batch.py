"""Many lookups at once: their keys asked together, one store call per round for all of them.

A scheduler that lets lookups run while it goes on (vLLM's ``lookup_async``) hands them to a
:class:`LookupBatcher`: :meth:`~LookupBatcher.submit` starts one and returns at once,
:meth:`~LookupBatcher.poll` answers None until it is decided, :meth:`~LookupBatcher.discard`
drops one (a request aborted while its lookup was pending asks nothing more). A background
thread builds the keys, takes every lookup waiting for a call, asks the union of their keys in
one ``batch_is_exist`` (a key several of them need, such as a shared system prompt's, is asked
once) and hands each lookup its own answers: each answer is exactly the one its lookup would
have alone (the same steps, :meth:`LookupEngine.steps`, fed the same answer per key). Lookups
submitted while a call is in flight go together in the next one.

**Lease calls together.** With lease-free probes (Mooncake 0.3.14's ``batch_probe_key``) a hit
ends with a lease call of exactly its keys, all or none (:meth:`LookupEngine.call_lease`); the
lookups that reach it in the same batch are leased by one call: the union of their keys (each
key once) as one all-or-nothing candidate. Every key there: every one of those hits is leased,
and answered. A key gone: nothing was leased; the lookups with a key gone get what that call
found (as their own lease call would have answered: they look again without it), and the
others are leased by one more call of their union (:meth:`LookupBatcher._lease` says why that
fallback and how far it goes). No lookup is answered a hit whose keys are not all leased. With
a 0.3.13 client the lease call is a ``batch_is_exist`` like the rounds' calls, shared as they
are.

**One table.** A lookup is in :attr:`LookupBatcher` 's table from :meth:`submit` until its
answer is taken (:meth:`poll`) or it is discarded, whatever the thread is doing with it: there
is no moment at which a submitted lookup is in no table (:meth:`pending` is True all along), and
the thread drops whatever it was doing for a lookup that left the table (or was submitted anew)
meanwhile.

**Reused answers.** A key a call answered present is not asked again for a short while
(:func:`reuse_window`): on Mooncake it holds a read lease (the master's
``--default_kv_lease_ttl``) from that call on, so it cannot be evicted or removed (without
force) during the lease, and a fresh ask would answer the same. Answers are reused only when
the lease is known (``lease_s``), each for at most :data:`REUSE_LEASE_FRACTION` of it from the
moment the call that answered it was sent (an answer served from reuse keeps that time: it took
no lease of its own) and never more than :data:`REUSE_S`; with the lease unknown, never. Each
key keeps its own time, so requests that interleave several system prompts find each prompt's
keys answered whichever call asked them last. A key
answered absent is always asked again (it may have been saved since). :meth:`forget_answers`
(after a removal the caller knows of: vLLM's reset, which removes every key with force) drops
every answer got before it: reused ones, and those of lookups under way, which start again.
So every answer is the one a lookup asking the store alone would get at the time of its calls.

**Bounds.** The thread keeps the hashes of the last :data:`RECENT_REQUESTS` requests, at most
:data:`RECENT_HASHES` of each (one 8-byte digest per hash, and one count per distinct digest):
at most 262,144 digests whatever the number of requests. Each lookup under way holds its
arguments and its step state (the keys of its next call) until its answer is taken or it is
discarded; the reused answers are the keys answered present within the reuse window, at most
:data:`MAX_REUSED` of them (the oldest go first).

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
from array import array
from collections import OrderedDict
from typing import Any, Callable, Dict, Hashable, List, Optional, Tuple

from .._checks import seconds_arg
from .engine import LeaseKeys, LookupEngine, LookupResult, Steps
from .hashes import as_block_hashes

#: How many recent requests' hashes tell a shared prefix from a request's own part.
RECENT_REQUESTS = 256
#: How many of a request's first hashes are counted (where a shared prefix ends is all they
#: tell; a prefix shared for longer gives no hint, which only moves the first probes).
RECENT_HASHES = 1024
#: A burst arrives within one scheduler pass: the thread, woken by a first lookup while idle,
#: waits until no lookup came for GATHER_QUIET_S (at most GATHER_MAX_S), so that the burst's
#: lookups start together and know the hashes they share.
GATHER_QUIET_S = 0.001
GATHER_MAX_S = 0.004
#: The longest the last call's answers serve the next calls (seconds), whatever the lease.
REUSE_S = 1.0
#: The part of the master's read lease during which the last call's answers are reused,
#: counted from the moment the call was sent: a reused present answer is still leased when it
#: is used, with at least 90 % of a fresh answer's lease left for the load that follows.
REUSE_LEASE_FRACTION = 0.1
#: The most present answers kept for reuse (keys; about 150 bytes each with a 128-character key).
MAX_REUSED = 1 << 20
#: Lease calls of one batch asked as one union before each lookup left asks its own (the first
#: union found a key gone, the second the union of the lookups whose keys all existed).
LEASE_UNIONS = 2

__all__ = ["LookupBatcher", "BatchStats", "reuse_window"]

logger = logging.getLogger("mooncake_keys.lookup")


def reuse_window(lease_s: Optional[float]) -> float:
    """Seconds the answers of a call are reused from the moment it was sent, for a master whose
    read lease is ``lease_s`` seconds: ``min(REUSE_S, REUSE_LEASE_FRACTION * lease_s)``, and 0
    (never reused) when the lease is unknown (None)."""
    if lease_s is None:
        return 0.0
    return min(REUSE_S, REUSE_LEASE_FRACTION * seconds_arg("lease_s", lease_s))


class BatchStats:
    """Counters since the batcher started: store calls, keys asked in them (each distinct key
    of a call once), keys the lookups wanted (with repeats across lookups), keys answered from
    the last call's answers, lookups submitted, answered, discarded, replaced (submitted again
    while under way) and started again (their answers forgotten, :meth:`LookupBatcher.forget_answers`);
    ``lease_calls``: of the calls, those that leased hits with lease-free probes (Mooncake
    0.3.14's ``LastHitOnly``: a batch's hits together, see :meth:`LookupBatcher._lease`)."""

    __slots__ = ("calls", "keys_asked", "keys_wanted", "keys_reused", "submitted", "answered", "discarded",
                 "replaced", "restarted", "lease_calls")

    def __init__(self) -> None:
        self.calls = self.keys_asked = self.keys_wanted = self.keys_reused = self.lease_calls = 0
        self.submitted = self.answered = self.discarded = self.replaced = self.restarted = 0

    def as_dict(self) -> Dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


_QUEUED, _STARTING, _WAITING, _CALLING, _DONE = range(5)


class _Lookup:
    """One lookup of the table: its arguments, where it is, and (the thread's) its steps."""

    __slots__ = ("args", "state", "gen", "steps", "keys", "result")

    def __init__(self, args: Tuple[Any, Any, Any]) -> None:
        self.args = args  # (num_tokens, block_hashes, skip_tokens) as submitted
        self.state = _QUEUED
        self.gen = 0  # raised each time it starts again: the thread's work on an older one is dropped
        self.steps: Optional[Steps] = None
        self.keys: List[str] = []  # the keys of its next call
        self.result: Optional[LookupResult] = None


class LookupBatcher:
    """Lookups of ``engine`` run together by one background thread (see the module docstring).

    Lookups are named by a hashable key of the caller's (vLLM: the request id). ``lease_s`` is
    the master's read lease in seconds (Mooncake's ``--default_kv_lease_ttl``; None: unknown,
    and no answer is reused); ``clock`` (seconds) times the reuse of answers. The thread starts with the first lookup and stops at
    :meth:`close`.
    """

    def __init__(self, engine: LookupEngine, *, lease_s: Optional[float] = None,
                 name: str = "mooncake_keys-lookups", clock: Callable[[], float] = time.monotonic) -> None:
        if not isinstance(engine, LookupEngine):
            raise TypeError(f"engine must be a LookupEngine, got {type(engine).__name__}")
        self.engine = engine
        #: Seconds a present answer is reused, from when its call was sent (0: never).
        self.reuse_s = reuse_window(lease_s)
        self._clock = clock
        self.stats = BatchStats()
        self._name = name
        self._cond = threading.Condition()
        #: Every lookup from submit until its answer is taken or it is discarded.
        self._lookups: Dict[Hashable, _Lookup] = {}
        self._queued: Dict[Hashable, _Lookup] = {}  # to be started (a subset of _lookups)
        self._waiting: Dict[Hashable, _Lookup] = {}  # started, waiting for the next call
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        # The keys answered present, each with the time until which it is reused, oldest first
        # (calls are sent in time order); replaced, not changed, by forget_answers. The thread's.
        self._reused: "OrderedDict[str, float]" = OrderedDict()
        self._epoch = 0  # raised by forget_answers: a call sent before it is not reused
        # The thread's own: the digests of recent requests' first hashes, and how many of those
        # requests hold each digest.
        self._recent: "OrderedDict[Hashable, array]" = OrderedDict()
        self._seen: Dict[int, int] = {}
        self._kept = 0  # digests in _recent, all requests (read by sizes() without iterating)

    # ------------------------------------------------------------------ the caller's side
    def submit(self, key: Hashable, num_tokens: int, block_hashes: Any, skip_tokens: int = 0) -> None:
        """Start the lookup named ``key`` (a lookup of that name under way or answered and not
        yet taken is replaced). Its arguments are checked in the background: a bad one answers
        0, logged. ``block_hashes`` is read later, by the thread: do not change it meanwhile."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher is closed")
            if self._drop(key):
                self.stats.replaced += 1
            lk = _Lookup((num_tokens, block_hashes, skip_tokens))
            self._lookups[key] = self._queued[key] = lk
            self.stats.submitted += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            self._cond.notify()

    def poll(self, key: Hashable) -> Optional[LookupResult]:
        """The answer of lookup ``key`` once decided (it then leaves the table), else None."""
        with self._cond:
            lk = self._lookups.get(key)
            if lk is None or lk.state != _DONE:
                return None
            del self._lookups[key]
            return lk.result

    def pending(self, key: Hashable) -> bool:
        """Whether lookup ``key`` is in the table: submitted, and its answer not yet taken
        (True from :meth:`submit` on, also once decided, until :meth:`poll` returns it)."""
        with self._cond:
            return key in self._lookups

    def discard(self, key: Hashable) -> None:
        """Forget lookup ``key``: it asks no more keys (a call already sent is not recalled),
        its answer is dropped."""
        with self._cond:
            if self._drop(key):
                self.stats.discarded += 1

    def forget_answers(self) -> None:
        """Forget every store answer got before now (call it after keys were removed, with force
        or not): the last call's answers are not reused, and every lookup under way or answered
        and not yet taken starts again, on the store as it is from now on."""
        with self._cond:
            self._epoch += 1
            self._reused = OrderedDict()
            for key, lk in self._lookups.items():
                lk.gen += 1
                lk.state, lk.steps, lk.keys, lk.result = _QUEUED, None, [], None
                self._queued[key] = lk
                self.stats.restarted += 1
            self._waiting.clear()
            self._cond.notify()

    def sizes(self) -> Dict[str, int]:
        """The sizes of the batcher's tables (for checks of its bounds): ``lookups`` (under way or
        not yet taken), ``recent_requests``, ``recent_hashes`` (digests kept, all requests),
        ``distinct_hashes`` (counted digests) and ``reused_answers``."""
        with self._cond:
            return {"lookups": len(self._lookups), "queued": len(self._queued), "waiting": len(self._waiting),
                    "recent_requests": len(self._recent), "recent_hashes": self._kept,
                    "distinct_hashes": len(self._seen), "reused_answers": len(self._reused)}

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (after the call in flight, if any); lookups under way are dropped."""
        with self._cond:
            self._closed = True
            self._lookups.clear()
            self._queued.clear()
            self._waiting.clear()
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _drop(self, key: Hashable) -> bool:
        """Take ``key`` out of every table (under the lock); whether it was in."""
        self._queued.pop(key, None)
        self._waiting.pop(key, None)
        return self._lookups.pop(key, None) is not None

    def _current(self, key: Hashable, lk: _Lookup, gen: int) -> bool:
        """Whether the thread's work on ``lk`` (started at ``gen``) still counts (under the lock)."""
        return not self._closed and self._lookups.get(key) is lk and lk.gen == gen

    # ------------------------------------------------------------------ the thread
    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._closed or self._queued or self._waiting):
                    self._cond.wait()
                if not self._waiting:  # idle until now: let the burst come in
                    deadline = time.monotonic() + GATHER_MAX_S
                    seen = len(self._queued)
                    while not self._closed and time.monotonic() < deadline:
                        self._cond.wait(GATHER_QUIET_S)
                        if len(self._queued) == seen:
                            break
                        seen = len(self._queued)
                if self._closed:
                    return
                starting = [(key, lk, lk.gen, lk.args) for key, lk in self._queued.items()]
                self._queued.clear()
                for _, lk, _, _ in starting:
                    lk.state = _STARTING
            hints = {key: self._first_own(self._remember(key, args[1])) for key, _, _, args in starting}
            for key, lk, gen, (num_tokens, hashes, skip) in starting:
                self._start(key, lk, gen, num_tokens, hashes, skip, hints[key])
            self._call()

    def _remember(self, key: Hashable, block_hashes: Any) -> array:
        """Count request ``key``'s first hashes among the recent ones; their digests."""
        try:
            hashes = as_block_hashes(block_hashes)
            blob, hl = hashes.blob, hashes.hash_len
            n = min(len(hashes), RECENT_HASHES)
            # A digest per hash (Python's hash of its bytes): a collision can only move a hint.
            mine = array("q", [hash(bytes(blob[i * hl:(i + 1) * hl])) for i in range(n)])
        except Exception:  # noqa: BLE001 - checked (and answered) by the lookup itself
            return array("q")
        old = self._recent.pop(key, None)
        if old is not None:
            self._uncount(old)
        while len(self._recent) >= RECENT_REQUESTS:  # room first: never more than RECENT_REQUESTS
            _, gone = self._recent.popitem(last=False)
            self._uncount(gone)
        self._recent[key] = mine
        self._kept += len(mine)
        seen = self._seen
        for d in set(mine):
            seen[d] = seen.get(d, 0) + 1
        return mine

    def _uncount(self, digests: array) -> None:
        self._kept -= len(digests)
        seen = self._seen
        for d in set(digests):
            left = seen[d] - 1
            if left:
                seen[d] = left
            else:
                del seen[d]  # a count of 0 would keep every hash ever seen

    def _first_own(self, digests: array) -> Tuple[int, ...]:
        """Where (tokens) a request's hashes stop being shared with another recent request."""
        seen = self._seen
        for i, d in enumerate(digests):
            if seen.get(d, 0) <= 1:
                return (i * self.engine.deployment.hash_block_size,) if i else ()
        return ()

    def _start(self, key: Hashable, lk: _Lookup, gen: int, num_tokens: Any, block_hashes: Any, skip_tokens: Any,
               hints: Tuple[int, ...]) -> None:
        """Begin one lookup: its first keys, or its answer if it needs no call."""
        try:
            steps = self.engine.steps(num_tokens, block_hashes, skip_tokens, rounds_min_keys=0, hints=hints,
                                      share_leases=True)
            self._advance(key, lk, gen, steps, next(steps))
        except StopIteration as done:
            self._finish(key, lk, gen, done.value)
        except Exception as exc:  # noqa: BLE001 - a scheduler must never crash on a lookup
            logger.warning("lookup %r answered 0: %s: %s", key, type(exc).__name__, exc)
            self._finish(key, lk, gen, None)

    def _advance(self, key: Hashable, lk: _Lookup, gen: int, steps: Steps, keys: List[str]) -> None:
        with self._cond:
            if self._current(key, lk, gen):
                lk.state, lk.steps, lk.keys = _WAITING, steps, keys
                self._waiting[key] = lk

    def _finish(self, key: Hashable, lk: _Lookup, gen: int, answer: Any) -> None:
        result = self.engine.result_of(answer)
        with self._cond:
            if self._current(key, lk, gen):
                lk.state, lk.steps, lk.keys, lk.result = _DONE, None, [], result
                self.stats.answered += 1

    def _call(self) -> None:
        """One store call for every lookup waiting for an existence call, each key once, and one
        lease call for every lookup waiting for its hit's lease (:meth:`_lease`)."""
        with self._cond:
            batch = [(key, lk, lk.gen, lk.steps, lk.keys) for key, lk in self._waiting.items()]
            self._waiting.clear()
            for _, lk, _, _, _ in batch:
                lk.state = _CALLING
            epoch = self._epoch
            last = self._reused
        now = self._clock()
        while last:  # the answers whose window is over (the oldest first)
            key, until = next(iter(last.items()))
            if until > now:
                break
            del last[key]
        if not batch:
            return
        asking = [item for item in batch if type(item[4]) is not LeaseKeys]
        leasing = [item for item in batch if type(item[4]) is LeaseKeys]
        answers: Dict[Hashable, Optional[list]] = {}
        if asking:
            answers.update(self._exist(asking, last, epoch))
        if leasing:
            answers.update(zip((item[0] for item in leasing), self._lease([item[4] for item in leasing])))
        for key, lk, gen, steps, keys in batch:
            with self._cond:
                if not self._current(key, lk, gen):
                    continue  # discarded, submitted anew or started again: dropped
            try:
                self._advance(key, lk, gen, steps, steps.send(answers[key]))
            except StopIteration as done:
                self._finish(key, lk, gen, done.value)
            except Exception as exc:  # noqa: BLE001
                logger.warning("lookup %r answered 0: %s: %s", key, type(exc).__name__, exc)
                self._finish(key, lk, gen, None)

    def _exist(self, batch: List[Tuple[Hashable, _Lookup, int, Steps, List[str]]],
               last: "OrderedDict[str, float]", epoch: int) -> Dict[Hashable, Optional[list]]:
        """The existence call of ``batch`` (each key once, those of ``last``, the keys answered
        present within their window, answered 1 from it): each lookup's answers (None: the call
        failed)."""
        wanted = [k for item in batch for k in item[4]]
        merged = [k for k in dict.fromkeys(wanted) if k not in last]  # each key once, not just answered
        known: Optional[Dict[str, Any]] = dict.fromkeys(last, 1)  # before this call adds its own
        from_reuse = sum(1 for k in wanted if k in known) if known else 0
        if merged:
            sent = self._clock()
            answers = self.engine.call_store(merged)
            self.stats.calls += 1
            self.stats.keys_asked += len(merged)
            if answers is None:
                known = None
            else:
                known.update(zip(merged, answers))
                if self.reuse_s > 0:
                    # Only keys answered present: each holds the lease this call took. One
                    # answered absent may be saved any moment: it is asked again.
                    until = sent + self.reuse_s
                    with self._cond:
                        if epoch == self._epoch:  # not across forget_answers
                            reused = self._reused
                            for k, a in zip(merged, answers):
                                if a == 1:
                                    reused[k] = until  # not in it: it was not answered from it
                            while len(reused) > MAX_REUSED:
                                reused.popitem(last=False)
        self.stats.keys_wanted += len(wanted)
        self.stats.keys_reused += from_reuse
        return {key: None if known is None else [known[k] for k in keys] for key, _, _, _, keys in batch}

    def _lease(self, wanted: List[LeaseKeys]) -> List[Optional[list]]:
        """The lease calls of hits reached in one batch, asked together: per lookup, the answers
        to its keys (None: a failed call), all 1 only where a call leased every one of them.

        Mooncake 0.3.14 leases one all-or-nothing set per call (``LastHitOnly``), so the union
        of the hits' keys (each key once: a shared prompt's once for the batch) is that set: if
        every key exists, every hit is leased by one call. If some key is gone, nothing was
        leased; a lookup with a key gone is answered what that call found, as its own lease call
        would have been (a key gone, nothing leased: it looks again without it). The others'
        keys all exist but are not leased: their union is asked once more. Not the first union
        minus the gone keys: that would lease the keys of the lookups that go on to a shorter
        hit, keys they will not load, while those lookups lease their new hits anyway. A key gone
        again by then (evictions within the moment between the two calls) leaves each remaining
        lookup to its own call: at most two unions and one call per lookup, at most the union's
        keys twice beside the keys the lookups would ask alone. Answers are never reused here: a
        lease call is the call that takes the lease."""
        answers: List[Optional[list]] = [None] * len(wanted)
        todo = list(range(len(wanted)))
        for _ in range(LEASE_UNIONS):
            if len(todo) <= 1:
                break
            union = list(dict.fromkeys(k for i in todo for k in wanted[i]))
            got = self._ask_lease(union, sum(len(wanted[i]) for i in todo))
            if got is None:
                return answers  # a failed call: each lookup in it answers 0, as with its own
            if self._all_present(got):  # every key exists, and the call leased them all
                for i in todo:
                    answers[i] = [1] * len(wanted[i])
                return answers
            known = dict(zip(union, got))
            rest = []
            for i in todo:
                own = [known[k] for k in wanted[i]]
                if self._all_present(own):
                    rest.append(i)  # its keys exist, but the union held a gone key: not leased
                else:
                    answers[i] = own
            todo = rest
        for i in todo:  # one lookup (alone in its batch), or the unions kept finding a key gone
            answers[i] = self._ask_lease(list(wanted[i]), len(wanted[i]))
        return answers

    def _all_present(self, answers: list) -> bool:
        """Whether every answer is present (exactly 1, as the lookups read them: the core's rule)."""
        return self.engine.deployment.reduce(answers, 1)[1] == len(answers)

    def _ask_lease(self, keys: List[str], wanted: int) -> Optional[list]:
        """One lease call of ``keys`` (``wanted``: the keys of the lookups it is for, repeats
        counted): its answers, or None."""
        got = self.engine.call_lease(keys)
        self.stats.calls += 1
        self.stats.lease_calls += 1
        self.stats.keys_asked += len(keys)
        self.stats.keys_wanted += wanted
        return got
