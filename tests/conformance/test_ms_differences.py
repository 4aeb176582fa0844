"""The documented differences (docs/concepts/mindspore.md): cuts MindSpore's own operators refuse,
which jshard accepts because XLA inserts the communication they need. Each row's network is the
MindSpore test's, which raises there; here it runs, equals one device, and the plan's record of the
operator says how it differs from MindSpore (where one JAX primitive is that operator)."""

import pathlib

import jax
import jax.numpy as jnp
import pytest

import jshard as js

from ._ms import MS_COMMIT, Case, check, named, params
from .test_ms_validity import N24, net24

DOC = pathlib.Path(__file__).parents[2] / "docs" / "concepts" / "mindspore.md"


def _layer_norm(x, w, gamma, beta):
    """test_layer_norm.py::test_layer_norm_wrong_strategy: LayerNorm(begin_norm_axis=1) with its
    normalized dims cut ((1, 2, 1, 2), (2, 1, 2), (2, 1, 2))."""
    def ln(a, g, b):
        mean = a.mean((1, 2, 3), keepdims=True)
        var = ((a - mean) ** 2).mean((1, 2, 3), keepdims=True)
        return (a - mean) * jax.lax.rsqrt(var + 1e-5) * g + b
    out = js.shard(jnp.multiply, ((2, 2, 2, 1), (2, 2, 2, 1)))(x, w)
    return js.shard(named(ln, "layer_norm"), ((1, 2, 1, 2), (2, 1, 2), (2, 1, 2)))(out, gamma, beta)


def _one(fn, name, strategy):
    def net(x):
        return js.shard(named(fn, name), (strategy,))(x)
    return net


def _topk(x, w):
    """test_topk.py::test_topk_strategy_error: TopK over the last dim with it cut ((1, 8),)."""
    out = js.shard(jnp.multiply, ((8, 1), (8, 1)))(x, w)
    values, _ = js.shard(lambda a: jax.lax.top_k(a, 3), ((1, 8),))(out)
    return values


def _arg(reduce, name):
    """test_reduce_method_info.py::test_arg_m*_semi_axis_parallel: Mul, then Argmax/Argmin over the last
    dim with it cut ((4, 1, 2),), which MindSpore takes with a warning that the index may differ."""
    def net(x, y):
        out = js.shard(named(jnp.multiply, "mul1"), ((1, 4, 2), (1, 4, 2)))(x, y)
        return js.shard(named(reduce, name), ((4, 1, 2),))(out)
    return net


# (case, the primitive whose record carries the note, or None where no one primitive is the operator)
DIFFERENCES = [
    (Case("test_reduce_method_info.py::test_arg_max_semi_axis_parallel",
          _arg(lambda a: jnp.argmax(a, -1), "argmax"), ((8, 8, 16), (8, 8, 16))), "argmax"),
    (Case("test_reduce_method_info.py::test_arg_min_semi_axis_parallel",
          _arg(lambda a: jnp.argmin(a, -1), "argmin"), ((8, 8, 16), (8, 8, 16))), "argmin"),
    (Case("test_layer_norm.py::test_layer_norm_wrong_strategy", _layer_norm,
          ((16, 16, 4, 4), (16, 16, 4, 4), (16, 4, 4), (16, 4, 4))), None),
    (Case("test_split_ext.py::test_split_tensor_shard_fail",
          _one(lambda a: jnp.split(a, 2, 0), "split", (2, 4, 1)), ((16, 8, 8),)), "split"),
    (Case("test_slice.py::test_slice_no_fully_fetch_split_error",
          _one(lambda a: a[0:16], "slice", (2, 2, 2)), ((32, 8, 8),)), "slice"),
    (Case("test_stridedslice.py::test_stridedslice_no_fully_fetch_split_error",
          _one(lambda a: a[0:16, :, :], "slice", (2, 2, 2)), ((32, 8, 8),)), "slice"),
    (Case("test_stridedslice.py::test_stridedslice_strides_no_1_split_error",
          _one(lambda a: a[0:16, :, ::2], "slice", (1, 2, 2)), ((32, 8, 8),)), "slice"),
    (Case("test_topk.py::test_topk_strategy_error", _topk, ((16, 16), (16, 16))), "top_k"),
    (Case("test_cumsum_ext.py::test_cumsum_ext_shard_dim_error",
          _one(lambda a: jnp.cumsum(a, 0), "cumsum", (2, 4)), ((16, 16),)), "cumsum"),
    (Case("test_tile.py::test_layout_tile4",
          lambda w: js.shard(named(lambda a: jnp.tile(a, (1, 4, 1)), "tile"),
                             (js.Layout((2, 2, 2), ("dp", "cp", "mp"))("dp", "cp", "mp"),))(w), ((16, 2, 8),)), "tile"),
    # An output layout that is not the input's transposed: MindSpore refuses it; jshard's out_strategy
    # constrains the call's result, XLA moving it there.
    (Case("test_layout_extend_transpose.py::test_layout_extend_transpose_with_output_layout_fail1",
          lambda y: js.shard(jnp.transpose, (js.Layout((2, 4), ("dp", "sp"))("dp", "sp"),),
                             (js.Layout((2, 4), ("dp", "sp"))("dp", "sp"),))(y), ((16, 32),)), None),
    # MindSpore refuses these two without naming a rule (its redistribution between the layouts on 24
    # devices); jshard plans them over one mesh of 24, XLA moving between any two of its layouts.
    (Case("test_device_num_not_power_of_2.py::test_auto_parallel_device_num_24_2",
          net24(((8, 3), (8, 3)), ((8, 3), (3, 1)), ((3, 1), (1,))), N24, devices=24), None),
    (Case("test_device_num_not_power_of_2.py::test_auto_parallel_device_num_24_3",
          net24(((8, 3), (8, 3)), ((8, 1), (1, 3)), ((24, 1), (1,))), N24, devices=24), None),
]


@pytest.mark.parametrize("case, primitive", [(p.values[0], primitive) for p, (_, primitive) in
                                             zip(params([c for c, _ in DIFFERENCES]), DIFFERENCES)],
                         ids=[c.id for c, _ in DIFFERENCES])
def test_documented_difference(case, primitive):
    plan = check(case)
    if primitive is not None:
        notes = [op.note for op in plan.ops if op.primitive == primitive and op.annotation and not op.backward]
        assert notes and all("MindSpore's" in n for n in notes), plan.summary()
    assert case.ref in DOC.read_text(), f"{case.ref} is not in the table of {DOC.name}"


def test_one_alias_for_two_axes_is_refused_where_mindspore_keeps_aliases_local():
    """test_layout_extend_transpose.py::test_layout_extend_transpose_with_output_layout2: the input's
    Layout((2, 4)) and the output's Layout((4, 2)) both name an axis "dp". MindSpore's aliases are
    local to each Layout; jshard names the plan's one mesh after them, so it refuses, naming the fix."""
    ref = "test_layout_extend_transpose.py::test_layout_extend_transpose_with_output_layout2"

    def net(y):
        return js.shard(jnp.transpose, (js.Layout((2, 4), ("dp", "sp"))("dp", "sp"),),
                        (js.Layout((4, 2), ("dp", "sp"))("dp", "sp"),))(jax.nn.relu(y))

    with pytest.raises(js.ShardingError, match=r"'dp' names an axis of 2 devices at rank stride 4 in one and of 4 at "
                                               r"stride 2 in the other\. .* Build both from one Layout"):
        js.parallelize(net, devices=8).plan(jax.ShapeDtypeStruct((16, 32), jnp.float32))
    assert ref in DOC.read_text(), f"{ref} is not in the table of {DOC.name}"


def test_the_page_names_the_commit_the_cases_were_read_at():
    assert MS_COMMIT in DOC.read_text()
