"""Rules for `gather` and the `scatter` family: indexed dims whole, every other dim passes through.

A gather reads one slice of `operand` for every index vector of `indices` (the last dim of
`indices`). Read as factors, after the dimension numbers:

- each batch dim of `indices` (every dim but the index vector) is one batch dim of the output;
- an operand batching dim, its indices batching dim and their output dim share one factor;
- an operand dim the slice takes whole is one output offset dim;
- the index vector, and the operand dims it indexes or slices in part, are whole: any device may
  need any row.

An embedding lookup `table[tokens]` so keeps the tokens' batch cut and the table's feature cut;
`take_along_axis` keeps every dim but the axis it takes along.
A dim looked up one element at a time (an embedding table's rows) may stay cut too, as in
MindSpore's row-cut Gather / EmbeddingLookup: each device looks up in its own rows, zeroes what
falls outside them, and an all-reduce sums the pieces (a `reduced` factor). A `shard`ed lookup's
tuples take MindSpore's Gather device matrix (`jshard.layouts.gather_layouts`).

A scatter is the reverse, with `updates` in the output's place: its scatter dims are the indices'
batch dims, its window dims the slices. A scatter that combines (`scatter-add`, `-sub`, `-mul`,
`-min`, `-max`) may cut its scatter dims: each device combines its share of the updates into a
full-size result, and an all-reduce finishes it (the embedding gradient). Those factors are
`reduced`. A plain `scatter` overwrites, and which write lands depends on every update, so its
scatter dims stay whole. A dim the scatter writes one element at a time (an inserted window dim
it indexes: the embedding gradient's rows) may stay cut in any scatter, as XLA partitions it: each
device applies the updates that land in its rows and drops the others, so no sum is left (with
its scatter dims cut too, the device's rows hold partial sums over those axes only: the
row-cut embedding gradient all-reduces its own rows, not the table).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from jax.extend import core as jcore

from jshard.rules._factors import DimFactors, FactorBuilder, Factors, rule, shape_of

COMBINING_SCATTERS = ("scatter-add", "scatter-sub", "scatter-mul", "scatter-min", "scatter-max")


@rule("gather")
def gather(eqn: jcore.JaxprEqn) -> Factors:
    dn = eqn.params["dimension_numbers"]
    b = FactorBuilder()
    operand, indices, out, _ = _slicing(
        b, eqn, result=eqn.outvars[0], window_dims=dn.offset_dims, dropped=dn.collapsed_slice_dims,
        indexed=dn.start_index_map, operand_batching=dn.operand_batching_dims,
        indices_batching=dn.start_indices_batching_dims, cut_batch=True,
    )
    # A dim looked up one element at a time may stay cut: each device gathers from its own range,
    # zeroes what falls outside it, and an all-reduce sums the pieces (a vocab-parallel lookup).
    looked_up = []
    for d in dn.collapsed_slice_dims:
        if d in dn.start_index_map and eqn.params["slice_sizes"][d] == 1:
            operand[d] = (b.new(shape_of(eqn.invars[0])[d]),)
            looked_up.append(operand[d][0])
    return b.build([operand, indices], [out], reduced=looked_up, flops=math.prod(shape_of(eqn.outvars[0])))


@rule("scatter", *COMBINING_SCATTERS)
def scatter(eqn: jcore.JaxprEqn) -> Factors:
    dn = eqn.params["dimension_numbers"]
    b = FactorBuilder()
    operand, indices, updates, scattered = _slicing(
        b, eqn, result=eqn.invars[2], window_dims=dn.update_window_dims, dropped=dn.inserted_window_dims,
        indexed=dn.scatter_dims_to_operand_dims, operand_batching=dn.operand_batching_dims,
        indices_batching=dn.scatter_indices_batching_dims, cut_batch=eqn.primitive.name in COMBINING_SCATTERS,
    )
    # A dim written one element at a time (an embedding gradient's rows) may stay cut: each device
    # applies the updates that fall in its own range and drops the rest, with nothing to sum.
    for d in dn.inserted_window_dims:
        if d in dn.scatter_dims_to_operand_dims:
            operand[d] = (b.new(shape_of(eqn.invars[0])[d]),)
    return b.build(
        [operand, indices, updates], [operand], reduced=scattered, flops=math.prod(shape_of(eqn.invars[2]))
    )


def _slicing(
    b: FactorBuilder,
    eqn: jcore.JaxprEqn,
    result,
    window_dims: Sequence[int],
    dropped: Sequence[int],
    indexed: Sequence[int],
    operand_batching: Sequence[int],
    indices_batching: Sequence[int],
    cut_batch: bool,
) -> tuple[list[DimFactors], list[DimFactors], list[DimFactors], list[int]]:
    """Factors of `operand`, `indices` and the sliced side (`result`: a gather's output, a scatter's
    updates), and the factors of the indices' batch dims that pair with no operand dim (a scatter's
    scatter dims; with `cut_batch` False they are whole and none is returned)."""
    op_shape, idx_shape, res_shape = shape_of(eqn.invars[0]), shape_of(eqn.invars[1]), shape_of(result)
    operand: list[DimFactors] = [() for _ in op_shape]
    indices: list[DimFactors] = [() for _ in idx_shape]
    res: list[DimFactors] = [() for _ in res_shape]
    batch = [d for d in range(len(res_shape)) if d not in window_dims]  # one per indices dim but the last
    for o, i in zip(operand_batching, indices_batching):
        operand[o] = indices[i] = res[batch[i]] = (b.new(op_shape[o]),)
    scattered = []
    if cut_batch:
        for i in range(len(idx_shape) - 1):
            if i not in indices_batching:
                indices[i] = res[batch[i]] = (b.new(idx_shape[i]),)
                scattered.append(indices[i][0])
    sliced = [d for d in range(len(op_shape)) if d not in dropped and d not in operand_batching]
    for o, r in zip(sliced, sorted(window_dims)):
        if o not in indexed and res_shape[r] == op_shape[o]:
            operand[o] = res[r] = (b.new(op_shape[o]),)
    return operand, indices, res, scattered
