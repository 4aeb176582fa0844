"""Rules for windowed operators: pooling (`reduce_window*`) and its gradients.

A dim the window does not slide along (window 1, stride 1, no padding, no dilation) keeps its
extent and its cut, and is shared by every operand; a dim the window slides along reads its
neighbours and stays whole. Max-pooling's gradient (`select_and_scatter_add`) and its
forward-mode twin (`select_and_gather_add`) take the same window parameters, so one rule serves
all of them. Scalar operands (the init values of a generic `reduce_window`) are whole.
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of, whole

WINDOWED = (
    "reduce_window", "reduce_window_sum", "reduce_window_max", "reduce_window_min",
    "select_and_scatter", "select_and_scatter_add", "select_and_gather_add",
)


@rule(*WINDOWED)
def windowed(eqn: jcore.JaxprEqn) -> Factors:
    p = eqn.params
    window = p["window_dimensions"]
    rank = len(window)
    base = p.get("base_dilation", (1,) * rank)
    dilation = p.get("window_dilation", (1,) * rank)
    b = FactorBuilder()
    dims = [
        (b.new(n),) if (w, s, pad, bd, wd) == (1, 1, (0, 0), 1, 1) else ()
        for n, w, s, pad, bd, wd in zip(
            shape_of(eqn.invars[0]), window, p["window_strides"], map(tuple, p["padding"]), base, dilation
        )
    ]
    of = lambda v: dims if len(shape_of(v)) == rank else whole(v)
    smaller = min(math.prod(shape_of(v)) for v in [*eqn.invars, *eqn.outvars] if len(shape_of(v)) == rank)
    return b.build([of(v) for v in eqn.invars], [of(v) for v in eqn.outvars], flops=smaller * math.prod(window))
