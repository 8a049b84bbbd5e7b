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
(``None``) is then what vLLM's scheduler already expects, and it asks again next step. A request is
held at most :data:`HOLD_S` seconds; a load not reported finished within that is forgotten. The
answers stay vLLM's: holding changes when a request is answered, never what it is answered.
Work per call: O(1) to decide, O(blocks loaded) once per load.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from .._checks import int_arg, seconds_arg

__all__ = ["HOLD_S", "SharedLoads"]

#: Longest a request waits for another request's load of its blocks (seconds), and how long an
#: unfinished load is trusted to be in flight.
HOLD_S = 1.0


class SharedLoads:
    """Which block hashes an in-flight load is bringing in, and which requests wait for them.

    ``hash_block_tokens``: tokens per entry of ``request.block_hashes`` (vLLM's hash block size).
    ``on_wait(seconds, expired)`` is called when a held request goes on: after how long, and
    whether because it waited ``hold_s`` (True) or because the load it waited for landed.
    """

    def __init__(self, hash_block_tokens: int, *, hold_s: float = HOLD_S,
                 clock: Callable[[], float] = time.monotonic,
                 on_wait: Optional[Callable[[float, bool], None]] = None) -> None:
        self.hash_block_tokens = int_arg("hash_block_tokens", hash_block_tokens, min=1)
        self.hold_s = seconds_arg("hold_s", hold_s)
        self._clock = clock
        self._on_wait = on_wait
        self._owner: Dict[bytes, str] = {}  # block hash -> the request whose load brings it in
        self._loads: Dict[str, Tuple[float, List[bytes], bool]] = {}  # request -> (started, hashes, landed)
        self._held: Dict[str, float] = {}  # request -> when it was first held
        #: Polls answered "still pending" because another load brings the blocks in.
        self.holds = 0

    def waits(self, req_id: str, block_hashes: Sequence[bytes], computed_tokens: int) -> bool:
        """True when ``req_id`` should stay pending this step: the first block it would load
        (the one after its ``computed_tokens`` already in vLLM's cache) is in another request's
        load, and it has waited less than ``hold_s``."""
        index = computed_tokens // self.hash_block_tokens
        owner = self._owner.get(block_hashes[index]) if index < len(block_hashes) else None
        if owner is None or owner == req_id or owner not in self._loads:
            self._went_on(req_id, expired=False)
            return False
        now = self._clock()
        since = self._held.setdefault(req_id, now)
        if now - since >= self.hold_s:
            self._went_on(req_id, expired=True)
            return False
        self.holds += 1
        return True

    def _went_on(self, req_id: str, expired: bool) -> None:
        since = self._held.pop(req_id, None)
        if since is not None and self._on_wait is not None:
            self._on_wait(self._clock() - since, expired)

    def loading(self, req_id: str, block_hashes: Sequence[bytes], computed_tokens: int, load_tokens: int) -> None:
        """``req_id`` loads ``load_tokens`` tokens after its ``computed_tokens`` (replacing a load
        it had, and ending a hold)."""
        self.finished([req_id])
        first = computed_tokens // self.hash_block_tokens
        last = min(len(block_hashes), (computed_tokens + load_tokens) // self.hash_block_tokens)
        hashes = list(block_hashes[first:last])
        self._loads[req_id] = (self._clock(), hashes, False)
        for h in hashes:
            self._owner.setdefault(h, req_id)

    def step(self, finished_loads: Iterable[str]) -> None:
        """Once per engine step, with the requests whose loads finished in it. A landed load
        keeps its blocks one step more: vLLM caches them during the next schedule, and a request
        asked before that in the same schedule would not see them yet."""
        now = self._clock()
        done = [r for r, (started, _, landed) in self._loads.items() if landed or now - started >= self.hold_s]
        self.finished(done)
        for req_id in finished_loads:
            load = self._loads.get(req_id)
            if load is not None:
                self._loads[req_id] = (load[0], load[1], True)
        for req_id in [r for r, since in self._held.items() if now - since >= self.hold_s]:
            del self._held[req_id]  # held, then aborted or answered elsewhere

    def finished(self, req_ids: Iterable[str]) -> None:
        """Forget these requests' loads and holds (finished, aborted)."""
        for req_id in req_ids:
            self._held.pop(req_id, None)
            load = self._loads.pop(req_id, None)
            if load is None:
                continue
            for h in load[1]:
                if self._owner.get(h) == req_id:
                    del self._owner[h]

    def __len__(self) -> int:
        """Loads in flight."""
        return len(self._loads)
