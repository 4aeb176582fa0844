"""Gradient accumulation (`parallelize(..., accumulation=js.Accumulation(k, shard=...))` with
`jshard.accumulate` in the step): the reference GPT with Adam on 8 devices, 4 micro-batches, equals
the full-batch step on one device over 3 steps, and its compiled program holds less temporary
memory than the full-batch one's."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _loop import run_steps
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models

STEPS = 3
ROWS = 32
CFG = models.GPTConfig(n_layers=1)
OPT = optax.adam(1e-3)


def _loss(p, b):
    return models.gpt_loss(p, b, CFG)


def _step(params, state, batch):
    loss, grads = js.accumulate(jax.value_and_grad(_loss))(params, batch)
    updates, state = OPT.update(grads, state, params)
    return optax.apply_updates(params, updates), state, loss


def _problem():
    params = models.init_gpt(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    return params, OPT.init(params), [models.copy_task_batch(rng, CFG, ROWS) for _ in range(STEPS)]


@functools.cache
def _reference():
    params, state, batches = _problem()
    return run_steps(jax.jit(models.make_train_step(_loss, OPT)), params, state, batches)


@functools.cache
def _compiled(k: int, shard: bool):
    params, state, batches = _problem()
    step = js.parallelize(_step, devices=8, mode="data", accumulation=js.Accumulation(k, shard=shard), optimizer=js.OptimizerParallel(1, threshold="16KiB"))
    return step, step.lower(params, state, batches[0]).compile()


def _two_d(shard: bool = False):
    """The step under the 2-D preset (dp=2, mp=4) with `jshard.accumulate` over 2 micro-batches: the
    weights laid out over mp by the preset's rules, their optimizer state alike, the batch over dp."""
    params, state, batches = _problem()
    preset = models.preset("2d", 8)
    p_strats = preset.parameters(params, models.GPT_RULES)
    s_strats = models.state_strategies(p_strats, params, state)

    def step(params, state, batch):
        loss, grads = js.accumulate(jax.value_and_grad(lambda p, b: models.gpt_loss(p, b, CFG, preset)))(params, batch)
        updates, state = OPT.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return js.parallelize(step, devices=8, in_strategy=(p_strats, s_strats, tuple(preset.batch(x.ndim) for x in batches[0])),
                          out_strategy=(p_strats, s_strats, None), accumulation=js.Accumulation(2, shard=shard))


def _assert_equals_one_device(par, params, state, batches):
    """`STEPS` steps of `par` give the losses, parameters and optimizer state of the full-batch step
    on one device."""
    got_params, got_state, got_losses = run_steps(par, params, state, batches)
    ref_params, ref_state, ref_losses = _reference()
    terms = STEPS * step_terms(params, batches[0])
    assert_close(got_losses, ref_losses, dtype=np.float32, terms=terms)
    assert_close(got_params, ref_params, terms=terms)
    assert_close(got_state, ref_state, terms=terms)


@pytest.mark.parametrize("shard", [False, True], ids=["carry-as-gradient", "carry-cut"])
def test_four_micro_batches_equal_the_full_batch_on_one_device(shard):
    params, state, batches = _problem()
    _assert_equals_one_device(_compiled(4, shard)[0], params, state, batches)


def test_tensor_parallel_inside_cuts_the_accumulator_over_the_free_axis_and_equals_one_device():
    """The 2-D preset (dp=2, mp=4) lays the weights out over mp; `accumulation_shard` cuts their
    accumulated gradients over dp too, and 2 micro-batches equal the full batch on one device."""
    params, state, batches = _problem()
    par = _two_d(shard=True)
    # w_up [64, 256]: mp (d1, d2) cuts its columns; the accumulator adds dp (d0) on the rows, and each
    # micro-batch's gradient is reduce-scattered onto them over dp alone (a group of 2 devices)
    report = js.audit(par.lower(params, state, batches[0]).compile())
    assert report.count("reduce-scatter") > 0 and {c.group_size for c in report.collectives
                                                   if c.kind == "reduce-scatter"} == {2}
    _assert_equals_one_device(par, params, state, batches)


def test_tensor_parallel_inside_the_reduce_once_loop_equals_one_device():
    """The 2-D preset (dp=2, mp=4): the micro-batch loop runs manual over dp alone, its `shard`
    annotations keep their mp cuts inside (dp taken out), and the step equals one device."""
    params, state, batches = _problem()
    par = _two_d()
    text = par.lower(params, state, batches[0]).as_text()
    assert 'sdy.manual_computation' in text and 'manual_axes={"dp"}' in text
    _assert_equals_one_device(par, params, state, batches)


def test_micro_batches_hold_less_temporary_memory_than_the_full_batch():
    full = _compiled(1, False)[1].memory_analysis().temp_size_in_bytes
    micro = _compiled(4, False)[1].memory_analysis().temp_size_in_bytes
    cut = _compiled(4, True)[1].memory_analysis().temp_size_in_bytes
    assert micro < full
    assert cut < micro  # the accumulated gradients cut 8 ways (reduce-scattered into the carry)


def test_four_micro_batches_reduce_the_gradients_once_as_the_full_batch_does():
    """Each device sums its own micro-batches, one all-reduce after the loop: the bytes of the
    full-batch step, not 4 times them. With `accumulation_shard` each micro-batch's gradients above
    the threshold are reduce-scattered into the cut carry (on every backend: jshard emits it), the
    small ones all-reduced once."""
    full, micro, cut = (js.audit(_compiled(k, shard)[1]) for k, shard in ((1, False), (4, False), (4, True)))
    assert full.bytes("all-reduce") > 0
    assert abs(micro.bytes("all-reduce") - full.bytes("all-reduce")) <= 0.02 * full.bytes("all-reduce")
    assert micro.bytes() <= 1.02 * full.bytes()  # and the optimizer-parallel all-gather of the updates, once
    params, _, _ = _problem()
    big = [x for x in jax.tree.leaves(params) if x.nbytes >= 16 * 2**10]
    assert cut.count("reduce-scatter") == 4 * len(big) and cut.bytes("reduce-scatter") == 4 * sum(x.nbytes for x in big)
    assert cut.bytes("all-reduce") < full.bytes("all-reduce") - sum(x.nbytes for x in big)


def test_the_micro_batches_run_in_one_scan_of_k():
    params, _, batches = _problem()
    jaxpr = jax.make_jaxpr(js.accumulate(jax.value_and_grad(_loss), 4))(params, batches[0])
    scans = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "scan"]
    assert [e.params["length"] for e in scans] == [4]


def test_integer_results_are_summed_and_floats_averaged():
    def count(w, x):
        return jnp.mean(x @ w), jnp.sum(x > 0).astype(jnp.int32)

    x = jnp.arange(24.0).reshape(8, 3) - 4
    got = js.accumulate(count, 4)(jnp.ones((3,)), x)
    assert_close(got, count(jnp.ones((3,)), x), terms=x.size)


@pytest.mark.parametrize("k", [0, -2, 2.0, True, "4"])
def test_a_step_count_that_is_not_a_positive_int_is_named(k):
    with pytest.raises(js.ShardingError, match=rf"jshard.parallelize\(_step\): Accumulation\(steps={k!r}\) is not a "
                                               r"number of micro-batches; give a positive int k that divides"):
        js.parallelize(_step, accumulation=js.Accumulation(k))


@pytest.mark.parametrize("k, match", [
    (3, r"jshard.parallelize\(_step\): accumulation=3 does not divide the 32 rows of the batch args\[2\]\[0\] "
        r"i32\[32,16\]. Give a k that divides 32 \(1, 2, 4, 8, 16, 32\), or a batch of a multiple of 3 rows"),
    (8, r"accumulation=8 cuts the batch args\[2\]\[0\] i32\[32,16\] into micro-batches of 4 rows, which the "
        r"dataset strategy cannot cut into 8 equal parts .* \(1, 2, 4\), or a batch of a multiple of 64 rows"),
], ids=["k-does-not-divide-the-rows", "micro-batches-the-devices-cannot-cut"])
def test_batch_rows_that_do_not_fit_k_are_named(k, match):
    params, state, batches = _problem()
    with pytest.raises(js.ShardingError, match=match):
        js.parallelize(_step, devices=8, mode="data", accumulation=k).plan(params, state, batches[0])


def test_a_step_without_accumulate_is_named():
    params, state, batches = _problem()
    step = js.parallelize(models.make_train_step(_loss, OPT), devices=8, mode="data", accumulation=2)
    with pytest.raises(js.ShardingError, match=r"accumulation=2, but the function calls no jshard.accumulate.*"
                                               r"jshard.accumulate\(jax.value_and_grad\(loss_fn\)\)\(params, batch\)"):
        step.plan(params, state, batches[0])


def test_shard_without_a_data_parallel_axis_is_named():
    def step(w, x):
        loss, grad = js.accumulate(jax.value_and_grad(lambda w, x: jnp.sum(x @ w)))(w, x)
        return w - grad, loss

    w, x = jnp.ones((8, 8)), jnp.ones((8, 8))
    par = js.parallelize(step, devices=8, in_strategy=((2, 4), (1, 1)), accumulation=js.Accumulation(2, shard=True))
    with pytest.raises(js.ShardingError, match=r"Accumulation\(shard=True\) cuts the accumulated gradients over the "
                                               r"data-parallel devices .* e.g. args\[0\] f32\[8,8\] is laid out "
                                               r"P\(.*\) over the mesh \(d0=2, d1=2, d2=2\). Run on more devices"):
        par.plan(w, x)


def _linear_step(argnums):
    def step(w, x):
        grad = js.accumulate(jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2), argnums=argnums))(w, x)
        return w - 0.1 * (grad if argnums == 0 else jnp.sum(grad))

    return step


def test_a_jax_grad_result_is_the_accumulator_cut_and_equals_one_device():
    w, x = jnp.linspace(-1, 1, 64 * 8).reshape(64, 8), jnp.linspace(-2, 2, 32 * 64).reshape(32, 64)
    par = js.parallelize(_linear_step(0), devices=8, mode="data", accumulation=js.Accumulation(2, shard=True))
    # the loop manual over the batch's axes; the accumulated gradient comes out cut on its rows
    assert 'out_shardings=[<@mesh, [{"d0", "d1", "d2"}, {}]>] manual_axes={"d0", "d1", "d2"}' in par.lower(w, x).as_text()
    want = jax.jit(lambda w, x: w - 0.1 * jax.grad(lambda w, x: jnp.mean(jnp.tanh(x @ w) ** 2))(w, x))(w, x)
    assert_close(par(w, x), want, terms=2 * x.size)  # forward and backward sums over x


def test_shard_without_gradients_like_the_parameters_is_named():
    w, x = jnp.ones((64, 8)), jnp.ones((32, 64))
    par = js.parallelize(_linear_step(1), devices=8, mode="data", accumulation=js.Accumulation(2, shard=True))
    with pytest.raises(js.ShardingError, match=r"Accumulation\(shard=True\) cuts the accumulated gradients like the "
                                               r"parameters \(argument 0 of the step\), but no result of the gradient "
                                               r"function has their tree and shapes"):
        par.plan(w, x)


def test_accumulation_in_a_pipeline_is_named():
    with pytest.raises(js.ShardingError, match=r"accumulation= cuts a step's batch into micro-batches outside a "
                                               r"pipeline; a pipeline accumulates its own micro_batches. Use "
                                               r"Pipelining\(micro_batches=...\), or drop accumulation="):
        js.parallelize(models.gpt_pipeline(models.GPTConfig(n_layers=2, scan=True)), pipeline=js.Pipelining(stages=2, micro_batches=2), accumulation=2)


def test_shard_outside_data_and_semi_auto_is_named():
    with pytest.raises(js.ShardingError, match=r"Accumulation\(shard=True\) cuts the accumulated gradients .* this call "
                                               r"has mode='auto'. Use mode='data' or 'semi_auto'"):
        js.parallelize(_step, mode="auto", accumulation=js.Accumulation(2, shard=True))


def test_accumulate_outside_parallelize_needs_steps_and_they_must_agree():
    grad = js.accumulate(jax.value_and_grad(_loss))
    params, _, batches = _problem()
    with pytest.raises(js.ShardingError, match=r"jshard.accumulate\(_loss\): no micro-batch count: "
                                               r"pass accumulate\(grad_fn, steps=k\)"):
        grad(params, batches[0])

    def step(params, state, batch):
        loss, _ = js.accumulate(jax.value_and_grad(_loss), 2)(params, batch)
        return params, state, loss

    with pytest.raises(js.ShardingError, match=r"steps=2 but the step is parallelized with accumulation=4"):
        js.parallelize(step, devices=8, mode="data", accumulation=4).plan(*_problem()[:2], batches[0])
