"""SGLang's hit rules, on per-page presence: one rank's answer, and the ranks' reduced one.

One rank (``MooncakeStore.batch_exists`` / ``batch_exists_v2``):

* **KV**: the pages up to the first one with an object missing (``kv_pages``).
* **Sidecar pools** (``batch_exists_v2``), read only below ``kv_pages``: the *stop points*
  ``1 .. kv_pages`` are cut pool by pool, in order. An ``all_pages`` pool keeps the stop points
  up to its first missing page; a ``trailing_pages`` pool of window ``W`` keeps stop point ``p``
  when its pages ``p - W .. p - 1`` all exist (so it can leave holes). Each pool's own boundary
  (its last stop point, when it has one) is its verdict; once no stop point is left the later
  pools are not read and give none. The answer is the last stop point left (0: none).

The ranks (``HybridCacheController._sync_prefetch_hit_query``, gloo ``all_reduce(MIN)``):
without a trailing pool, the MIN of the ranks' hit tokens; with one, the MIN of one 0/1 flag
per prefix length (the intersection of the ranks' stop points; the answer is the largest
common one). Pool verdicts ride in the same tensor, ``-1`` for "no verdict", so a rank without
one vetoes it.
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = ["ALL_PAGES", "TRAILING_PAGES", "KV", "PoolAnswer", "RankResult", "kv_pages",
           "pool_answer", "rank_result", "reduce_ranks", "trailing_stop_points"]

ALL_PAGES, TRAILING_PAGES = "all_pages", "trailing_pages"
#: The KV pool's name (SGLang's ``PoolName.KV``): its verdict is ``kv_pages``.
KV = "kv"
NO_VERDICT = -1


class PoolAnswer(NamedTuple):
    """One rank's ``batch_exists_v2`` answer, in pages: the hit (the last stop point left),
    each pool's own boundary where it has one (``"kv"`` and the sidecars' names), and every
    stop point left, ascending."""

    pages: int
    boundaries: Dict[str, int]
    restorable: List[int]


class RankResult(NamedTuple):
    """What one rank's query hands the reduction: its hit in tokens, its restorable stop points
    (pages; None: a contiguous prefix) and its pool verdicts (pages)."""

    hit_tokens: int
    restorable: Optional[List[int]]
    verdicts: Dict[str, int]


def kv_pages(flags: bytes) -> int:
    """Pages up to the first page with a missing object (``flags``: one byte per page, 1 when
    every object of the page exists)."""
    first = flags.find(0)
    return len(flags) if first < 0 else first


def trailing_stop_points(flags: bytes, pages: int, window: int) -> List[int]:
    """Stop points ``1 .. pages`` (ascending) whose last ``window`` pages (fewer near the start)
    all exist in ``flags``."""
    out = []
    run = 0  # present pages ending at the current one
    for p in range(1, pages + 1):
        run = run + 1 if flags[p - 1] else 0
        if run >= min(window, p):
            out.append(p)
    return out


def pool_answer(kv: int, pools: Sequence[Tuple[str, str, int, bytes]]) -> PoolAnswer:
    """The ``batch_exists_v2`` answer given ``kv`` KV pages and, per sidecar pool in order,
    ``(name, policy, window, flags)`` (``flags``: one byte per page, read below ``kv``;
    ``window``: pages, for ``trailing_pages``)."""
    boundaries: Dict[str, int] = {KV: kv} if kv else {}
    if not kv:
        return PoolAnswer(0, boundaries, [])
    restorable = list(range(1, kv + 1))
    for name, policy, window, flags in pools:
        if not restorable:
            break
        if policy == ALL_PAGES:
            boundary = kv_pages(bytes(flags[:kv]))
            kept = set(range(1, boundary + 1))
        elif policy == TRAILING_PAGES:
            points = trailing_stop_points(flags, kv, window)
            boundary = points[-1] if points else 0
            kept = set(points)
        else:
            raise ValueError(f"policy must be {ALL_PAGES!r} or {TRAILING_PAGES!r}, got {policy!r}")
        if boundary:
            boundaries[name] = boundary
        restorable = [p for p in restorable if p in kept]
    return PoolAnswer(restorable[-1] if restorable else 0, boundaries, restorable)


def rank_result(answer: PoolAnswer, page_size: int, pool_names: Sequence[str] = ()) -> RankResult:
    """What ``_storage_hit_query`` makes of a rank's answer: its hit in tokens, its stop points,
    and its verdicts (KV's, and each queried pool's that has one)."""
    verdicts = {KV: answer.boundaries.get(KV, answer.pages)}
    for name in pool_names:
        if name in answer.boundaries:
            verdicts[name] = answer.boundaries[name]
    return RankResult(answer.pages * page_size, list(answer.restorable), verdicts)


def reduce_ranks(results: Sequence[RankResult], page_size: int, span_pages: int, trailing: bool
                 ) -> Tuple[int, Dict[str, int]]:
    """The hit (tokens) every rank agrees on, and the reduced pool verdicts: what
    ``_sync_prefetch_hit_query`` gives each rank after its MIN over the sync groups."""
    if not results:
        raise ValueError("results must hold at least one rank's result")
    names = sorted({name for r in results for name in r.verdicts})
    packed = []
    for r in results:
        if trailing:
            hits = [0] * (span_pages + 1)
            hits[0] = 1
            if r.hit_tokens > 0:
                top = r.hit_tokens // page_size
                pages = r.restorable if r.restorable is not None else range(1, top + 1)
                for p in pages:
                    if 0 < p <= top:
                        hits[p] = 1
        else:
            hits = [r.hit_tokens]
        packed.append(hits + [r.verdicts.get(name, NO_VERDICT) for name in names])
    reduced = [min(column) for column in zip(*packed)]
    n = span_pages + 1 if trailing else 1
    verdicts = {name: v for name, v in zip(names, reduced[n:]) if v != NO_VERDICT}
    if not trailing:
        return reduced[0], verdicts
    return max(i for i, ok in enumerate(reduced[:n]) if ok) * page_size, verdicts
