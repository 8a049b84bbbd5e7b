"""The fixed-width text tables the benchmarks print."""

from __future__ import annotations

import re
from typing import Any, Iterable, Sequence, Tuple

__all__ = ["text_table"]


def text_table(columns: Sequence[Tuple[str, str]], rows: Iterable[Sequence[Any]]) -> str:
    """A header, a rule and one line per row. ``columns`` are (title, format spec) pairs, such as
    ``("keys", "7d")``, ``("ms", "8.2f")``, ``("stored", "6.0%")`` or ``("path", "20")`` (text):
    numbers right-aligned under their title, text left-aligned; a value None prints "-"."""
    widths = [int(re.match(r"\D*(\d+)", spec).group(1)) for _, spec in columns]  # type: ignore[union-attr]
    numeric = [spec[-1] in "dfge%" for _, spec in columns]
    head = " ".join(f"{title:{'>' if num else '<'}{w}}" for (title, _), w, num in zip(columns, widths, numeric))
    lines = [head, "-" * len(head)]
    for row in rows:
        lines.append(" ".join(f"{'-':>{w}}" if v is None else format(v, spec)
                              for v, (_, spec), w in zip(row, columns, widths)))
    return "\n".join(lines)
