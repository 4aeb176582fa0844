"""MindSpore's Gather (`test_gather_v2.py`), OneHot (`test_onehot.py`), LayerNorm
(`test_layer_norm.py`), Dropout (`test_dropout.py`), TopK (`test_topk.py`), Conv2D (`test_conv2d.py`)
and softmax-with-loss (`test_softmax_cross_entropy_loss.py`) tests."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js

from ._ms import Case, check, named, params


def _i32(*shape):
    return jax.ShapeDtypeStruct(shape, jnp.int32)


def _gather_mul(axis, s1, s2, out=None):
    """test_gather_v2.py Net: Gather(table, index, axis) with s1 (None: no strategy), then Mul by y."""
    def net(x, index, y):
        take = named(lambda t, i: jnp.take(t, i, axis=axis), "gather")
        got = take(x, index) if s1 is None else js.shard(take, s1, out)(x, index)
        return js.shard(named(jnp.multiply, "mul"), s2)(got, y)
    return net


def _g(name, axis, s1, s2, table, out=None, index=(4, 4), marks=()):
    shapes = (table, _i32(*index), (*table[:axis], *index, *table[axis + 1:]))
    return Case(f"test_gather_v2.py::{name}", _gather_mul(axis, s1, s2, out), shapes,
                strategies={"gather": s1} if s1 else {}, marks=marks)


GATHER = [
    _g("test_gatherv2_semi_auto0", 0, ((1, 8), (1, 1)), ((4, 2, 1), (4, 2, 1)), (16, 16)),
    _g("test_gatherv2_semi_auto1", 0, ((8, 1), (1, 1)), ((4, 2, 1), (4, 2, 1)), (16, 16)),
    _g("test_gatherv2_semi_auto2", 0, ((2, 4), (1, 1)), ((4, 2, 1), (4, 2, 1)), (16, 16)),
    _g("test_gatherv2_semi_auto3", 1, ((1, 8), (1, 1)), ((4, 2, 1), (4, 2, 1)), (16, 16)),
    _g("test_gatherv2_semi_auto4", 1, ((8, 1), (1, 1)), ((4, 2, 1), (4, 2, 1)), (16, 8)),
    _g("test_gatherv2_semi_auto5", 1, ((2, 4), (1, 1)), ((4, 2, 1), (4, 2, 1)), (16, 8)),
    _g("test_gatherv2_semi_auto6", 0, None, ((4, 2, 1), (4, 2, 1)), (16, 8)),
    _g("test_gatherv2_semi_auto7", 1, None, ((4, 2, 1), (4, 2, 1)), (16, 8)),
    _g("test_gatherv2_semi_auto8", 0, ((8,), (1, 1)), ((4, 2), (4, 2)), (16,), index=(4, 4)),
    _g("test_gatherv2_forward_all_reduce", 0, ((8, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16), index=(2, 8)),
    _g("test_gatherv2_shard_batch_and_axis", 0, ((4, 1), (2, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16), index=(2, 8)),
    _g("test_gatherv2_split_axis_0_repeat_calc", 0, ((4, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16), index=(2, 8)),
    _g("test_gatherv2_out_strategy_allreduce", 0, ((8, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16),
       out=((1, 1, 1),), index=(8, 8)),
    _g("test_gatherv2_out_strategy_allreduce_repeat_calc", 0, ((4, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16),
       out=((1, 1, 1),), index=(8, 8)),
    _g("test_gatherv2_out_strategy_reducescatter", 0, ((8, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16),
       out=((8, 1, 1),), index=(8, 8)),
    _g("test_gatherv2_out_strategy_reducescatter_repeat_calc", 0, ((4, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)), (16, 16),
       out=((4, 1, 1),), index=(8, 8)),
    _g("test_gatherv2_shard_batch_and_axis_out_strategy_allreduce", 0, ((4, 1), (2, 1)), ((2, 4, 1), (2, 4, 1)),
       (16, 16), out=((2, 1, 1),), index=(8, 8)),
    _g("test_gatherv2_shard_batch_and_axis_out_strategy_reducescatter", 0, ((4, 1), (2, 1)), ((2, 4, 1), (2, 4, 1)),
       (16, 16), out=((8, 1, 1),), index=(8, 8)),
    _g("test_gatherv2_no_shard_axis_and_set_out_strategy", 0, ((1, 1), (8, 1)), ((8, 1, 1), (8, 1, 1)), (16, 16),
       out=((8, 1, 1),), index=(8, 8)),
]


def _onehot(s3, axis=-1, depth=16):
    """test_onehot.py: MatMul, GeLU-free logits, OneHot of the labels (its strategy on the indices),
    then a softmax cross-entropy (strategy4)."""
    def net(x, w, labels):
        logits = js.shard(jnp.matmul, ((2, 4), (4, 2)))(x, w)
        # MindSpore's OneHot strategy is its output's; the indices are cut as the output's batch dim
        onehot = named(lambda i: jax.nn.one_hot(i, depth, axis=axis), "onehot")
        hot = js.shard(onehot, ((s3[0],),), (s3,) if axis == -1 else None)(labels)
        hot = hot if axis == -1 else hot.T
        loss = js.shard(named(lambda a, b: -b * jax.nn.log_softmax(a, -1), "loss"), ((16, 1), (16, 1)))(logits, hot)
        return loss.sum(-1)
    return net


ONEHOT = [
    Case("test_onehot.py::test_onehot_model_parallel", _onehot((1, 16)), ((16, 8), (8, 16), _i32(16)), devices=16),
    Case("test_onehot.py::test_onehot_batch_parallel", _onehot((16, 1)), ((16, 8), (8, 16), _i32(16)), devices=16),
    Case("test_onehot.py::test_onehot_repeated_calculation", _onehot((4, 1)), ((16, 8), (8, 16), _i32(16)), devices=16),
    Case("test_onehot.py::test_onehot_batch_parallel_axis0", _onehot((16, 1), axis=0), ((16, 8), (8, 16), _i32(16)),
         devices=16),
    Case("test_onehot.py::test_onehot_batch_parallel_invalid_strategy", _onehot((16,)), ((16, 8), (8, 16), _i32(16)),
         devices=16, refuses=r"out_strategy\[0\]=\(16,\) has 1 entries"),
]


def _layer_norm(s1, s2, s3, begin=2):
    """test_layer_norm.py Net: Mul, LayerNorm(begin_norm_axis) with gamma and beta, Mul."""
    def ln(x, gamma, beta):
        axes = tuple(range(begin, x.ndim))
        mean = x.mean(axes, keepdims=True)
        var = ((x - mean) ** 2).mean(axes, keepdims=True)
        return (x - mean) * jax.lax.rsqrt(var + 1e-5) * gamma + beta

    def net(x, w, b, gamma, beta):
        out = js.shard(jnp.multiply, s1)(x, w)
        out = js.shard(named(ln, "layer_norm"), s2)(out, gamma, beta)
        return js.shard(jnp.multiply, s3)(out, b)
    return net


LN_X = (16, 16, 4, 4)  # [16, 64, 32, 16] scaled
LN = (LN_X, LN_X, LN_X, (16, 4, 4), (16, 4, 4))
LN2 = (LN_X, LN_X, LN_X, (4, 4), (4, 4))
NORMALIZED_CUT = "normalized"
LAYER_NORM = [
    Case("test_layer_norm.py::test_layer_norm_data_parallel",
         _layer_norm(((16, 1, 1, 1),) * 2, ((16, 1, 1, 1), (1, 1), (1, 1)), ((16, 1, 1, 1),) * 2), LN2, devices=16),
    Case("test_layer_norm.py::test_layer_norm_model_parallel",
         _layer_norm(((1, 16, 1, 1),) * 2, ((1, 16, 1, 1), (16, 1, 1), (16, 1, 1)), ((1, 16, 1, 1),) * 2, begin=1),
         LN, devices=16),
    Case("test_layer_norm.py::test_layer_norm_hybrid_parallel",
         _layer_norm(((2, 8, 1, 1),) * 2, ((2, 8, 1, 1), (8, 1, 1), (8, 1, 1)), ((2, 8, 1, 1),) * 2, begin=1),
         LN, devices=16),
    Case("test_layer_norm.py::test_layer_norm_repeat_calc",
         _layer_norm(((2, 2, 4, 1),) * 2, ((2, 2, 1, 1), (2, 1, 1), (2, 1, 1)), ((2, 2, 4, 1),) * 2, begin=1),
         LN, devices=16),
]


def _dropout(s1, s2):
    """test_dropout.py Net: Mul, Dropout(keep_prob=0.6) (its strategy), Mul."""
    def drop(x):
        keep = jax.random.bernoulli(jax.random.key(0), 0.6, x.shape)
        return jnp.where(keep, x / 0.6, 0.0)

    def net(x, w, b):
        out = js.shard(jnp.multiply, s1)(x, w)
        out = js.shard(named(drop, "dropout"), s2)(out)
        return js.shard(jnp.multiply, s1)(out, b)
    return net


D = ((16, 16),) * 3
DROPOUT = [
    Case("test_dropout.py::test_dropout_data_parallel", _dropout(((16, 1), (16, 1)), ((16, 1),)), D, devices=16,
         strategies={"dropout": ((16, 1),)}),
    Case("test_dropout.py::test_dropout_model_parallel", _dropout(((1, 16), (1, 16)), ((1, 16),)), D, devices=16,
         strategies={"dropout": ((1, 16),)}),
    Case("test_dropout.py::test_dropout_mixed_parallel", _dropout(((4, 4), (4, 4)), ((4, 4),)), D, devices=16,
         strategies={"dropout": ((4, 4),)}),
    Case("test_dropout.py::test_dropout_repeat_calc", _dropout(((4, 4), (4, 4)), ((2, 4),)), D, devices=16,
         strategies={"dropout": ((2, 4),)}),
]


def _topk(s1, s2):
    """test_topk.py Net: Mul, TopK(k=3) over the last dim (its strategy), Mul of the values."""
    def net(x, w):
        out = js.shard(jnp.multiply, s1)(x, w)
        values, _ = js.shard(named(lambda a: jax.lax.top_k(a, 3), "topk"), s2)(out)
        return values * 2.0
    return net


TOPK = [
    Case("test_topk.py::test_topk_data_parallel", _topk(((8, 1), (8, 1)), ((8, 1),)), ((16, 16),) * 2,
         strategies={"topk": ((8, 1),)}),
    Case("test_topk.py::test_topk_model_parallel", _topk(((2, 4), (2, 4)), ((2, 1),)), ((16, 16),) * 2,
         strategies={"topk": ((2, 1),)}),
]


def _conv(s1, s2, stride=1, padding="SAME", dilation=1, groups=1):
    """test_conv2d.py Net: Conv2D (NCHW, OIHW) with strategy ((n, c, h, w), (o, c, kh, kw)), then Neg."""
    def conv(x, k):
        return jax.lax.conv_general_dilated(x, k, (stride, stride), padding, rhs_dilation=(dilation, dilation),
                                            feature_group_count=groups, dimension_numbers=("NCHW", "OIHW", "NCHW"))

    def net(x, k):
        out = js.shard(named(conv, "conv"), s1)(x, k)
        return js.shard(jnp.negative, s2)(out)
    return net


CONV = [
    Case("test_conv2d.py::test_conv2d_data_parallel", net=_conv(((8, 1, 1, 1), (1, 1, 1, 1)), ((8, 1, 1, 1),)),
         shapes=((16, 4, 8, 8), (8, 4, 2, 2)), strategies={"conv": ((8, 1, 1, 1), (1, 1, 1, 1))}),
    Case("test_conv2d.py::test_conv2d_data_parallel_dilation",
         _conv(((8, 1, 1, 1), (1, 1, 1, 1)), ((8, 1, 1, 1),), dilation=2), ((16, 4, 8, 8), (8, 4, 2, 2))),
    Case("test_conv2d.py::test_conv2d_data_parallel_group",
         _conv(((8, 1, 1, 1), (1, 1, 1, 1)), ((8, 1, 1, 1),), groups=2), ((16, 4, 8, 8), (8, 2, 2, 2))),
    Case("test_conv2d.py::test_conv2d_model_parallel1", _conv(((2, 2, 1, 1), (2, 2, 1, 1)), ((8, 1, 1, 1),)),
         ((16, 4, 8, 8), (8, 4, 2, 2))),
    Case("test_conv2d.py::test_conv2d_model_parallel2", _conv(((2, 2, 2, 2), (2, 2, 1, 1)), ((32, 1, 1, 1),)),
         ((32, 4, 8, 8), (8, 4, 2, 2)), devices=32),
    Case("test_conv2d.py::test_conv2d_model_parallel3", _conv(((2, 1, 1, 4), (1, 1, 1, 1)), ((2, 1, 1, 4),)),
         ((16, 4, 8, 16), (8, 4, 2, 2))),
    Case("test_conv2d.py::test_conv2d_pad_mode", _conv(((1, 1, 2, 4), (1, 1, 1, 1)), ((1, 1, 1, 1),)),
         ((16, 4, 8, 16), (8, 4, 3, 3))),
    Case("test_conv2d.py::test_conv2d_left_and_right_no_need_to_send",
         _conv(((2, 1, 1, 4), (1, 1, 1, 1)), ((2, 1, 1, 4),), stride=2), ((16, 4, 8, 16), (8, 4, 2, 2))),
]


def _softmax_loss(s1, s2, s3):
    """test_softmax_cross_entropy_loss.py Net: MatMul(transpose_b) (its strategy), GeLU, then
    SoftmaxCrossEntropyWithLogits (strategy3) against the labels b."""
    def net(x, y, b):
        out = js.shard(named(lambda a, w: a @ w.T, "matmul"), s1)(x, y)
        out = js.shard(jax.nn.gelu, s2)(out)
        loss = js.shard(named(lambda a, t: -(t * jax.nn.log_softmax(a, -1)).sum(-1), "loss"), s3)(out, b)
        return loss.mean()
    return net


SOFTMAX = [
    Case("test_softmax_cross_entropy_loss.py::test_softmax_cross_entropy_loss",
         _softmax_loss(((4, 1), (2, 1)), ((4, 2),), ((8, 1), (8, 1))), ((16, 8), (16, 8), (16, 16)),
         strategies={"matmul": ((4, 1), (2, 1)), "loss": ((8, 1), (8, 1))}),
    Case("test_softmax_cross_entropy_loss.py::test_softmax_cross_entropy_loss_repeated_calculation",
         _softmax_loss(((4, 1), (2, 1)), ((4, 2),), ((2, 1), (2, 1))), ((16, 8), (16, 8), (16, 16)),
         strategies={"loss": ((2, 1), (2, 1))}),
]


@pytest.mark.parametrize("case", params(GATHER + ONEHOT + LAYER_NORM + DROPOUT + TOPK + CONV + SOFTMAX))
def test_compiles_as_mindspore(case):
    check(case)


@pytest.mark.parametrize("rows", [16, 4096])
def test_gather_strategy_binds_whatever_the_table_size(rows):
    """test_gather_v2.py::test_gatherv2_semi_auto1's strategy ((8, 1), (1, 1)): the gather itself
    takes the table cut by rows (a masked lookup and an all-reduce), for a small table too, where
    gathering the table would cost less: a user's cut is never replaced by propagation."""
    net = _gather_mul(0, ((8, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)))
    args = (jnp.ones((rows, 16)), jnp.ones((8, 8), jnp.int32), jnp.ones((8, 8, 16)))
    plan = js.parallelize(net, devices=8, mode="semi_auto", dataset_strategy="full_batch").plan(*args)
    (gather,) = [op for op in plan.ops if op.primitive == "gather"]
    assert gather.origin == "user" and gather.in_strategy[0] == (8, 1)
    assert [c.kind for c in gather.comms] == ["all-reduce"]


def test_explain_says_the_user_strategy_forces_the_collective():
    """Where a user's cut forces communication inside the operator (the row-cut table's masked
    lookup and its all-reduce), `explain` says the strategy is kept and why the collective runs."""
    net = _gather_mul(0, ((8, 1), (1, 1)), ((2, 4, 1), (2, 4, 1)))
    args = (jnp.ones((16, 16)), jnp.ones((8, 8), jnp.int32), jnp.ones((8, 8, 16)))
    plan = js.parallelize(net, devices=8, mode="semi_auto", dataset_strategy="full_batch").plan(*args)
    (gather,) = [op for op in plan.ops if op.primitive == "gather"]
    assert "the user's strategy binds" in plan.explain(gather)
