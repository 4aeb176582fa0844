"""ResNet and mixture of experts learn their tasks and, under the presets, equal the single-device
train step; the scanned GPT equals the unrolled one."""

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, fan_in, step_terms

import jshard as js
from jshard import models

LEARN_STEPS = 8
PARALLEL_STEPS = 2
# Adam divides by |grad| + eps: with the default eps=1e-8, the rounding noise of a near-zero gradient
# (which differs between one device and eight) becomes a full-size step. A larger eps keeps the runs
# comparable and still learns.
OPTIMIZER = optax.adam(1e-2, eps=1e-3)


class Model(NamedTuple):
    cfg: Any
    init: Any
    loss: Any
    batch: Any
    rules: dict


MODELS = {
    "resnet": Model(models.ResNetConfig(), models.init_resnet, models.resnet_loss, models.resnet_batch,
                    models.RESNET_RULES),
    "moe": Model(models.MoEConfig(), models.init_moe, models.moe_loss, models.moe_batch, models.MOE_RULES),
}


@functools.cache
def _setup(name):
    m = MODELS[name]
    rng = np.random.default_rng(1)
    batches = [m.batch(rng, m.cfg, 16) for _ in range(LEARN_STEPS)]
    loss = lambda p, b, preset: m.loss(p, b, m.cfg, preset)
    return m.init(m.cfg, jax.random.key(0)), batches, loss


@functools.cache
def _reference(name):
    """Single-device run: the losses of every step and the parameters after `PARALLEL_STEPS`."""
    params, batches, loss = _setup(name)
    step = jax.jit(models.make_train_step(lambda p, b: loss(p, b, None), OPTIMIZER))
    opt_state, losses = OPTIMIZER.init(params), []
    for i, batch in enumerate(batches):
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
        if i + 1 == PARALLEL_STEPS:
            after = params
    return losses, after


@pytest.mark.parametrize("name", MODELS)
def test_loss_falls_on_the_synthetic_task(name):
    losses, _ = _reference(name)
    assert losses[-1] < 0.8 * losses[0], losses


@pytest.mark.parametrize("preset", ["data", "2d"])
@pytest.mark.parametrize("name", MODELS)
def test_train_step_equals_single_device(name, preset):
    params, batches, loss = _setup(name)
    opt_state = OPTIMIZER.init(params)
    step = models.parallel_train_step(
        loss, OPTIMIZER, params, opt_state, batches[0], models.preset(preset, 8), MODELS[name].rules
    )
    losses = []
    for batch in batches[:PARALLEL_STEPS]:
        params, opt_state, value = step(params, opt_state, batch)
        losses.append(float(value))
    ref_losses, ref_params = _reference(name)
    # Each step adds its rounding to the parameters. Adam divides by |grad| + eps: a gradient's rounding
    # moves a step by up to lr / eps = 10 times as much, which the worst-case count, far above the
    # typical sqrt(terms), leaves room for.
    terms = PARALLEL_STEPS * step_terms(params, batches[0])
    assert_close(losses, ref_losses[:PARALLEL_STEPS], dtype=np.float32, terms=terms)
    assert_close(params, ref_params, terms=terms)


def test_moe_needs_mp_to_divide_the_experts():
    params, batches, _ = _setup("moe")
    with pytest.raises(js.ShardingError, match=r"mp=8\) cuts the expert dim 8 ways, but 8 does not divide n_experts=4"):
        models.moe_apply(params, batches[0][0], MODELS["moe"].cfg, models.preset("tensor", 8))


def test_resnet_rules_cut_conv_output_channels_and_head_columns():
    preset = models.preset("2d", 8)
    layouts = preset.parameters(_setup("resnet")[0], models.RESNET_RULES)
    assert layouts["blocks"][1]["proj"] == preset.layout("None", "None", "None", "mp")
    assert layouts["head"]["w"] == preset.layout("None", "mp")
    assert layouts["head"]["b"] == preset.layout("None")


# Every weight 64x64: one random-number program to compile for the whole init.
GPT_CFG = models.GPTConfig(vocab=64, seq_len=64, d_model=64, n_heads=4, n_layers=2, d_ff=64)


def test_scanned_gpt_equals_unrolled():
    scanned_cfg = dataclasses.replace(GPT_CFG, scan=True)
    params = models.init_gpt(GPT_CFG, jax.random.key(0))
    stacked = dict(params, layers=jax.tree.map(lambda *a: jnp.stack(a), *params["layers"]))
    jax.tree.map(np.testing.assert_array_equal, models.init_gpt(scanned_cfg, jax.random.key(0)), stacked)
    tokens = models.copy_task_batch(np.random.default_rng(0), GPT_CFG, 4)[0]
    apply = jax.jit(models.gpt_apply, static_argnums=2)
    assert_close(apply(stacked, tokens, scanned_cfg), apply(params, tokens, GPT_CFG), terms=fan_in(params))  # forward


def test_gpt_rules_cut_the_matrix_dims_of_stacked_weights():
    preset = models.preset("2d", 8)
    params = jax.eval_shape(lambda: models.init_gpt(dataclasses.replace(GPT_CFG, scan=True), jax.random.key(0)))
    layouts = preset.parameters(params, models.GPT_RULES)["layers"]
    assert layouts["wq"] == layouts["w_up"] == preset.layout("None", "None", "mp")
    assert layouts["wo"] == layouts["w_down"] == preset.layout("None", "mp", "None")
    assert layouts["ln1"]["scale"] == preset.layout("None", "None")


def test_fenced_gradients_are_the_same_values_and_plan_under_auto():
    """`GPTConfig(fence_grads=True)`: the residual stream's gradient passes an optimization barrier at
    each residual add (two per block) and nothing else changes: the same gradients, bit for bit under
    `jax.jit`, and a plan under `mode="auto"` that equals one device."""
    cfg = models.GPTConfig(n_layers=2)
    fenced = dataclasses.replace(cfg, fence_grads=True)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 8)
    grad = lambda c: jax.grad(lambda p, b: models.gpt_loss(p, b, c))
    jaxpr = str(jax.make_jaxpr(grad(fenced))(params, batch))
    assert jaxpr.count("optimization_barrier") == 2 * cfg.n_layers
    plain, held = jax.jit(grad(cfg))(params, batch), jax.jit(grad(fenced))(params, batch)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(held)))
    parallel = js.parallelize(grad(fenced), devices=8, mode="auto")(params, batch)
    assert_close(parallel, held, terms=step_terms(params, batch))
