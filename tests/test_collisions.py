"""`LayoutCollisionWarning`: `in_strategy` tuples given apart whose cuts land on one mesh axis where
an operator takes them together; the shared `Layout` it suggests moves nothing."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close

import jshard as js
from jshard._format import human_bytes


def _dense(p, x):
    return x @ p["w"]


@pytest.fixture(scope="module")
def inputs():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.standard_normal((8, 16)), jnp.float32)}
    return params, jnp.asarray(rng.standard_normal((16, 8)), jnp.float32)


def _check_against_one_device(step, params, x):
    want = jax.jit(_dense)(params, x)
    assert_close(step(params, x), want, terms=8, scale=float(jnp.max(jnp.abs(x)) * jnp.max(jnp.abs(params["w"])) * 8))


def test_tuples_given_apart_that_collide_warn_with_the_cost_and_the_shared_layout(inputs):
    params, x = inputs
    step = js.parallelize(_dense, devices=8, in_strategy=({"w": (1, 4)}, (2, 1)))
    with pytest.warns(js.LayoutCollisionWarning) as caught:
        plan = step.plan(params, x)
    (message,) = [str(w.message) for w in caught]
    assert plan.predicted_bytes() > 0  # the redistribution the warning names is the plan's only one
    assert message.startswith(
        "jshard.parallelize(_dense): in_strategy[1]=(2, 1) and in_strategy[0]['w']=(1, 4) are lone tuples, each its "
        "own device matrix, so both cut onto mesh axis d0; dot_general at tests/test_collisions.py:")
    assert (f"takes them together and XLA redistributes one first: predicted {human_bytes(plan.predicted_bytes())} "
            f"per device per call") in message
    assert message.endswith(
        "Give both one Layout, as one shard call's strategy ((2, 1), (1, 4)) would: lay = jshard.Layout((2, 4), "
        "('m0', 'm1')); in_strategy[1]=lay('m0', 'None'), in_strategy[0]['w']=lay('None', 'm1').")
    _check_against_one_device(step, params, x)


def test_the_suggested_layout_moves_nothing(inputs):
    params, x = inputs
    lay = js.Layout((2, 4), ("m0", "m1"))
    step = js.parallelize(_dense, devices=8, in_strategy=({"w": lay("None", "m1")}, lay("m0", "None")))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert step.plan(params, x).predicted_bytes() == 0
    _check_against_one_device(step, params, x)


@pytest.mark.parametrize("in_strategy", [None, ({"w": (1, 8)}, (8, 1)), ({"w": (1, 1)}, (8, 1))],
                         ids=["one-shard-call", "no-layout-holds-both", "no-shared-axis"])
def test_no_warning_where_the_tuples_do_not_collide_or_no_layout_helps(inputs, in_strategy):
    params, x = inputs
    mm = js.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)))  # the Megatron pair: one device matrix
    fn = (lambda p, x: mm(x, p["w"])) if in_strategy is None else _dense
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        js.parallelize(fn, devices=8, in_strategy=in_strategy).plan(params, x)


@pytest.mark.parametrize("through", [
    lambda p, x: jnp.tanh((2.0 * x) @ p["w"]),
    lambda p, x: jnp.tanh(x.astype(jnp.bfloat16) @ p["w"].astype(jnp.bfloat16)),
    lambda p, x: jnp.tanh(jnp.tanh(x).reshape(16, 2, 4).reshape(16, 8) @ p["w"]),
], ids=["scaled", "cast", "reshaped"])
def test_the_collision_is_followed_through_elementwise_operators_casts_and_reshapes(inputs, through):
    # was: no warning for tanh((2.0 * x) @ w), with the same colliding tuples and the same all-gather
    params, x = inputs
    step = js.parallelize(through, devices=8, in_strategy=({"w": (1, 4)}, (2, 1)))
    with pytest.warns(js.LayoutCollisionWarning, match=r"in_strategy\[1\]=\(2, 1\) and in_strategy\[0\]\['w'\]=\(1, 4\) "
                      r"are lone tuples.*so both cut onto mesh axis d0; dot_general at tests/test_collisions.py:"):
        step.plan(params, x)
