"""Rules for PRNG keys: typed key arrays (`jax.random.key`) and the raw `uint32` words under them.

A typed key array `key<fry>[8]` is eight keys: its dims are tensor dims, cut like any other. The
key data under each key (`u32[2]` for threefry) is not: `random_wrap` and `random_unwrap`, which
turn `u32[8, 2]` into `key<fry>[8]` and back, keep that trailing dim whole. Bits and keys made from
keys (`random_bits`, `random_split`) lead with the keys' dims, then add their own, free to cut.
A cut never changes the values drawn (XLA's partitioner keeps the program's meaning); with JAX's
partitionable threefry (the default) each device also computes only its own slice.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._elementwise import elementwise
from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of

KEY_ELEMENTWISE = ("random_seed", "random_fold_in", "random_clone", "random_gamma")
"""One key per element, in and out: seeds to keys, keys folded with data, gamma draws per key."""


@rule(*KEY_ELEMENTWISE)
def key_elementwise(eqn: jcore.JaxprEqn) -> Factors:
    return elementwise(eqn)


@rule("random_wrap", "random_unwrap")
def wrap(eqn: jcore.JaxprEqn) -> Factors:
    """Keys and their key data share the keys' dims; the key data's trailing dims are whole."""
    (x,), (y,) = eqn.invars, eqn.outvars
    b = FactorBuilder()
    keys = b.dims(shape_of(x)[: min(len(shape_of(x)), len(shape_of(y)))])
    pad = lambda v: tuple(keys) + ((),) * (len(shape_of(v)) - len(keys))
    return b.build([pad(x)], [pad(y)])


@rule("random_bits", "random_split")
def drawn(eqn: jcore.JaxprEqn) -> Factors:
    """`key[k...] -> out[k..., s...]`: the keys' dims lead the output's; the drawn dims `s` are free."""
    keys, out_shape = shape_of(eqn.invars[0]), shape_of(eqn.outvars[0])
    b = FactorBuilder()
    out = b.dims(out_shape)
    return b.build([out[: len(keys)]], [out], flops=math.prod(out_shape))
