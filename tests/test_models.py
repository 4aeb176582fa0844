"""The reference models under every preset equal the single-device train step, step for step."""

import functools

import jax
import numpy as np
import optax
import pytest
from _loop import run_steps
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models

STEPS = 3



GPT_CFG = models.GPTConfig(n_layers=1)
MLP_CFG = models.MLPConfig(n_layers=4)


def _gpt():
    params = models.init_gpt(GPT_CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    batches = [models.copy_task_batch(rng, GPT_CFG, 8) for _ in range(STEPS)]
    return params, batches, lambda p, b, pr: models.gpt_loss(p, b, GPT_CFG, pr), models.GPT_RULES


def _mlp():
    params = models.init_mlp(MLP_CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    batches = [models.mlp_batch(rng, MLP_CFG, 8) for _ in range(STEPS)]
    return params, batches, models.mlp_loss, models.MLP_RULES


@functools.cache
def _reference(model):
    params, batches, loss, _ = {"gpt": _gpt, "mlp": _mlp}[model]()
    opt = optax.sgd(0.1)
    step = jax.jit(models.make_train_step(lambda p, b: loss(p, b, None), opt))
    return run_steps(step, params, opt.init(params), batches)


@pytest.mark.parametrize("preset", models.PRESETS)
@pytest.mark.parametrize("model", ["mlp", "gpt"])
def test_train_step_equals_single_device(model, preset):
    params, batches, loss, rules = {"gpt": _gpt, "mlp": _mlp}[model]()
    opt = optax.sgd(0.1)
    opt_state = opt.init(params)
    step = models.parallel_train_step(loss, opt, params, opt_state, batches[0], models.preset(preset, 8), rules)
    got_params, _, got_losses = run_steps(step, params, opt_state, batches)
    ref_params, _, ref_losses = _reference(model)
    terms = STEPS * step_terms(params, batches[0])  # each step adds its rounding to the parameters
    assert_close(got_losses, ref_losses, dtype=np.float32, terms=terms)
    assert_close(got_params, ref_params, terms=terms)


def test_preset_lays_out_weights_and_adam_state_where_the_matmuls_use_them():
    params, batches, loss, rules = _gpt()
    opt = optax.adam(1e-3)
    opt_state = opt.init(params)
    preset = models.preset("2d", 8)
    step = models.parallel_train_step(loss, opt, params, opt_state, batches[0], preset, rules)
    new_params, new_state, _ = step(params, opt_state, batches[0])
    w_up = new_params["layers"][0]["w_up"]  # column-parallel: columns cut 4 ways, rows whole
    assert {s.data.shape for s in w_up.addressable_shards} == {(64, 64)}
    mu = new_state[0].mu["layers"][0]["w_down"]  # row-parallel: rows cut 4 ways
    assert {s.data.shape for s in mu.addressable_shards} == {(64, 64)}
    # Column block j of a column-parallel weight sits on the tensor-parallel rank j of each data group.
    holders = sorted(s.device.id for s in w_up.addressable_shards if s.index[1].start == 0)
    assert holders == [0, 4]


@pytest.mark.parametrize("name,dp,mp", [("data", 8, 1), ("tensor", 1, 8), ("2d", 2, 4)])
def test_presets(name, dp, mp):
    p = models.preset(name, 8)
    assert (p.dp, p.mp) == (dp, mp)
    assert p.column(3) == ((dp, 1, 1), (1, mp))
    assert p.row(3) == ((dp, 1, mp), (mp, 1))


def test_unknown_preset_is_an_error():
    with pytest.raises(js.ShardingError, match=r"presets are \('data', 'tensor', '2d'\)"):
        models.preset("pipeline", 8)


def test_copy_task_is_learnable_signal():
    tokens, targets, mask = models.copy_task_batch(np.random.default_rng(0), GPT_CFG, 4)
    k = (GPT_CFG.seq_len - 2) // 2
    np.testing.assert_array_equal(targets[:, k + 1 : 2 * k + 1], tokens[:, 1 : k + 1])
    assert mask.sum() == 4 * k
