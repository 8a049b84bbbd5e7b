"""Driving a :class:`~mooncake_keys.lookup.batch.LookupBatcher` as vLLM's scheduler does: submit
lookups, then poll until each is answered."""

from __future__ import annotations

import time
from typing import Any, Dict, Iterable, Mapping, Optional, Sequence


def answers_of(batcher: Any, names: Iterable[Any], seconds: float = 20.0) -> Dict[Any, Any]:
    """Poll every lookup of ``names`` until each is answered or ``seconds`` have passed: the
    answers got (a name missing from them was not answered in time)."""
    names = list(names)
    out: Dict[Any, Any] = {}
    deadline = time.monotonic() + seconds
    while len(out) < len(names) and time.monotonic() < deadline:
        for name in names:
            if name not in out:
                got = batcher.poll(name)
                if got is not None:
                    out[name] = got
        time.sleep(0.001)
    return out


def burst(batcher: Any, requests: Mapping[Any, Sequence[bytes]], tokens: Optional[int] = None,
          seconds: float = 20.0) -> Dict[Any, Any]:
    """Submit every request at once (the batcher's thread takes them in one batch: it waits on the
    lock held here; a Condition's lock is reentrant, so submit takes it again), each for its
    hashes' tokens plus one (or ``tokens``), and wait for every answer (AssertionError otherwise)."""
    with batcher._cond:
        for name, hashes in requests.items():
            batcher.submit(name, len(hashes) * 16 + 1 if tokens is None else tokens, hashes)
    out = answers_of(batcher, requests, seconds)
    assert len(out) == len(requests), f"answered {sorted(out)} of {sorted(requests)}"
    return out
