"""Strategy validity both ways, slicing operators, repeated calculation and device counts that are
not powers of two: MindSpore's `test_matmul_transpose_attr.py`, `test_element_wise_two_inputs.py`,
`test_element_wise_one_input.py`, `test_conv2d.py`, `test_layer_norm.py`, `test_gather_v2.py`,
`test_split.py`, `test_slice.py`, `test_stridedslice.py`, `test_repeated_calc.py`,
`test_device_num_not_power_of_2.py` and `test_batch_matmul.py`."""

import jax
import jax.numpy as jnp
import pytest
from jax import lax

import jshard as js

from ._ms import Case, check, named, params


def _transpose_a(s1, transpose_b=False):
    """test_matmul_transpose_attr.py MatMulNet: MatMul(transpose_a[, transpose_b]) of [K, M] and
    [K, N] ([N, K]), then ReLU."""
    dims = (((0,), (1 if transpose_b else 0,)), ((), ()))

    def net(x, w):
        out = js.shard(named(lambda a, b: lax.dot_general(a, b, dims), "matmul"), s1)(x, w)
        return jax.nn.relu(out)
    return net


def _bmm(s1, s2, transpose_b=False):
    """test_batch_matmul.py Net: Mul by a weight, then BatchMatMul (transpose_b) by another."""
    product = (lambda a, w: a @ jnp.swapaxes(w, -1, -2)) if transpose_b else jnp.matmul

    def net(x, w1, w2):
        out = js.shard(jnp.multiply, s1)(x, w1)
        return js.shard(named(product, "bmm"), s2)(out, w2)
    return net


MATMUL = [
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a", _transpose_a(((2, 4), (2, 1))), ((8, 16), (8, 32)),
         strategies={"matmul": ((2, 4), (2, 1))}),
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a_data_parallel", _transpose_a(((1, 8), (1, 1))),
         ((8, 16), (8, 32))),
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a_repeat_calculation", _transpose_a(((2, 2), (2, 1))),
         ((8, 16), (8, 32))),
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a_b", _transpose_a(((2, 4), (1, 2)), True),
         ((8, 16), (32, 8))),
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a_b_repeat_calculation",
         _transpose_a(((2, 2), (1, 2)), True), ((8, 16), (32, 8))),
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a_error_strategy", _transpose_a(((2, 2), (1, 2))),
         ((8, 16), (8, 32)), refuses=r"contracts dim 0 of in_strategy\[0\]=\(2, 2\) with dim 0 of in_strategy\[1\]"),
    Case("test_matmul_transpose_attr.py::test_matmul_transpose_a_b_error_strategy",
         _transpose_a(((2, 4), (2, 1)), True), ((8, 16), (32, 8)), refuses="cut them differently"),
    Case("test_batch_matmul.py::test_batch_matmul_data_parallel",
         _bmm(((16, 1, 1), (16, 1, 1)), ((16, 1, 1), (16, 1, 1))), ((16, 8, 8), (16, 8, 8), (16, 8, 8)), devices=16,
         strategies={"bmm": ((16, 1, 1), (16, 1, 1))}),
    Case("test_batch_matmul.py::test_batch_matmul_model_parallel",
         _bmm(((1, 1, 1), (1, 1, 1)), ((1, 1, 1), (1, 1, 16))), ((16, 8, 8), (16, 8, 8), (16, 8, 16)), devices=16),
    Case("test_batch_matmul.py::test_batch_matmul_hybrid_parallel",
         _bmm(((2, 2, 2), (2, 2, 2)), ((2, 2, 2), (2, 2, 2))), ((16, 8, 8), (16, 8, 8), (16, 8, 8)), devices=16),
    Case("test_batch_matmul.py::test_batch_matmul_repeat_calc",
         _bmm(((2, 2, 4), (2, 2, 4)), ((1, 2, 2), (1, 2, 2))), ((16, 8, 8), (16, 8, 8), (16, 8, 8)), devices=16),
    Case("test_batch_matmul.py::test_batch_matmul_transpose_b",
         _bmm(((2, 2, 4), (2, 2, 4)), ((1, 2, 2), (1, 2, 2)), True), ((16, 8, 8), (16, 8, 8), (16, 8, 8)), devices=16),
    # A batch of 1: jnp.matmul squeezes it before the dot; the squeezed dims are still the batch.
    Case("test_batch_matmul.py::test_batch_matmul_hybrid_parallel/batch_1",
         _bmm(((1, 2, 4), (1, 2, 4)), ((1, 2, 2), (1, 2, 2))), ((1, 8, 8), (1, 8, 8), (1, 8, 8)),
         strategies={"bmm": ((1, 2, 2), (1, 2, 2))}),
]


def _two(op, strategy):
    def net(a, b):
        return js.shard(named(op, "op"), strategy)(a, b)
    return net


ELEMENTWISE = [
    Case("test_element_wise_two_inputs.py::test_isclose_with_default_values",
         _two(lambda a, b: jnp.isclose(a, b), ((1, 4), (1, 4))), ((16, 16), (16, 16))),
    Case("test_element_wise_two_inputs.py::test_isclose_shard_strategy_error",
         _two(lambda a, b: jnp.isclose(a, b), ((1, 4), (2, 4))), ((16, 16), (16, 16)), refuses="differently"),
    Case("test_element_wise_two_inputs.py::test_remaindertensortensor_with_default_values",
         _two(jnp.remainder, ((1, 4), (1, 4))), ((16, 16), (16, 16))),
    Case("test_element_wise_two_inputs.py::test_remaindertensortensor_shard_strategy_error",
         _two(jnp.remainder, ((1, 4), (2, 4))), ((16, 16), (16, 16)), refuses="differently"),
    Case("test_element_wise_two_inputs.py::test_polar_with_positive_values",
         _two(lambda r, t: lax.complex(r * jnp.cos(t), r * jnp.sin(t)), ((1, 4), (1, 4))), ((16, 16), (16, 16))),
    Case("test_element_wise_two_inputs.py::test_polar_with_different_strategies",
         _two(lambda r, t: lax.complex(r * jnp.cos(t), r * jnp.sin(t)), ((1, 4), (2, 4))), ((16, 16), (16, 16)),
         refuses="differently"),
    Case("test_element_wise_two_inputs.py::test_FmodTensor_with_default_values",
         _two(jnp.fmod, ((1, 4), (1, 4))), ((16, 16), (16, 16))),
    Case("test_element_wise_two_inputs.py::test_FmodTensor_other_shape_broadcast_succ",
         _two(jnp.fmod, ((1, 4), (1, 1))), ((16, 16), (16, 1))),
    Case("test_element_wise_one_input.py::test_softplus_default_values",
         lambda x: js.shard(jax.nn.softplus, ((1, 4),))(x), ((16, 16),)),
    Case("test_element_wise_one_input.py::test_softplus_shard_strategy_error",
         lambda x: js.shard(jax.nn.softplus, ((1, 4), (1,)))(x), ((16, 16),), refuses="in_strategy has 2 entries"),
    Case("test_element_wise_one_input.py::test_relu_default_values",
         lambda x: js.shard(jax.nn.relu, ((1, 4),))(x), ((16, 16),)),
    Case("test_element_wise_one_input.py::test_relu_shard_strategy_error",
         lambda x: js.shard(jax.nn.relu, ((1, 4), (1,)))(x), ((16, 16),), refuses="in_strategy has 2 entries"),
    Case("test_element_wise_one_input.py::test_elu_default_values",
         lambda x: js.shard(jax.nn.elu, ((1, 4),))(x), ((16, 16),)),
    Case("test_element_wise_one_input.py::test_leakyrelu_default_values",
         lambda x: js.shard(jax.nn.leaky_relu, ((1, 4),))(x), ((16, 16),)),
    Case("test_element_wise_one_input.py::test_relu_layout_extend",
         lambda x: js.shard(jax.nn.relu, (js.Layout((2, 2, 2), ("dp", "cp", "mp"))(("dp", "cp"), "None"),))(x),
         ((16, 16),)),
]


def _conv(s1, groups=1):
    def net(x, k):
        conv = named(lambda a, b: lax.conv_general_dilated(a, b, (1, 1), "SAME", feature_group_count=groups,
                                                           dimension_numbers=("NCHW", "OIHW", "NCHW")), "conv")
        return js.shard(conv, s1)(x, k)
    return net


CONV = [
    Case("test_conv2d.py::test_split_kernel", _conv(((1, 1, 1, 1), (1, 1, 2, 2))), ((8, 4, 8, 8), (8, 4, 2, 2)),
         refuses="kernel's spatial dims"),
    Case("test_conv2d.py::test_conv2d_model_parallel_group", _conv(((2, 2, 1, 1), (2, 2, 1, 1)), groups=2),
         ((8, 4, 8, 8), (8, 2, 2, 2)), refuses="grouped convolution"),
    Case("test_conv2d.py::test_conv2d_model_parallel_group2", _conv(((2, 1, 2, 2), (1, 1, 1, 1)), groups=2),
         ((8, 4, 8, 8), (8, 2, 2, 2))),
]


def _ln_wrong_rank(x, gamma, beta):
    """test_layer_norm.py::test_layer_norm_error_strategy: begin_norm_axis=2, gamma given three entries."""
    def ln(a, g, b):
        mean = a.mean((2, 3), keepdims=True)
        return (a - mean) * g + b
    return js.shard(ln, ((2, 8, 1, 1), (8, 1, 1), (8, 1, 1)))(x, gamma, beta)


def _gather_out(strategy, out):
    def net(table, index):
        return js.shard(lambda t, i: jnp.take(t, i, axis=0), strategy, out)(table, index)
    return net


OTHER_REFUSALS = [
    Case("test_layer_norm.py::test_layer_norm_error_strategy", _ln_wrong_rank, ((16, 16, 4, 4), (4, 4), (4, 4)),
         devices=16, refuses=r"in_strategy\[1\]=\(8, 1, 1\) has 3 entries"),
    Case("test_gather_v2.py::test_gatherv2_bs_1_and_set_out_strategy_reduce_scatter",
         _gather_out(((8, 1), (1, 1)), ((8, 1, 1),)), ((16, 16), jax.ShapeDtypeStruct((1, 16), jnp.int32)),
         refuses="does not divide 1"),
]


def _split(s_split, s_mul, axis=0):
    """test_split.py Net: Mul by a weight, Split(axis, 3), then Mul of the first two parts and the third."""
    def net(x, w):
        out = js.shard(jnp.multiply, ((1, 4, 2), (1, 4, 2)))(x, w)
        a, b, c = js.shard(named(lambda t: jnp.split(t, 3, axis), "split"), (s_split,))(out)
        return js.shard(jnp.multiply, s_mul)(a, b) * c
    return net


def _slice(s_mul, s_slice, start, stop):
    """test_slice.py Net: Slice of a weight (its strategy), Mul by x, Mul by a second weight."""
    def net(x, w, w2):
        part = js.shard(named(lambda t: t[start[0]:stop[0], start[1]:stop[1], start[2]:stop[2]], "slice"),
                        (s_slice,))(w)
        return js.shard(jnp.multiply, s_mul)(x, part) * w2
    return net


SLICING = [
    Case("test_split.py::test_split_parameter", _split((1, 4, 2), ((1, 4, 2), (1, 4, 2))), ((12, 8, 8), (12, 8, 8)),
         strategies={"split": ((1, 4, 2),)}),
    Case("test_split.py::test_split_parameter_no_full_split", _split((1, 2, 2), ((1, 4, 2), (1, 4, 2))),
         ((12, 8, 8), (12, 8, 8)), strategies={"split": ((1, 2, 2),)}),
    Case("test_split.py::test_split_no_strategy",
         lambda x, w: (lambda a, b, c: js.shard(jnp.multiply, ((1, 4, 2), (1, 4, 2)))(a, b) * c)(
             *jnp.split(js.shard(jnp.multiply, ((1, 4, 2), (1, 4, 2)))(x, w), 3, 0)), ((12, 8, 8), (12, 8, 8))),
    Case("test_slice.py::test_slice_parameter", _slice(((1, 4, 1), (1, 4, 2)), (1, 4, 2), (0, 0, 0), (16, 8, 8)),
         ((16, 8, 1), (32, 8, 8), (16, 8, 8)), strategies={"slice": ((1, 4, 2),)}),
    Case("test_slice.py::test_slice_parameter_no_full_split",
         _slice(((1, 4, 1), (1, 4, 2)), (1, 2, 2), (0, 0, 0), (16, 8, 8)), ((16, 8, 1), (32, 8, 8), (16, 8, 8)),
         strategies={"slice": ((1, 2, 2),)}),
    Case("test_slice.py::test_slice_tensor", _slice(((1, 4, 1), (1, 4, 2)), (1, 4, 2), (0, 0, 0), (16, 8, 8)),
         ((16, 8, 1), (32, 8, 8), (16, 8, 8))),
    Case("test_stridedslice.py::test_stridedslice_parameter",
         _slice(((1, 4, 1), (1, 4, 2)), (1, 4, 2), (0, 0, 0), (16, 8, 8)), ((16, 8, 1), (32, 8, 8), (16, 8, 8))),
    Case("test_stridedslice.py::test_stridedslice_parameter_no_full_split",
         _slice(((1, 4, 1), (1, 4, 2)), (1, 2, 2), (0, 0, 0), (16, 8, 8)), ((16, 8, 1), (32, 8, 8), (16, 8, 8))),
]


def _add_reshape_matmul(x, y, b):
    """test_repeated_calc.py::test_tensoradd_reshape_matmul: Add ((8, 1, 1), ...) on 64 devices (8
    used, 8 repeats), a reshape, MatMul ((8, 1), (1, 8))."""
    out = js.shard(named(jnp.add, "add"), ((8, 1, 1), (8, 1, 1)))(x, y)
    out = out.reshape(-1, out.shape[-1])
    return js.shard(named(jnp.matmul, "matmul"), ((8, 1), (1, 8)))(out, b)


def _repeated_two_matmul(x, y, b):
    """test_repeated_calc.py::test_two_matmul: ((8, 8), (8, 1)) then ((8, 1), (1, 1)) on 64 devices."""
    out = js.shard(named(jnp.matmul, "mm1"), ((8, 8), (8, 1)))(x, y)
    return js.shard(named(jnp.matmul, "mm2"), ((8, 1), (1, 1)))(out, b)


def net24(mul, matmul, gather):
    """test_device_num_not_power_of_2.py Net on 24 devices: Gather of an embedding table, MatMul,
    Mul, add b, sum."""
    def op(fn, name, strategy):  # no strategy: the operator is left to the engine
        return fn if strategy is None else js.shard(named(fn, name), strategy)

    def net(index, b, table, w_mm, w_mul):
        out = op(lambda t, i: jnp.take(t, i, axis=0), "gather", gather)(table, index)
        out = op(jnp.matmul, "matmul", matmul)(out, w_mm)
        out = op(jnp.multiply, "mul", mul)(out, w_mul)
        return (out + b).sum()
    return net


N24 = (jax.ShapeDtypeStruct((48,), jnp.int32), (48, 24), (48, 24), (24, 24), (48, 24))
REPEATED = [
    Case("test_repeated_calc.py::test_tensoradd_reshape_matmul", _add_reshape_matmul, ((8, 2, 8), (8, 2, 8), (8, 8)),
         devices=64, strategies={"add": ((8, 1, 1), (8, 1, 1)), "matmul": ((8, 1), (1, 8))}),
    Case("test_repeated_calc.py::test_two_matmul", _repeated_two_matmul, ((16, 16), (16, 8), (8, 8)), devices=64,
         strategies={"mm1": ((8, 8), (8, 1)), "mm2": ((8, 1), (1, 1))}),
    Case("test_device_num_not_power_of_2.py::test_auto_parallel_device_num_24",
         net24(((24, 1), (24, 1)), ((24, 1), (1, 1)), ((1, 1), (24,))), N24, devices=24,
         strategies={"gather": ((1, 1), (24,)), "matmul": ((24, 1), (1, 1))}),
    Case("test_device_num_not_power_of_2.py::test_auto_parallel_device_num_24_1",
         net24(((3, 8), (3, 8)), ((3, 8), (8, 1)), ((24, 1), (1,))), N24, devices=24,
         strategies={"gather": ((24, 1), (1,)), "matmul": ((3, 8), (8, 1))}),
    Case("test_device_num_not_power_of_2.py::test_auto_parallel_device_num_24_prop_search",
         net24(None, ((3, 8), (8, 1)), None), N24, devices=24, mode="auto", strategies={"matmul": ((3, 8), (8, 1))}),
]


@pytest.mark.parametrize("case", params(MATMUL + ELEMENTWISE + CONV + OTHER_REFUSALS + SLICING + REPEATED))
def test_as_mindspore(case):
    check(case)
