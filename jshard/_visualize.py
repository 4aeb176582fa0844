"""`visualize`: which device holds which slice of an array, drawn as a grid, for arrays of any rank.

Like `jax.debug.visualize_array_sharding` (which draws rank 1 and 2 only), the last two dims are the
grid's rows and columns, each cell naming the devices (ranks) that hold that block: several where
blocks are replicated. An array of rank 0 is one cell; of rank 1, one row; of rank > 2, one grid per
distinct block of its leading dims, titled with that block (`[0:2, 4:8, :, :]`). In a terminal the
grid is text (`print`, or `rich.print` in colour); in a notebook it is an SVG figure (`_repr_svg_`),
so no plotting library is needed.
"""

from __future__ import annotations

import dataclasses
import html
from collections.abc import Sequence

import jax
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from jshard._errors import ShardingError, api_boundary
from jshard._format import plain_text, shape_str

Bounds = tuple[int, int]
"""One dim of a block: `[start, stop)` in elements (or in blocks, for a sharding given no shape)."""

_PALETTE = ("#8dd3c7", "#ffffb3", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
            "#d9d9d9", "#bc80bd", "#ccebc5", "#ffed6f")
_CELL_W, _CELL_H, _LABEL_W, _TITLE_H, _FONT = 400, 34, 64, 22, 11


@dataclasses.dataclass(frozen=True)
class Visualization:
    """Which devices hold which block of an array; `str()` draws it as text, a notebook as SVG.

    Attributes:
      title: the array's type and sharding, as one line.
      shape: the array's shape (for a sharding given no shape: the number of blocks per dim).
      blocks: `(bounds per dim, device ids holding it)` for every distinct block, in index order.
    """

    title: str
    shape: tuple[int, ...]
    blocks: tuple[tuple[tuple[Bounds, ...], tuple[int, ...]], ...]
    in_blocks: bool = False
    """Whether `shape` counts blocks (a sharding drawn without a shape): labels are block numbers."""

    def grids(self) -> list[tuple[str, list[Bounds], list[Bounds], dict[tuple[int, int], tuple[int, ...]]]]:
        """`(title, row bounds, column bounds, {(row, column): devices})`, one per block of the leading dims."""
        lead = len(self.shape) - 2 if len(self.shape) > 2 else 0
        groups: dict[tuple[Bounds, ...], list] = {}
        for bounds, devices in self.blocks:
            groups.setdefault(bounds[:lead], []).append((bounds[lead:], devices))
        out = []
        for leading, members in sorted(groups.items()):
            grid = [_pad(b) for b, _ in members]
            rows = sorted({b[0] for b in grid})
            cols = sorted({b[1] for b in grid})
            cells = {(rows.index(b[0]), cols.index(b[1])): d for b, (_, d) in zip(grid, members)}
            title = "[" + ", ".join([f"{a}:{b}" for a, b in leading] + [":"] * (len(self.shape) - lead)) + "]" if lead else ""
            out.append((title, rows, cols, cells))
        return out

    def label(self, b: Bounds) -> str:
        """A block's extent along one dim, as the grid's headers write it: `0:4`, or `2` in blocks."""
        return str(b[0]) if self.in_blocks else f"{b[0]}:{b[1]}"

    def __rich__(self) -> Group:
        colours = _colours(self.blocks)
        rank = len(self.shape)
        parts: list = [Text(self.title)]
        for title, rows, cols, cells in self.grids():
            table = Table(box=box.SQUARE, show_lines=True, show_header=rank >= 1, title=title or None,
                          title_justify="left")
            if rank >= 2:
                table.add_column("", justify="right", style="dim")
            for c in cols:
                table.add_column(self.label(c), justify="center")
            for i, r in enumerate(rows):
                row = [Text(_ranks_str(cells[i, j]), style=f"black on {colours[cells[i, j]]}") if (i, j) in cells
                       else Text("") for j in range(len(cols))]
                table.add_row(*([self.label(r)] if rank >= 2 else []), *row)
            parts.append(table)
        return Group(*parts)

    def __str__(self) -> str:
        return plain_text(self)

    __repr__ = __str__

    def _repr_svg_(self) -> str:
        return svg(self)


@api_boundary
def visualize(x: object, *, shape: Sequence[int] | None = None) -> Visualization:
    """Which device (rank) holds which slice of `x`, as a grid: text in a terminal, a figure in a notebook.

    Args:
      x: a `jax.Array`, a `jax.ShapeDtypeStruct` with a sharding, or a `jax.sharding.Sharding` (an
        argument's sharding from `plan.in_shardings`, say).
      shape: the array's shape, for a sharding; without it a `NamedSharding` is drawn in blocks
        (each dim as many units as it is cut into).

    Returns:
      A `Visualization`: `print` it (or `rich.print` it, in colour), or leave it last in a notebook cell.

    Raises:
      ShardingError: a sharding that is not a `NamedSharding` given without `shape`.
      TypeError: `x` is none of the above.

    Examples:
      >>> mesh = jax.make_mesh((2, 4), ("dp", "mp"), devices=jax.devices()[:8])
      >>> sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("dp"))
      >>> print(visualize(sharding, shape=(8, 16)))
      [8,16] sharded as NamedSharding(P('dp',), mesh (dp=2, mp=4))
      ┌─────┬──────┐
      │     │ 0:16 │
      ├─────┼──────┤
      │ 0:4 │ 0-3  │
      ├─────┼──────┤
      │ 4:8 │ 4-7  │
      └─────┴──────┘
    """
    sharding, dims, what = _sharding_and_shape(x, shape)
    by_block: dict[tuple[Bounds, ...], list[int]] = {}
    for device, index in sharding.devices_indices_map(dims).items():
        bounds = tuple(_bounds(s, n) for s, n in zip(index, dims))
        by_block.setdefault(bounds, []).append(device.id)
    blocks = tuple((b, tuple(sorted(d))) for b, d in sorted(by_block.items()))
    in_blocks = isinstance(x, jax.sharding.Sharding) and shape is None
    title = f"{what}: {' × '.join(map(str, dims)) or 'one'} blocks" if in_blocks else f"{_shape_text(x, dims)} {what}"
    return Visualization(title, dims, blocks, in_blocks)


def _sharding_and_shape(x, shape) -> tuple[jax.sharding.Sharding, tuple[int, ...], str]:
    if isinstance(x, jax.sharding.Sharding):
        if shape is not None:
            return x, tuple(shape), f"sharded as {_sharding_str(x)}"
        if not isinstance(x, jax.sharding.NamedSharding):
            raise ShardingError(
                f"jshard.visualize({type(x).__name__}): a sharding other than a NamedSharding says nothing of the "
                f"array's rank; pass its shape: jshard.visualize(sharding, shape=x.shape)."
            )
        sizes = dict(x.mesh.shape)
        blocks = tuple(_cuts(entry, sizes) for entry in x.spec)
        return x, blocks, f"sharding {_sharding_str(x)}, in blocks (no shape given)"
    sharding = getattr(x, "sharding", None)
    if isinstance(x, (jax.Array, jax.ShapeDtypeStruct)) and sharding is not None:
        return sharding, tuple(shape if shape is not None else x.shape), f"sharded as {_sharding_str(sharding)}"
    raise TypeError(
        f"jshard.visualize: x must be a jax.Array, a jax.ShapeDtypeStruct with a sharding, or a jax.sharding.Sharding, "
        f"got {type(x).__name__}."
    )


def _cuts(entry, sizes) -> int:
    axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
    count = 1
    for a in axes:
        count *= sizes[a]
    return count


def _sharding_str(sharding) -> str:
    if isinstance(sharding, jax.sharding.NamedSharding):
        mesh = ", ".join(f"{n}={s}" for n, s in sharding.mesh.shape.items())
        return f"NamedSharding({sharding.spec}, mesh ({mesh}))"
    return type(sharding).__name__


def _shape_text(x, dims) -> str:
    dtype = getattr(x, "dtype", None)
    return shape_str(dtype, dims) if dtype is not None else f"[{','.join(map(str, dims))}]"


def _bounds(s: slice, n: int) -> Bounds:
    start, stop, _ = s.indices(n)
    return start, stop


def _pad(bounds: tuple[Bounds, ...]) -> tuple[Bounds, Bounds]:
    """A block's (row, column) bounds: rank 0 and 1 arrays are one row (of one cell)."""
    return ((0, 1),) * (2 - len(bounds)) + tuple(bounds)


def _ranks_str(devices: tuple[int, ...]) -> str:
    """Device ids as runs: `0-3`, `0,4`, `0-1,4-5`."""
    runs: list[list[int]] = []
    for d in devices:
        if runs and d == runs[-1][1] + 1:
            runs[-1][1] = d
        else:
            runs.append([d, d])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def _colours(blocks) -> dict[tuple[int, ...], str]:
    """One colour per set of devices, in order of first appearance."""
    out: dict[tuple[int, ...], str] = {}
    for _, devices in blocks:
        out.setdefault(devices, _PALETTE[len(out) % len(_PALETTE)])
    return out


def svg(v: Visualization) -> str:
    """The grids as one SVG figure: cells sized by their blocks, each named by its devices."""
    colours = _colours(v.blocks)
    parts, y = [], _TITLE_H
    parts.append(_svg_text(0, 15, v.title, anchor="start"))
    for title, rows, cols, cells in v.grids():
        if title:
            y += _TITLE_H
            parts.append(_svg_text(0, y - 6, title, anchor="start"))
        col_x = _positions(cols, _CELL_W)
        row_y = _positions(rows, _CELL_H * len(rows))
        y += 16
        for j, c in enumerate(cols):
            if len(v.shape) >= 1:
                parts.append(_svg_text(_LABEL_W + (col_x[j] + col_x[j + 1]) / 2, y - 4, v.label(c)))
        for i, r in enumerate(rows):
            top, bottom = y + row_y[i], y + row_y[i + 1]
            if len(v.shape) >= 2:
                parts.append(_svg_text(_LABEL_W - 6, (top + bottom) / 2 + 4, v.label(r), anchor="end"))
            for j in range(len(cols)):
                devices = cells.get((i, j))
                left, right = _LABEL_W + col_x[j], _LABEL_W + col_x[j + 1]
                fill = colours[devices] if devices else "white"
                parts.append(f'<rect x="{left:.1f}" y="{top:.1f}" width="{right - left:.1f}" height="{bottom - top:.1f}" '
                             f'fill="{fill}" stroke="black"/>')
                if devices:
                    parts.append(_svg_text((left + right) / 2, (top + bottom) / 2 + 4, _ranks_str(devices)))
        y += row_y[-1] + 8
    width = max(_LABEL_W + _CELL_W + 8, round(len(v.title) * _FONT * 0.62) + 8)  # a monospace glyph: ~0.6 em
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{y:.0f}" '
            f'font-family="monospace" font-size="{_FONT}">' + "".join(parts) + "</svg>")


def _positions(bounds: list[Bounds], total: float) -> list[float]:
    """Edges of cells whose sizes follow their blocks' lengths, `total` wide."""
    lengths = [b - a for a, b in bounds]
    whole = sum(lengths) or 1
    edges = [0.0]
    for n in lengths:
        edges.append(edges[-1] + total * n / whole)
    return edges


def _svg_text(x: float, y: float, text: str, anchor: str = "middle") -> str:
    return f'<text x="{x:.1f}" y="{y:.1f}" text-anchor="{anchor}">{html.escape(text)}</text>'
