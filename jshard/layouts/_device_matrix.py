"""Operator device matrices: how an operator's strategy tuples become one device matrix.

MindSpore derives one device matrix per operator from its input strategies. jshard implements the
two families a `shard` call can meet with plain tuples:

* contraction (`dot_general`, so `matmul`, `einsum` of two operands, `Dense`): the matrix is
  `[batch..., lhs free..., contracted..., rhs free...]`; MatMul `((a, b), (b, c))` gives `[a, b, c]`.
* broadcasting (elementwise and anything whose operands line up from the right): the matrix is the
  operands' common strategy.

Anything else is expressed with a `Layout`, which names its device matrix itself.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from jshard._errors import ShardingError
from jshard._format import shape_str
from jshard.layouts._strategy import Strategy, TensorLayout

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
            if owner[pos] is not None and matrix[pos] != cut:
                j = owner[pos]
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
