"""An explanation of a lookup (:mod:`mooncake_keys.lookup.explain`) printed: as text, and as a
heat map. ``mooncake_keys explain`` prints both (its command is :mod:`mooncake_keys.cli.explain`).

* :func:`text`: the lookup, a table per store group (its chunks' counts, the leading run, the
  first missing chunk and which namespaces lack it, a row per namespace), the steps, the hit.
* :func:`heat_map`: rows are each group's namespaces, columns its chunks (in tokens, so every
  group lines up), coloured by the answer: present, absent, an error code, counted present
  (below ``skip_tokens``) or not asked (the lookup mask, past the hashes); a vertical line at
  the hit and at each cut. matplotlib is the ``bench`` extra. A group of more than
  ``max_columns`` chunks or ``max_rows`` namespaces is drawn with a cell for several of them
  (the worst answer among them), so the picture's size is bounded whatever the deployment.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Tuple

from .lookup.explain import ABSENT, ERROR, PRESENT, Explanation, GroupExplanation

__all__ = ["MAX_COLUMNS", "MAX_ROWS", "heat_map", "matplotlib_missing", "text"]

#: A heat map has at most this many columns per group; beyond, a column stands for several chunks.
MAX_COLUMNS = 400
#: ... and at most this many rows per group; beyond, a row stands for several namespaces.
MAX_ROWS = 64
#: The text's namespace table lists every namespace up to this many; beyond, those that lack
#: something (the others are counted).
_LIST_ALL_NAMESPACES = 16


def text(x: Explanation) -> str:
    """The report as text: the lookup, a table per group, the steps, the hit."""
    lines = [
        f"lookup of {x.num_tokens} tokens, model {x.model_name!r}, vllm_compat {x.vllm_compat}: "
        f"{x.num_hashes} hashes of {x.hash_block_size} tokens, lookup length {x.lookup_tokens}"
        + (f", skip_tokens {x.skip_tokens}" if x.skip_tokens else "")
        + f"; {x.keys_asked} keys asked",
    ]
    if x.fault:
        lines.append(f"store fault: {x.fault}")
    for g in x.groups:
        lines.append("")
        lines.extend(_format_group(g))
    lines += ["", "steps:"]
    lines += [f"  {i}. {cut.text}" for i, cut in enumerate(x.cuts, 1)]
    tails = ", ".join(f"group {t.group_id} at {t.num_tokens}" for t in x.tail_key_boundaries)
    lines.append(f"hit: {x.hit_length} tokens" + (f" (tail key boundaries: {tails})" if tails else ""))
    return "\n".join(lines)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def _format_group(g: GroupExplanation) -> List[str]:
    presumed = f" (+{len(g.presumed_chunks)} below skip_tokens, counted present)" if g.presumed_chunks else ""
    lines = [f"group {g.group_id}: {g.spec}; {_count(len(g.namespaces), 'namespace')}; "
             f"{_count(len(g.asked_chunks), 'chunk')} asked{presumed}"]
    if not g.answers:
        lines.append("  no answers (store fault)" if g.asked_chunks else "  nothing asked")
        return lines
    lines.append(f"  chunks: {g.present_chunks} present in every namespace, {g.absent_chunks} absent, "
                 f"{g.error_chunks} with an error code")
    run = f"  leading run: {_count(g.run_chunks, 'chunk')}, {g.run_tokens} tokens"
    miss = g.first_missing
    if miss is None:
        lines.append(run + "; every chunk asked is present")
    else:
        why = [f"absent in {', '.join(miss.absent)}"] if miss.absent else []
        why += [f"error {code} in {name}" for name, code in miss.errors]
        lines.append(f"{run}; first missing: chunk {miss.chunk} (token {miss.start_tokens}): {'; '.join(why)}")
    if g.alone_hit_tokens is not None:
        lines.append(f"  its answers alone allow {g.alone_hit_tokens} tokens (every other group present, before EAGLE)")
    rows = g.namespace_rows()
    shown = [r for r in rows if len(rows) <= _LIST_ALL_NAMESPACES or r.first_not_present is not None]
    width = max(len("namespace"), *(len(r.namespace) for r in rows))
    lines.append(f"  {'namespace':<{width}}  present  absent  error  first not present")
    for r in shown:
        first = "-" if r.first_not_present is None else \
            f"chunk {r.first_not_present} (token {r.first_not_present * g.chunk_tokens})"
        lines.append(f"  {r.namespace:<{width}}  {r.present:>7}  {r.absent:>6}  {r.error:>5}  {first}")
    if len(shown) < len(rows):
        lines.append(f"  ... and {len(rows) - len(shown)} namespaces holding every chunk asked")
    return lines


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


def _cells(g: GroupExplanation, chunks: int, per: int, per_row: int, codes: Dict[int, int]) -> Any:
    """The group's cells: a row per ``per_row`` namespaces, a column per ``per`` of its ``chunks``
    chunks, each the worst answer among them (work: the answers, and the cells); error codes
    numbered from ``_ERROR`` in ``codes`` (code -> value)."""
    import numpy as np

    cells = np.full((-(-len(g.namespaces) // per_row), -(-chunks // per)), _NOT_ASKED, dtype=np.int16)
    for col in sorted({chunk // per for chunk in g.presumed_chunks}):
        cells[:, col] = np.maximum(cells[:, col], _PRESUMED)
    for k, status in enumerate(g.status):
        row = cells[k // per_row]
        for i, chunk in enumerate(g.asked_chunks):
            s = status[i]
            value = _PRESENT if s == PRESENT else _ABSENT if s == ABSENT else \
                codes.setdefault(g.answers[k][i], _ERROR + len(codes))
            if value > row[chunk // per]:
                row[chunk // per] = value
    return cells


def heat_map(x: Explanation, path: str, *, max_columns: int = MAX_COLUMNS, max_rows: int = MAX_ROWS) -> str:
    """Draw ``x`` as a PNG heat map at ``path`` (see the module docstring); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    codes: Dict[int, int] = {}
    spans = []  # per group: (its cells, chunks per column, namespaces per row)
    for g in x.groups:
        last = g.asked_chunks[-1:] + g.presumed_chunks[-1:]
        chunks = max([x.lookup_tokens // g.chunk_tokens] + [c + 1 for c in last])
        per = max(1, -(-chunks // max_columns))
        per_row = max(1, -(-len(g.namespaces) // max_rows))
        spans.append((_cells(g, chunks, per, per_row, codes), per, per_row))
    colours = [_COLOURS[v] for v in range(_ERROR)]
    colours += [_ERROR_COLOURS[i % len(_ERROR_COLOURS)] for i in range(len(codes))]
    cmap = ListedColormap(colours)
    heights = [max(1.0, 0.22 * cells.shape[0]) for cells, _, _ in spans] or [1.0]
    fig, axes = plt.subplots(max(1, len(x.groups)), 1, sharex=True, squeeze=False, dpi=110,
                             figsize=(11, 1.6 + sum(heights)), gridspec_kw={"height_ratios": heights})
    end = max([x.lookup_tokens] + [cells.shape[1] * per * g.chunk_tokens for g, (cells, per, _) in zip(x.groups, spans)])
    lines = _lines(x)
    for ax, g, (cells, per, per_row) in zip(axes[:, 0], x.groups, spans):
        width = cells.shape[1] * per * g.chunk_tokens
        rows = cells.shape[0]
        ax.imshow(cells, aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=len(colours) - 1,
                  extent=(0, width, rows, 0))
        step = max(1, rows // 24)  # at most ~24 labels per group
        ax.set_yticks([k + 0.5 for k in range(0, rows, step)])
        ax.set_yticklabels([g.namespaces[k * per_row] + (" ..." if per_row > 1 else "") for k in range(0, rows, step)],
                           fontsize=7)
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
    aggregated = sorted({per for _, per, _ in spans if per > 1})
    if aggregated:
        title += f"\nmore than {max_columns} chunks: each column stands for {'/'.join(map(str, aggregated))} " \
                 "chunks and shows the worst answer among them"
    stacked = sorted({per_row for _, _, per_row in spans if per_row > 1})
    if stacked:
        title += f"\nmore than {max_rows} namespaces: each row stands for {'/'.join(map(str, stacked))} " \
                 "namespaces and shows the worst answer among them"
    fig.suptitle(title, fontsize=9)
    shown = sorted({int(v) for cells, _, _ in spans for v in np.unique(cells)})
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
