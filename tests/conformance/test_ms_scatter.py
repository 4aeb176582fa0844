"""MindSpore's scatter tests (`test_scatter_ops.py`): ScatterAdd / Min / Max / Mul / Div of updates
into a parameter at indices, with strategies `(operand, indices, updates)`, then Add with x and ReLU."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js

from ._ms import Case, check, named, params

OPS = {
    "add": lambda t, i, u: t.at[i].add(u), "min": lambda t, i, u: t.at[i].min(u),
    "max": lambda t, i, u: t.at[i].max(u), "mul": lambda t, i, u: t.at[i].multiply(u),
    "div": lambda t, i, u: t.at[i].multiply(1.0 / u),  # ScatterDiv: each row divided by its updates
}


def _scatter(op, s1, s2):
    def net(x, table, indices, updates):
        out = js.shard(named(OPS[op], "scatter"), s1)(table, indices, updates)
        return jax.nn.relu(js.shard(jnp.add, s2)(x, out))
    return net


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


T3 = ((8, 8, 8), (8, 8, 8), _i32(2, 2), (2, 2, 8, 8))  # [32, 64, 128], indices [4, 8], updates [4, 8, 64, 128]
T2 = ((16, 16), (16, 16), _i32(4), (4, 16))  # [128, 64], indices [4], updates [4, 64]
T2b = ((16, 16), (16, 16), _i32(2, 2), (2, 2, 16))  # indices [4, 4], updates [4, 4, 64]
SCATTER = [
    Case("test_scatter_ops.py::test_scatter_add_column_split",
         _scatter("add", ((1, 2, 4), (1, 1), (1, 1, 2, 4)), ((1, 2, 4), (1, 2, 4))), T3,
         strategies={"scatter": ((1, 2, 4), (1, 1), (1, 1, 2, 4))}),
    Case("test_scatter_ops.py::test_scatter_min_column_split",
         _scatter("min", ((1, 2, 4), (1, 1), (1, 1, 2, 4)), ((1, 2, 4), (1, 2, 4))), T3),
    Case("test_scatter_ops.py::test_scatter_max_column_split",
         _scatter("max", ((1, 2, 4), (1, 1), (1, 1, 2, 4)), ((1, 2, 4), (1, 2, 4))), T3),
    Case("test_scatter_ops.py::test_scatter_add_row_split",
         _scatter("add", ((8, 1, 1), (1, 1), (1, 1, 1, 1)), ((1, 1, 1), (1, 1, 1))), T3,
         strategies={"scatter": ((8, 1, 1), (1, 1), (1, 1, 1, 1))}),
    Case("test_scatter_ops.py::test_scatter_add_mix_split",
         _scatter("add", ((3, 2, 4), (1, 1), (1, 1, 2, 4)), ((1, 1, 1), (1, 1, 1))),
         ((24, 8, 8), (24, 8, 8), _i32(2, 2), (2, 2, 8, 8)), devices=24),
    Case("test_scatter_ops.py::test_scatter_mul_mix_split",
         _scatter("mul", ((8, 8), (1,), (1, 8)), ((1, 1), (1, 1))), T2, devices=64),
    Case("test_scatter_ops.py::test_scatter_div_mix_split",
         _scatter("div", ((8, 8), (1, 1), (1, 1, 8)), ((1, 1), (1, 1))), T2b, devices=64),
    # The updates cut otherwise than the operand's trailing dims: MindSpore's ScatterOps refuse it.
    Case("test_scatter_ops.py::test_scatter_add_column_split/updates_cut_otherwise",
         _scatter("add", ((1, 2, 4), (1, 1), (1, 1, 4, 2)), ((1, 2, 4), (1, 2, 4))), T3,
         refuses="take the indices whole and the updates cut as the operand's dims after the first"),
]


@pytest.mark.parametrize("case", params(SCATTER))
def test_scatter_as_mindspore(case):
    check(case)
