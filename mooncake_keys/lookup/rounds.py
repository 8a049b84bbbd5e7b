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
namespace when its round asked it. On Mooncake 0.3.13 each key ``batch_is_exist`` answers
present is leased (10 s by default), so none of them can be removed or evicted before the lookup
ends: the hit loads, and is at most the one-shot hit of the store as it is then (a chunk saved
meanwhile may be missed). Without leases only the first holds (docs/mooncake.md,
tests/test_rounds_under_change.py).

*Leases = keys loaded* (Mooncake 0.3.14, or answers from the key-event mirror): the rounds ask
without leases, and the lookup ends with one call that leases exactly the keys its hit loads
(:meth:`Rounds.loaded_slots`: every namespace of the chunks each group's load reads), all of
them or none. If a key has gone by then, those chunks become known absent
(:meth:`Rounds.learn`) and the rounds go on to the hit without them, then lease again; a hit
is never answered with a key not leased.

Rounds work in *slots*: the positions of a group's asked chunks in the lookup plan (under a
lookup mask not every chunk is asked), so a round is a few slices of the plan's arrays.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from math import gcd
from typing import Callable, Dict, List, NamedTuple, Sequence, Tuple, Union

from .deployment import Deployment, LookupPlan
from .specs import ChunkedLocalAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

__all__ = ["Rounds", "RoundsGroup", "Segment", "HitOf", "MIN_KEYS", "PROBE_GAP_KEYS", "PROBE_GAP_FRACTION", "FIRST_ROUND_KEYS"]

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

    def __init__(self, deployment: Deployment, plan: LookupPlan, hints: Sequence[int] = (), *,
                 ask_everything: bool = False) -> None:
        """``hints``: tokens where the stored prefix may well end (a batch of lookups knows
        where a request stops sharing its hashes with the others): the first round probes the
        chunk holding each. ``ask_everything``: the first round asks every key (a short lookup,
        one-shot, that still ends with its lease call)."""
        coord = deployment.coordinator
        groups = [RoundsGroup(grp.spec, len(hs), g in coord.eagle_group_ids)
                  for g, (grp, hs) in enumerate(zip(deployment.store_groups, deployment.heads))]
        self._start(groups, plan, coord.alignment, hints, ask_everything)

    @classmethod
    def for_groups(cls, groups: Sequence["RoundsGroup"], plan: LookupPlan, alignment: int,
                   hints: Sequence[int] = (), *, ask_everything: bool = False) -> "Rounds":
        """Rounds over ``plan`` for groups described directly (an engine other than vLLM's, whose
        deployment is not a :class:`Deployment`: SGLang's KV pages are one full-attention group
        with one namespace per object of a page); ``alignment`` in tokens, as the coordinator's."""
        rounds = cls.__new__(cls)
        rounds._start(groups, plan, alignment, hints, ask_everything)
        return rounds

    def _start(self, groups: Sequence["RoundsGroup"], plan: LookupPlan, alignment: int,
               hints: Sequence[int], ask_everything: bool) -> None:
        self.groups = [_Group(g, plan, grp.spec, grp.namespaces, grp.eagle, alignment)
                       for g, grp in enumerate(groups)]
        self.heads = [tuple(range(grp.namespaces)) for grp in groups]
        self.plan = plan
        self.round = 0
        self.hints = tuple(hints)
        self.ask_everything = ask_everything

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
        if k == 0 and self.ask_everything:
            return [seg for grp in self.groups for seg in grp.everything(len(grp.known), self.heads[grp.g])]
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

    # ------------------------------------------------------------------ the lease call
    def learn(self, group: int, slots: Slots, flags: bytes) -> None:
        """What a call outside the rounds found (the lease call): per slot of ``group``, 1 when
        present in every namespace, else known absent from now on."""
        self.groups[group].record(Segment(group, slots, self.heads[group], ALL), flags)

    def loaded_slots(self, hit: int, hit_of: "HitOf") -> List[Slots]:
        """Per group, the slots whose keys the lease call asks for a hit of ``hit`` tokens: the
        chunks a load of the hit reads (vLLM's load mask: full attention every chunk below the
        hit, a sliding window its last window, a Mamba group the state at the hit, chunked local
        attention the hit's attention chunk), without those below ``skip_tokens`` (the engine
        holds them). ``hit_of(presence)`` is the engine's hit on per-group presence: the set
        must give ``hit`` by itself, so that every key the answer depends on is leased; where
        the load's chunks do not (an EAGLE hit rests on the chunk it drops), the chunk just past
        the hit is added, and failing that every chunk known present."""
        picked = [self._reads(grp, hit) for grp in self.groups]
        if hit_of(self._presence(picked)) == hit:
            return picked
        past = [self._with_next(grp, slots, hit) for grp, slots in zip(self.groups, picked)]
        if hit_of(self._presence(past)) == hit:
            return past
        return [array("q", [s for s in range(len(grp.known)) if grp.known[s] == 1 and grp.low[grp.pos[s]]])
                for grp in self.groups]

    def _reads(self, grp: _Group, hit: int) -> Slots:
        bs = grp.block_size
        n = hit // bs
        if grp.kind == "full":
            first = 0
        elif grp.kind == "swa":
            first = n - self.groups[grp.g].window + grp.eagle  # the window without the EAGLE chunk
        elif grp.kind == "mamba":
            first = n - 1
        else:  # chunked local attention: from the start of the hit's attention chunk
            first = hit // grp.chunk * grp.chunk // bs
        return _present_run(grp, grp.slot(max(0, first)), grp.slot(n))

    def _with_next(self, grp: _Group, slots: Slots, hit: int) -> Slots:
        s = grp.slot(hit // grp.block_size)
        if s < len(grp.known) and grp.known[s] == 1 and grp.low[grp.pos[s]] and s not in slots:
            return array("q", sorted([*slots, s]))
        return slots

    def _presence(self, picked: Sequence[Slots]) -> List[bytearray]:
        out = []
        for g, (grp, slots) in enumerate(zip(self.groups, picked)):
            p = self.plan.presence_of(g, b"")  # the chunks held below skip_tokens
            for s in slots:
                p[grp.pos[s]] = 1
            out.append(p)
        return out


#: The engine's hit (tokens) on per-group presence.
HitOf = Callable[[List[bytearray]], int]


def _present_run(grp: _Group, lo: int, hi: int) -> Slots:
    """Slots ``[lo, hi)`` known present, as a range when all are (a full-attention hit)."""
    low, pos, known = grp.low, grp.pos, grp.known
    if hi <= lo:
        return range(lo, lo)
    if isinstance(pos, range) and known.find(0, lo, hi) < 0 and known.find(2, lo, hi) < 0 \
            and low.find(0, pos[lo], pos[hi - 1] + 1) < 0:
        return range(lo, hi)
    return array("q", [s for s in range(lo, hi) if known[s] == 1 and low[pos[s]]])
