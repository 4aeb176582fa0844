"""Operator device matrices: how an operator's strategy tuples become one device matrix.

MindSpore derives one device matrix per operator from its input strategies. jshard implements the
two families a `shard` call can meet with plain tuples:

* contraction (`dot_general`, so `matmul`, `einsum` of two operands, `Dense`): the matrix is
  `[batch..., lhs free..., contracted..., rhs free...]`; MatMul `((a, b), (b, c))` gives `[a, b, c]`.
* broadcasting (elementwise and anything whose operands line up from the right): the matrix is the
  operands' common strategy.
* lookup (MindSpore's Gather / EmbeddingLookup, `jnp.take(table, indices, axis)`): `gather_layouts`.
* convolution (MindSpore's Conv2D, `lax.conv_general_dilated`): `conv_layouts`.
* scatter into rows (MindSpore's ScatterAdd ..., `table.at[indices].add(updates)`): `scatter_layouts`.

Anything else is expressed with a `Layout`, which names its device matrix itself.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, cast

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
    lmap: list[tuple[int, ...]] = [()] * len(lhs)
    rmap: list[tuple[int, ...]] = [()] * len(rhs)
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
    - The looked-up dim cut, indices whole (any axis): the matrix is `table`; each device looks
      the indices up in its block of that dim (zeros outside) and an all-reduce over its axis sums
      them. Looking up rows (axis 0), the result's first dim is cut as the rows are where they
      divide it (MindSpore's reduce-scatter), else whole.

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
        indices cut otherwise than `((a, 1), (c, 1))`, or a device matrix that does not divide the
        device count.
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
    rows_cut = axis == 0 and shapes[1][0] % table[0] == 0
    out = (tuple((d,) for d in range(axis)) + ((axis,) if rows_cut else (),) + ((),) * (ni - 1)
           + tuple((d,) for d in range(axis + 1, nt)))
    maps = (tuple((d,) for d in range(nt)), ((),) * ni, out)
    return _repeated(table, maps, (axis,), math.prod(table), device_count, call=call, op=op,
                     strategies=(table, indices))


def _check_row_cut(table, indices, axis, shapes, device_count, *, call, op, names) -> None:
    ms = "MindSpore's Gather"
    if not shapes[1]:
        raise ShardingError(f"{call}: {op} looks up one scalar index in a table whose rows {names[0]}={table} cuts; "
                            f"{ms} takes a cut table only with an array of indices. Leave the rows whole.")
    if math.prod(indices) == 1:
        if axis == 0 and math.prod(table) != device_count and len(table) == 2 and table[1] != 1:
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


ConvDims = tuple[Sequence[int], Sequence[int], Sequence[int]]
"""A convolution's dimension numbers: the dims of the input `(batch, feature, spatial...)`, of the
kernel `(out feature, in feature, spatial...)` and of the result `(batch, feature, spatial...)`."""


def conv_layouts(
    lhs: Strategy, rhs: Strategy, dims: ConvDims, groups: int, *, call: str, op: str, names: tuple[str, str]
) -> tuple[TensorLayout, TensorLayout, TensorLayout, tuple[int, ...]]:
    """Layouts of MindSpore's Conv2D / Conv3D under its strategy `((n, c, h, w), (o, c, 1, 1))`: one
    tuple per operand, each in its own dim order (NCHW and OIHW, or as `dims` says).

    The device matrix is `[n, c, spatial..., o]`: the input's batch over `n`, its channels and the
    kernel's input channels over `c` (partial sums, reduced), its spatial dims over theirs (XLA
    exchanges the halos), the kernel's output channels over `o`; the result is `(n, o, spatial...)`.

    Returns:
      `(lhs_layout, rhs_layout, out_layout, partial_axes)`.

    Raises:
      ShardingError: the input channels cut differently in the two operands, a kernel's spatial dim
        cut, or input channels cut in a grouped convolution (MindSpore's Conv2D refuses each).
    """
    (lb, lf, *ls), (ro, ri, *rs), (ob, of, *os_) = dims
    bad = _conv_error(lhs, rhs, (lf, ri, rs), groups, call=call, op=op, names=names)
    if bad:
        raise ShardingError(bad)
    k = len(ls)
    matrix = (lhs[lb], lhs[lf], *(lhs[d] for d in ls), rhs[ro])
    lmap: list[tuple[int, ...]]
    rmap: list[tuple[int, ...]]
    omap: list[tuple[int, ...]]
    lmap, rmap, omap = [()] * len(lhs), [()] * len(rhs), [()] * (k + 2)
    lmap[lb], lmap[lf], omap[ob] = (0,), (1,), (0,)
    rmap[ri], rmap[ro], omap[of] = (1,), (k + 2,), (k + 2,)
    for j, (dl, do) in enumerate(zip(ls, os_)):
        lmap[dl] = omap[do] = (2 + j,)
    partial = (1,) if matrix[1] > 1 else ()
    layouts = (TensorLayout(matrix, tuple(m)) for m in (lmap, rmap, omap))
    # three layouts, one per map: mypy cannot count a generator's items
    return cast("tuple[TensorLayout, TensorLayout, TensorLayout, tuple[int, ...]]", (*layouts, partial))


def _conv_error(lhs, rhs, dims, groups, *, call, op, names) -> str:
    lf, ri, rs = dims
    fix = tuple(lhs[lf] if d == ri else 1 if d in rs else c for d, c in enumerate(rhs))
    if lhs[lf] != rhs[ri]:
        return (f"{call}: {op} convolves {names[0]}={lhs} with {names[1]}={rhs}, but they cut the input channels "
                f"differently ({lhs[lf]} vs {rhs[ri]}). MindSpore's Conv2D cuts them alike, as in "
                f"((n, c, h, w), (o, c, 1, 1)): e.g. {names[1]}={fix}.")
    if any(rhs[d] != 1 for d in rs):
        return (f"{call}: {op}: {names[1]}={rhs} cuts the kernel's spatial dims; MindSpore's Conv2D keeps the "
                f"kernel's spatial dims whole. Use {names[1]}={fix}.")
    if groups > 1 and lhs[lf] != 1:
        return (f"{call}: {op} is a grouped convolution ({groups} groups) and {names[0]}={lhs} cuts its input "
                f"channels; MindSpore's Conv2D cuts the channels of a grouped convolution only whole (1).")
    return ""


def check_layouts_broadcast(
    layouts: Sequence[TensorLayout], operands: Sequence[Any], *, call: str, op: str, names: Sequence[str]
) -> None:
    """The check `broadcast_layouts` makes of tuples, made of `Layout`s given to operands of an
    elementwise function: dims that line up from the right are cut alike (by the same aliases, where
    the layouts share a device matrix), and a broadcast size-1 dim is whole.

    Raises:
      ShardingError: two operands cut a lined-up dim differently, or a broadcast dim is cut.
    """
    same = len({lay.device_matrix for lay in layouts}) == 1
    rank = max(len(x.shape) for x in operands)
    seen: dict[int, tuple[int, int]] = {}
    for i, (lay, x) in enumerate(zip(layouts, operands)):
        for d, n in enumerate(x.shape):
            if n == 1:
                if lay.strategy[d] != 1:
                    raise ShardingError(f"{call}: {op}: {names[i]}={lay.describe()} cuts dim {d} of "
                                        f"{shape_str(x.dtype, x.shape)}, a size-1 dim that is broadcast. Use \"None\" there.")
                continue
            pos = rank - len(x.shape) + d
            j, dj = seen.setdefault(pos, (i, d))
            cut = (lambda k, e: layouts[k].tensor_map[e]) if same else (lambda k, e: layouts[k].strategy[e])
            if cut(j, dj) != cut(i, d):
                y = operands[j]
                raise ShardingError(
                    f"{call}: {op}: {names[j]}={layouts[j].describe()} and {names[i]}={lay.describe()} cut dim {dj} "
                    f"of {shape_str(y.dtype, y.shape)} and dim {d} of {shape_str(x.dtype, x.shape)}, which line "
                    f"up from the right, differently ({_dim_str(layouts[j], dj)} vs {_dim_str(lay, d)}). Operands of "
                    f"an elementwise operator are cut alike, as MindSpore requires of its layouts; give both the "
                    f"same aliases there.")


def check_layouts_product(
    lhs: TensorLayout, rhs: TensorLayout, dims: DotDims, *, call: str, op: str, names: tuple[str, str]
) -> None:
    """A contraction's result, under `Layout`s of its operands sharing one device matrix and cutting
    the contracted dims alike (MindSpore's MatMul layouts), is cut by its operands' batch and free
    dims' aliases: each alias may cut one dim of it only. Contracted dims cut differently are
    MindSpore's N-D tensor parallel (its `enable_nd_tp`), which XLA's redistribution takes as is.

    Raises:
      ShardingError: an alias would cut two dims of the result (MindSpore refuses the layouts).
    """
    (lc, rc), (lb, rb) = dims
    if lhs.device_matrix != rhs.device_matrix or any(lhs.tensor_map[l] != rhs.tensor_map[r] for l, r in zip(lc, rc)):
        return
    free = [(lhs, names[0], d) for d in range(lhs.rank) if d not in lc] + \
           [(rhs, names[1], d) for d in range(rhs.rank) if d not in rc and d not in rb]
    owner: dict[int, tuple[str, int]] = {}
    for lay, name, d in free:
        for a in lay.tensor_map[d]:
            if a in owner:
                alias = lay.axis_names[a] if lay.axis_names else f"axis {a}"
                first, fd = owner[a]
                raise ShardingError(
                    f"{call}: {op}: {first}={lhs.describe() if first == names[0] else rhs.describe()} cuts dim {fd} "
                    f"and {name}={lay.describe()} cuts dim {d} by {alias!r}; both become dims of the result, which "
                    f"one alias cannot cut twice (MindSpore refuses these layouts). Cut one of them by another alias "
                    f"or leave it \"None\".")
            owner[a] = (name, d)


def _dim_str(lay: TensorLayout, d: int) -> str:
    if lay.axis_names is None:
        return str(lay.strategy[d])
    names = [lay.axis_names[a] for a in lay.tensor_map[d]]
    return '"None"' if not names else repr(names[0]) if len(names) == 1 else repr(tuple(names))


def scatter_layouts(
    operand: Strategy, indices: Strategy, updates: Strategy, *, call: str, op: str, names: tuple[str, str, str]
) -> tuple[TensorLayout, TensorLayout, TensorLayout, TensorLayout]:
    """Layouts of MindSpore's ScatterAdd / ScatterUpdate / ScatterMax ... (`table.at[indices].add(
    updates)`) under strategies `(operand, indices, updates)`: the matrix is `operand`'s; the
    indices are whole; the updates' index dims are whole and their other dims cut as the operand's
    dims after the first. A cut first dim (rows) has each device apply the updates whose index
    falls in its rows.

    Returns:
      `(operand_layout, indices_layout, updates_layout, out_layout)`; the result is laid out as
      the operand.

    Raises:
      ShardingError: the indices cut, the updates' index dims cut, or the updates' other dims cut
        otherwise than the operand's (MindSpore's scatter operators refuse each).
    """
    ni = len(indices)
    want = (1,) * ni + tuple(operand[1:])
    if any(c != 1 for c in indices) or tuple(updates) != want:
        raise ShardingError(
            f"{call}: {op} scatters {names[2]}={updates} into {names[0]}={operand} at {names[1]}={indices}; "
            f"MindSpore's scatter operators take the indices whole and the updates cut as the operand's dims "
            f"after the first, their index dims whole: use {names[1]}={(1,) * ni}, {names[2]}={want}.")
    matrix = tuple(operand)
    own = tuple((d,) for d in range(len(operand)))
    return (TensorLayout(matrix, own), TensorLayout(matrix, ((),) * ni),
            TensorLayout(matrix, ((),) * ni + own[1:]), TensorLayout(matrix, own))
