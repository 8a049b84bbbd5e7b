"""The Mooncake I/O of one rank: save a request's KV-cache chunks to the pool, load them back.

A :class:`KVPool` is the worker-side twin of a :class:`~mooncake_keys.LookupEngine` for the
same deployment (model, KV-cache groups, rank layout, cache prefix): both are built from one
:class:`~mooncake_keys.Deployment`, so a pool writes exactly the keys a lookup asks for, under
this rank's *writer namespace*, and a hit the lookup reports is a hit every rank can load
(vLLM's ``MooncakeStoreWorker`` send/recv threads). Keys, the chunk-to-hash rule and the
usable length of a load all come from the deployment: the same code as the lookup's.

Shape contract of ``kv_caches``
    One ``torch.Tensor`` per store group (the prefix-cacheable KV-cache groups; a bare tensor
    is accepted when there is one): a **contiguous CPU tensor** of shape ``[num_blocks, ...]`` of any dtype. Dim 0 is
    the block id; block ``b`` is the ``nbytes // num_blocks`` bytes at
    ``data_ptr() + b * block_nbytes``, and that byte range is the value stored under the
    chunk's key. A group with several layers therefore lays its cache out block-major, e.g.
    ``[num_blocks, num_layers, 2, block_size, num_kv_heads, head_size]`` (vLLM's cross-layer
    blocks), because a pool key maps to one contiguous value. Groups may share one tensor (vLLM
    hybrid models do, with disjoint block ids): its memory is registered once. Only CPU memory is
    accepted: the store reads and writes the blocks by address, and nothing here uses CUDA.

Sizes are in tokens unless named otherwise; chunk ``j`` of a group covers tokens
``[j * block_size, (j + 1) * block_size)`` (the chunk-to-hash rule is the deployment's).

Failure handling
    * A per-key result code is data, not an exception: a put result ``< 0`` is reported per
      chunk in :class:`SaveResult`; a get result other than the block's byte count (a negative
      code such as -704 OBJECT_NOT_FOUND, or a short read) is reported per chunk in
      :class:`LoadResult`, and **that destination block is zeroed**, so no block is ever left
      holding a partial or foreign value.
    * A store call that raises, or answers with the wrong number of results, raises
      :class:`KVPoolStoreError` (saves and loads are not on the scheduler's path; the caller
      decides to retry or recompute). When a ``batch_get_into`` fails that way, every
      destination block of the call is zeroed first.
    * Bad arguments raise ``TypeError`` / ``ValueError`` naming the argument, before any I/O.
    * A registered tensor that was reallocated since (``resize_``, ``set_``) is refused with
      :class:`KVPoolError` before any I/O: the store would read or write freed memory.
    * The work of a save or load is bounded by the hashes given, whatever ``token_len`` says.
"""

from __future__ import annotations

import ctypes
import logging
import operator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, NamedTuple, Optional, Sequence, Tuple

try:
    import torch
except ImportError as exc:  # pragma: no cover - torch is an optional dependency
    raise ImportError("mooncake_keys.kvpool needs torch: pip install 'mooncake-keys[torch]'") from exc

from ._checks import int_arg
from .lookup.contract import Contract
from .lookup.deployment import Deployment, DeploymentViews, GroupLike
from .lookup.hashes import BlockHashes, as_block_hashes
from .lookup.layout import Namespace, ParallelLayout
from .lookup.specs import SlidingWindowSpec
from .store.gate import CallGate, GateClosed

__all__ = [
    "ChunkFailure",
    "ChunkStatus",
    "KVPool",
    "KVPoolError",
    "KVPoolStoreError",
    "LoadResult",
    "SaveResult",
]

logger = logging.getLogger("mooncake_keys.kvpool")

_STORE_METHODS = ("register_buffer", "unregister_buffer", "batch_is_exist", "batch_put_from", "batch_get_into")


class KVPoolError(RuntimeError):
    """The pool cannot do what was asked: closed, or its memory could not be registered."""


class KVPoolStoreError(KVPoolError):
    """A store call raised or answered malformed results (the cause is chained)."""


class ChunkStatus(NamedTuple):
    """One chunk of a load: ``code`` is the store's result (bytes read, or a negative code)."""

    chunk_id: int
    ok: bool
    code: int


class ChunkFailure(NamedTuple):
    """One chunk whose put failed, with the store's (negative) result code."""

    group_id: int
    chunk_id: int
    code: int


@dataclass(frozen=True)
class SaveResult:
    """What one :meth:`KVPool.save` did (counts are chunks of this rank, all groups).

    ``asked = skipped_existing + stored + len(failed)``; ``chunks[g]`` are the chunk ids of
    group ``g`` this rank was responsible for (after the mask and put striding).
    """

    token_len: int  # the length saved: token_len floored to the scheduler block size
    chunks: Tuple[Tuple[int, ...], ...]
    asked: int
    skipped_existing: int
    stored: int
    failed: Tuple[ChunkFailure, ...]

    @property
    def ok(self) -> bool:
        return not self.failed


@dataclass(frozen=True)
class LoadResult:
    """What one :meth:`KVPool.load` did.

    ``chunks[g]`` lists a :class:`ChunkStatus` per chunk of group ``g`` asked of the store, in
    chunk order. ``loaded_tokens`` is the longest prefix (a multiple of the lcm of the group
    block sizes, at most ``token_len``) whose KV is complete in every group, counting chunks
    below ``skip_tokens`` as held: full attention needs every chunk before it, sliding window
    the chunks of its window before it.
    """

    token_len: int  # the length asked: token_len floored to the lcm of the group block sizes
    chunks: Tuple[Tuple[ChunkStatus, ...], ...]
    loaded_tokens: int

    @property
    def ok(self) -> bool:
        """Every chunk asked was loaded and the whole ``token_len`` is usable."""
        return self.loaded_tokens == self.token_len and all(c.ok for cs in self.chunks for c in cs)

    @property
    def failed(self) -> Tuple[ChunkFailure, ...]:
        return tuple(
            ChunkFailure(g, c.chunk_id, c.code) for g, cs in enumerate(self.chunks) for c in cs if not c.ok
        )


@dataclass(frozen=True)
class _GroupCache:
    """One group's KV-cache tensor, seen as ``num_blocks`` blocks of ``block_nbytes`` bytes."""

    tensor: Any
    ptr: int
    num_blocks: int
    block_nbytes: int

    def block_ptr(self, block_id: int) -> int:
        return self.ptr + block_id * self.block_nbytes

    def still_registered(self) -> bool:
        """The tensor still lives at the registered address with the registered size."""
        t = self.tensor
        return t.data_ptr() == self.ptr and t.shape[0] == self.num_blocks and t.is_contiguous() and (
            t.numel() * t.element_size() == self.num_blocks * self.block_nbytes
        )


def _check_tensor(name: str, t: Any) -> _GroupCache:
    if not isinstance(t, torch.Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of shape [num_blocks, ...] (one per KV-cache group), "
            f"got {type(t).__name__}"
        )
    if t.layout != torch.strided:
        raise ValueError(f"{name} must be a dense (strided) tensor, got layout {t.layout}")
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor (the store reads and writes it by address), got device {t.device}")
    if t.dim() < 1 or t.shape[0] < 1:
        raise ValueError(f"{name} must have shape [num_blocks, ...] with num_blocks >= 1, got {tuple(t.shape)}")
    if t.numel() == 0:
        raise ValueError(f"{name} has empty blocks (shape {tuple(t.shape)}): a block must hold at least one byte")
    if not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous so that each block is one byte range, got strides {t.stride()} "
            f"for shape {tuple(t.shape)} (use .contiguous() on the cache you allocate)"
        )
    num_blocks = t.shape[0]
    return _GroupCache(t, t.data_ptr(), num_blocks, t.numel() * t.element_size() // num_blocks)


def _merged_ranges(caches: Sequence[_GroupCache]) -> List[Tuple[int, int]]:
    """The tensors' byte ranges as (ptr, size), overlapping ones merged (Mooncake refuses overlaps)."""
    spans = sorted((c.ptr, c.ptr + c.num_blocks * c.block_nbytes) for c in caches)
    merged: List[List[int]] = []
    for start, end in spans:
        if merged and start < merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def _is_index(x: Any) -> bool:
    """An int-like scalar (int, numpy or 0-d torch integer), not a bool."""
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except (TypeError, ValueError, RuntimeError):
        return False
    return True


def _is_sequence(x: Any) -> bool:
    """A list-like of items (list, tuple, range, numpy or torch 1-d array), not a string."""
    return not isinstance(x, (str, bytes, bytearray)) and hasattr(x, "__len__") and hasattr(x, "__getitem__")


class KVPool(DeploymentViews):
    """Saves and loads the KV-cache blocks of the rank ``rank = (tp, pcp, dcp, pp)``.

    Built from a :class:`~mooncake_keys.Deployment` (:meth:`for_deployment`: for the deployment
    a :class:`~mooncake_keys.LookupEngine` is built for, the pool writes exactly the keys the
    engine asks), or from the deployment's own arguments: ``KVPool(model_name, groups, layout,
    rank=..., kv_caches=..., store=..., hash_block_size=...)`` takes every argument of
    :class:`~mooncake_keys.Deployment` (documented there), with its type and default, and builds
    the deployment itself (``tests/test_signatures.py`` keeps the two signatures equal). Partial
    hash hits are not supported: a pool saves and loads whole chunks.

    ``kv_caches`` holds this rank's KV-cache tensor of each store group (see the module
    docstring for the shape contract). ``store`` needs ``register_buffer``,
    ``unregister_buffer``, ``batch_is_exist``, ``batch_put_from`` and ``batch_get_into`` (a
    :class:`~mooncake_keys.store.memory.MemoryStore`, a
    :class:`~mooncake_keys.store.mooncake.MooncakeStore`). The tensors' memory is registered
    with the store here and unregistered by :meth:`close` (or leaving a ``with`` block): always
    close a pool before its tensors are freed.
    """

    def __init__(
        self,
        model_name: str,
        groups: Sequence[GroupLike],
        layout: ParallelLayout,
        *,
        rank: Tuple[int, int, int, int],
        kv_caches: Any,
        store: Any,
        # The Deployment's arguments, as Deployment.__init__ has them (a test compares the two).
        hash_block_size: int,
        scheduler_block_size: Optional[int] = None,
        use_eagle: bool = False,
        cache_prefix: str = "",
        store_namespace: str = "",
        partial_hash_hits: bool = False,
        vllm_compat: Optional[str] = None,
        contract: Optional[Contract] = None,
        allow_ambiguous_names: bool = False,
        core: Optional[str] = None,
    ) -> None:
        deployment = Deployment(
            model_name, groups, layout, hash_block_size=hash_block_size,
            scheduler_block_size=scheduler_block_size, use_eagle=use_eagle, cache_prefix=cache_prefix,
            store_namespace=store_namespace, partial_hash_hits=partial_hash_hits, vllm_compat=vllm_compat,
            contract=contract, allow_ambiguous_names=allow_ambiguous_names, core=core,
        )
        self._start(deployment, rank, kv_caches, store)

    @classmethod
    def for_deployment(cls, deployment: Deployment, *, rank: Tuple[int, int, int, int], kv_caches: Any,
                       store: Any) -> "KVPool":
        """The pool of rank ``rank`` of ``deployment``."""
        pool = cls.__new__(cls)
        pool._start(deployment, rank, kv_caches, store)
        return pool

    def _start(self, deployment: Deployment, rank: Tuple[int, int, int, int], kv_caches: Any, store: Any) -> None:
        if not isinstance(deployment, Deployment):
            raise TypeError(f"deployment must be a Deployment, got {type(deployment).__name__}")
        if deployment.partial_hash_hits:
            raise ValueError("a KVPool saves and loads whole chunks: partial_hash_hits is not supported")
        missing = [m for m in _STORE_METHODS if not callable(getattr(store, m, None))]
        if missing:
            raise TypeError(f"store lacks the method(s) {', '.join(missing)} a KV pool needs")
        #: The deployment, validated once: keys, chunk-to-hash rule, plans and hit lengths.
        self.deployment = deployment
        self.store = store
        self.rank: Namespace = deployment.layout.check_rank(rank)
        writers = [deployment.writer(g, self.rank) for g in range(len(deployment.store_groups))]
        #: Per store group, this rank's writer namespace (tp, pcp, dcp, pp): where it saves to
        #: and loads from; and the put step of the ranks sharing it.
        self.writer_namespaces: Tuple[Namespace, ...] = tuple(ns for ns, _ in writers)
        self.put_steps: Tuple[int, ...] = tuple(step for _, step in writers)
        self._heads = tuple((deployment.key_head(g, ns),) for g, ns in enumerate(self.writer_namespaces))
        self._caches = self._check_caches(kv_caches)

        self._gate = CallGate()
        self._registered: List[int] = []
        for ptr, size in _merged_ranges(self._caches):
            try:
                rc = store.register_buffer(ptr, size)
            except Exception as exc:
                self._unregister()
                raise KVPoolError(f"store.register_buffer(0x{ptr:x}, {size}) raised {type(exc).__name__}: {exc}") from exc
            if rc != 0:
                self._unregister()
                raise KVPoolError(
                    f"store.register_buffer(0x{ptr:x}, {size}) of the kv_caches memory returned {rc} "
                    "(is that memory already registered with this store, e.g. by another KVPool?)"
                )
            self._registered.append(ptr)

    @property
    def writer_namespace(self) -> Namespace:
        """This rank's writer namespace of store group 0 (every group's, unless they differ in MLA)."""
        return self.writer_namespaces[0]

    @property
    def writer_prefixes(self) -> Tuple[str, ...]:
        """Per store group, the prefix of this rank's keys (up to and including ``@group:<g>``);
        :attr:`prefixes` are every namespace's, as for the engine."""
        return tuple(self.deployment.key_prefix(g, ns) for g, ns in enumerate(self.writer_namespaces))

    # ------------------------------------------------------------------ validation
    def _check_caches(self, kv_caches: Any) -> Tuple[_GroupCache, ...]:
        n = len(self.store_groups)
        if isinstance(kv_caches, torch.Tensor) and n == 1:
            kv_caches = [kv_caches]
        if isinstance(kv_caches, (torch.Tensor, str, bytes)) or not isinstance(kv_caches, Sequence):
            raise TypeError(
                f"kv_caches must be a sequence of one torch.Tensor per KV-cache group ({n}), "
                f"got {type(kv_caches).__name__}"
            )
        if len(kv_caches) != n:
            raise ValueError(f"kv_caches must hold one tensor per KV-cache group ({n}), got {len(kv_caches)}")
        return tuple(_check_tensor(f"kv_caches[{g}]", t) for g, t in enumerate(kv_caches))

    def _block_table(self, block_ids: Any, need: Sequence[int]) -> Tuple[Sequence[Any], ...]:
        """``block_ids`` as one sequence per group, each with at least ``need[g]`` entries."""
        n = len(self.store_groups)
        if not _is_sequence(block_ids):
            raise TypeError(f"block_ids must be a list of block ids per KV-cache group, got {type(block_ids).__name__}")
        if n == 1 and (not len(block_ids) or _is_index(block_ids[0])):
            block_ids = [block_ids]  # the single group's list on its own
        if len(block_ids) != n:
            raise ValueError(f"block_ids must hold one list per KV-cache group ({n}), got {len(block_ids)}")
        for g, ids in enumerate(block_ids):
            if not _is_sequence(ids):
                raise TypeError(f"block_ids[{g}] must be a list of block ids, got {type(ids).__name__}")
            if len(ids) < need[g]:
                raise ValueError(
                    f"block_ids[{g}] has {len(ids)} entries, fewer than the {need[g]} chunks of group {g} "
                    "with a hash below token_len"
                )
        return tuple(block_ids)

    def _block_id(self, block_ids: Sequence[Any], g: int, j: int) -> int:
        b = block_ids[j]
        if not _is_index(b):
            raise TypeError(f"block_ids[{g}][{j}] must be an int, got {type(b).__name__}")
        b = operator.index(b)
        nb = self._caches[g].num_blocks
        if not 0 <= b < nb:
            raise ValueError(f"block_ids[{g}][{j}] = {b} is out of range for kv_caches[{g}] ({nb} blocks)")
        return b

    def _chunks_with_hash(self, token_len: int, num_hashes: int) -> List[int]:
        """Per group, how many leading chunks lie below ``token_len`` and have a hash."""
        return [self.deployment.chunks_with_hash(g, token_len, num_hashes) for g in range(len(self.store_groups))]

    def _keys(self, hashes: BlockHashes, chunks: Sequence[Sequence[int]]) -> List[str]:
        """This namespace's key of each (group, chunk), in group then chunk order."""
        keys: List[str] = [None] * sum(len(c) for c in chunks)  # type: ignore[list-item]
        pos = 0
        for g, cs in enumerate(chunks):
            if cs:
                pos = self.deployment.fill_keys(keys, pos, self._heads[g], hashes, self.deployment.hash_index(g, cs))
        return keys

    # ------------------------------------------------------------------ lifecycle
    @contextmanager
    def _call_gate(self) -> Iterator[None]:
        """One save or load: refused once closed, and only on tensors still where they were
        registered (a reallocated one would have the store touch freed memory)."""
        try:
            with self._gate.call("KV pool"):
                for g, cache in enumerate(self._caches):
                    if not cache.still_registered():
                        raise KVPoolError(
                            f"kv_caches[{g}] was reallocated or reshaped after the pool registered it "
                            f"(resize_ or set_?): the store would use freed memory; make a new KVPool"
                        )
                yield
        except GateClosed:
            raise KVPoolError("the KV pool is closed") from None

    def _unregister(self) -> None:
        while self._registered:
            ptr = self._registered.pop()
            try:
                rc = self.store.unregister_buffer(ptr)
            except Exception as exc:  # noqa: BLE001 - closing must go on with the other buffers
                logger.warning("store.unregister_buffer(0x%x) raised %s: %s", ptr, type(exc).__name__, exc)
                continue
            if rc != 0:
                logger.warning("store.unregister_buffer(0x%x) returned %s", ptr, rc)

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def close(self) -> None:
        """Unregister the tensors' memory once calls in flight end. Idempotent."""
        self._gate.close(self._unregister)

    def __enter__(self) -> "KVPool":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return f"<KVPool rank={self.rank} namespace={self.writer_namespace} groups={len(self.store_groups)} {state}>"

    # ------------------------------------------------------------------ save
    def save(self, token_len: int, block_hashes: Any, block_ids: Any) -> SaveResult:
        """Put this rank's share of the chunks of the first ``token_len`` tokens into the pool.

        ``token_len`` is floored to the scheduler block size. ``block_ids[g][j]`` is the block
        of ``kv_caches[g]`` holding chunk ``j`` of group ``g`` (one list alone is accepted for
        one group); it needs an entry for every chunk below ``token_len`` that has a hash.
        Saved: every chunk a lookup could ask (all chunks for full attention, the lookup
        mask's chunks for sliding window) that has a hash; with put striding (``put_step > 1``)
        only the chunks ``j`` with ``j % put_step == (tp_rank + g) % put_step``, so that the
        ranks sharing this namespace store each chunk exactly once. Keys that already exist
        (one ``batch_is_exist``) are skipped; the rest go in one zero-copy ``batch_put_from``.
        """
        with self._call_gate():
            return self._save(token_len, block_hashes, block_ids)

    def _save(self, token_len: int, block_hashes: Any, block_ids: Any) -> SaveResult:
        token_len = int_arg("token_len", token_len, min=0)
        hashes = as_block_hashes(block_hashes)
        token_len -= token_len % self.scheduler_block_size
        table = self._block_table(block_ids, self._chunks_with_hash(token_len, len(hashes)))
        no_chunks: Tuple[Tuple[int, ...], ...] = tuple(() for _ in self.store_groups)
        if not token_len or not len(hashes):
            return SaveResult(token_len, no_chunks, 0, 0, 0, ())
        steps = self.put_steps
        chunks = tuple(
            tuple(j for j in plan.asked if j % steps[g] == (self.rank[0] + g) % steps[g])
            for g, plan in enumerate(self.deployment.plan(token_len, len(hashes), 0).groups)
        )
        where = [(g, j) for g, cs in enumerate(chunks) for j in cs]
        if not where:
            return SaveResult(token_len, chunks, 0, 0, 0, ())
        ptrs = [self._caches[g].block_ptr(self._block_id(table[g], g, j)) for g, j in where]
        sizes = [self._caches[g].block_nbytes for g, _ in where]
        keys = self._keys(hashes, chunks)

        exists = self._call("batch_is_exist", len(keys), keys)
        todo = [i for i, e in enumerate(exists) if e != 1]
        failed: List[ChunkFailure] = []
        if todo:
            put = self._call(
                "batch_put_from", len(todo),
                [keys[i] for i in todo], [ptrs[i] for i in todo], [sizes[i] for i in todo],
            )
            failed = [ChunkFailure(*where[i], rc) for i, rc in zip(todo, put) if rc < 0]
            if failed:
                logger.warning("save: %d of %d puts failed (first: group %d chunk %d, code %d)",
                               len(failed), len(todo), *failed[0])
        return SaveResult(token_len, chunks, len(keys), len(keys) - len(todo), len(todo) - len(failed), tuple(failed))

    def _call(self, method: str, n: int, *args: Any) -> List[int]:
        """``store.<method>(*args)`` for ``n`` keys: its per-key codes, or KVPoolStoreError."""
        try:
            results = getattr(self.store, method)(*args)
        except Exception as exc:
            raise KVPoolStoreError(f"store.{method} of {n} keys raised {type(exc).__name__}: {exc}") from exc
        try:
            codes = [operator.index(r) for r in results]
        except TypeError as exc:
            raise KVPoolStoreError(
                f"store.{method} returned {type(results).__name__} {results!r:.200}, not a list of ints"
            ) from exc
        if len(codes) != n:
            raise KVPoolStoreError(f"store.{method} returned {len(codes)} results for {n} keys")
        return codes

    # ------------------------------------------------------------------ load
    def _load_chunks(self, token_len: int, have: Sequence[int], skip_tokens: int) -> List[range]:
        """Per group, the chunks a load of ``[skip_tokens, token_len)`` reads (vLLM's load mask).

        Full attention: every chunk from ``skip_tokens`` on. Sliding window: only the chunks of
        the window before ``token_len`` (the next token attends to nothing older).
        """
        out = []
        for g, grp in enumerate(self.store_groups):
            bs = grp.spec.block_size
            first = skip_tokens // bs
            if isinstance(grp.spec, SlidingWindowSpec):
                first = max(first, token_len // bs - grp.spec.blocks_needed(False))
            out.append(range(min(first, have[g]), have[g]))
        return out

    def _loaded_tokens(self, token_len: int, num_hashes: int, skip_tokens: int, loaded: Sequence[set]) -> int:
        """The longest usable prefix (the deployment's hit length, EAGLE aside) when the chunks
        with a hash below ``skip_tokens`` are held and those in ``loaded`` were loaded."""
        dep = self.deployment
        span = dep.span(token_len, num_hashes)
        presence = []
        for g, grp in enumerate(self.store_groups):
            p = bytearray(span // grp.spec.block_size)
            held = min(skip_tokens // grp.spec.block_size, dep.chunks_with_hash(g, span, num_hashes))
            p[:held] = b"\x01" * held
            for j in loaded[g]:
                p[j] = 1
            presence.append(p)
        return dep.hit_length(presence, span, num_hashes, apply_eagle=False)

    def load(self, token_len: int, block_hashes: Any, block_ids: Any, skip_tokens: int = 0) -> LoadResult:
        """Get the chunks of ``[skip_tokens, token_len)`` from this rank's namespace into its blocks.

        ``token_len`` is floored to the scheduler block size (a lookup hit is a multiple of it);
        ``skip_tokens`` (tokens already held) is floored to each
        group's block size. ``block_ids`` is as for :meth:`save` and names the destination
        blocks, which must not overlap. No put striding here: every chunk comes from this rank's
        own namespace, with one zero-copy ``batch_get_into``. A chunk whose get did not return
        the block's exact byte count is reported with the store's code and its block is zeroed.
        """
        with self._call_gate():
            return self._load(token_len, block_hashes, block_ids, skip_tokens)

    def _load(self, token_len: int, block_hashes: Any, block_ids: Any, skip_tokens: int) -> LoadResult:
        token_len = int_arg("token_len", token_len, min=0)
        skip_tokens = int_arg("skip_tokens", skip_tokens, min=0)
        hashes = as_block_hashes(block_hashes)
        token_len -= token_len % self.scheduler_block_size
        have = self._chunks_with_hash(token_len, len(hashes))
        table = self._block_table(block_ids, have)
        chunks = self._load_chunks(token_len, have, skip_tokens)
        where = [(g, j) for g, cs in enumerate(chunks) for j in cs]
        ptrs = [self._caches[g].block_ptr(self._block_id(table[g], g, j)) for g, j in where]
        sizes = [self._caches[g].block_nbytes for g, _ in where]
        spans = sorted(zip(ptrs, sizes, where))
        for (p0, n0, w0), (p1, _, w1) in zip(spans, spans[1:]):
            if p0 + n0 > p1:
                raise ValueError(
                    f"block_ids: the destination blocks of group {w0[0]} chunk {w0[1]} and group {w1[0]} "
                    f"chunk {w1[1]} overlap"
                )

        codes: List[int] = []
        if where:
            try:
                codes = self._call("batch_get_into", len(where), self._keys(hashes, chunks), ptrs, sizes)
            except KVPoolStoreError:
                for p, n in zip(ptrs, sizes):  # the store may have written into any of them
                    ctypes.memset(p, 0, n)
                raise
            for p, n, rc in zip(ptrs, sizes, codes):
                if rc != n:
                    ctypes.memset(p, 0, n)

        statuses: List[List[ChunkStatus]] = [[] for _ in self.store_groups]
        loaded: List[set] = [set() for _ in self.store_groups]
        for (g, j), n, rc in zip(where, sizes, codes):
            statuses[g].append(ChunkStatus(j, rc == n, rc))
            if rc == n:
                loaded[g].add(j)
        result = LoadResult(
            token_len, tuple(tuple(s) for s in statuses),
            self._loaded_tokens(token_len, len(hashes), skip_tokens, loaded),
        )
        if not result.ok:
            bad = result.failed
            logger.warning("load: %d of %d chunks failed; %d of %d tokens usable%s", len(bad), len(where),
                           result.loaded_tokens, token_len,
                           f" (first: group {bad[0].group_id} chunk {bad[0].chunk_id}, code {bad[0].code})"
                           if bad else "")
        return result
