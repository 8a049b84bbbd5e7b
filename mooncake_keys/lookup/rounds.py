"""Asking in rounds: a lookup that costs only the keys its answer needs.

The one-shot lookup (vLLM's) asks every candidate chunk in every namespace in one
``batch_is_exist``. On a real master every key costs about a microsecond, and every key found
present also takes a read lease that blocks its eviction for a while (docs/mooncake.md). Asked
in rounds, a lookup asks what can decide its answer first, and stops as soon as it is decided.

*Decided* has a precise meaning. Counting every chunk not known yet as absent gives a lower
bound of the hit (``low``), counting it present an upper bound (``high``), wherever the hit
grows with presence (:attr:`Coordinator.hit_is_monotone`; elsewhere the engine asks one-shot).
A chunk is known present when every namespace of its group answered 1, known absent as soon as
one namespace answered anything else. When the two bounds meet, every answer the store could
give for the rest yields that hit: it is exactly the one-shot lookup's. Property tests hold the
two strategies equal on random stores, and tests/against_vllm on vLLM's own code.

The answer's floor is every namespace of every full-attention chunk up to and including the
first absent one, plus the chunks the other groups read at the hit (a sliding window, a Mamba
state, the last attention chunk). The rounds come close to it:

1. **Probes.** A full-attention group asks its first chunks in every namespace, and *probes*
   chunks spread over the rest of the prompt in one namespace each (rotating through them):
   spaced by :data:`PROBE_GAP_KEYS` keys' worth of chunks near the start and by
   :data:`PROBE_GAP_FRACTION` of the position further on, a few dozen keys in all, and the
   chunks the caller hints at (a batch of lookups hints where each request stops sharing its
   hashes with the others: a shared system prompt's end). A probe answering absent ends the
   hit there (an absent chunk in any namespace does).
2. **Up to the first absent probe.** Every namespace of every chunk below it (the namespaces a
   probe did not ask): the full-attention hit is then decided, having asked at most a probe gap
   past the floor.
3. **The other groups at the hit**, once full attention is decided: a sliding window's chunks
   just below the upper bound, a Mamba group's last aligned states (one, then more), a chunked
   group's last attention chunk. A group with no full-attention group beside it starts there.

If no group has a chunk left that could move a bound, the rest is asked: a lookup always ends,
after at most the keys of the one-shot lookup, and never asks a key twice. A lookup of fewer
than :data:`MIN_KEYS` keys is asked one-shot: it has little to save, and a hit would pay the
extra round trips.

*A store that changes between rounds*: every chunk counted present was present in every
namespace when its round asked it. On Mooncake each key answered present is leased (10 s by
default), so none of them can be removed or evicted before the lookup ends: the hit loads, and
is at most the one-shot hit of the store as it is then (a chunk saved meanwhile may be missed).
Without leases only the first holds (docs/mooncake.md, tests/test_rounds_under_change.py).

Rounds work in *slots*: the positions of a group's asked chunks in the lookup plan (under a
lookup mask not every chunk is asked), so a round is a few slices of the plan's arrays.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from math import gcd
from typing import Dict, List, NamedTuple, Sequence, Tuple, Union

from .deployment import Deployment, LookupPlan
from .specs import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

__all__ = ["Rounds", "RoundsGroup", "Segment", "MIN_KEYS", "PROBE_GAP_KEYS", "PROBE_GAP_FRACTION", "FIRST_ROUND_KEYS"]

#: A lookup of fewer keys than this is asked one-shot. A round trip costs the master about as
#: much as 100-200 keys (0.1-0.2 ms on loopback), so below ~2,000 keys the extra rounds of a hit
#: would cost more than 10 % (short prompts: standard scenario (d) sends 512 keys).
MIN_KEYS = 2048
#: Keys the first round asks of a full-attention group's first chunks (every namespace).
FIRST_ROUND_KEYS = 64
#: Probes are at most this many keys' worth of chunks apart (the second round's overshoot past
#: the first absent chunk is below one gap) ...
PROBE_GAP_KEYS = 400
#: ... or, further on, this fraction of their position (the overshoot stays a few % of the hit).
PROBE_GAP_FRACTION = 0.08
#: A Mamba group asks this many times more states each round after its first.
MAMBA_GROWTH = 8

ALL, PROBE, REST = 0, 1, 2
_ONE_IF_SET = bytes([0] + [1] * 255)  # a flag byte as 0 or 1
Slots = Union[range, array]


class RoundsGroup(NamedTuple):
    """What rounds need to know of one group: its spec (kind, block size in tokens, window),
    how many namespaces each of its chunks is asked in, and whether it is an EAGLE group."""

    spec: KVCacheSpec
    namespaces: int
    eagle: bool = False


class Segment(NamedTuple):
    """What one round asks of one group: ``slots`` (positions in the group's plan) in the
    namespaces ``heads`` (indices into the group's key heads); ``mode`` says which: ``ALL``
    every namespace, ``PROBE`` one, ``REST`` every namespace but the one a probe asked."""

    group: int
    slots: Slots
    heads: Tuple[int, ...]
    mode: int


def _runs(known: bytearray, start: int, stop: int) -> List[Tuple[int, int]]:
    """The runs of unknown slots (``known`` byte 0) in ``[start, stop)``."""
    out = []
    i = known.find(0, start, stop)
    while i >= 0:
        ends = [e for e in (known.find(1, i, stop), known.find(2, i, stop)) if e >= 0]
        j = min(ends) if ends else stop
        out.append((i, j))
        i = known.find(0, j, stop) if j < stop else -1
    return out


class _Group:
    """What is known of one group: per slot unknown (0), known (1) or probed present in one
    namespace (2); per chunk presence with the unknown absent (``low``) and present (``high``)."""

    def __init__(self, g: int, plan: LookupPlan, spec: KVCacheSpec, namespaces: int, eagle: bool,
                 alignment: int) -> None:
        self.g = g
        p = plan.groups[g]
        self.pos = p.asked
        self.index = p.index
        self.known = bytearray(len(p.asked))
        self.probed: Dict[int, int] = {}  # slot -> the namespace its probe found present
        self.low = plan.presence_of(g, b"")
        self.high = plan.presence_of(g, b"\x01" * len(p.asked))
        self.first_absent = len(p.asked)  # the first slot known absent
        self.block_size = spec.block_size
        self.r = namespaces
        self.kind = ("swa" if isinstance(spec, SlidingWindowSpec) else "mamba" if isinstance(spec, MambaSpec)
                     else "chunked" if isinstance(spec, ChunkedLocalAttentionSpec) else "full")
        self.eagle = int(eagle)
        self.window = spec.blocks_needed(eagle) if self.kind == "swa" else 0
        self.step = alignment // gcd(spec.block_size, alignment)  # Mamba: chunk j aligned iff (j+1) % step == 0
        self.chunk = getattr(spec, "attention_chunk_size", 0)
        self.asked_rounds = 0

    def slot(self, chunk: int) -> int:
        """The first slot whose chunk is ``>= chunk``."""
        pos = self.pos
        if isinstance(pos, range):
            return min(max(chunk - pos.start, 0), len(pos))
        return bisect_left(pos, chunk)

    def chunk_of(self, slot: int) -> int:
        return self.pos[slot]

    def decided_below(self, top: int) -> bool:
        """Whether every slot below ``min(top, first absent)`` is known."""
        stop = min(top, self.first_absent)
        return self.known.find(0, 0, stop) < 0 and self.known.find(2, 0, stop) < 0

    # ------------------------------------------------------------------ round choices
    def everything(self, stop: int, all_heads: Tuple[int, ...]) -> List[Segment]:
        """Every namespace not asked yet of the slots below ``stop``."""
        g = self.g
        out = [Segment(g, range(a, b), all_heads, ALL) for a, b in _runs(self.known, 0, stop)]
        by_head: Dict[int, List[int]] = {}
        for s, k in self.probed.items():
            if s < stop and self.known[s] == 2:
                by_head.setdefault(k, []).append(s)
        for k, slots in sorted(by_head.items()):
            out.append(Segment(g, array("q", sorted(slots)), tuple(h for h in all_heads if h != k), REST))
        return out

    def probes(self, start: int, stop: int, hints: Sequence[int] = ()) -> List[Segment]:
        """One namespace each of slots spread over ``[start, stop)``, rotating namespaces, and
        of the chunks ``hints`` (where the caller expects the stored prefix to end)."""
        gap0 = max(1, PROBE_GAP_KEYS // self.r)
        picked = set()
        s = start
        while s < stop:
            picked.add(s)
            s += max(gap0, int(self.chunk_of(s) * PROBE_GAP_FRACTION))
        picked.update(s for s in map(self.slot, hints) if start <= s < stop)
        chosen: Dict[int, List[int]] = {}
        for n, s in enumerate(sorted(s for s in picked if not self.known[s])):
            chosen.setdefault(n % self.r, []).append(s)
        return [Segment(self.g, array("q", slots), (k,), PROBE) for k, slots in sorted(chosen.items())]

    def highest(self, size: int, floor: int, top: int, all_heads: Tuple[int, ...],
                aligned_only: bool = False) -> List[Segment]:
        """Up to ``size`` unknown slots, the highest first, in ``[floor, top)`` (Mamba: only
        slots whose chunk ends aligned)."""
        picked: List[int] = []
        j = top
        known, step = self.known, self.step
        while size > 0:
            j = known.rfind(0, floor, j)
            if j < 0:
                break
            if not aligned_only or (self.chunk_of(j) + 1) % step == 0:
                picked.append(j)
                size -= 1
        if not picked:
            return []
        return [Segment(self.g, array("q", sorted(picked)), all_heads, ALL)]

    def lowest(self, start: int, stop: int, all_heads: Tuple[int, ...]) -> List[Segment]:
        """Every unknown slot in ``[start, stop)``."""
        return [Segment(self.g, range(a, b), all_heads, ALL) for a, b in _runs(self.known, start, stop)]

    # ------------------------------------------------------------------ answers
    def record(self, seg: Segment, flags: bytes) -> None:
        known, low, high, pos = self.known, self.low, self.high, self.pos
        mode = seg.mode
        slots = seg.slots
        if mode != PROBE and type(slots) is range and type(pos) is range and slots.step == pos.step == 1:
            # A run of slots answered in every namespace it asks: as the loop below, in slices (a
            # long prompt's hit is thousands of slots; the loop cost 0.7 ms per 2,048 of them).
            n = min(len(slots), len(flags))
            if n:
                a = slots.start
                c = pos[a]
                f = bytes(flags[:n]).translate(_ONE_IF_SET)
                known[a:a + n] = b"\x01" * n
                low[c:c + n] = high[c:c + n] = f
                j = f.find(0)
                if 0 <= j and a + j < self.first_absent:
                    self.first_absent = a + j
            return
        for s, f in zip(slots, flags):
            c = pos[s]
            if mode == PROBE and f:
                if self.r > 1:
                    known[s] = 2
                    self.probed[s] = seg.heads[0]
                    continue
            known[s] = 1
            low[c] = high[c] = 1 if f else 0
            if not f and s < self.first_absent:
                self.first_absent = s


class Rounds:
    """One lookup asked in rounds: what is known, and what to ask next (see the module doc)."""

    def __init__(self, deployment: Deployment, plan: LookupPlan, hints: Sequence[int] = ()) -> None:
        """``hints``: tokens where the stored prefix may well end (a batch of lookups knows
        where a request stops sharing its hashes with the others): the first round probes the
        chunk holding each."""
        coord = deployment.coordinator
        groups = [RoundsGroup(grp.spec, len(hs), g in coord.eagle_group_ids)
                  for g, (grp, hs) in enumerate(zip(deployment.store_groups, deployment.heads))]
        self._start(groups, plan, coord.alignment, hints)

    @classmethod
    def for_groups(cls, groups: Sequence["RoundsGroup"], plan: LookupPlan, alignment: int,
                   hints: Sequence[int] = ()) -> "Rounds":
        """Rounds over ``plan`` for groups described directly (an engine other than vLLM's, whose
        deployment is not a :class:`Deployment`: SGLang's KV pages are one full-attention group
        with one namespace per object of a page); ``alignment`` in tokens, as the coordinator's."""
        rounds = cls.__new__(cls)
        rounds._start(groups, plan, alignment, hints)
        return rounds

    def _start(self, groups: Sequence["RoundsGroup"], plan: LookupPlan, alignment: int,
               hints: Sequence[int]) -> None:
        self.groups = [_Group(g, plan, grp.spec, grp.namespaces, grp.eagle, alignment)
                       for g, grp in enumerate(groups)]
        self.heads = [tuple(range(grp.namespaces)) for grp in groups]
        self.round = 0
        self.hints = tuple(hints)

    @property
    def low(self) -> List[bytearray]:
        return [grp.low for grp in self.groups]

    @property
    def high(self) -> List[bytearray]:
        return [grp.high for grp in self.groups]

    def next_round(self, low: int, high: int) -> List[Segment]:
        """What to ask next given the bounds ``low`` < ``high`` of the hit (tokens)."""
        k = self.round
        self.round += 1
        out: List[Segment] = []
        fulls = [grp for grp in self.groups if grp.kind == "full"]
        full_decided = all(grp.decided_below(grp.slot(high // grp.block_size + 1)) for grp in fulls)
        for grp in self.groups:
            heads = self.heads[grp.g]
            bs = grp.block_size
            top = grp.slot(high // bs + 1)
            if grp.kind == "full":
                if k == 0:
                    head = min(top, max(1, FIRST_ROUND_KEYS // grp.r))
                    hinted = [t // bs for t in self.hints]
                    out += grp.lowest(0, head, heads) + grp.probes(head, top, hinted)
                else:
                    out += grp.everything(min(top, grp.first_absent), heads)
                continue
            if fulls and not full_decided:
                continue  # the other groups are read at the hit, once full attention has it
            n = grp.asked_rounds
            if grp.kind == "swa":  # a window ends at the upper bound (one chunk past it with EAGLE)
                end = grp.slot(high // bs + grp.eagle)
                out += grp.highest(grp.window << n, grp.slot(max(0, low // bs - grp.window)), end, heads)
            elif grp.kind == "mamba":
                out += grp.highest(MAMBA_GROWTH ** n, grp.slot(low // bs), top, heads, aligned_only=True)
            else:  # chunked local attention: the last attention chunk below the upper bound
                start = grp.slot(high // grp.chunk * grp.chunk // bs) if high else 0
                out += grp.lowest(start, top, heads)
                if start > 0 and n == 0:  # and the chunk before it (vLLM reads it for the tail key)
                    out += grp.lowest(start - 1, start, heads)
            if out and out[-1].group == grp.g:
                grp.asked_rounds += 1
        if not out:  # nothing between the bounds: ask what is left, and be done
            for grp in self.groups:
                out += grp.everything(len(grp.known), self.heads[grp.g])
        return out

    def record(self, segments: Sequence[Segment], flags: Sequence[bytes]) -> None:
        """Take a round's answers: per segment, one flag per slot (1: present in every
        namespace the segment asked)."""
        for seg, f in zip(segments, flags):
            self.groups[seg.group].record(seg, f)
