"""What ``mooncake_keys explain`` runs beside the report (:mod:`mooncake_keys.lookup.explain`): a
prompt's block hashes from vLLM's own hasher, and the report as a heat map.

* :func:`vllm_block_hashes`: token ids -> the block hashes vLLM gives a plain text prompt (no
  LoRA, multimodal input, cache salt or prompt embeddings), by the installed vLLM's own
  ``get_request_block_hasher``. vLLM chains every hash from ``NONE_HASH``, which it seeds from
  ``PYTHONHASHSEED`` when that is set; without it, vLLM 0.29 and later seed sha256 hashes with a
  fixed string and xxhash ones at random, earlier releases every one at random. A random seed
  cannot be reproduced outside the server, so that case is refused.
* :func:`heat_map`: rows are each group's namespaces, columns its chunks (in tokens, so every
  group lines up), coloured by the answer: present, absent, an error code, counted present
  (below ``skip_tokens``) or not asked (the lookup mask, past the hashes); a vertical line at
  the hit and at each cut. matplotlib is the ``bench`` extra.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Sequence, Tuple

from ..lookup.explain import ABSENT, ERROR, PRESENT, Explanation, GroupExplanation

__all__ = ["HASH_ALGOS", "MAX_COLUMNS", "heat_map", "matplotlib_missing", "vllm_block_hashes"]

#: vLLM's ``--prefix-caching-hash-algo`` choices.
HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
#: A heat map has at most this many columns per group; beyond, a column stands for several chunks.
MAX_COLUMNS = 400


def vllm_block_hashes(token_ids: Sequence[int], hash_block_size: int, hash_algo: str = "sha256") -> List[bytes]:
    """The block hashes (``hash_block_size`` tokens each) vLLM gives a plain prompt of
    ``token_ids``, by the installed vLLM's own hasher (see the module docstring).

    ImportError without vLLM; ValueError when vLLM would seed them at random in this process."""
    if hash_algo not in HASH_ALGOS:
        raise ValueError(f"hash_algo must be one of {HASH_ALGOS}, got {hash_algo!r}")
    try:
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core import kv_cache_utils
        from vllm.v1.request import Request
    except ImportError as exc:
        raise ImportError(
            "hashing token ids needs vLLM (the release the server runs: its hasher is used): install it, "
            f"or give the request's block hashes instead (--hashes) ({type(exc).__name__}: {exc})"
        ) from exc
    fixed_seed = hasattr(kv_cache_utils, "resolve_none_hash_seed") and not hash_algo.startswith("xxhash")
    if os.environ.get("PYTHONHASHSEED") is None and not fixed_seed:
        raise ValueError(
            f"without PYTHONHASHSEED this vLLM seeds {hash_algo} block hashes at random in every process, so "
            "the server's cannot be reproduced here: set PYTHONHASHSEED to the server's value, or give the "
            "request's block hashes (--hashes)"
        )
    hash_fn = get_hash_fn_by_name(hash_algo)
    kv_cache_utils.init_none_hash(hash_fn)
    hasher = kv_cache_utils.get_request_block_hasher(hash_block_size, hash_fn)
    request = Request(request_id="mooncake_keys-explain", prompt_token_ids=list(token_ids),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None, block_hasher=hasher)
    return [bytes(h) for h in request.block_hashes]


def matplotlib_missing() -> str:
    """Why no heat map can be drawn here ("" when matplotlib is there)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"the heat map needs matplotlib: pip install 'mooncake-keys[bench]' ({exc})"
    return ""


#: Cell values, worst last: an aggregated column shows the worst answer among its chunks.
_NOT_ASKED, _PRESUMED, _PRESENT, _ABSENT, _ERROR = range(5)
_COLOURS = {_NOT_ASKED: "#f2f2f2", _PRESUMED: "#a6dba0", _PRESENT: "#1b7837", _ABSENT: "#d6604d"}
_ERROR_COLOURS = ("#40004b", "#762a83", "#9970ab", "#2166ac", "#053061")
_LABELS = {_NOT_ASKED: "not asked", _PRESUMED: "below skip_tokens (counted present)", _PRESENT: "present",
           _ABSENT: "absent"}


def _cells(g: GroupExplanation, columns: int, codes: Dict[int, int]) -> List[List[int]]:
    """Per namespace, a cell value per chunk (``columns`` chunks); error codes numbered from
    ``_ERROR`` in ``codes`` (code -> value)."""
    rows = []
    for k in range(len(g.namespaces)):
        row = [_NOT_ASKED] * columns
        for chunk in g.presumed_chunks:
            row[chunk] = _PRESUMED
        if g.status:
            for i, chunk in enumerate(g.asked_chunks):
                s = g.status[k][i]
                if s == PRESENT:
                    row[chunk] = _PRESENT
                elif s == ABSENT:
                    row[chunk] = _ABSENT
                elif s == ERROR:
                    row[chunk] = codes.setdefault(g.answers[k][i], _ERROR + len(codes))
        rows.append(row)
    return rows


def heat_map(x: Explanation, path: str, *, max_columns: int = MAX_COLUMNS) -> str:
    """Draw ``x`` as a PNG heat map at ``path`` (see the module docstring); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    codes: Dict[int, int] = {}
    spans = []  # per group: (its cells aggregated, chunks per column)
    for g in x.groups:
        last = g.asked_chunks[-1:] + g.presumed_chunks[-1:]
        chunks = max([x.lookup_tokens // g.chunk_tokens] + [c + 1 for c in last])
        per = max(1, -(-chunks // max_columns))
        cells = np.array(_cells(g, chunks, codes), dtype=np.int16).reshape(len(g.namespaces), chunks)
        pad = -chunks % per
        if pad:
            cells = np.pad(cells, ((0, 0), (0, pad)), constant_values=_NOT_ASKED)
        spans.append((cells.reshape(cells.shape[0], -1, per).max(axis=2), per))
    colours = [_COLOURS[v] for v in range(_ERROR)]
    colours += [_ERROR_COLOURS[i % len(_ERROR_COLOURS)] for i in range(len(codes))]
    cmap = ListedColormap(colours)
    heights = [max(1.0, 0.22 * len(g.namespaces)) for g in x.groups] or [1.0]
    fig, axes = plt.subplots(max(1, len(x.groups)), 1, sharex=True, squeeze=False, dpi=110,
                             figsize=(11, 1.6 + sum(heights)), gridspec_kw={"height_ratios": heights})
    end = max([x.lookup_tokens] + [cells.shape[1] * per * g.chunk_tokens for g, (cells, per) in zip(x.groups, spans)])
    lines = _lines(x)
    for ax, g, (cells, per) in zip(axes[:, 0], x.groups, spans):
        width = cells.shape[1] * per * g.chunk_tokens
        ax.imshow(cells, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=len(colours) - 1,
                  extent=(0, width, len(g.namespaces), 0))
        step = max(1, len(g.namespaces) // 24)  # at most ~24 labels per group
        ax.set_yticks([k + 0.5 for k in range(0, len(g.namespaces), step)])
        ax.set_yticklabels(g.namespaces[::step], fontsize=7)
        ax.set_ylabel(f"group {g.group_id}\n{g.kind}", rotation=0, ha="right", va="center", fontsize=8)
        for tokens, style in lines:
            ax.axvline(tokens, **style)
    top, bottom = axes[0, 0], axes[-1, 0]
    bottom.set_xlim(0, max(end, 1))
    bottom.set_xlabel("tokens")
    for tokens, style in lines:
        top.annotate(style["label"], (tokens, 0), xytext=(2, 2), textcoords="offset points", rotation=90,
                     fontsize=7, va="bottom", annotation_clip=False)
    title = f"{x.model_name}: hit {x.hit_length} of {x.num_tokens} tokens (vllm_compat {x.vllm_compat})"
    if x.fault:
        title += "\nstore fault: " + x.fault[:120]
    aggregated = sorted({per for _, per in spans if per > 1})
    if aggregated:
        title += f"\nmore than {max_columns} chunks: each column stands for {'/'.join(map(str, aggregated))} " \
                 "chunks and shows the worst answer among them"
    fig.suptitle(title, fontsize=9)
    shown = sorted({int(v) for cells, _ in spans for v in np.unique(cells)})
    names = {v: f"error {code}" for code, v in codes.items()}
    fig.legend(handles=[Patch(color=colours[v], label=_LABELS.get(v) or names[v]) for v in shown],
               loc="lower center", ncol=min(6, max(1, len(shown))), fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.05, 1, 0.93))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)  # checked writable (cli.png_path)
    fig.savefig(path)
    plt.close(fig)
    return path


def _lines(x: Explanation) -> List[Tuple[int, Dict[str, Any]]]:
    """(tokens, line style with a label): the hit, and each cut's bound below the lookup length."""
    hit = x.hit_length
    out: List[Tuple[int, Dict[str, Any]]] = [(hit, dict(color="black", linewidth=1.6, label=f"hit {hit}"))]
    seen = {hit}
    for cut in x.cuts:
        if cut.tokens is None or cut.tokens in seen or not 0 < cut.tokens < x.lookup_tokens:
            continue
        seen.add(cut.tokens)
        where = "" if cut.group is None else f" (g{cut.group})"
        out.append((cut.tokens, dict(color="#555555", linewidth=0.8, linestyle="--",
                                     label=f"{cut.rule}{where} {cut.tokens}")))
    return out
