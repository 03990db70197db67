"""Plain-text tables shared by the benchmarks' reports."""

from __future__ import annotations


def format_table(rows: list[list[str]], *, left_columns: int = 1) -> list[str]:
    """``rows`` (the first is the header) as the lines of a fixed-width table that is also
    valid Markdown; the first ``left_columns`` are left-aligned, the rest right-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for i, row in enumerate(rows):
        cells = [
            c.ljust(w) if j < left_columns else c.rjust(w)
            for j, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        out.append("| " + " | ".join(cells) + " |")
        if i == 0:
            out.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return out
