"""Full train steps in a pipeline (issue 30, item 4): a step that computes its gradients and then
updates the parameters (SGD by hand, optax with its state, a Flax `TrainState`) returns, pipelined,
what it returns unpipelined, where it marks its gradient function with `jshard.accumulate`; a step
that returns something other than a loss or `jax.value_and_grad`'s pair without that mark is
refused (it used to come back with the gradients in place of the updated parameters, silently)."""

import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from _tolerance import assert_close
from flax.training import train_state

import jshard as js

ROWS = 16
TERMS = 64  # a 4-, 8- and 2-term chain of dots, tanh, a mean over 16 rows, an update: well under 64


def _loss(params, batch):
    x, y = batch
    h = js.pipeline_stage(lambda w, x: jnp.tanh(x @ w), 0)(params["a"], x)
    return jnp.mean((js.pipeline_stage(lambda w, h: h @ w, 1)(params["b"], h) - y) ** 2)


@functools.cache
def _data():
    k = jax.random.split(jax.random.key(0), 4)
    params = {"a": jax.random.normal(k[0], (4, 8)), "b": jax.random.normal(k[1], (8, 2))}
    return params, (jax.random.normal(k[2], (ROWS, 4)), jax.random.normal(k[3], (ROWS, 2)))


def _sgd(marked: bool):
    def sgd_step(params, batch):
        grad_fn = jax.value_and_grad(_loss)
        loss, grads = (js.accumulate(grad_fn) if marked else grad_fn)(params, batch)
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), loss

    return sgd_step


TX = optax.adamw(1e-2)


def _optax_step(params, opt_state, batch):
    loss, grads = js.accumulate(jax.value_and_grad(_loss))(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def _state_step(state, batch):
    loss, grads = js.accumulate(jax.value_and_grad(_loss))(state.params, batch)
    return state.apply_gradients(grads=grads), loss


def _pipelined(step, schedule="gpipe"):
    return js.parallelize(step, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule=schedule))


def test_sgd_step_without_the_mark_is_refused_not_answered_with_the_gradients():
    params, batch = _data()
    step = lambda p, b: _sgd(False)(p, b)[::-1]  # (loss, updated params): value_and_grad's shape
    with pytest.raises(js.ShardingError, match=r"returns \(loss, tree like params\), but result \[1\]\['a'\] is made "
                                               r"by sub .* jshard.accumulate\(jax.value_and_grad"):
        _pipelined(step)(params, batch)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_sgd_step_marked_returns_the_updated_parameters(schedule):
    params, batch = _data()
    want = jax.jit(_sgd(False))(params, batch)
    assert_close(_pipelined(_sgd(True), schedule)(params, batch), want, terms=TERMS)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_optax_adamw_step_with_its_state_equals_the_unpipelined_step_over_three_calls(schedule):
    params, batch = _data()
    state = TX.init(params)
    step, plain = _pipelined(_optax_step, schedule), jax.jit(_optax_step_unmarked)
    got, want = (params, state), (params, state)
    for _ in range(3):
        *got, got_metrics = step(*got, batch)
        *want, want_metrics = plain(*want, batch)
    assert_close((got, got_metrics), (want, want_metrics), terms=3 * TERMS)


def _optax_step_unmarked(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, {"loss": loss}


def test_flax_train_state_step_equals_the_unpipelined_step():
    params, batch = _data()
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=optax.adam(1e-2))

    def plain(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), loss

    assert_close(_pipelined(_state_step, "1f1b")(state, batch), jax.jit(plain)(state, batch), terms=TERMS)


def test_full_step_results_come_back_in_the_layout_the_next_call_takes():
    params, batch = _data()
    step = _pipelined(_optax_step)
    out = step(params, TX.init(params), batch)
    assert all(x.sharding.is_fully_replicated and len(x.sharding.device_set) == 8 for x in jax.tree.leaves(out))


def test_marked_forms_a_pipeline_cannot_run_are_refused_naming_them():
    params, batch = _data()

    def grad_only(params, batch):
        return js.accumulate(jax.grad(_loss))(params, batch)

    with pytest.raises(js.ShardingError, match=r"returns a scalar loss, or \(loss, grads\)"):
        _pipelined(grad_only)(params, batch)

    def three(params, batch):
        return js.accumulate(jax.value_and_grad(lambda p, b, s: _loss(p, b) * s))(params, batch, 2.0)

    with pytest.raises(js.ShardingError, match=r"takes \(params, batch\), the batch last"):
        _pipelined(three)(params, batch)

    def closing(params, scale, batch):
        loss, grads = js.accumulate(jax.value_and_grad(lambda p, b: _loss(p, b) * scale))(params, batch)
        return jax.tree.map(lambda p, g: p - g, params, grads)

    with pytest.raises(js.ShardingError, match=r"closes over a value the step computes or takes \(f32\[\]\)"):
        _pipelined(closing)(params, jnp.float32(2.0), batch)

    with pytest.raises(js.ShardingError, match=r"takes 3 arguments and marks no gradient function"):
        _pipelined(lambda p, s, b: _loss(p, b))(params, 1.0, batch)
