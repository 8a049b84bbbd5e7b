"""Why a lookup hits what it hits: every answer of its keys, and the coordinator's steps.

``LookupEngine.explain(num_tokens, block_hashes)`` (this module's :func:`explain` does its work)
asks the engine's store once, with every key a one-shot lookup asks (built by the engine itself,
and sent through ``engine.call_store``: the same store-fault policy and log line), and keeps every
(group, chunk, namespace) answer. The answers are read by the lookup itself (``steps()`` of a
one-shot engine of the same deployment), so the hit and the tail key boundaries are those of
``engine.lookup_result`` on the same store state. A lookup of more than :data:`MAX_KEYS` keys is
refused before a key is built (:class:`ExplanationTooLarge`): every answer is kept. From the same
answers:

* per store group (:class:`GroupExplanation`): the chunks asked, the leading run of chunks
  present in every namespace, the first chunk that is not and which namespaces answered absent
  or an error code, counts, and the hit this group's answers alone would allow;
* the coordinator's steps (:class:`Cut`): the lookup length, the run of present chunks, the
  alignment, the EAGLE drop, a sliding window, a Mamba state, the hybrid fixed point, the last
  token, a store fault; each figure is the coordinator's own answer (``Deployment.hit_length``)
  on these answers, on one group's answers alone, without the EAGLE drop, or at the hit.

Nothing here restates a hit rule: where a sentence names one, its figures come from the
function that applies it. The engine imports this module, never the reverse (the engine it is
handed is read through its public methods); the report is printed by :mod:`mooncake_keys.report`.
"""

from __future__ import annotations

import logging
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

from .deployment import Deployment, LookupPlan
from .hashes import as_block_hashes
from .layout import Namespace
from .specs import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec, SlidingWindowSpec

__all__ = [
    "ABSENT", "ERROR", "MAX_KEYS", "PRESENT", "Cut", "Explanation", "ExplanationTooLarge", "GroupExplanation",
    "MissingChunk", "NamespaceRow", "explain", "is_error_code", "namespace_name",
]

#: How an answer reads (``GroupExplanation.status``): absent, present (exactly 1), an error code.
ABSENT, PRESENT, ERROR = 0, 1, 2
#: The most keys an explanation asks (and keeps every answer of): a 128k-token prompt of 16-token
#: chunks on 64 namespaces is 524,288. Beyond, :class:`ExplanationTooLarge` before any key is built.
MAX_KEYS = 1 << 20


class ExplanationTooLarge(ValueError):
    """The lookup asks more keys than :data:`MAX_KEYS`: explain a shorter prefix."""

def namespace_name(namespace: Namespace) -> str:
    """``(tp, pcp, dcp, pp)`` as an operator reads it: ``"tp0 pcp0 dcp0 pp1"``."""
    tp, pcp, dcp, pp = namespace
    return f"tp{tp} pcp{pcp} dcp{dcp} pp{pp}"


def is_error_code(answer: Any) -> bool:
    """Whether a ``batch_is_exist`` answer is an error code (Mooncake's negative ``ErrorCode``;
    -900: the master is unreachable). Like every answer but 1, it counts as absent."""
    return type(answer) is int and answer < 0


@dataclass(frozen=True)
class MissingChunk:
    """The first chunk a group asked that is not present in every namespace."""

    #: The chunk's index in its group: tokens ``[chunk * chunk_tokens, (chunk + 1) * chunk_tokens)``.
    chunk: int
    #: Its first token.
    start_tokens: int
    #: The namespaces that answered absent (0, or anything that is neither 1 nor an error code).
    absent: Tuple[str, ...]
    #: The namespaces that answered an error code, with the code.
    errors: Tuple[Tuple[str, int], ...]


class NamespaceRow(NamedTuple):
    """One namespace of a group, over the chunks asked: keys present, absent, with an error
    code, and the first chunk (index) it lacks (None: none)."""

    namespace: str
    present: int
    absent: int
    error: int
    first_not_present: Optional[int]


@dataclass(frozen=True)
class GroupExplanation:
    """What one store group's keys were answered. Chunk counts in chunks, sizes in tokens."""

    #: The store group (``@group:<g>`` in its keys).
    group_id: int
    #: "full attention", "sliding window", "Mamba" or "chunked local attention".
    kind: str
    #: The spec in words (window, chunk size, MLA, EAGLE).
    spec: str
    #: Whether the EAGLE drop applies to this group.
    eagle: bool
    #: Tokens per chunk of the group (its block size).
    block_size: int
    #: Tokens per entry asked: the block size, or the hash unit with partial hash hits.
    chunk_tokens: int
    #: Its namespaces (``"tp0 pcp0 dcp0 pp1"``) and their key prefixes, in the order asked.
    namespaces: Tuple[str, ...]
    prefixes: Tuple[str, ...]
    #: The chunks asked, in order (a sliding-window group asks only where a window can end).
    asked_chunks: Tuple[int, ...]
    #: The chunks below ``skip_tokens``: not asked, counted present.
    presumed_chunks: Tuple[int, ...]
    #: ``answers[k][i]``: namespace ``k``'s answer for ``asked_chunks[i]``; empty after a store fault.
    answers: Tuple[Tuple[Any, ...], ...]
    #: ``status[k][i]``: that answer read as the lookup reads it: :data:`PRESENT` (exactly 1),
    #: :data:`ERROR` (an error code, counted absent) or :data:`ABSENT` (anything else).
    status: Tuple[bytes, ...]
    #: Chunks asked that are present in every namespace; absent somewhere (and no error code);
    #: with an error code somewhere.
    present_chunks: int
    absent_chunks: int
    error_chunks: int
    #: The leading chunks (asked or presumed) present in every namespace, and the token where
    #: that run ends: the first missing chunk's start, or the end of the last chunk asked.
    run_chunks: int
    run_tokens: int
    #: The first chunk asked that is not present in every namespace (None: none).
    first_missing: Optional[MissingChunk]
    #: The hit (tokens) this group's answers alone allow: every other group counted present,
    #: before the EAGLE drop and the last-token rule; None when nothing was answered.
    alone_hit_tokens: Optional[int]

    def namespace_rows(self) -> Tuple[NamespaceRow, ...]:
        """Per namespace, its answers counted (see :class:`NamespaceRow`)."""
        rows = []
        for name, status in zip(self.namespaces, self.status):
            i = next((i for i, s in enumerate(status) if s != PRESENT), None)
            rows.append(NamespaceRow(name, status.count(PRESENT), status.count(ABSENT), status.count(ERROR),
                                     None if i is None else self.asked_chunks[i]))
        return tuple(rows)


@dataclass(frozen=True)
class Cut:
    """One step from the lookup length to the hit, in words with its figures (tokens)."""

    #: What decided it: "length", "hashes", "skip", "present", "alignment", "units", "window",
    #: "state", "chunk", "eagle", "hybrid", "at-hit", "last-token", "fault", "nothing", "hit".
    rule: str
    text: str
    #: The hit's bound after this step, in tokens (None: a fact that bounds nothing).
    tokens: Optional[int]
    #: The store group it is about (None: the lookup as a whole).
    group: Optional[int] = None


@dataclass(frozen=True)
class Explanation:
    """Why a lookup hits what it hits (see the module docstring). Sizes in tokens."""

    model_name: str
    vllm_compat: str
    #: The lookup's arguments, and its length (``num_tokens`` floored to the alignment).
    num_tokens: int
    lookup_tokens: int
    skip_tokens: int
    num_hashes: int
    hash_block_size: int
    #: Keys asked (one ``batch_is_exist``).
    keys_asked: int
    groups: Tuple[GroupExplanation, ...]
    #: The steps from the lookup length to the hit, in order.
    cuts: Tuple[Cut, ...]
    #: ``engine.lookup_result(...)``'s answer on the same store state (its ``TailKeyBoundary``s).
    hit_length: int
    tail_key_boundaries: Tuple[Any, ...]
    #: None, or the store fault's log line (the hit is then 0).
    fault: Optional[str]


# ------------------------------------------------------------------------------- explain
@contextmanager
def _warnings_of_this_thread(lookup_logger: logging.Logger) -> Iterator[List[str]]:
    """The warning lines the lookup logger writes in this thread meanwhile (a fault's reason)."""
    said: List[str] = []
    me = threading.get_ident()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == me and record.levelno >= logging.WARNING:
                said.append(record.getMessage())

    handler = Keep()
    lookup_logger.addHandler(handler)
    try:
        yield said
    finally:
        lookup_logger.removeHandler(handler)


def explain(engine: Any, num_tokens: int, block_hashes: Any, *, skip_tokens: int = 0,
            lookup_logger: logging.Logger) -> Explanation:
    """Why ``engine.lookup_result(num_tokens, block_hashes, skip_tokens=...)`` hits what it hits
    on the store as it is now (see the module docstring): the work of ``LookupEngine.explain``,
    for ``engine``, whose store-fault lines go to ``lookup_logger``. Asks the store once, with
    every key of the one-shot lookup; the arguments are checked as by the lookup, and a lookup
    of more than :data:`MAX_KEYS` keys is refused (:class:`ExplanationTooLarge`)."""
    dep = engine.deployment
    hashes = as_block_hashes(block_hashes)
    asked = engine.plan_of(num_tokens, hashes, skip_tokens=skip_tokens)  # the lookup's checks and plan
    if asked is not None and asked.num_keys > MAX_KEYS:
        raise ExplanationTooLarge(
            f"explain asks every key of the one-shot lookup and keeps every answer: num_tokens {num_tokens} over "
            f"{len(hashes)} block_hashes asks {asked.num_keys:,} keys ({asked.chunks_asked:,} chunks, each in every "
            f"namespace of its group), more than {MAX_KEYS:,}: explain a shorter prefix (a smaller num_tokens)"
        )
    # The lookup itself, one-shot, with this engine's deployment; its counters are its own (an
    # explanation is not a lookup served), the store call is this engine's.
    oneshot = type(engine).for_deployment(dep, store=engine.store, strategy="oneshot", key_cache_bytes=0,
                                          spare_key_bytes=0)
    steps = oneshot.steps(num_tokens, hashes, skip_tokens)
    keys: List[str] = []
    results: Optional[list] = None
    with _warnings_of_this_thread(lookup_logger) as said:
        try:
            keys = next(steps)  # the arguments are checked here, as by a lookup
        except StopIteration as done:  # nothing to ask
            answer = done.value
        else:
            results = engine.call_store(keys)
            try:
                steps.send(results)
                raise RuntimeError("a one-shot lookup asked the store twice")  # pragma: no cover
            except StopIteration as done:
                answer = done.value
    fault = None
    if keys and answer is None:  # the call failed, or its answer could not be read: logged
        fault = said[0] if said else "the store's answer could not be used (its log line is filtered out)"
    num_tokens, skip_tokens = int(num_tokens), int(skip_tokens)  # checked by the lookup
    n = len(hashes)
    plan = asked
    token_len = plan.token_len if plan is not None else \
        dep.coordinator.align(num_tokens) if dep.contract.aligns_lookup_length else num_tokens
    if plan is not None and plan.num_keys != len(keys):  # pragma: no cover - the lookup's own plan
        raise RuntimeError(f"the lookup asked {len(keys)} keys, its plan has {plan.num_keys}")
    presence = answer[2] if answer is not None else None
    hit = answer[0] if answer is not None else 0
    groups = _groups(dep, plan, results if presence is not None else None, presence, n)
    if fault is not None:
        cuts = [Cut("fault", f"store fault: {fault}: -> 0", 0)]
    elif plan is None or presence is None:
        why = "no hashes" if not n else f"lookup length {token_len} tokens" if token_len <= 0 else \
            "no chunk has a hash below the lookup length"
        cuts = [Cut("nothing", f"{why}: nothing is asked -> 0", 0)]
    else:
        cuts = _cuts(dep, plan, presence, num_tokens, n, skip_tokens, hit, groups)
    tails = oneshot.result_of(answer).tail_key_boundaries if presence is not None else ()
    return Explanation(
        model_name=dep.model_name, vllm_compat=dep.contract.name, num_tokens=num_tokens,
        lookup_tokens=max(token_len, 0), skip_tokens=skip_tokens, num_hashes=n,
        hash_block_size=dep.hash_block_size, keys_asked=len(keys), groups=groups, cuts=tuple(cuts),
        hit_length=hit, tail_key_boundaries=tails, fault=fault,
    )


def _kind(spec: Any) -> Tuple[str, str]:
    """(kind, the spec in words)."""
    if isinstance(spec, SlidingWindowSpec):
        return "sliding window", f"sliding window of {spec.sliding_window} tokens"
    if isinstance(spec, MambaSpec):
        return "Mamba", "Mamba (recurrent state)"
    if isinstance(spec, ChunkedLocalAttentionSpec):
        chunk = spec.attention_chunk_size
        return "chunked local attention", f"chunked local attention ({chunk}-token attention chunks)"
    return "full attention", "full attention"


def _eagle_groups(dep: Deployment) -> frozenset:
    coord = dep.coordinator
    return frozenset(g for a, (_, ids) in enumerate(coord.attention_groups)
                     if a in coord.eagle_attention_indices for g in ids)


def _groups(dep: Deployment, plan: Optional[LookupPlan], results: Optional[list],
            presence: Optional[Sequence[bytearray]], n: int) -> Tuple[GroupExplanation, ...]:
    out = []
    eagle = _eagle_groups(dep)
    off = 0
    for g, grp in enumerate(dep.store_groups):
        spec = grp.spec
        kind, words = _kind(spec)
        unit = dep.hash_block_size if dep.partial_hash_hits else spec.block_size
        words += f", {spec.block_size}-token chunks" + (", MLA" if spec.use_mla else "") \
            + (", EAGLE" if g in eagle else "")
        gp = plan.groups[g] if plan is not None else None
        asked = tuple(gp.asked) if gp is not None else ()
        presumed = tuple(gp.presumed) if gp is not None else ()
        names = tuple(namespace_name(ns) for ns in dep.group_namespaces[g])
        r = len(names)
        answers: Tuple[Tuple[Any, ...], ...] = ()
        status: Tuple[bytes, ...] = ()
        counts = [0, 0, 0]  # chunks present, absent, with an error code
        first: Optional[MissingChunk] = None
        run_chunks = len(presumed) + len(asked)
        run_tokens = max((c + 1 for c in asked[-1:] + presumed[-1:]), default=0) * unit
        alone = None
        if presence is not None and results is not None:
            block = results[off:off + len(asked) * r]
            answers = tuple(tuple(block[k::r]) for k in range(r))
            status = tuple(_read(dep, a) for a in answers)
            p = presence[g]
            for i, chunk in enumerate(asked):
                if p[chunk]:
                    counts[0] += 1
                    continue
                errors = tuple((names[k], answers[k][i]) for k in range(r) if status[k][i] == ERROR)
                counts[2 if errors else 1] += 1
                if first is None:
                    absent = tuple(names[k] for k in range(r) if status[k][i] == ABSENT)
                    first = MissingChunk(chunk, chunk * unit, absent, errors)
                    run_chunks = len(presumed) + i
                    run_tokens = chunk * unit
        if presence is not None and plan is not None:
            alone = dep.hit_length(_alone(dep, plan, presence, n, g), plan.token_len, n, apply_eagle=False)
        off += len(asked) * r
        out.append(GroupExplanation(
            group_id=g, kind=kind, spec=words, eagle=g in eagle, block_size=spec.block_size, chunk_tokens=unit,
            namespaces=names, prefixes=tuple(dep.prefixes[g]), asked_chunks=asked, presumed_chunks=presumed,
            answers=answers, status=status, present_chunks=counts[0], absent_chunks=counts[1], error_chunks=counts[2],
            run_chunks=run_chunks, run_tokens=run_tokens, first_missing=first, alone_hit_tokens=alone,
        ))
    return tuple(out)


def _read(dep: Deployment, answers: Sequence[Any]) -> bytes:
    """One namespace's answers as :data:`PRESENT` / :data:`ABSENT` / :data:`ERROR` (present:
    the core's reduction, the lookup's own rule)."""
    flags = dep.reduce(list(answers), 1)[0] if answers else b""
    return bytes(ERROR if is_error_code(a) else f for f, a in zip(flags, answers))


def _alone(dep: Deployment, plan: LookupPlan, presence: Sequence[bytearray], n: int, g: int) -> List[bytearray]:
    """The presence with every group but ``g`` holding every chunk it has a hash for."""
    out = []
    for k, p in enumerate(presence):
        if k == g:
            out.append(p)
            continue
        full = bytearray(len(p))
        have = min(dep.chunks_with_hash(k, plan.span, n), len(p))
        full[:have] = b"\x01" * have
        out.append(full)
    return out


def _cuts(dep: Deployment, plan: LookupPlan, presence: Sequence[bytearray], num_tokens: int, n: int,
          skip_tokens: int, hit: int, groups: Sequence[GroupExplanation]) -> List[Cut]:
    """The steps from the lookup length to ``hit`` (see :class:`Cut`), every figure an answer of
    ``Deployment.hit_length``."""
    coord = dep.coordinator
    token_len = plan.token_len
    cuts: List[Cut] = []
    aligned = f"the {'hash block size (partial hash hits)' if dep.partial_hash_hits else 'scheduler block size'}" \
        f" ({coord.alignment} tokens)"
    if token_len != num_tokens:
        cuts.append(Cut("length", f"lookup length: floored to {aligned}: {num_tokens} -> {token_len}", token_len))
    hashed = n * dep.hash_block_size
    if hashed < token_len:
        cuts.append(Cut("hashes", f"the {n} hashes cover {hashed} tokens: chunks past them count absent", hashed))
    if skip_tokens and plan.presumes_any:
        cuts.append(Cut("skip", f"chunks below skip_tokens ({skip_tokens}) count present, not asked", None))
    alone = []
    for g, ge in enumerate(groups):
        plain = ge.alone_hit_tokens
        assert plain is not None  # answers were read
        alone.append(plain)
        label = f"{ge.kind} (group {g})"
        spec = dep.store_groups[g].spec
        if isinstance(spec, FullAttentionSpec):
            run = min(ge.run_tokens, token_len)
            cuts.append(Cut("present", f"{label}: {run} tokens present in every namespace", run, g))
            if plain < run:
                cuts.append(Cut("alignment", f"{label}: aligned to {aligned}: {run} -> {plain}", plain, g))
            elif plain > run:
                cuts.append(Cut("units", f"{label}: partial hash hits read whole blocks by their last hash unit, then "
                                         f"the units of the first incomplete one: {run} -> {plain}", plain, g))
        elif isinstance(spec, SlidingWindowSpec):
            cuts.append(Cut("window", f"{label} needs {spec.blocks_needed(False)} chunks present before the hit: the "
                                      f"last complete window ends at {plain}", plain, g))
        elif isinstance(spec, MambaSpec):
            cuts.append(Cut("state", f"{label}: the last state stored at an aligned boundary ends at {plain}"
                            if plain else f"{label}: no state stored at an aligned boundary: 0", plain, g))
        else:
            cuts.append(Cut("chunk", f"{label}: present from the start of the last attention chunk: {plain}", plain, g))
    plain = dep.hit_length(presence, token_len, n, apply_eagle=False)
    if len(groups) > 1 and plain != min(alone):
        cuts.append(Cut("hybrid", "the groups together (vLLM's hybrid fixed point: one length every group hits): "
                                  f"{min(alone)} -> {plain}", plain))
    together = dep.hit_length(presence, token_len, n)
    eagle = [ge.group_id for ge in groups if ge.eagle]
    if together != plain:
        which = f"group {eagle[0]}" if len(eagle) == 1 else f"groups {', '.join(map(str, eagle))}"
        cuts.append(Cut("eagle", f"EAGLE drops one block ({which}): {plain} -> {together}", together))
    for g, ge in enumerate(groups):
        spec = dep.store_groups[g].spec
        if len(groups) == 1 or together <= 0 or ge.eagle or isinstance(spec, FullAttentionSpec):
            continue
        at = dep.hit_length(_alone(dep, plan, presence, n, g), together, n, apply_eagle=False)
        if isinstance(spec, SlidingWindowSpec):
            what, done = f"needs {spec.blocks_needed(False)} chunks ending at the hit: the window at {together} is", \
                "complete"
        elif isinstance(spec, MambaSpec):
            what, done = f"needs a state stored at the hit: at {together} it is", "stored"
        else:
            what, done = f"needs the chunks from its attention chunk's start to the hit: at {together} they are", \
                "present"
        cuts.append(Cut("at-hit", f"{ge.kind} (group {g}) {what} {done if at == together else 'not ' + done}",
                        None, g))
    if hit != together:
        if dep.contract.rederives_full_hit and together >= num_tokens:
            cuts.append(Cut("last-token", f"the last token is computed ({dep.contract.argument} {dep.contract.name}): a hit of "
                                          f"all {num_tokens} tokens is looked up again below them: {together} -> {hit}",
                            hit))
        else:  # pragma: no cover - the engine's hit is the coordinator's but for the last-token rule
            cuts.append(Cut("engine", f"the engine's hit: {together} -> {hit}", hit))
    cuts.append(Cut("hit", f"hit: {hit} tokens", hit))
    return cuts
