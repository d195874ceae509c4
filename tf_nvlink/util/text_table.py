"""Plain-text tables with aligned columns (nccl-tests style headers on request).

Example:
    >>> table([["name", "GB/s"], ["nccl", "176"]], right={1}, header_rows=1)
    ['# name  GB/s', '  nccl   176']
"""

from __future__ import annotations

from typing import Collection, Sequence


def table(rows: Sequence[Sequence[str]], right: Collection[int] = (), header_rows: int = 0) -> list[str]:
    """Rows of cells as aligned lines: each column as wide as its widest cell, those in `right` right-aligned.

    With `header_rows`, nccl-tests style: the first `header_rows` lines (names, units) start with "# ", the
    others with two spaces.

    Example:
        >>> table([["name", "GB/s"], ["nccl", "176"]], right={1}, header_rows=1)
        ['# name  GB/s', '  nccl   176']
    """
    widths = [max(len(row[c]) for row in rows) for c in range(len(rows[0]))] if rows else []
    lines = []
    for r, row in enumerate(rows):
        cells = [cell.rjust(widths[c]) if c in right else cell.ljust(widths[c]) for c, cell in enumerate(row)]
        lead = ("# " if r < header_rows else "  ") if header_rows else ""
        lines.append(lead + "  ".join(cells).rstrip())
    return lines
