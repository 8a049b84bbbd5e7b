"""The pool key grammar, and the only place that knows it.

A pool key names one chunk of one KV-cache group in one rank namespace::

    [<cache_prefix>@]<model><store_namespace>@tp_rank:<T>@pcp<P>@dcp<D>@pp_rank:<S>@group:<G>@<hex>

byte for byte as vLLM's ``MooncakeStoreConnector`` writes it. ``cache_prefix`` is left out
exactly when it is the empty string; ``store_namespace`` (vLLM 0.33, e.g.
``@store_tp:4@store_pp:1@store_format:tp_shared_lbhnc``) stands verbatim right after the model
name, and is empty unless a store layout was asked for; ``pcp`` and ``dcp`` carry no colon;
``<hex>`` is the lowercase hex of the chunk hash.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .._checks import int_arg, str_arg, text_arg

__all__ = ["KeyMetadata", "PoolKey", "model_name_from_path"]

_SEP = "@"


@dataclass(frozen=True, order=True)
class KeyMetadata:
    """The rank namespace and group a key belongs to (vLLM's ``KeyMetadata``, same fields in the
    same order; ``store_namespace`` came with vLLM 0.33)."""

    model_name: str
    tp_rank: int
    pcp_rank: int
    dcp_rank: int
    pp_rank: int
    group_id: int = 0
    cache_prefix: str = ""
    store_namespace: str = ""

    def __post_init__(self) -> None:
        text_arg("model_name", self.model_name)
        text_arg("cache_prefix", self.cache_prefix)
        text_arg("store_namespace", self.store_namespace)
        for name in ("tp_rank", "pcp_rank", "dcp_rank", "pp_rank", "group_id"):
            int_arg(name, getattr(self, name), min=0)


@dataclass(frozen=True, order=True)
class PoolKey:
    """One pool key: a :class:`KeyMetadata` and the hex string of a chunk hash."""

    key_metadata: KeyMetadata
    chunk_hash: str

    def __post_init__(self) -> None:
        _metadata_arg(self.key_metadata)
        str_arg("chunk_hash", self.chunk_hash)

    def to_string(self) -> str:
        return PoolKey.build_key_string(PoolKey.build_prefix(self.key_metadata), self.chunk_hash)

    @staticmethod
    def build_prefix(
        md: KeyMetadata,
        *,
        tp_rank: Optional[int] = None,
        pcp_rank: Optional[int] = None,
        dcp_rank: Optional[int] = None,
        pp_rank: Optional[int] = None,
    ) -> str:
        """The key up to and including ``@group:<G>``; each override that is None falls back to ``md``."""
        _metadata_arg(md)
        tp = md.tp_rank if tp_rank is None else int_arg("tp_rank", tp_rank, min=0)
        pcp = md.pcp_rank if pcp_rank is None else int_arg("pcp_rank", pcp_rank, min=0)
        dcp = md.dcp_rank if dcp_rank is None else int_arg("dcp_rank", dcp_rank, min=0)
        pp = md.pp_rank if pp_rank is None else int_arg("pp_rank", pp_rank, min=0)
        head = md.cache_prefix + _SEP if md.cache_prefix else ""
        return (
            f"{head}{md.model_name}{md.store_namespace}@tp_rank:{tp}@pcp{pcp}@dcp{dcp}"
            f"@pp_rank:{pp}@group:{md.group_id}"
        )

    @staticmethod
    def build_key_string(prefix: str, chunk_hash: str) -> str:
        """``prefix`` + ``@`` + ``chunk_hash`` (the hex string of the chunk hash)."""
        return str_arg("prefix", prefix) + _SEP + str_arg("chunk_hash", chunk_hash)


def _metadata_arg(md: object) -> None:
    if not isinstance(md, KeyMetadata):
        raise TypeError(f"key_metadata must be a KeyMetadata, got {type(md).__name__}")


def key_head(prefix: str) -> str:
    """What stands before the hex in every key of ``prefix``: the compiled core appends hex to it."""
    return PoolKey.build_key_string(prefix, "")


def model_name_from_path(model: str) -> str:
    """vLLM's key model name: the last ``/`` part of the model path or hub id."""
    return str_arg("model", model).rstrip("/").split("/")[-1]
