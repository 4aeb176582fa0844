"""Rules for the operators no other family covers: sorting, splitting and stacking, tiling, bit
casts, `rng_bit_generator`, and `device_put` (a copy between memories).

Each keeps the dims it leaves alone and their cut; the dim it works along (sorted, split,
stacked, tiled, bit-cast) is whole.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import (
    DimFactors,
    FactorBuilder,
    Factors,
    rule,
    shape_of,
    whole,
)


def _all_but(b: FactorBuilder, shape, axis: int) -> list[DimFactors]:
    """A fresh factor for every dim of `shape` but `axis`, which is whole."""
    return [() if i == axis % len(shape) else (b.new(n),) for i, n in enumerate(shape)]


@rule("sort")
def sort(eqn: jcore.JaxprEqn) -> Factors:
    """Every operand (keys and the values sorted with them) shares every dim but the sorted one."""
    shape = shape_of(eqn.invars[0])
    b = FactorBuilder()
    dims = _all_but(b, shape, eqn.params["dimension"])
    n = math.prod(shape)
    return b.build([dims for _ in eqn.invars], [dims for _ in eqn.outvars], flops=n * math.log2(max(n, 2)))


PER_DEVICE = frozenset({"top_k"})
"""Primitives XLA's SPMD partitioner gathers whole whatever their cut (it partitions the `TopK` custom
call only along its sorted dim), so emission runs them on each device's slices in a `shard_map`
over the axes their rule lets cut them (`Emission.per_device`): no collective, as priced."""


@rule("top_k")
def top_k(eqn: jcore.JaxprEqn) -> Factors:
    shape = shape_of(eqn.invars[0])
    b = FactorBuilder()
    dims = _all_but(b, shape, eqn.params.get("axis", -1))
    return b.build([dims], [dims for _ in eqn.outvars], flops=math.prod(shape))


@rule("approx_top_k")
def approx_top_k(eqn: jcore.JaxprEqn) -> Factors:
    """Operand and its values and indices share every dim but the one reduced."""
    shape = shape_of(eqn.invars[0])
    b = FactorBuilder()
    dims = _all_but(b, shape, eqn.params["reduction_dimension"])
    return b.build([dims for _ in eqn.invars], [dims for _ in eqn.outvars], flops=math.prod(shape))


@rule("split")
def split(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    dims = _all_but(b, shape_of(eqn.invars[0]), eqn.params["axis"])
    return b.build([dims], [dims for _ in eqn.outvars])


@rule("stack")
def stack(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    dims = b.dims(shape_of(eqn.invars[0]))
    out = list(dims)
    out.insert(eqn.params["axis"] % (len(dims) + 1), ())
    return b.build([dims for _ in eqn.invars], [out])


@rule("unstack")
def unstack(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    dims = _all_but(b, shape_of(eqn.invars[0]), eqn.params["axis"])
    out = [d for i, d in enumerate(dims) if i != eqn.params["axis"] % len(dims)]
    return b.build([dims], [out for _ in eqn.outvars])


@rule("tile")
def tile(eqn: jcore.JaxprEqn) -> Factors:
    """A dim repeated more than once is whole (its copies would interleave the cut)."""
    b = FactorBuilder()
    dims = [(b.new(n),) if r == 1 else () for n, r in zip(shape_of(eqn.invars[0]), eqn.params["reps"])]
    return b.build([dims], [dims])


@rule("bitcast_convert_type")
def bitcast_convert_type(eqn: jcore.JaxprEqn) -> Factors:
    """Elementwise, but for the trailing dim a bit cast between widths adds or removes (whole)."""
    shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    b = FactorBuilder()
    dims = b.dims(shape[: min(len(shape), len(out_shape))])
    if len(shape) == len(out_shape):
        return b.build([dims], [dims], flops=math.prod(shape))
    pad = lambda n: list(dims) + [()] * (n - len(dims))
    return b.build([pad(len(shape))], [pad(len(out_shape))], flops=math.prod(shape))


@rule("rng_bit_generator")
def rng_bit_generator(eqn: jcore.JaxprEqn) -> Factors:
    """Bits made from a whole key: every dim of the bits free, the key and its successor whole."""
    b = FactorBuilder()
    key, bits = eqn.outvars
    return b.build([whole(eqn.invars[0])], [whole(key), b.dims(shape_of(bits))])


@rule("device_put")
def device_put(eqn: jcore.JaxprEqn) -> Factors:
    """A copy between memories (`jshard.on_host`'s moves, activation offload): each result is laid
    out as its operand."""
    b = FactorBuilder()
    dims = [b.dims(shape_of(v)) for v in eqn.invars]
    return b.build(dims, dims)
