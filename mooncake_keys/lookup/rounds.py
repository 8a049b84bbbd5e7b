"""Asking in rounds: a lookup that costs only the keys its answer needs.

The one-shot lookup (vLLM's) asks every candidate chunk in one ``batch_is_exist``. On a real
master every key costs about a microsecond, so a miss at chunk 0 still pays for the whole
prompt. Asked in rounds, a lookup asks a few chunks of every group first, then more, and stops
as soon as the answer is decided.

*Decided* has a precise meaning. Counting every chunk not asked yet as absent gives a lower
bound of the hit (``low``), counting them present an upper bound (``high``), wherever the hit
grows with presence (:attr:`Coordinator.hit_is_monotone`; elsewhere the engine asks one-shot).
When the two bounds meet, every answer the store could give for the rest yields that hit: it is
exactly the one-shot lookup's. A property test holds the two strategies equal on random stores.

Which chunks a round asks, per group (a chunk is asked at most once):

- full attention: the lowest chunks not asked yet (its hit is a prefix), none past the upper
  bound; the first round ``first`` of them, then ``growth`` times as many each round, or with
  ``growth=None`` (the default) all the rest at once: every extra round costs a round trip
  (0.1-0.4 ms on loopback, as much as a few hundred keys), so a hit pays one small round more
  than the one-shot lookup, where doubling rounds would pay several;
- sliding window: the highest chunks not asked yet at or below the upper bound (a window ends
  there) and above the lower bound less a window: ``first``, then a window's worth, doubling
  each round. A window far below the full-attention hit is never asked.

If no group has a chunk left between the bounds, the rest is asked: a lookup always ends, after
at most as many keys as the one-shot lookup. A lookup of fewer than :data:`MIN_KEYS` keys is
asked one-shot: it has little to save, and a hit would pay the extra round trip.

Measured on a real ``mooncake_master`` on loopback (docs/benchmarks.md): a miss on standard
scenario (a) costs 64 keys in one call instead of 16,384 (about 0.1x the one-shot time); a full
hit costs one round of 64 keys more (about 1.0x); with a sliding-window group beside full
attention (scenario b) only the windows near the hit are asked (0.05x at a miss, 0.5-0.7x at a
partial or full hit).

Rounds work in *slots*: the positions of a group's asked chunks in the lookup plan (under a
lookup mask not every chunk is asked), so a round is a few slices of the plan's arrays.
"""

from __future__ import annotations

from bisect import bisect_left
from typing import List, Optional, Sequence, Tuple

from .deployment import Deployment, LookupPlan
from .specs import SlidingWindowSpec

__all__ = ["Rounds", "DEFAULT_FIRST_ROUND", "DEFAULT_GROWTH", "MIN_KEYS", "Slices"]

#: Chunks per group in the first round.
DEFAULT_FIRST_ROUND = 8
#: Full attention: each round asks this many times the chunks of the last; None: all the rest.
DEFAULT_GROWTH: Optional[int] = None
#: A lookup of fewer keys than this is asked one-shot. A round trip costs the master about as
#: much as 100-200 keys (0.1-0.2 ms on loopback), so below ~2,000 keys the first round of a hit
#: would cost more than 10 % (short prompts: standard scenario (d) sends 512 keys).
MIN_KEYS = 2048

#: Per group, the slot ranges ``(start, stop)`` a round asks.
Slices = Tuple[Tuple[Tuple[int, int], ...], ...]


class _Group:
    """What is known of one group: presence per chunk with unknown chunks absent (``low``) and
    present (``high``), and which slots were asked."""

    __slots__ = ("pos", "index", "known", "low", "high", "lo", "block_size", "window", "swa")

    def __init__(self, deployment: Deployment, g: int, plan: LookupPlan) -> None:
        p = plan.groups[g]
        spec = deployment.store_groups[g].spec
        self.pos = p.asked
        self.index = p.index
        self.known = bytearray(len(p.asked))
        self.low = plan.presence_of(g, b"")
        self.high = plan.presence_of(g, b"\x01" * len(p.asked))
        self.lo = 0  # full attention: every slot below is known
        self.block_size = spec.block_size
        self.swa = isinstance(spec, SlidingWindowSpec)
        eagle = g in deployment.coordinator.eagle_group_ids
        self.window = spec.blocks_needed(eagle) if self.swa else 0

    def slot(self, chunk: int) -> int:
        """The first slot whose chunk is ``>= chunk``."""
        pos = self.pos
        if isinstance(pos, range):
            return min(max(chunk - pos.start, 0), len(pos))
        return bisect_left(pos, chunk)

    def lowest_unknown(self, size: Optional[int], top: int) -> Tuple[Tuple[int, int], ...]:
        lo = self.known.find(0, self.lo)
        self.lo = lo = len(self.known) if lo < 0 else lo
        stop = self.slot(top) if size is None else min(lo + size, self.slot(top))
        return ((lo, stop),) if stop > lo else ()

    def highest_unknown(self, size: int, floor: int, top: int) -> Tuple[Tuple[int, int], ...]:
        out = []
        first, hi = self.slot(floor), self.slot(top)
        known = self.known
        while size > 0:
            j = known.rfind(0, first, hi)
            if j < 0:
                break
            start = max(known.rfind(1, first, j) + 1, first, j + 1 - size)  # the run of unknown slots down from j
            out.append((start, j + 1))
            size -= j + 1 - start
            hi = start
        return tuple(reversed(out))

    def unknown_runs(self) -> Tuple[Tuple[int, int], ...]:
        out, known, i = [], self.known, 0
        while True:
            i = known.find(0, i)
            if i < 0:
                return tuple(out)
            j = known.find(1, i)
            j = len(known) if j < 0 else j
            out.append((i, j))
            i = j

    def record(self, start: int, stop: int, flags: bytes) -> None:
        self.known[start:stop] = b"\x01" * (stop - start)
        pos = self.pos
        if isinstance(pos, range):
            c0 = pos.start + start
            self.low[c0:c0 + stop - start] = flags
            self.high[c0:c0 + stop - start] = flags
            return
        low, high = self.low, self.high
        for s, f in zip(range(start, stop), flags):
            low[pos[s]] = high[pos[s]] = f


class Rounds:
    """One lookup asked in rounds: what is known, and which slots to ask next."""

    def __init__(self, deployment: Deployment, plan: LookupPlan, first: int = DEFAULT_FIRST_ROUND,
                 growth: Optional[int] = DEFAULT_GROWTH) -> None:
        if first < 1:
            raise ValueError(f"first must be >= 1 chunk, got {first}")
        if growth is not None and growth < 2:
            raise ValueError(f"growth must be None or >= 2, got {growth}")
        self.groups = [_Group(deployment, g, plan) for g in range(len(plan.groups))]
        self.first = first
        self.growth = growth
        self.round = 0

    @property
    def low(self) -> List[bytearray]:
        return [grp.low for grp in self.groups]

    @property
    def high(self) -> List[bytearray]:
        return [grp.high for grp in self.groups]

    def next_round(self, low: int, high: int) -> Slices:
        """Per group, the slots to ask next, given the bounds ``low`` < ``high`` of the hit in
        tokens; every group's empty when nothing is left to ask."""
        k = self.round
        self.round += 1
        chosen = []
        for grp in self.groups:
            bs = grp.block_size
            if grp.swa:
                size = self.first if k == 0 else max(self.first, grp.window) << (k - 1)
                floor = max(0, low // bs - grp.window)
                chosen.append(grp.highest_unknown(size, floor, high // bs + 2))
            else:
                size = self.first if k == 0 else (None if self.growth is None else self.first * self.growth ** k)
                chosen.append(grp.lowest_unknown(size, high // bs + 2))
        if not any(chosen):  # nothing between the bounds: ask what is left, and be done
            chosen = [grp.unknown_runs() for grp in self.groups]
        return tuple(chosen)

    def record(self, chosen: Slices, flags: Sequence[bytes]) -> None:
        """Take a round's answers: per group, one flag per chunk asked (slices in order)."""
        for grp, slices, f in zip(self.groups, chosen, flags):
            off = 0
            for start, stop in slices:
                grp.record(start, stop, f[off:off + stop - start])
                off += stop - start
