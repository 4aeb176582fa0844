"""`Plan.summary`: the plan grouped by source line, as a rich table (a terminal), plain text that fits
a width (120 columns unless told), or an HTML table (Jupyter's `_repr_html_`).

One row per (source line, pass). Its strategy column says what the whole group does: the strategy of
its one kind of operator where every member shares it, else its matmuls' input strategies and how
its results are cut (each distinct cut with its count, `whole` for an uncut one), so a softmax line of
40 operators reads as the cut it keeps, not as one member's tuple.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from jshard._format import html_table, human_bytes, plain_text
from jshard.plan._records import ORIGINS, OpRecord, source_str, strategies_str

WIDTH = 120
"""Columns the text summary fits (a terminal's, a notebook's, a log's)."""

HEADERS = ("source", "pass", "operators", "strategy", "origin", "comm")
_SOURCE_WIDTH = 28
_KINDS_SHOWN = 3
_CUTS_SHOWN = 3
_MAX_WIDTHS = {"operators": 24, "origin": 14}  # so the strategy keeps the width a long one needs


def header_lines(plan) -> list[str]:
    """The summary's lines above the table: devices, mesh, origins, coverage, search, optimizer,
    recompute, offload, what one device does where nearly nothing is cut (`WorkReport.line`), and the
    round trip a loop pays between calls (`Plan.round_trip`) where there is one."""
    axes = ", ".join(f"{n}={s}" for n, s in zip(plan.fine.names, plan.fine.sizes))
    origins = collections.Counter(op.origin for op in plan.ops)
    lines = [
        f"Plan: {plan.device_count} devices, mode={plan.mode}, propagation={plan.propagation}, mesh ({axes})",
        f"{len(plan.ops)} operators: " + ", ".join(f"{origins[o]} {o}" for o in ORIGINS if origins[o])
        + f"; coverage {plan.coverage:.1%}; predicted collectives {human_bytes(plan.predicted_bytes())} per device",
    ]
    if plan.peer is not None:
        lines.append(plan.peer.line())
    if plan.search is not None:
        lines.append(plan.search.line())
    if plan.search is not None and plan.search.context_line() is not None:
        lines.append(plan.search.context_line())
    if plan.optimizer is not None:
        lines.append(plan.optimizer.line())
    if plan.recompute is not None:
        lines.append(plan.recompute.line())
    if plan.offload is not None:
        lines.append(plan.offload.line())
    if plan.communication is not None:
        lines.append(plan.communication.line())
    if plan.work is not None and plan.work.line() is not None:
        lines.append(plan.work.line())
    if plan.round_trip:
        lines.append(f"round trip: results that update arguments come back in other layouts than taken; a loop "
                     f"moves {human_bytes(plan.round_trip)} per device before each next call (jshard.audit.moved_bytes)")
    return lines


def rows(ops: Sequence[OpRecord]) -> list[tuple[str, ...]]:
    """One row per (source line, pass): source, pass, operators, strategy, origins, predicted bytes."""
    groups: dict[tuple[str, bool], list[OpRecord]] = {}
    for op in ops:
        groups.setdefault((op.source.split(" ")[0], op.backward), []).append(op)
    out = []
    for (source, backward), members in groups.items():
        kinds = collections.Counter(m.primitive for m in members)
        origins = collections.Counter(m.origin for m in members)
        comm = sum(b for m in members for _, b, _ in m.comms)
        out.append((
            short_source(source),
            "bwd" if backward else "fwd",
            ", ".join(p + (f"×{c}" if c > 1 else "") for p, c in kinds.most_common(_KINDS_SHOWN))
            + (" …" if len(kinds) > _KINDS_SHOWN else ""),
            group_strategy(members),
            ", ".join(f"{c} {o}" for o, c in origins.items()),
            human_bytes(comm) if comm else "-",
        ))
    return out


def short_source(source: str) -> str:
    """A source location as the table shows it: its last two path parts, cut from the left to fit."""
    if not source:
        return "(no source)"
    short = source_str(source)
    return short if len(short) <= _SOURCE_WIDTH else "…" + short[-(_SOURCE_WIDTH - 1):]


def group_strategy(members: Sequence[OpRecord]) -> str:
    """What a group of operators does: one shared strategy, or its matmuls' and its results' cuts."""
    decided = [m for m in members if m.in_strategy is not None]
    if not decided:
        return "left to XLA"
    signatures = {(m.primitive, m.in_strategy, m.out_strategy) for m in decided}
    if len(signatures) == 1:
        prim, ins, outs = signatures.pop()
        return f"{prim} {strategies_str(ins)} -> {strategies_str(outs)}"
    parts = [f"{m.primitive} {strategies_str(m.in_strategy)}" for m in _distinct(decided, "dot_general")]
    cuts = collections.Counter(_cut_str(s) for m in decided for s in (m.out_strategy or ()) if s)
    shown = ", ".join(cut + (f" ×{n}" if n > 1 else "") for cut, n in cuts.most_common(_CUTS_SHOWN))
    parts.append("results " + (shown or "scalar") + (" …" if len(cuts) > _CUTS_SHOWN else ""))
    return "; ".join(parts)


def _distinct(members: Sequence[OpRecord], primitive: str) -> list[OpRecord]:
    seen: dict[tuple, OpRecord] = {}
    for m in members:
        if m.primitive == primitive:
            seen.setdefault(m.in_strategy, m)
    return list(seen.values())


def _cut_str(strategy) -> str:
    return "whole" if all(c == 1 for c in strategy) else str(tuple(strategy))


def table(plan, limit: int | None = None) -> Table:
    """The rows as a rich `Table` (the first `limit` rows, and a last one counting the rest)."""
    t = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0), header_style="bold")
    for name in HEADERS:
        t.add_column(name, no_wrap=name in ("source", "pass", "comm"), justify="right" if name == "comm" else "left",
                     max_width=_MAX_WIDTHS.get(name))
    all_rows = rows(plan.ops)
    for row in all_rows[:limit]:
        t.add_row(*map(Text, row))  # Text: user text is not read as markup or emoji (`file.py:100:`)
    if limit is not None and len(all_rows) > limit:
        t.add_row(f"… {len(all_rows) - limit} more rows", "", "", "", "", "")
    return t


def summary_renderable(plan, limit: int | None = None) -> Group:
    """The header lines and the table, for a rich console."""
    return Group(*(Text(line) for line in header_lines(plan)), table(plan, limit))


def summary_text(plan, width: int = WIDTH, limit: int | None = None) -> str:
    """The summary as plain text no wider than `width` columns (long cells wrap inside their column)."""
    return plain_text(summary_renderable(plan, limit), width)


def summary_html(plan) -> str:
    """The summary as HTML: the header lines, then a `<table>` with one row per source line and pass."""
    return html_table(HEADERS, rows(plan.ops), header_lines(plan))
