"""MindSpore's reductions (`test_reduce_method_info.py`), transposes (`test_transpose.py`), concat
(`test_concat.py`), tile (`test_tile.py`) and expand-dims (`test_expand_dims.py`) tests: each
operator's strategy on its input, between Mul operators with their own."""

import jax.numpy as jnp
import pytest

import jshard as js

from ._ms import Case, check, named, params


def _mul_reduce_mul(reduce, s1, s2, s3):
    """Mul, a reduction (its own strategy), then Mul by b (if `s3`)."""
    def net(x, y, *b):
        out = js.shard(named(jnp.multiply, "mul1"), s1)(x, y)
        out = js.shard(named(reduce, "reduce"), s2)(out)
        return js.shard(named(jnp.multiply, "mul2"), s3)(out, b[0]) if s3 else out
    return net


def _r(name, fn, shapes, s1, s2, s3=None, devices=8):
    return Case(f"test_reduce_method_info.py::{name}", _mul_reduce_mul(fn, s1, s2, s3), shapes, devices=devices,
                strategies={"reduce": s2, **({"mul2": s3} if s3 else {})})


X3 = (8, 8, 16)  # [128, 32, 64] scaled
REDUCE = [
    _r("test_sum_mul", lambda a: a.sum(1), (X3, X3, (8, 16)), ((1, 1, 8), (1, 1, 8)), ((4, 1, 2),), ((2, 4), (2, 4))),
    _r("test_sum_mul2", lambda a: a.sum((0, 1)), ((4, 8, 8, 8),) * 2 + ((8, 8),), ((1, 1, 4, 2), (1, 1, 4, 2)),
       ((2, 4, 1, 1),), ((2, 4), (2, 4))),
    _r("test_sum_mul3", lambda a: a.sum(-1), (X3, X3, (8, 8)), ((1, 4, 2), (1, 4, 2)), ((4, 2, 1),), ((2, 4), (2, 4))),
    _r("test_sum_mul4", lambda a: a.sum(-1, keepdims=True), (X3, X3, (8, 8, 1)), ((1, 4, 2), (1, 4, 2)), ((2, 2, 2),),
       ((4, 2, 1), (4, 2, 1))),
    _r("test_sum_mul5", lambda a: a.sum(0, keepdims=True), (X3, X3), ((1, 8, 8), (1, 8, 8)), ((2, 4, 1),), devices=64),
    _r("test_sum_mul6", lambda a: a.sum(1, keepdims=True), (X3, X3), ((1, 8, 8), (1, 8, 8)), ((2, 1, 4),), devices=64),
    _r("test_sum_mul7", lambda a: a.sum((0, 1), keepdims=True), (X3, X3), ((1, 8, 8), (1, 8, 8)), ((2, 4, 1),), devices=64),
    _r("test_max_mul", lambda a: a.max(-1), (X3, X3, (8, 8)), ((1, 4, 2), (1, 4, 2)), ((4, 1, 2),), ((2, 4), (2, 4))),
    _r("test_min_mul", lambda a: a.min(0), (X3, X3, (8, 16)), ((1, 4, 2), (1, 4, 2)), ((4, 1, 2),), ((2, 4), (2, 4))),
    _r("test_reduce_mean_mul_float32", lambda a: a.mean(0), (X3, X3, (8, 16)), ((1, 4, 2), (1, 4, 2)), ((4, 1, 2),),
       ((2, 4), (2, 4))),
    _r("test_arg_max_with_value_mul_semi", lambda a: a.max(-1), (X3, X3, (8, 8)), ((1, 4, 2), (1, 4, 2)), ((4, 1, 1),),
       ((2, 4), (2, 4))),
    _r("test_arg_min_with_value_mul_semi_axis_parallel", lambda a: a.min(-1), (X3, X3, (8, 8)), ((1, 4, 2), (1, 4, 2)),
       ((4, 1, 2),), ((2, 4), (2, 4))),
    _r("test_arg_min_with_value_mul_semi", lambda a: a.min(-1), (X3, X3, (8, 8)), ((1, 4, 2), (1, 4, 2)), ((4, 1, 1),),
       ((2, 4), (2, 4))),
    _r("test_arg_max_mul_semi", lambda a: jnp.argmax(a, -1), (X3, X3), ((1, 4, 2), (1, 4, 2)), ((4, 2, 1),)),
    _r("test_arg_min_mul_semi", lambda a: jnp.argmin(a, -1), (X3, X3), ((1, 4, 2), (1, 4, 2)), ((4, 2, 1),)),
    _r("test_any_mul", lambda a: jnp.any(a > 1.0, 1), (X3, X3), ((1, 8, 1), (1, 8, 1)), ((1, 8, 1),), devices=64),
    _r("test_any_mul2", lambda a: jnp.any(a > 1.0, 1), (X3, X3), ((8, 1, 1), (8, 1, 1)), ((8, 1, 1),), devices=64),
    _r("test_all_mul", lambda a: jnp.all(a > 1.0, 1), (X3, X3), ((1, 8, 1), (1, 8, 1)), ((1, 8, 1),)),
    _r("test_all_mul2", lambda a: jnp.all(a > 1.0, 1), (X3, X3), ((8, 1, 1), (8, 1, 1)), ((8, 1, 1),)),
    _r("test_prod_mul", lambda a: jnp.prod(a, 0), (X3, X3), ((1, 1, 8), (1, 1, 8)), ((2, 2, 2),)),
]


def _cross_batch(first, second):
    """test_cross_batch(2): Mul, a reduction over the last dim, then one over the rest."""
    def net(x, y):
        out = js.shard(named(jnp.multiply, "mul1"), ((4, 2), (4, 2)))(x, y)
        out = js.shard(named(first, "reduce1"), ((2, 1),))(out)
        return js.shard(named(second, "reduce2"), ((8,),))(out)
    return net


def _max_empty_tuple(x, y, b):
    """test_max_empty_tuple: a ReduceMax over every dim, then Add with strategy `((), (1, 1))`."""
    out = js.shard(jnp.multiply, ((1, 4, 2), (1, 4, 2)))(x, y)
    out = js.shard(jnp.max, ((4, 1, 2),))(out)
    return js.shard(named(jnp.add, "add"), ((), (1, 1)))(out, b)


REDUCE += [
    Case("test_reduce_method_info.py::test_cross_batch", _cross_batch(lambda a: a.sum(-1), lambda a: a.mean(0)),
         ((16, 16), (16, 16)), strategies={"reduce1": ((2, 1),), "reduce2": ((8,),)}),
    Case("test_reduce_method_info.py::test_cross_batch2", _cross_batch(lambda a: a.mean(-1), lambda a: a.sum(0)),
         ((16, 16), (16, 16)), strategies={"reduce1": ((2, 1),), "reduce2": ((8,),)}),
    Case("test_reduce_method_info.py::test_max_empty_tuple", _max_empty_tuple, (X3, X3, (8, 8)),
         strategies={"add": ((), (1, 1))}),
]


def _transposes(s1, s2):
    """test_transpose.py: MatMul ((8, 1), (1, 1)), then two Transposes (1, 0) with their strategies."""
    def net(x, w):
        out = js.shard(jnp.matmul, ((8, 1), (1, 1)))(x, w)
        out = js.shard(named(jnp.transpose, "t1"), (s1,))(out)
        return js.shard(named(jnp.transpose, "t2"), (s2,))(out)
    return net


TRANSPOSE = [
    Case("test_transpose.py::test_transpose1", _transposes((1, 8), (1, 8)), ((16, 8), (8, 16)),
         strategies={"t1": ((1, 8),), "t2": ((1, 8),)}),
    Case("test_transpose.py::test_transpose2", _transposes((1, 4), (1, 8)), ((16, 8), (8, 16)),
         strategies={"t1": ((1, 4),), "t2": ((1, 8),)}),
]


def _concat_params(s1, s2):
    """test_concat.py Net: Concat(axis=0) of two weights, then Mul by x."""
    def net(x, w1, w2):
        out = js.shard(named(lambda a, b: jnp.concatenate([a, b], 0), "concat"), s1)(w1, w2)
        return js.shard(named(jnp.multiply, "mul"), s2)(out, x)
    return net


def _concat_output(s1, s2, axis=0):
    """test_concat.py Net2: Mul, then Concat(axis) of the product and a weight."""
    def net(x, w):
        out = js.shard(named(jnp.multiply, "mul"), s1)(x, x)
        return js.shard(named(lambda a, b: jnp.concatenate([a, b], axis), "concat"), s2)(out, w)
    return net


C_X, C_W1, C_W2 = (16, 8, 8), (12, 8, 8), (4, 8, 8)  # [128, 64, 32], [96, 64, 32], [32, 64, 32]
CONCAT = [
    Case("test_concat.py::test_concat_parameter", _concat_params(((1, 4, 2), (1, 4, 2)), ((1, 4, 2), (1, 4, 2))),
         (C_X, C_W1, C_W2), strategies={"concat": ((1, 4, 2), (1, 4, 2))}),
    Case("test_concat.py::test_concat_parameter_no_full_split",
         _concat_params(((1, 2, 2), (1, 2, 2)), ((1, 4, 2), (1, 4, 2))), (C_X, C_W1, C_W2),
         strategies={"concat": ((1, 2, 2), (1, 2, 2))}),
    Case("test_concat.py::test_concat_tensor_and_parameter",
         _concat_params(((1, 2, 2), (1, 2, 2)), ((1, 4, 2), (1, 4, 2))), (C_X, C_W1, C_W2),
         strategies={"concat": ((1, 2, 2), (1, 2, 2))}),
    Case("test_concat.py::test_concat_output", _concat_output(((2, 2, 2), (2, 2, 2)), ((1, 4, 2), (1, 4, 2))),
         (C_X, C_X), strategies={"concat": ((1, 4, 2), (1, 4, 2))}),
    Case("test_concat.py::test_concat_output_no_full_split",
         _concat_output(((2, 2, 2), (2, 2, 2)), ((1, 2, 2), (1, 2, 2))), (C_X, C_X),
         strategies={"concat": ((1, 2, 2), (1, 2, 2))}),
    Case("test_concat.py::test_concat_no_strategy",
         lambda x, w: jnp.concatenate([js.shard(jnp.multiply, ((2, 2, 2), (2, 2, 2)))(x, x), w], 0), (C_X, C_X)),
]


def _tile(s1, s2, reps=(4, 2, 2)):
    """test_tile.py Net: Tile of a weight, Mul by x, Mul by a second weight. MindSpore's Tile
    strategy cuts a tiled dim's multiple (each device tiles the whole dim fewer times: the output
    is cut) and an untiled dim's input."""
    ins = tuple(1 if r > 1 else c for c, r in zip(s2, reps))

    def net(x, w, w2):
        out = js.shard(named(lambda a: jnp.tile(a, reps), "tile"), (ins,), (s2,))(w)
        out = js.shard(named(jnp.multiply, "mul"), s1)(x, out)
        return out * w2
    return net


T_X, T_W = (16, 8, 8), (4, 4, 4)  # Tile (8, 4, 2) of [16, 16, 16] to [128, 64, 32], scaled
TILE = [
    Case("test_tile.py::test_tile_parameter", _tile(((2, 2, 2), (2, 2, 2)), (2, 2, 2)), (T_X, T_W, T_X),
         strategies={"tile": ((1, 1, 1),)}),
    Case("test_tile.py::test_tile_parameter_no_full_split", _tile(((2, 2, 2), (2, 2, 2)), (2, 2, 1)), (T_X, T_W, T_X),
         strategies={"tile": ((1, 1, 1),)}),
    Case("test_tile.py::test_tile_tensor", _tile(((2, 2, 2), (2, 2, 2)), (2, 2, 2)), (T_X, T_W, T_X)),
    Case("test_tile.py::test_tile_tensor_no_full_split", _tile(((2, 2, 2), (2, 2, 2)), (2, 2, 1)), (T_X, T_W, T_X)),
    Case("test_tile.py::test_tile_tensor_no_full_split2", _tile(((4, 4, 1), (4, 4, 1)), (4, 4, 1)), (T_X, T_W, T_X),
         devices=32),
    Case("test_tile.py::test_tile_no_strategy",
         lambda x, w, w2: js.shard(jnp.multiply, ((2, 2, 2), (2, 2, 2)))(x, jnp.tile(w, (4, 2, 2))) * w2,
         (T_X, T_W, T_X)),
]


def _expand(s1, s2, s3):
    """test_expand_dims.py Net: Mul, ExpandDims(-1), Mul by b [.., 1]."""
    def net(x, w, b):
        out = js.shard(jnp.multiply, s1)(x, w)
        out = js.shard(named(lambda a: jnp.expand_dims(a, -1), "expand"), s2)(out)
        return js.shard(named(jnp.multiply, "mul2"), s3)(out, b)
    return net


E = ((16, 8, 16), (16, 8, 16), (16, 8, 16, 1))  # [128, 64, 32] and b [128, 64, 32, 1], scaled
EXPAND = [
    Case("test_expand_dims.py::test_expand_dims_data_parallel",
         _expand(((16, 1, 1), (16, 1, 1)), ((16, 1, 1),), ((16, 1, 1, 1), (16, 1, 1, 1))), E, devices=16,
         strategies={"expand": ((16, 1, 1),), "mul2": ((16, 1, 1, 1), (16, 1, 1, 1))}),
    Case("test_expand_dims.py::test_expand_dims_model_parallel",
         _expand(((1, 1, 16), (1, 1, 16)), ((1, 1, 16),), ((1, 1, 16, 1), (1, 1, 16, 1))), E, devices=16,
         strategies={"expand": ((1, 1, 16),)}),
    Case("test_expand_dims.py::test_expand_dims_hybrid_parallel",
         _expand(((2, 2, 4), (2, 2, 4)), ((2, 2, 4),), ((2, 2, 4, 1), (2, 2, 4, 1))), E, devices=16,
         strategies={"expand": ((2, 2, 4),)}),
]


@pytest.mark.parametrize("case", params(REDUCE + TRANSPOSE + CONCAT + TILE + EXPAND))
def test_compiles_as_mindspore(case):
    check(case)

