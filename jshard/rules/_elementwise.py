"""Rules for elementwise operators: every operand of the output's shape shares its factors.

Scalars (rank-0 literals and operands) stand apart; everything else in a jaxpr's elementwise
operator already has the output's shape (broadcasting is explicit, as `broadcast_in_dim`).
"""

from __future__ import annotations

import math

from jax.extend import core as jcore

from jshard.rules._factors import FactorBuilder, Factors, rule, shape_of, whole

ELEMENTWISE = (
    "abs", "acos", "acosh", "add", "add_any", "and", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "clamp",
    "convert_element_type", "copy", "copy_p", "cos", "cosh", "digamma", "div", "eq", "erf", "erf_inv", "erfc",
    "exp", "exp2", "expm1", "floor", "ge", "gt", "imag", "integer_pow", "is_finite", "le", "lgamma", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "nextafter", "not", "or", "polygamma", "pow",
    "real", "reduce_precision", "rem", "round", "rsqrt", "select_n", "shift_left", "shift_right_arithmetic",
    "shift_right_logical", "sign", "sin", "sinh", "sqrt", "square", "stop_gradient", "sub", "tan", "tanh",
    "xor", "population_count", "clz", "optimization_barrier", "complex", "conj", "bessel_i0e", "bessel_i1e",
    "igamma", "igammac", "igamma_grad_a", "eq_to", "le_to", "lt_to", "random_gamma_grad", "zeta", "regularized_incomplete_beta",
    "threefry2x32",  # elementwise over its counters; the key words are scalars (keys: `_random.py`)
)


@rule(*ELEMENTWISE)
def elementwise(eqn: jcore.JaxprEqn) -> Factors:
    """One factor per output dim, shared by every input of the same shape."""
    out_shape = shape_of(eqn.outvars[0])
    b = FactorBuilder()
    dims = b.dims(out_shape)
    ins = [_like(v, out_shape, dims) for v in eqn.invars]
    outs = [_like(v, out_shape, dims) for v in eqn.outvars]
    return b.build(ins, outs, flops=math.prod(out_shape) * len(eqn.outvars))


def _like(v, out_shape, dims):
    """The output's factors on each dim of `v` of the same extent; a size-1 (broadcast) dim whole."""
    shape = shape_of(v)
    if len(shape) != len(out_shape):
        return whole(v)
    return tuple(d if n == m else () for n, m, d in zip(shape, out_shape, dims))
