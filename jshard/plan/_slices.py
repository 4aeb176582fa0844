"""`Plan.slices`: per rank, which slice of each operand and result of one operator it holds (MindSpore
prints its strategies per rank; this is the same table read off the plan's `PartitionSpec`s)."""

from __future__ import annotations

import dataclasses
import math
import re

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from jshard._format import html_table, plain_text
from jshard.plan._records import OpRecord, source_str, strategies_str

_DIMS = re.compile(r"\[([\d,]*)\]$")


@dataclasses.dataclass(frozen=True)
class RankSlices:
    """One operator's slices per rank: `str()` is a text table, a notebook shows an HTML one.

    Attributes:
      title: the operator, its strategy and its source line.
      headers: `rank`, then one column per operand (`in[0] f32[8,16] (2, 1)`) and result (`out[0] ...`).
      rows: per rank, its id and the index ranges it holds (`0:4, :`; `-` where jshard fixed no layout).
    """

    title: str
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]

    def __rich__(self) -> Group:
        table = Table(*self.headers, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="bold")
        for row in self.rows:
            table.add_row(*map(Text, row))  # Text: not read as markup or emoji
        return Group(Text(self.title), table)

    def __str__(self) -> str:
        return plain_text(self)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return html_table(self.headers, self.rows, (self.title,))


def rank_slices(plan, op: OpRecord) -> RankSlices:
    """The `RankSlices` of `op` in `plan`: ranks in the mesh's device order (row-major, last axis fastest)."""
    if plan.mesh is not None:
        names, sizes = tuple(plan.mesh.shape), tuple(plan.mesh.shape.values())
        ranks = [d.id for d in np.asarray(plan.mesh.devices).flat]
    else:
        names, sizes = plan.fine.names, plan.fine.sizes
        ranks = list(range(math.prod(sizes)))
    operands = [("in", i, s, _nth(op.in_specs, i), _nth(op.in_strategy, i)) for i, s in enumerate(op.in_shapes)]
    operands += [("out", i, s, _nth(op.out_specs, i), _nth(op.out_strategy, i)) for i, s in enumerate(op.out_shapes)]
    headers = ("rank",) + tuple(f"{kind}[{i}] {shape} {'-' if cut is None else cut}"
                                for kind, i, shape, _, cut in operands)
    rows = []
    for position, rank in enumerate(ranks):
        coords = dict(zip(names, np.unravel_index(position, sizes)))
        rows.append((str(rank),) + tuple("-" if spec is None else _slice_str(_dims(shape), spec, coords, dict(zip(names, sizes)))
                                         for _, _, shape, spec, _ in operands))
    title = (f"op #{op.index} {op.primitive} {strategies_str(op.in_strategy)} -> {strategies_str(op.out_strategy)} "
             f"({op.origin}, {source_str(op.source)})")
    return RankSlices(title, headers, tuple(rows))


def _nth(values, i: int):
    """`values[i]`, None where jshard fixed none (no tuple, or fewer entries)."""
    return values[i] if values is not None and i < len(values) else None


def _dims(shape: str) -> tuple[int, ...]:
    """The dims of a shape as plans write it (`f32[8,16]` -> (8, 16))."""
    found = _DIMS.search(shape)
    return tuple(int(d) for d in found.group(1).split(",") if d) if found else ()


def _slice_str(dims: tuple[int, ...], spec, coords: dict, sizes: dict) -> str:
    """The index ranges one rank holds of a tensor of `dims` laid out as `spec` (`0:4, :`), as XLA
    cuts them: blocks of ceil(dim / cuts) elements, the last one short where the cut does not divide."""
    if not dims:
        return "whole"
    parts = []
    for d, n in enumerate(dims):
        entry = spec[d] if d < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        block, cuts = 0, 1
        for a in axes:
            block, cuts = block * sizes[a] + int(coords[a]), cuts * sizes[a]
        if cuts == 1:
            parts.append(":")
            continue
        chunk = -(-n // cuts)
        start = min(block * chunk, n)
        parts.append(f"{start}:{min(start + chunk, n)}")
    return ", ".join(parts)
