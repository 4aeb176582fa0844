"""MindSpore's "layout extend" tests (`test_layout_extend.py`, `test_layout_extend_arithmetic.py`,
`test_batch_matmul_high_dimension.py`): strategies given as `Layout`s, several aliases on one dim
("multi shard"), "None" inside a dim's aliases, output layouts, and the layouts MindSpore refuses."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js

from ._ms import Case, check, named, params

L3 = js.Layout((2, 2, 2), ("dp", "sp", "mp"))
L4 = js.Layout((2, 2, 2, 2), ("dp", "sp", "vp", "mp"))


def _matmul_relu(ins, outs=None):
    """test_layout_extend.py Net: MatMul(y, w) with layouts, then out + ReLU(out)."""
    def net(y, w):
        out = js.shard(named(jnp.matmul, "matmul"), ins, outs)(y, w)
        return out + jax.nn.relu(out)
    return net


def _e(name, ins, outs=None, strategy=None, devices=8, shapes=((16, 16), (16, 16)), refuses=None):
    return Case(f"test_layout_extend.py::{name}", _matmul_relu(ins, outs), shapes, devices=devices, refuses=refuses,
                strategies={"matmul": strategy} if strategy else {})


LAYOUT_EXTEND = [
    _e("test_layout_extend_base", (L3("dp", "sp"), L3("sp", "mp")), strategy=((2, 2), (2, 2))),
    _e("test_layout_extend_base_reduce_scatter", (L3("dp", "sp"), L3("sp", "mp")), (L3(("dp", "sp"), "mp"),)),
    _e("test_layout_extend_batch_multi_shard", (L4(("dp", "mp"), "sp"), L4("sp", "vp")), devices=16,
       strategy=((4, 2), (2, 2))),
    _e("test_layout_extend_batch_multi_shard_reduce_scatter", (L4(("dp", "mp"), "sp"), L4("sp", "vp")),
       (L4(("dp", "mp", "sp"), "vp"),), devices=16),
    _e("test_layout_extend_reduce_axis_multi_shard", (L4("dp", ("sp", "mp")), L4(("sp", "mp"), "vp")), devices=16,
       strategy=((2, 4), (4, 2))),
    _e("test_layout_extend_reduce_axis_multi_shard_reduce_scatter", (L4("dp", ("sp", "mp")), L4(("sp", "mp"), "vp")),
       (L4(("dp", "sp", "mp"), "vp"),), devices=16),
    _e("test_layout_extend_reduce_axis_multi_shard_reduce_scatter_opt_shard_not_full",
       (js.Layout((4, 2, 2, 2), ("dp", "sp", "vp", "mp"))("dp", ("sp", "mp")),
        js.Layout((4, 2, 2, 2), ("dp", "sp", "vp", "mp"))(("sp", "mp"), "vp")),
       (js.Layout((4, 2, 2, 2), ("dp", "sp", "vp", "mp"))(("dp", "sp", "mp"), "vp"),), devices=32,
       shapes=((32, 16), (16, 16))),
    _e("test_layout_extend_reduce_axis_multi_shard_reduce_scatter_including_dev1",
       (js.Layout((2, 2, 2, 1), ("dp", "sp", "vp", "mp"))("dp", ("sp", "mp")),
        js.Layout((2, 2, 2, 1), ("dp", "sp", "vp", "mp"))(("sp", "mp"), "vp")),
       (js.Layout((2, 2, 2, 1), ("dp", "sp", "vp", "mp"))(("dp", "sp", "mp"), "vp"),)),
    _e("test_layout_extend_reduce_axis_multi_shard_reduce_scatter_including_axis_none",
       (L3("dp", ("sp", "mp")), L3(("sp", "mp"), "None")), (L3(("dp", "sp", "mp"), "None"),),
       strategy=((2, 4), (4, 1))),
    _e("test_layout_extend_only_reshape_redis",
       (js.Layout((4, 1, 2), ("dp", "sp", "mp"))(("dp", "mp"), "sp"), js.Layout((4, 1, 2), ("dp", "sp", "mp"))("sp", "None"))),
    # The product's result would need dp on both its dims (rows from y, columns from w).
    _e("test_layout_extend_error_case1", (L3("dp", ("sp", "mp")), L3(("sp", "mp"), "dp")),
       refuses="dp"),
]


def test_layout_extend_error_case2():
    """test_layout_extend.py::test_layout_extend_error_case2: one alias on two dims of a tensor."""
    with pytest.raises(ValueError, match="mp"):
        L3(("sp", "mp"), "mp")


def _moe(x, w):
    """test_layout_extend.py::test_layout_extend_moe: a BatchMatMul of experts with layouts."""
    lay = js.Layout((2, 2, 4), ("vp", "dp", "mp"))
    x = js.shard(jax.nn.relu, (lay("None", ("dp", "vp"), "None"),))(x)
    return js.shard(named(jnp.matmul, "bmm"), (lay(("dp", "vp"), "None", "None"), lay(("dp", "vp"), "None", "mp")))(x, w)


LAYOUT_EXTEND.append(Case("test_layout_extend.py::test_layout_extend_moe", _moe, ((4, 8, 8), (4, 8, 16)), devices=16,
                          strategies={"bmm": ((4, 1, 1), (4, 1, 4))}))

OPS = {"add": jnp.add, "sub": jnp.subtract, "mul": jnp.multiply, "div": jnp.divide, "real_div": jnp.true_divide}


def _arith(op, ins):
    """test_layout_extend_arithmetic.py Net: an arithmetic op of y and a weight with layouts, then ReLU."""
    def net(y, w):
        return jax.nn.relu(js.shard(named(OPS[op], "op"), ins)(y, w))
    return net


def _a(test, op, ins, w_shape, strategy=None, refuses=None):
    return Case(f"test_layout_extend_arithmetic.py::{test}/{op}", _arith(op, ins), ((16, 16), w_shape),
                refuses=refuses, strategies={"op": strategy} if strategy else {})


ARITHMETIC = [
    case for op in OPS for case in (
        _a("test_layout_extend_add_same_shape_same_shard", op, (L3(("dp", "sp"), "mp"), L3(("dp", "sp"), "mp")),
           (16, 16), strategy=((4, 2), (4, 2))),
        _a("test_layout_extend_add_same_shape_wrong_shard", op, (L3(("dp", "sp"), "mp"), L3(("dp", "mp"), "sp")),
           (16, 16), refuses="differently"),
        _a("test_layout_extend_add_same_dim_broadcast", op, (L3(("dp", "sp"), "mp"), L3("None", "mp")), (1, 16),
           strategy=((4, 2), (1, 2))),
        _a("test_layout_extend_add_different_dim_broadcast", op, (L3(("dp", "sp"), "mp"), L3("mp")), (16,),
           strategy=((4, 2), (2,))),
        _a("test_layout_extend_add_different_dim_broadcast_failed", op, (L3(("dp", "sp"), "mp"), L3("None")), (16,),
           refuses="differently"),
    )
]


def _nd_tp(ins1, ins2, transpose_b):
    """test_batch_matmul_high_dimension.py: two (Batch)MatMuls (transpose_b: the weights are
    [.., out, in]) with 2-D / 3-D tensor-parallel layouts (MindSpore's `enable_nd_tp`)."""
    product = (lambda a, w: a @ jnp.swapaxes(w, -1, -2)) if transpose_b else jnp.matmul

    def net(x, w1, w2):
        out = js.shard(named(product, "mm1"), ins1)(x, w1)
        return js.shard(named(product, "mm2"), ins2)(out, w2)
    return net


def _h(test, lay, ins1, ins2, devices, batch=True, transpose_b=False):
    shapes = ((16, 8), (8, 16), (16, 16)) if not transpose_b else ((16, 8), (16, 8), (16, 16))
    if batch:
        shapes = tuple((4, *s) for s in shapes)
    net = _nd_tp(tuple(lay(*a) for a in ins1), tuple(lay(*a) for a in ins2), transpose_b)
    return Case(f"test_batch_matmul_high_dimension.py::{test}", net, shapes, devices=devices)


B3 = js.Layout((1, 2, 4), ("b", "x", "y"))
HIGH_DIMENSION = [
    _h("test_batch_matmul_2D_TP", B3, (("b", "None", ("x", "y")), ("b", "x", "y")),
       (("b", "None", ("y", "x")), ("b", "y", "x")), 8),
    _h("test_batch_matmul_2D_TP_reduce_1D", js.Layout((1, 1, 8), ("b", "x", "y")),
       (("b", "None", ("x", "y")), ("b", "x", "y")), (("b", "None", ("y", "x")), ("b", "y", "x")), 8),
    _h("test_batch_matmul_3D_TP", js.Layout((2, 2, 4), ("z", "x", "y")),
       (("None", ("z", "x"), "y"), ("None", ("y", "z"), "x")), (("None", ("z", "y"), "x"), ("None", ("x", "z"), "y")), 16),
    _h("test_matmul_2D_TP", js.Layout((2, 4), ("x", "y")), (("None", ("x", "y")), ("x", "y")),
       (("None", ("y", "x")), ("y", "x")), 8, batch=False),
    _h("test_matmul_3D_TP", js.Layout((2, 2, 4), ("x", "y", "z")), ((("z", "x"), "y"), (("y", "z"), "x")),
       ((("z", "y"), "x"), (("x", "z"), "y")), 16, batch=False),
    _h("test_matmul_3D_TP_transpose_b_plit_cp", js.Layout((2, 2, 2, 2), ("cp", "z", "x", "y")),
       ((("cp", "z", "x"), "y"), ("x", ("y", "z"))), ((("cp", "z", "y"), "x"), ("y", ("x", "z"))), 16, batch=False,
       transpose_b=True),
    _h("test_batch_matmul_2D_TP_transpose_b", B3, (("b", "None", ("x", "y")), ("b", "y", "x")),
       (("b", "None", ("y", "x")), ("b", "x", "y")), 8, transpose_b=True),
    _h("test_matmul_2D_TP_transpose_b", js.Layout((2, 4), ("x", "y")), (("None", ("x", "y")), ("y", "x")),
       (("None", ("y", "x")), ("x", "y")), 8, batch=False, transpose_b=True),
]


@pytest.mark.parametrize("case", params(LAYOUT_EXTEND + ARITHMETIC + HIGH_DIMENSION))
def test_compiles_as_mindspore(case):
    check(case)
