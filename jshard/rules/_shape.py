"""Rules for operators that move dims around: broadcast, reshape, transpose, squeeze, slicing,
concatenation, padding, `iota`.

A dim that keeps its extent keeps its cut. A dim an operator changes in extent (sliced, padded,
concatenated along) must be whole. A reshape keeps a cut through split and merged dims where the
sizes divide (`[b, t*h] -> [b, t, h]` keeps a cut of `t*h` on `t`).
"""

from __future__ import annotations

from jax.extend import core as jcore

from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of, whole


@rule("broadcast_in_dim")
def broadcast_in_dim(eqn: jcore.JaxprEqn) -> Factors:
    shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    b = FactorBuilder()
    out = b.dims(out_shape)
    ins = [out[o] if shape[i] == out_shape[o] else () for i, o in enumerate(eqn.params["broadcast_dimensions"])]
    return b.build([ins] + [whole(v) for v in eqn.invars[1:]], [out])


@rule("transpose")
def transpose(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    ins = b.dims(shape_of(eqn.invars[0]))
    return b.build([ins], [[ins[p] for p in eqn.params["permutation"]]])


@rule("squeeze")
def squeeze(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    ins = b.dims(shape_of(eqn.invars[0]))
    gone = {d % len(ins) for d in eqn.params["dimensions"]}
    return b.build([ins], [[d for i, d in enumerate(ins) if i not in gone]])


@rule("expand_dims")
def expand_dims(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    out_shape = shape_of(eqn.outvars[0])
    new = {d % len(out_shape) for d in eqn.params["dimensions"]}
    ins = b.dims(shape_of(eqn.invars[0]))
    it = iter(ins)
    return b.build([ins], [[() if i in new else next(it) for i in range(len(out_shape))]])


@rule("reshape")
def reshape(eqn: jcore.JaxprEqn) -> Factors:
    """Common factors of the two shapes, group by group; a group that does not divide stays whole."""
    shape, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    b = FactorBuilder()
    ins: list[list[int]] = [[] for _ in shape]
    outs: list[list[int]] = [[] for _ in out_shape]
    for gi, go in _groups(shape, out_shape):
        if not _factor_group(b, shape, out_shape, gi, go, ins, outs):
            for d in gi:
                ins[d] = []
            for d in go:
                outs[d] = []
    rest = [whole(v) for v in eqn.invars[1:]]
    return b.build([[tuple(d) for d in ins]] + rest, [[tuple(d) for d in outs]])


def _groups(shape, out_shape):
    """Runs of input and output dims with equal products (`[2, 3, 4] -> [6, 4]`: `[0, 1]~[0]`, `[2]~[1]`)."""
    i = o = 0
    while i < len(shape) or o < len(out_shape):
        gi, go = [], []
        pi = po = 1
        while not gi or not go or pi != po:
            if (pi <= po or o == len(out_shape)) and i < len(shape):
                gi.append(i)
                pi *= shape[i]
                i += 1
            elif o < len(out_shape):
                go.append(o)
                po *= out_shape[o]
                o += 1
            else:
                break
        yield gi, go


def _factor_group(b, shape, out_shape, gi, go, ins, outs) -> bool:
    """Splits one group into shared factors, major first; False where the sizes do not nest."""
    ii = oo = 0
    ri, ro = shape[gi[0]] if gi else 1, out_shape[go[0]] if go else 1
    while ii < len(gi) and oo < len(go):
        if ri == 1:
            ii += 1
            ri = shape[gi[ii]] if ii < len(gi) else 1
        elif ro == 1:
            oo += 1
            ro = out_shape[go[oo]] if oo < len(go) else 1
        elif ri % ro == 0 or ro % ri == 0:
            f = b.new(min(ri, ro))
            ins[gi[ii]].append(f)
            outs[go[oo]].append(f)
            ri, ro = ri // b.sizes[f], ro // b.sizes[f]
        else:
            return False
    return True


@rule("concatenate")
def concatenate(eqn: jcore.JaxprEqn) -> Factors:
    axis = eqn.params["dimension"]
    b = FactorBuilder()
    out = [() if i == axis else (b.new(d),) for i, d in enumerate(shape_of(eqn.outvars[0]))]
    return b.build([out for _ in eqn.invars], [out])


@rule("pad")
def pad(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    cfg = eqn.params["padding_config"]
    dims = [(b.new(d),) if c == (0, 0, 0) else () for d, c in zip(shape_of(eqn.invars[0]), cfg)]
    return b.build([dims, whole(eqn.invars[1])], [dims])


@rule("slice")
def slice_(eqn: jcore.JaxprEqn) -> Factors:
    shape = shape_of(eqn.invars[0])
    strides = eqn.params["strides"] or (1,) * len(shape)
    b = FactorBuilder()
    dims = [
        (b.new(d),) if s == 0 and e == d and k == 1 else ()
        for d, s, e, k in zip(shape, eqn.params["start_indices"], eqn.params["limit_indices"], strides)
    ]
    return b.build([dims], [dims])


@rule("dynamic_slice")
def dynamic_slice(eqn: jcore.JaxprEqn) -> Factors:
    shape = shape_of(eqn.invars[0])
    b = FactorBuilder()
    dims = [(b.new(d),) if n == d else () for d, n in zip(shape, eqn.params["slice_sizes"])]
    return b.build([dims] + [whole(v) for v in eqn.invars[1:]], [dims])


@rule("dynamic_update_slice")
def dynamic_update_slice(eqn: jcore.JaxprEqn) -> Factors:
    shape, update = shape_of(eqn.invars[0]), shape_of(eqn.invars[1])
    b = FactorBuilder()
    dims = [(b.new(d),) if n == d else () for d, n in zip(shape, update)]
    return b.build([dims, dims] + [whole(v) for v in eqn.invars[2:]], [dims])


@rule("rev")
def rev(eqn: jcore.JaxprEqn) -> Factors:
    flipped = set(eqn.params["dimensions"])
    b = FactorBuilder()
    dims = [() if i in flipped else (b.new(d),) for i, d in enumerate(shape_of(eqn.invars[0]))]
    return b.build([dims], [dims])


@rule("iota", "rng_uniform")
def generated(eqn: jcore.JaxprEqn) -> Factors:
    """Values made from nothing cut (iota, `rng_uniform`): every output dim free, inputs whole."""
    b = FactorBuilder()
    out_shape = shape_of(eqn.outvars[0])
    out = b.dims(out_shape)
    return b.build([whole(v) for v in eqn.invars], [out if shape_of(v) == out_shape else whole(v) for v in eqn.outvars])
