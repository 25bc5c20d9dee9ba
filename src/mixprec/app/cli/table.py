"""Plain-text tables for the terminal: aligned columns, no dependency."""

from __future__ import annotations

from collections.abc import Sequence


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str = "") -> str:
    """Columns padded to their widest cell; ``align`` has one 'l' or 'r' per column.

    By default the first column is left-aligned and the others (numbers) right-aligned.
    """
    align = align or "l" + "r" * (len(headers) - 1)
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]

    def line(cells: Sequence[str]) -> str:
        padded = [
            str(c).rjust(w) if a == "r" else str(c).ljust(w) for c, w, a in zip(cells, widths, align, strict=True)
        ]
        return "  ".join(padded).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(row) for row in rows)])
