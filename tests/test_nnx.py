"""Flax NNX graph objects as arguments of `jshard.parallelize`, with `nnx.jit`'s semantics: a
module, its `nnx.Optimizer` and an `nnx.Rngs` stream are updated in place (parameters, optimizer
state and step, batch statistics, RNG counts), graph objects come back as results, `js.shard` on a
submodule keeps the submodule's own updates; pmap-era collectives get an error that says what to
write instead; the default batch argument skips PRNG keys; a Linen `TrainState` step is pytrees, as
under `jax.jit`. Every result equals `nnx.jit` / `jax.jit` on one device."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms
from clients import nnx_optimizer
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import jshard as js

MESH = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("batch",))
MODES = {
    "data": {"mode": "data"},
    "semi_auto": {"mode": "semi_auto"},
    "auto": {"mode": "auto"},
    "xla": {"mode": "semi_auto", "propagation": "xla"},
    "manual": {"mode": "manual", "mesh": MESH, "in_strategy": (None, None, {"x": P("batch"), "y": P("batch")})},
}
STEPS = 2


@pytest.mark.parametrize("mode", MODES)
def test_nnx_optimizer_step_updates_in_place_as_nnx_jit(mode):
    model, optimizer, batch = nnx_optimizer.create()
    want_model, want_optimizer, _ = nnx_optimizer.create()
    step = js.parallelize(nnx_optimizer.train_step, **{"devices": 8, **MODES[mode]})
    reference = nnx.jit(nnx_optimizer.train_step)
    for _ in range(STEPS):
        loss = step(model, optimizer, batch)
        want_loss = reference(want_model, want_optimizer, batch)
    got = (nnx.state(model), nnx.state(optimizer), loss)
    assert_close(got, (nnx.state(want_model), nnx.state(want_optimizer), want_loss), terms=STEPS * nnx_optimizer.terms())
    assert int(optimizer.step[...]) == STEPS
    assert int(model.dropout.rngs.count[...]) == STEPS  # the dropout stream moved on, as under nnx.jit


def _ones_linear(din, dout):
    return nnx.Linear(din, dout, kernel_init=nnx.initializers.ones, rngs=nnx.Rngs(0))


def test_rngs_argument_and_graph_results():
    """An `nnx.Rngs` argument's count moves on; a result that is an argument is that object, a
    result built inside comes back as a new object, as with `nnx.jit`."""

    def step(model, rngs, x):
        noise = jax.random.uniform(rngs.noise(), x.shape)
        return model, _ones_linear(4, 2), model(x + noise)

    model, rngs = _ones_linear(4, 4), nnx.Rngs(noise=3)
    want_model, want_rngs = _ones_linear(4, 4), nnx.Rngs(noise=3)
    x = jnp.ones((8, 4))
    same, new, y = js.parallelize(step, devices=8)(model, rngs, x)
    _, want_new, want_y = nnx.jit(step)(want_model, want_rngs, x)
    assert same is model
    assert isinstance(new, nnx.Linear) and new is not model
    assert_close((nnx.state(new), y, nnx.state(rngs)), (nnx.state(want_new), want_y, nnx.state(want_rngs)), terms=4)
    assert int(rngs.noise.count[...]) == 1


def test_changing_a_graph_objects_structure_is_an_error():
    def step(model, x):
        model.extra = nnx.Param(jnp.zeros(3))
        return model(x)

    with pytest.raises(js.ShardingError, match=r"jshard.parallelize\(step\): the function changed the structure of its "
                                               r"graph objects \(Linear\): it added or removed an attribute"):
        js.parallelize(step, devices=8)(_ones_linear(4, 4), jnp.ones((8, 4)))


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(16, 32, rngs=rngs)
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.down = nnx.Linear(32, 16, rngs=rngs)

    def __call__(self, x):
        h = js.shard(self.up, ((2, 1),), parameter_plan={"kernel": (1, 4)})(x)
        h = js.shard(self.norm, ((2, 4),), parameter_plan={"scale": (4,)})(h)
        return self.down(nnx.relu(h))


def test_shard_on_submodules_keeps_their_updates():
    """`js.shard(self.norm, ..., parameter_plan=...)` runs the BatchNorm on constrained parameters;
    its batch statistics still land in the model, as without `shard`."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16), dtype=np.float32))
    model, want_model = _Block(nnx.Rngs(0)), _Block(nnx.Rngs(0))
    step = js.parallelize(lambda model, x: model(x).sum(), devices=8)
    got, want = step(model, x), nnx.jit(lambda model, x: model(x).sum())(want_model, x)
    assert_close((nnx.state(model), got), (nnx.state(want_model), want), terms=16 + 32 + 16 * 16)
    assert not np.allclose(model.norm.mean[...], 0.0)
    kinds = [a.in_layouts[0].strategy for a in step.plan(model, x).annotations]
    assert kinds == [(2, 1), (2, 4)]


# --- pmap-era collectives ---------------------------------------------------------------------------

ADVICE = ("this is pmap-era code (lax.psum/pmean/all_gather/axis_index over a named axis, or a BatchNorm with "
          "axis_name='batch', which calls pmean). Under jshard the function sees the global batch")


def _pmean(x):
    return jax.lax.pmean(x, "batch").sum()


def _linen_batchnorm(x):
    norm = nn.BatchNorm(use_running_average=False, axis_name="batch")
    variables = norm.init(jax.random.key(0), x)
    return norm.apply(variables, x, mutable=["batch_stats"])[0].sum()


def _nnx_batchnorm(x):
    return nnx.BatchNorm(4, axis_name="batch", rngs=nnx.Rngs(0))(x).sum()


@pytest.mark.parametrize("fn", [_pmean, _linen_batchnorm, _nnx_batchnorm], ids=["lax.pmean", "linen.BatchNorm", "nnx.BatchNorm"])
def test_pmap_era_collectives_say_what_to_write(fn):
    with pytest.raises(js.ShardingError, match=rf"jshard.parallelize\({fn.__name__}\): `psum` over the axis name 'batch' "
                                               r"at test_nnx.py:\d+ has no such axis to run on") as e:
        js.parallelize(fn, devices=8)(jnp.ones((8, 4)))
    assert ADVICE in str(e.value)
    assert "drop the collective (jnp.mean over the batch dim for lax.pmean) and the BatchNorm's axis_name=" in str(e.value)


# --- the default batch argument ---------------------------------------------------------------------


@pytest.mark.parametrize("key", [jax.random.PRNGKey(0), jax.random.key(0)], ids=["raw", "typed"])
def test_default_batch_is_not_a_trailing_key(key):
    """`step(w, x, key)`: the batch is `x`, the last argument holding an array that is not a key."""

    def step(w, x, key):
        return (x @ w) * jax.random.bernoulli(key, 0.5, (x.shape[0], w.shape[1]))

    w, x = jnp.ones((4, 3)), jnp.ones((16, 4))
    parallel = js.parallelize(step, devices=8)
    assert parallel.plan(w, x, key).in_specs[1] == jax.sharding.PartitionSpec(("d0", "d1", "d2"))
    assert_close(parallel(w, x, key), jax.jit(step)(w, x, key), terms=4)


# --- Linen: pytrees, as under jax.jit -------------------------------------------------------------


class _LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(32, use_bias=False)(x))
        return nn.Dense(4)(nn.Dropout(0.2, deterministic=not train)(nn.relu(x)))


class _TrainState(train_state.TrainState):
    batch_stats: dict


def _linen_step(state, x, key):
    def loss_fn(params):
        variables = {"params": params, "batch_stats": state.batch_stats}
        out, updates = state.apply_fn(variables, x, rngs={"dropout": key}, mutable=["batch_stats"])
        return jnp.mean(out**2), updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"]), loss


def test_linen_train_state_with_batch_stats_and_the_key_last():
    """A Linen `TrainState` step with batch statistics and dropout, the key its last argument: the
    batch (`x`) is cut by default, and the new state equals `jax.jit`'s."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 8), dtype=np.float32))
    net = _LinenNet()
    variables = net.init(jax.random.key(0), x, train=False)
    state = _TrainState.create(apply_fn=net.apply, params=variables["params"], batch_stats=variables["batch_stats"],
                               tx=optax.adam(1e-2))
    step = js.parallelize(_linen_step, devices=8)
    key = jax.random.key(1)
    assert step.plan(state, x, key).in_specs[len(jax.tree.leaves(state))] == P(("d0", "d1", "d2"))
    assert_close(step(state, x, key), jax.jit(_linen_step)(state, x, key), terms=step_terms(state.params, x) + 16)  # Adam: +16
