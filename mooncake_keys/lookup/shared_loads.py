"""A prefix being loaded is loaded once: the scheduler-side policy that keeps a request's lookup
pending while another request's asynchronous load is bringing in the first block it would load.
Any connector whose scheduler can answer "not yet" can use it; vLLM's drop-in does
(``FastMooncakeStoreConnector``, mooncake_keys/vllm/connector.py).

Why (measured in vLLM's real engine, docs/benchmarks.md): vLLM caches a loaded request's blocks
in its own prefix cache only when the load has finished. Requests sharing a system prompt whose
lookups are answered together (the drop-in's coalesced asynchronous lookups, or vLLM's
synchronous ones in one step) each load the whole shared prefix from the store again: a burst of
32 requests sharing 2,048 tokens loaded 32 copies. Held until the first load lands, the others
find the prefix in vLLM's prefix cache and load only their own blocks.

Only with vLLM's ``"lookup_async": true`` and ``"load_async"`` (its default): a pending answer
(``None``) is then what vLLM's scheduler already expects, and it asks again next step. The
answers stay vLLM's: holding changes when a request is answered, never what it is answered.

**A request is held once, at most** :data:`HOLD_S` **seconds in all**: from the first poll held
to the one it goes on at (waiting for one load, or for several in turn when one ends without
landing and another brings the block in), and never again after it went on (until it finishes).
A load not reported finished within :data:`HOLD_S` of its start is forgotten. Each wait is
reported once, when the request goes on, with how it ended: ``"landed"`` (the load it waited
for landed), ``"dropped"`` (that load ended without landing: its request finished or was
aborted first, or it was not reported within :data:`HOLD_S`; or the request stopped needing
it) or ``"expired"`` (it waited :data:`HOLD_S`).

Bounds: the loads started within the last :data:`HOLD_S` (and landed ones for one step more)
with their block hashes, the requests held now, and the requests that went on after a hold (at
most :data:`MAX_RELEASED`, each forgotten when it finishes). Work per call: O(1) to decide,
O(blocks loaded) once per load, O(requests held) per step.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Dict, Iterable, List, Optional, Sequence

from .._checks import int_arg, seconds_arg

__all__ = ["HOLD_S", "MAX_RELEASED", "OUTCOMES", "SharedLoads"]

#: Longest a request is held, in all (seconds), and how long an unfinished load is trusted to
#: be in flight.
HOLD_S = 1.0
#: How many requests that went on after a hold are remembered (so that none is held again): a
#: request is forgotten when it finishes; past this many, the oldest are.
MAX_RELEASED = 65536
#: How a wait ends (see the module docstring).
OUTCOMES = LANDED, DROPPED, EXPIRED = ("landed", "dropped", "expired")


class _Load:
    __slots__ = ("started", "hashes", "landed")

    def __init__(self, started: float, hashes: List[bytes]) -> None:
        self.started = started
        self.hashes = hashes
        self.landed = False


class _Hold:
    __slots__ = ("since", "owner", "ended")

    def __init__(self, since: float, owner: str) -> None:
        self.since = since
        self.owner = owner  # the request whose load it waits for (the last, if several in turn)
        self.ended: Optional[str] = None  # that load's end, once forgotten: LANDED or DROPPED


class SharedLoads:
    """Which block hashes an in-flight load is bringing in, and which requests wait for them.

    ``hash_block_tokens``: tokens per entry of ``request.block_hashes`` (vLLM's hash block size).
    ``on_wait(seconds, outcome)`` is called once when a held request goes on: after how long it
    was held, in all, and how the wait ended (one of :data:`OUTCOMES`).
    """

    def __init__(self, hash_block_tokens: int, *, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_wait: Optional[Callable[[float, str], None]] = None) -> None:
        self.hash_block_tokens = int_arg("hash_block_tokens", hash_block_tokens, min=1)
        self.hold_s = seconds_arg("hold_s", hold_s)
        self._clock = clock
        self._on_wait = on_wait
        self._owner: Dict[bytes, str] = {}  # block hash -> the request whose load brings it in
        self._loads: Dict[str, _Load] = {}  # request -> its load in flight
        self._held: Dict[str, _Hold] = {}  # request -> its hold, while held
        self._released: "OrderedDict[str, None]" = OrderedDict()  # went on after a hold: never held again
        #: Polls answered "still pending" because another load brings the blocks in.
        self.holds = 0

    def waits(self, req_id: str, block_hashes: Sequence[bytes], computed_tokens: int) -> bool:
        """True when ``req_id`` should stay pending this step: the first block it would load
        (the one after its ``computed_tokens`` already in vLLM's cache) is in another request's
        load, it was never held before, and it has been held less than ``hold_s`` in all."""
        hold = self._held.get(req_id)
        if hold is None and req_id in self._released:
            return False
        index = computed_tokens // self.hash_block_tokens
        owner = self._owner.get(block_hashes[index]) if index < len(block_hashes) else None
        if owner is None or owner == req_id or owner not in self._loads:
            if hold is not None:
                self._went_on(req_id, hold.ended or (LANDED if self._landed(hold.owner) else DROPPED))
            return False
        now = self._clock()
        if hold is None:
            hold = self._held[req_id] = _Hold(now, owner)
        elif hold.owner != owner:  # that load ended; another brings the block in: the same hold
            hold.owner, hold.ended = owner, None
        if now - hold.since >= self.hold_s:
            self._went_on(req_id, EXPIRED)
            return False
        self.holds += 1
        return True

    def _landed(self, owner: str) -> bool:
        load = self._loads.get(owner)
        return load is not None and load.landed

    def _went_on(self, req_id: str, outcome: str) -> None:
        hold = self._held.pop(req_id)
        self._released[req_id] = None
        while len(self._released) > MAX_RELEASED:
            self._released.popitem(last=False)
        if self._on_wait is not None:
            self._on_wait(self._clock() - hold.since, outcome)

    def loading(self, req_id: str, block_hashes: Sequence[bytes], computed_tokens: int, load_tokens: int) -> None:
        """``req_id`` loads ``load_tokens`` tokens after its ``computed_tokens`` (replacing a load
        it had)."""
        self._end_load(req_id)
        first = computed_tokens // self.hash_block_tokens
        last = min(len(block_hashes), (computed_tokens + load_tokens) // self.hash_block_tokens)
        hashes = list(block_hashes[first:last])
        self._loads[req_id] = _Load(self._clock(), hashes)
        for h in hashes:
            self._owner.setdefault(h, req_id)

    def step(self, finished_loads: Iterable[str]) -> None:
        """Once per engine step, with the requests whose loads finished in it. A landed load
        keeps its blocks one step more: vLLM caches them during the next schedule, and a request
        asked before that in the same schedule would not see them yet. A load older than
        ``hold_s`` and not reported finished is forgotten (it did not land); a request held for
        ``hold_s`` goes on (expired)."""
        now = self._clock()
        finished = set(finished_loads)
        for req_id, load in list(self._loads.items()):
            if load.landed:
                self._end_load(req_id)
            elif req_id in finished:
                load.landed = True
            elif now - load.started >= self.hold_s:
                self._end_load(req_id)
        for req_id in [r for r, hold in self._held.items() if now - hold.since >= self.hold_s]:
            self._went_on(req_id, EXPIRED)  # its next poll goes on: reported now, never held again

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget these requests (finished, aborted): their loads, holds and past holds. A
        request that waited for one of their loads goes on when next asked (``"dropped"`` unless
        the load had landed)."""
        for req_id in req_ids:
            self._held.pop(req_id, None)  # held, then gone: it never went on
            self._released.pop(req_id, None)
            self._end_load(req_id)

    def clear(self) -> None:
        """Forget every load (vLLM's reset removed what they load); held requests go on when
        next asked (``"dropped"``)."""
        for req_id in list(self._loads):
            self._end_load(req_id)

    def _end_load(self, req_id: str) -> None:
        load = self._loads.pop(req_id, None)
        if load is None:
            return
        for h in load.hashes:
            if self._owner.get(h) == req_id:
                del self._owner[h]
        for hold in self._held.values():
            if hold.owner == req_id:
                hold.ended = LANDED if load.landed else DROPPED

    def sizes(self) -> Dict[str, int]:
        """The sizes of its tables (for checks of its bounds)."""
        return {"loads": len(self._loads), "owned_hashes": len(self._owner), "held": len(self._held),
                "released": len(self._released)}

    def __len__(self) -> int:
        """Loads in flight."""
        return len(self._loads)
