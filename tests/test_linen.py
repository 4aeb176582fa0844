"""Flax Linen, the documented path (issue 30, item 3; docs/howto/linen.md): `shard` with a
`parameter_plan` on a Linen submodule names the ways that reach its parameters, and the first of
them, `shard` around the module's `apply`, runs on `jax.make_mesh`'s Explicit axes."""

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close
from clients import one_device
from jax.sharding import PartitionSpec as P

import jshard as js

X = jnp.asarray(np.random.default_rng(0).normal(size=(8, 8)), jnp.float32)


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        return js.shard(nn.Dense(16), in_strategy=((2, 1),), parameter_plan={"kernel": (1, 4)})(x)


def test_a_parameter_plan_on_a_linen_submodule_names_the_ways_that_work():
    # was: "parameter_plan pattern 'kernel' matches no parameter of Dense ... Its parameters are: (none)"
    model = Block()
    params = jax.eval_shape(model.init, jax.random.key(0), X)
    with pytest.raises(js.ShardingError, match="(?s)" + ".*".join(map(re.escape, (
        "jshard.shard(Dense): parameter_plan on the Linen module Dense at test_linen.py:",
        "a Linen module makes and reads its parameters inside its call", "bound or not",
        "(1) shard the module's apply", "(2) give the parameters their strategy at the boundary",
        "(3) logical axis rules", "(4) shard the matmul itself", "docs/howto/linen.md")))):
        js.parallelize(lambda p, x: model.apply(p, x)).plan(params, X)


def test_shard_around_a_linen_apply_with_a_parameter_plan_on_an_explicit_mesh():
    model = nn.Dense(16, use_bias=False)
    params = model.init(jax.random.key(0), X)
    lay = js.Layout((2, 4), ("dp", "mp"))

    def loss(params, x):
        dense = js.shard(model.apply, in_strategy=(None, lay("dp", "None")), parameter_plan={"kernel": lay("None", "mp")})
        return jnp.tanh(dense(params, x)).sum()

    step = js.parallelize(loss, mesh=jax.make_mesh((2, 4), ("dp", "mp")))  # Explicit axes
    assert_close(step(params, X), one_device(loss, params, X), terms=8 + 16)
    plan = step.plan(params, X)
    assert plan.in_specs[0] == P(None, "mp")  # stored as the plan cuts it
    dot = next(op for op in plan.ops if op.primitive == "dot_general")
    assert dot.origin == "user" and dot.gathered == ""  # one Layout: the cut is the operator's own


def test_a_parameter_plan_cut_the_plan_gathers_at_its_first_use_warns_with_the_cost_and_the_fix(tmp_path):
    # was: the column-cut kernel all-gathered before the matmul on every call, silently, the operator labelled "user"
    # with the call's strategy (None, (2, 1)) as if it were the matmul's
    model = nn.Dense(16, use_bias=False)
    rows = jnp.ones((64, 8), jnp.float32)
    params = jax.eval_shape(model.init, jax.random.key(0), rows)

    def loss(params, x):
        return jnp.tanh(js.shard(model.apply, in_strategy=(None, (2, 1)), parameter_plan={"kernel": (1, 4)})(params, x)).sum()

    with pytest.warns(js.LayoutCollisionWarning, match="(?s)" + ".*".join(map(re.escape, (
        "jshard.parallelize(loss): the parameter_plan entry for params/kernel of jshard.shard(apply) at test_linen.py:",
        "cuts f32[8,16] as (1, 4), but dot_general at", "its first use, takes it as", "XLA all-gathers it over mesh axis",
        "there on every call, predicted", "per device per call", "give it and the operand it meets one Layout")))):
        plan = js.parallelize(loss, devices=8).plan(params, rows)
    assert plan.predicted_bytes() > 0
    dot = next(op for op in plan.ops if op.primitive == "dot_general")
    assert dot.origin == "propagated" and dot.via == "user"  # the engine's layout, from the rows' in_strategy
    assert dot.in_strategy == ((2, 1), (1, 1)) and dot.out_strategy == ((2, 1),)  # what the matmul takes
    assert dot.gathered.startswith("operand 1 (f32[8,16]) comes cut (1, 4) by the parameter_plan entry for "
                                   "params/kernel of jshard.shard(apply) at test_linen.py:")
    assert dot.gathered.endswith("and is taken as (1, 1): XLA all-gathers it over mesh axis d0, d1 here")
    assert [c.kind for c in dot.comms] == ["all-gather"]
    assert "the user's cut is not kept here: operand 1 (f32[8,16]) comes cut (1, 4)" in plan.explain(dot)
    plan.save(tmp_path / "plan.json")
    assert js.Plan.load(tmp_path / "plan.json").ops == plan.ops  # the record survives a save
