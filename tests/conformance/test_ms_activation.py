"""MindSpore's softmax and activation tests: `test_mul_softmax_net.py` (Mul, Softmax with its own
strategy, Mul), `test_layout_extend_activation.py` (GeLU, SiLU, ReLU, Sigmoid with `Layout`s) and
`test_layout_extend_transpose.py` (Transpose with input and output `Layout`s)."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js

from ._ms import Case, check, named, params


def _mul_softmax(s1, s2, s3):
    def net(x, w, b):
        out = js.shard(jnp.multiply, s1)(x, w)
        out = js.shard(named(lambda a: jax.nn.softmax(a, -1), "softmax"), s2)(out)
        return js.shard(jnp.multiply, s3)(out, b)
    return net


X = ((16, 16, 2, 4),) * 3  # [16, 64, 32, 16] scaled
D, M, H = (16, 1, 1, 1), (1, 16, 1, 1), (2, 8, 1, 1)
SOFTMAX = [
    Case(f"test_mul_softmax_net.py::{test}", _mul_softmax((s, s), (soft,), (s, s)), X, devices=16,
         strategies={"softmax": (soft,)})
    for test, s, soft in (
        ("test_softmax_data_parallel", D, (16, 1, 1, 1)),
        ("test_softmax_data_parallel_with_half_repeat", D, (8, 1, 1, 1)),
        ("test_softmax_model_parallel", M, (16, 1, 1, 1)),
        ("test_softmax_model_parallel_with_repeat", M, (1, 1, 1, 1)),
        ("test_softmax_model_parallel_with_half_repeat", M, (8, 1, 1, 1)),
        ("test_softmax_hybrid_parallel", H, (16, 1, 1, 1)),
        ("test_softmax_hybrid_with_repeat_parallel", H, (1, 1, 1, 1)),
        ("test_softmax_hybrid_with_half_repeat_parallel", H, (8, 1, 1, 1)),
    )
]

ACTIVATIONS = {"gelu": jax.nn.gelu, "silu": jax.nn.silu, "relu": jax.nn.relu, "sigmoid": jax.nn.sigmoid}
L2 = js.Layout((2, 2), ("dp", "mp"))
L3 = js.Layout((2, 2, 2), ("dp", "sp", "mp"))
ACTIVATION = [
    Case(f"test_layout_extend_activation.py::{test}/{op}",
         lambda y, fn=ACTIVATIONS[op], lay=lay: js.shard(named(fn, "act"), (lay,))(y), ((16, 16),), devices=devices,
         strategies={"act": (cuts,)})
    for op in ACTIVATIONS
    for test, lay, devices, cuts in (
        ("test_layout_extend_base", L2("dp", "mp"), 4, (2, 2)),
        ("test_layout_extend_batch_multi_shard", L3(("dp", "mp"), "sp"), 8, (4, 2)),
        ("test_layout_extend_reduce_axis_multi_shard", L3("dp", ("mp", "sp")), 8, (2, 4)),
    )
]


def _transpose(ins, outs=None):
    def net(y):
        return js.shard(named(jnp.transpose, "transpose"), ins, outs)(jax.nn.relu(y))
    return net


TRANSPOSE = [
    Case("test_layout_extend_transpose.py::test_layout_extend_transpose_without_output_layout1",
         _transpose((L3(("dp", "sp"), "mp"),)), ((16, 32),), strategies={"transpose": ((4, 2),)}),
    Case("test_layout_extend_transpose.py::test_layout_extend_transpose_without_output_layout2",
         _transpose((js.Layout((2, 4), ("dp", "sp"))("dp", "sp"),)), ((16, 32),)),
    Case("test_layout_extend_transpose.py::test_layout_extend_transpose_with_output_layout1",
         _transpose((L3(("dp", "sp"), "mp"),), (L3("mp", ("dp", "sp")),)), ((16, 32),)),
    # test_layout_extend_transpose_with_output_layout2 gives one alias two sizes in two Layouts: a
    # documented difference (jshard refuses it), tests/conformance/test_ms_differences.py
]


@pytest.mark.parametrize("case", params(SOFTMAX + ACTIVATION + TRANSPOSE))
def test_as_mindspore(case):
    check(case)
