"""A results table (title, target, rows, notes) and the formatting its cells share."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

_UNITS = ("B", "KiB", "MiB", "GiB")


@dataclasses.dataclass(frozen=True)
class Table:
    """One table of the report, rendered as Markdown for the console and `BENCHMARKS.md` alike.

    Attributes:
      title: the heading.
      target: what the figures are held to, in words (`""`: none).
      columns: the header.
      rows: one tuple of cells per row, as many as `columns`.
      notes: lines under the table: how to read it, what was skipped.
    """

    title: str
    target: str
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    notes: tuple[str, ...] = ()

    def __post_init__(self):
        for row in self.rows:
            if len(row) != len(self.columns):
                raise ValueError(f"Table {self.title!r}: row {row} has {len(row)} cells for {len(self.columns)} columns.")

    def markdown(self) -> str:
        lines = [f"## {self.title}", ""]
        if self.target:
            lines += [f"Target: {self.target}", ""]
        lines.append(markdown_row(self.columns))
        lines.append(markdown_row(["---"] * len(self.columns)))
        lines += [markdown_row(row) for row in self.rows]
        if self.notes:
            lines += [""] + [f"- {note}" for note in self.notes]
        return "\n".join(lines) + "\n"


def markdown_row(cells: Sequence[str]) -> str:
    return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"


def verdict(ok: bool) -> str:
    return "meets" if ok else "misses"


def size(n: float) -> str:
    """Bytes in the largest binary unit that keeps the figure at least 1: `1.10 MiB`."""
    power = 0
    while abs(n) >= 1024 and power < len(_UNITS) - 1:
        n, power = n / 1024, power + 1
    return f"{n:.0f} B" if power == 0 else f"{n:.2f} {_UNITS[power]}"


def seconds(values: Sequence[float]) -> str:
    """The median of `values` in seconds, with how many runs it is the median of."""
    return f"{statistics.median(values):.2f} s (n={len(values)})"


def percent(change: float) -> str:
    return f"{change:+.1%}"
