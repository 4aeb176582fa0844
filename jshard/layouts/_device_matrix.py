"""Operator device matrices: how an operator's strategy tuples become one device matrix.

MindSpore derives one device matrix per operator from its input strategies. jshard implements the
two families a `shard` call can meet with plain tuples:

* contraction (`dot_general`, so `matmul`, `einsum` of two operands, `Dense`): the matrix is
  `[batch..., lhs free..., contracted..., rhs free...]`; MatMul `((a, b), (b, c))` gives `[a, b, c]`.
* broadcasting (elementwise and anything whose operands line up from the right): the matrix is the
  operands' common strategy.
* lookup (MindSpore's Gather / EmbeddingLookup, `jnp.take(table, indices, axis)`): `gather_layouts`.

Anything else is expressed with a `Layout`, which names its device matrix itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from jshard._errors import ShardingError
from jshard._format import shape_str
from jshard.layouts._strategy import Strategy, TensorLayout, with_repeated_calculation

DotDims = tuple[tuple[Sequence[int], Sequence[int]], tuple[Sequence[int], Sequence[int]]]
"""`dot_general`'s dimension numbers: `((lhs_contract, rhs_contract), (lhs_batch, rhs_batch))`."""


def dot_layouts(
    lhs: Strategy,
    rhs: Strategy,
    dims: DotDims,
    *,
    call: str,
    op: str,
    names: tuple[str, str],
) -> tuple[TensorLayout, TensorLayout, TensorLayout, tuple[int, ...]]:
    """Layouts of a contraction's operands and result under strategies `lhs` and `rhs`.

    `names` are what the user called the two strategies, for errors.

    Returns:
      `(lhs_layout, rhs_layout, out_layout, partial_axes)`: `partial_axes` are the device-matrix axes
      over which the result holds partial sums (the cut contracted dims), reduced by XLA.

    Raises:
      ShardingError: a contracted or batch dim is cut differently in the two operands.
    """
    (lc, rc), (lb, rb) = dims
    _check_agree(lhs, rhs, lb, rb, call=call, op=op, names=names, kind="batch")
    _check_agree(lhs, rhs, lc, rc, call=call, op=op, names=names, kind="contracted")
    lfree = [d for d in range(len(lhs)) if d not in lc and d not in lb]
    rfree = [d for d in range(len(rhs)) if d not in rc and d not in rb]
    matrix = (
        *(lhs[d] for d in lb),
        *(lhs[d] for d in lfree),
        *(lhs[d] for d in lc),
        *(rhs[d] for d in rfree),
    )
    nb, nl, nc = len(lb), len(lfree), len(lc)
    lmap = [()] * len(lhs)
    rmap = [()] * len(rhs)
    for i, (l, r) in enumerate(zip(lb, rb)):
        lmap[l] = rmap[r] = (i,)
    for j, l in enumerate(lfree):
        lmap[l] = (nb + j,)
    for k, (l, r) in enumerate(zip(lc, rc)):
        lmap[l] = rmap[r] = (nb + nl + k,)
    for m, r in enumerate(rfree):
        rmap[r] = (nb + nl + nc + m,)
    out_map = tuple((i,) for i in range(nb)) + tuple(lmap[l] for l in lfree) + tuple(rmap[r] for r in rfree)
    partial = tuple(nb + nl + k for k in range(nc) if matrix[nb + nl + k] > 1)
    return (
        TensorLayout(matrix, tuple(lmap)),
        TensorLayout(matrix, tuple(rmap)),
        TensorLayout(matrix, out_map),
        partial,
    )


def _check_agree(lhs, rhs, ldims, rdims, *, call, op, names, kind):
    bad = next(((l, r) for l, r in zip(ldims, rdims) if lhs[l] != rhs[r]), None)
    if bad is not None:
        raise ShardingError(_disagree_error(lhs, rhs, *bad, call=call, op=op, names=names, kind=kind))


def _disagree_error(lhs, rhs, l, r, *, call, op, names, kind):
    fixed = list(rhs)
    fixed[r] = lhs[l]
    verb = "contracts" if kind == "contracted" else "batches"
    return (
        f"{call}: {op} {verb} dim {l} of {names[0]}={lhs} with dim {r} of {names[1]}={rhs}, but "
        f"they cut them differently ({lhs[l]} vs {rhs[r]}). {kind.capitalize()} dims must be cut "
        f"alike, as in MatMul's ((a, b), (b, c)): e.g. {names[1]}={tuple(fixed)}."
    )


def broadcast_layouts(
    strategies: Sequence[Strategy], operands: Sequence[Any], *, call: str, op: str, names: Sequence[str]
) -> tuple[list[TensorLayout], TensorLayout]:
    """Layouts of operands that line up from the right (NumPy broadcasting) and of their result.

    `operands` are the arrays (anything with `shape` and `dtype`) the strategies cut; `names` are
    what the user called the strategies (`"in_strategy[1]"`), for errors.

    A dim of size 1 that is broadcast must not be cut; dims that line up must be cut alike.

    Raises:
      ShardingError: two operands cut a lined-up dim differently, or a broadcast dim is cut.
    """
    rank = max(len(s) for s in strategies)
    matrix = [1] * rank
    owner: list[int | None] = [None] * rank
    for i, (strategy, x) in enumerate(zip(strategies, operands)):
        shape = x.shape
        for d, cut in enumerate(strategy):
            pos = rank - len(strategy) + d
            if shape[d] == 1 and cut != 1:
                raise ShardingError(
                    f"{call}: {op}: {names[i]}={strategy} cuts dim {d} of "
                    f"{shape_str(x.dtype, shape)}, a size-1 dim that is broadcast. Use 1 there."
                )
            if shape[d] == 1:
                continue
            if (j := owner[pos]) is not None and matrix[pos] != cut:
                dj = pos - rank + len(strategies[j])
                raise ShardingError(
                    f"{call}: {op}: {names[j]}={strategies[j]} and {names[i]}={strategy} "
                    f"cut dim {dj} of {shape_str(operands[j].dtype, operands[j].shape)} and dim {d} of "
                    f"{shape_str(x.dtype, shape)}, which line up from the right, differently "
                    f"({matrix[pos]} vs {cut}). Operands that line up must be cut alike; for a function "
                    f"whose operands do not line up, give a jshard.Layout per operand instead."
                )
            matrix[pos], owner[pos] = cut, i
    layouts = [
        TensorLayout(tuple(matrix), tuple(() if x.shape[d] == 1 else (rank - len(s) + d,) for d in range(len(s))))
        for s, x in zip(strategies, operands)
    ]
    return layouts, TensorLayout(tuple(matrix), tuple((p,) for p in range(rank)))


def gather_layouts(
    table: Strategy,
    indices: Strategy,
    axis: int,
    shapes: tuple[Sequence[int], Sequence[int]],
    device_count: int,
    *,
    call: str,
    op: str,
    names: tuple[str, str],
) -> tuple[TensorLayout, TensorLayout, TensorLayout, tuple[int, ...]]:
    """Layouts of MindSpore's Gather(`axis`) under strategies `table` (its `input_params`) and
    `indices`, over `device_count` devices, as MindSpore's `GatherInfo` lays them out.

    - The looked-up dim whole (`table[axis] == 1`): the matrix is `table + indices`; the result
      `table[:axis] + indices + table[axis+1:]` is cut as those are.
    - Rows and indices cut, `((a, 1), (c, 1))` with `a * c` the device count (MindSpore's
      "shard batch and axis"): the matrix is `[c, a]`, the table's rows cut over `a` (fastest), the
      indices' rows over `c`; each device looks up its `c`-block of indices in its `a`-block of
      rows, out-of-block indices give zeros, and an all-reduce over `a` sums the pieces: the
      result's rows are cut over `c`.
    - Rows cut, indices whole (axis 0; a 1-D or 2-D table): the matrix is `table`; the masked
      lookup's all-reduce over the row axis leaves the result's first dim cut as the rows are
      where they divide it (MindSpore's reduce-scatter), else whole.

    Repeated calculation goes where MindSpore's Gather puts it: last where the table's strategy
    covers all devices or none, first otherwise.

    Returns:
      `(table_layout, indices_layout, out_layout, partial_axes)`: `partial_axes`, the device-matrix
      axes over which the masked lookups hold partial sums.

    Examples:
      >>> t, i, out, partial = gather_layouts((2, 1), (4, 1), 0, ((32, 8), (16, 4)), 8, call="f", op="take",
      ...                                     names=("in_strategy[0]", "in_strategy[1]"))
      >>> t.device_matrix, t.tensor_map, i.tensor_map, out.tensor_map, partial
      ((4, 2), ((1,), ()), ((0,), ()), ((0,), (), ()), (1,))

    Raises:
      ShardingError: a strategy MindSpore's Gather does not take: the looked-up dim cut with the
        indices cut otherwise than `((a, 1), (c, 1))`, rows cut on another axis than 0 or of a table
        of more than 2 dims, or a device matrix that does not divide the device count.
    """
    nt, ni = len(table), len(indices)
    if table[axis] == 1:
        matrix = (*table, *indices)
        out = tuple((d,) for d in range(axis)) + tuple((nt + j,) for j in range(ni)) + tuple((d,) for d in range(axis + 1, nt))
        maps = (tuple((d,) for d in range(nt)), tuple((nt + j,) for j in range(ni)), out)
        return _repeated(matrix, maps, (), math.prod(table), device_count, call=call, op=op,
                         strategies=(table, indices))
    if axis == 0 and ni == nt == 2 and table[1] == indices[1] == 1 and 1 < indices[0] < device_count == table[0] * indices[0]:
        matrix = (indices[0], table[0])
        layouts = (TensorLayout(matrix, ((1,), ())), TensorLayout(matrix, ((0,), ())), TensorLayout(matrix, ((0,), (), ())))
        return (*layouts, (1,))
    _check_row_cut(table, indices, axis, shapes, device_count, call=call, op=op, names=names)
    rows_cut = shapes[1][0] % table[0] == 0 if ni else False
    out = ((0,) if rows_cut else (),) + ((),) * (ni - 1) + tuple((d,) for d in range(1, nt))
    maps = (tuple((d,) for d in range(nt)), ((),) * ni, out)
    return _repeated(table, maps, (0,), math.prod(table), device_count, call=call, op=op,
                     strategies=(table, indices))


def _check_row_cut(table, indices, axis, shapes, device_count, *, call, op, names) -> None:
    ms = "MindSpore's Gather"
    if axis != 0 or len(table) > 2:
        raise ShardingError(
            f"{call}: {op} looks up dim {axis} of a {len(table)}-D table, and {names[0]}={table} cuts it; {ms} "
            f"takes a cut looked-up dim only as the rows (axis 0) of a 1-D or 2-D table (an embedding). Leave dim "
            f"{axis} whole ({names[0]}={tuple(1 if d == axis else c for d, c in enumerate(table))}) or look up rows.")
    if not shapes[1]:
        raise ShardingError(f"{call}: {op} looks up one scalar index in a table whose rows {names[0]}={table} cuts; "
                            f"{ms} takes a cut table only with an array of indices. Leave the rows whole.")
    if math.prod(indices) == 1:
        if math.prod(table) != device_count and len(table) == 2 and table[1] != 1:
            raise ShardingError(
                f"{call}: {op}: {names[0]}={table} cuts the rows and the columns of the table on {math.prod(table)} of "
                f"{device_count} devices; {ms} repeats a row-cut table only when its columns are whole. Use "
                f"{names[0]}={(device_count // table[1], table[1])} (every device) or {(table[0], 1)}.")
        return
    a = table[0]
    pattern = (a, 1) if len(table) == 2 else (a,)
    raise ShardingError(
        f"{call}: {op}: {names[0]}={table} cuts the table's rows (the looked-up dim) and {names[1]}={indices} "
        f"cuts the indices; {ms} cuts both only as ((a, 1), (c, 1)) with a * c = {device_count} devices, "
        f"a 2-D table and 2-D indices (rows of the table over a, rows of the indices over c, a masked lookup "
        f"and an all-reduce over a). Use {names[0]}={pattern}, {names[1]}={(1,) * len(indices)} (indices whole), "
        f"or {names[1]}={(device_count // a,) + (1,) * (len(indices) - 1)} with a 2-D table and 2-D indices.")


def _repeated(matrix, maps, partial, table_product, device_count, *, call, op, strategies):
    """The layouts over `matrix` (their tensor maps `maps`), with MindSpore's Gather's repeated
    calculation axis: last where the table covers all devices or one, first otherwise."""
    what = f"in_strategy=({strategies[0]}, {strategies[1]})"
    with_repeated_calculation(TensorLayout(tuple(matrix), ()), device_count, call=call, op=op, what=what)  # divides
    used = math.prod(matrix)
    if used != device_count and table_product not in (1, device_count):
        shift = lambda m: tuple(tuple(a + 1 for a in axes) for axes in m)
        matrix, maps, partial = (device_count // used, *matrix), tuple(shift(m) for m in maps), tuple(a + 1 for a in partial)
    elif used != device_count:
        matrix = (*matrix, device_count // used)
    return (*(TensorLayout(tuple(matrix), m) for m in maps), partial)
