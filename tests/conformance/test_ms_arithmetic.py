"""MindSpore's `test_arithmetic.py` and `test_matmul_tensor.py`: a MatMul followed by a binary
elementwise operator, each with its own strategy (the redistribution between them is XLA's), and
the broadcasting forms of the second strategy."""

import jax.numpy as jnp
import pytest
from jax import lax

import jshard as js

from ._ms import Case, check, named, params

SAME = ((16, 8), (8, 16), (16, 16))  # x [64, 32], y [32, 64], b [64, 64] in MindSpore, scaled down
ROW = ((16, 8), (8, 16), (16,))  # b [64]
OUTER = ((16, 8), (8, 1), (1, 16))  # y [32, 1], b [1, 64]


def _matmul_then(op, s1, s2):
    def net(x, y, b):
        out = js.shard(named(jnp.matmul, "matmul"), s1)(x, y)
        return js.shard(named(op, "second"), s2)(out, b)
    return net


BINARY = {
    "sub": jnp.subtract, "add": jnp.add, "mul": jnp.multiply, "div": jnp.divide, "mod": jnp.mod,
    "floormod": jnp.mod, "floordiv": jnp.floor_divide, "atan2": jnp.arctan2,
    "divNoNan": lambda a, b: jnp.where(b == 0, 0.0, a / b), "greater": jnp.greater,
    "mul_no_nan": lambda a, b: jnp.where(b == 0, 0.0, a * b), "truncate_div": lambda a, b: jnp.trunc(a / b),
    "truncate_mod": jnp.fmod, "xdivy": lambda a, b: jnp.where(a == 0, 0.0, a / b),
    "xlogy": lambda a, b: jnp.where(a == 0, 0.0, a * jnp.log(b)), "squared_difference": lambda a, b: (a - b) ** 2,
}

# (MindSpore test, its binary operator, its shapes, MatMul's strategy, the second operator's)
_CASES = [
    ("test_matmul_sub", "sub", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_add", "add", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_mul", "mul", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_mod", "mod", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_floormod", "floormod", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_atan2", "atan2", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_divNoNan", "divNoNan", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_div", "div", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_floordiv", "floordiv", SAME, ((2, 2), (2, 2)), ((4, 2), (4, 2))),
    ("test_matmul_add_broadcast", "add", ROW, ((2, 2), (2, 2)), ((4, 2), (2,))),
    ("test_matmul_add_broadcast2", "add", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_sub_broadcast", "sub", ROW, ((2, 2), (2, 2)), ((4, 2), (2,))),
    ("test_matmul_sub_broadcast2", "sub", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_mul_broadcast", "mul", ROW, ((2, 2), (2, 2)), ((4, 2), (2,))),
    ("test_matmul_mul_broadcast2", "mul", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_div_broadcast", "div", ROW, ((2, 2), (2, 2)), ((4, 2), (2,))),
    ("test_matmul_div_broadcast2", "div", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_greater_broadcast", "greater", ROW, ((2, 2), (2, 2)), ((4, 2), (2,))),
    ("test_matmul_greater_broadcast2", "greater", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_floordiv_broadcast", "floordiv", ROW, ((2, 2), (2, 2)), ((4, 2), (2,))),
    ("test_matmul_floordiv_broadcast2", "floordiv", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_mul_no_nan_broadcast", "mul_no_nan", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_truncate_div_broadcast", "truncate_div", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_truncate_mod_broadcast", "truncate_mod", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_xdivy_broadcast", "xdivy", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_xlogy_broadcast", "xlogy", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
    ("test_matmul_squared_difference_broadcast", "squared_difference", OUTER, ((2, 4), (4, 1)), ((4, 1), (1, 2))),
]
ARITHMETIC = [
    Case(f"test_arithmetic.py::{test}", _matmul_then(BINARY[op], s1, s2), shapes,
         strategies={"matmul": s1, "second": s2})
    for test, op, shapes, s1, s2 in _CASES
]


def _logical(combine):
    """test_matmul_logicaland / or: Equal and NotEqual of the product and b, combined."""
    def net(x, y, b):
        out = js.shard(named(jnp.matmul, "matmul"), ((2, 2), (2, 2)))(x, y)
        eq = js.shard(jnp.equal, ((4, 2), (4, 2)))(out, b)
        ne = js.shard(jnp.not_equal, ((4, 2), (4, 2)))(out, b)
        return js.shard(named(combine, "logical"), ((4, 2), (4, 2)))(eq, ne)
    return net


def _bitwise(op):
    """test_matmul_bitwise_*_broadcast: a broadcast bitwise op of int32 [64, 1] and [1, 64], then MatMul."""
    def net(x, y, z):
        out = js.shard(named(op, "bitwise"), ((2, 1), (1, 4)))(x, y)
        return js.shard(named(jnp.matmul, "matmul"), ((1, 4), (4, 2)))(out, z)
    return net


def _i32(*shape):
    import jax
    return jax.ShapeDtypeStruct(shape, jnp.int32)


ARITHMETIC += [
    Case("test_arithmetic.py::test_matmul_logicaland", _logical(jnp.logical_and), SAME,
         strategies={"logical": ((4, 2), (4, 2))}),
    Case("test_arithmetic.py::test_matmul_logicalor", _logical(jnp.logical_or), SAME,
         strategies={"logical": ((4, 2), (4, 2))}),
    *(Case(f"test_arithmetic.py::test_matmul_bitwise_{name}_broadcast", _bitwise(op), (_i32(16, 1), _i32(1, 16), _i32(16, 8)),
           strategies={"bitwise": ((2, 1), (1, 4)), "matmul": ((1, 4), (4, 2))})
      for name, op in (("and", jnp.bitwise_and), ("or", jnp.bitwise_or), ("xor", jnp.bitwise_xor))),
]


def _three_matmuls(x, y):
    """test_matmul_tensor.py::test_two_matmul: three MatMuls, the last with a constant [128, 128]."""
    v = jnp.ones((16, 16), jnp.float32)
    out = js.shard(named(jnp.matmul, "mm1"), ((2, 2), (2, 2)))(x, y)
    out = js.shard(named(jnp.matmul, "mm2"), ((1, 8), (8, 1)))(out, v)
    return js.shard(named(jnp.matmul, "mm3"), ((2, 4), (4, 1)))(out, v)


def _mul_constant(strategy, value):
    def net(x, y):
        out = js.shard(named(jnp.matmul, "matmul"), ((2, 4), (4, 1)) if value.ndim == 0 else ((2, 2), (2, 2)))(x, y)
        return js.shard(named(jnp.multiply if value.ndim == 0 else jnp.add, "second"), strategy)(out, value)
    return net


MATMUL_TENSOR = [
    Case("test_matmul_tensor.py::test_two_matmul", _three_matmuls, ((16, 8), (8, 16)),
         strategies={"mm1": ((2, 2), (2, 2)), "mm2": ((1, 8), (8, 1)), "mm3": ((2, 4), (4, 1))}),
    Case("test_matmul_tensor.py::test_two_matmul1", _three_matmuls, ((16, 16), (16, 16)),
         strategies={"mm1": ((2, 2), (2, 2)), "mm3": ((2, 4), (4, 1))}),
    # Mul by a 0-d constant: strategy `()` for the scalar.
    Case("test_matmul_tensor.py::test_matmul_mul_broadcast2", _mul_constant(((4, 1), ()), jnp.float32(2.0)),
         ((16, 8), (8, 1)), strategies={"second": ((4, 1), ())}),
    Case("test_matmul_tensor.py::test_matmul_add_tensor", _mul_constant(((4, 2), ()), jnp.float32(1.5)),
         ((16, 8), (8, 16)), strategies={"second": ((4, 2), ())}),
]


@pytest.mark.parametrize("case", params(ARITHMETIC + MATMUL_TENSOR))
def test_compiles_as_mindspore(case):
    check(case)


def test_operand_order_does_not_matter_for_a_contraction():
    """The contraction's operands may come in any argument order (lax.dot_general with swapped args)."""
    check(Case("test_arithmetic.py::test_matmul_sub/lax", lambda x, y, b: js.shard(
        lambda a, c: lax.dot_general(a, c, (((1,), (0,)), ((), ()))), ((2, 2), (2, 2)))(x, y) - b, SAME))


def test_records_inside_a_multi_input_call_are_per_operator():
    """A `shard` call of three inputs (MindSpore's Dense: MatMul then BiasAdd, as `x @ w + b`): the
    product's record has one strategy per operand of the product, as MindSpore's MatMul says, and
    the add's its own; no record carries the call's three entries for two operands."""
    def net(x, w, b):
        return js.shard(named(lambda a, k, c: a @ k + c[None], "dense"), ((2, 1), (1, 4), (4,)))(x, w, b)

    args = (jnp.ones((16, 8)), jnp.ones((8, 16)), jnp.ones((16,)))
    plan = js.parallelize(net, devices=8, mode="semi_auto", dataset_strategy="full_batch").plan(*args)
    records = {op.primitive: op for op in plan.ops if op.annotation == "dense"}
    assert records["dot_general"].in_strategy == ((2, 1), (1, 4))
    assert all(len(op.in_strategy) == len(op.in_shapes) for op in records.values())
