"""Rules for loops and branches: a value keeps one layout across the boundary of its body.

A nested operator's operands are its outer operands plus its bodies' results (inputs), and its
outer results plus its bodies' parameters (outputs), so the engine lays out a loop body like any
other neighbour: a choice made inside a `scan` body holds for every iteration. A `scan`'s stacked
dim (layers, time) stays whole: each iteration reads one slice of it.
"""

from __future__ import annotations

from jax.extend import core as jcore

from jshard.graph import nested_jaxprs
from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of


def body_vars(eqn: jcore.JaxprEqn) -> list[tuple[list, list]]:
    """`(invars, outvars)` of each body of a nested equation, in `nested_jaxprs` order."""
    return [(list(j.invars), list(j.outvars)) for j in nested_jaxprs(eqn)]


@rule("scan")
def scan(eqn: jcore.JaxprEqn) -> Factors:
    p = eqn.params
    nc, nk = p["num_consts"], p["num_carry"]
    (b_in, b_out), = body_vars(eqn)
    b = FactorBuilder()
    consts = [b.dims(shape_of(v)) for v in eqn.invars[:nc]]
    carry = [b.dims(shape_of(v)) for v in eqn.invars[nc : nc + nk]]
    xs = [b.dims(shape_of(v)[1:]) for v in eqn.invars[nc + nk :]]
    ys = [b.dims(shape_of(v)) for v in b_out[nk:]]
    outer_in = consts + carry + [((),) + x for x in xs]
    outer_out = carry + [((),) + y for y in ys]
    return b.build(outer_in + carry + ys, outer_out + consts + carry + xs)


@rule("while")
def while_(eqn: jcore.JaxprEqn) -> Factors:
    p = eqn.params
    nc, nb = p["cond_nconsts"], p["body_nconsts"]
    b = FactorBuilder()
    cond_consts = [b.dims(shape_of(v)) for v in eqn.invars[:nc]]
    body_consts = [b.dims(shape_of(v)) for v in eqn.invars[nc : nc + nb]]
    carry = [b.dims(shape_of(v)) for v in eqn.invars[nc + nb :]]
    return b.build(
        cond_consts + body_consts + carry + [()] + carry,
        carry + cond_consts + carry + body_consts + carry,
    )


@rule("cond")
def cond(eqn: jcore.JaxprEqn) -> Factors:
    b = FactorBuilder()
    ops = [b.dims(shape_of(v)) for v in eqn.invars[1:]]
    outs = [b.dims(shape_of(v)) for v in eqn.outvars]
    branches = len(eqn.params["branches"])
    return b.build([()] + ops + outs * branches, outs + ops * branches)
