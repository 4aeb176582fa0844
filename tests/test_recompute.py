"""Recompute: the user's `jax.checkpoint` / Flax remat regions keep their recompute through planning
and emission in every mode, and `jshard.recompute` wraps `jax.checkpoint` with MindSpore's policies.

XLA:CPU's buffer assignment barely shrinks when a program recomputes (it keeps about as much temp
memory either way), so temp memory alone cannot tell a kept recompute from a lost one here; the
optimization barriers `jax.checkpoint` lowers to (`prevent_cse`) and the compiled program's matmul
count can: an inlined remat body is merged with the forward pass it repeats.
"""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _remat_gpt import gpt_step
from _tolerance import assert_close, step_terms
from flax import nnx

import jshard as js
from jshard import models
from jshard.compile import build

CFG = models.GPTConfig(vocab=64, seq_len=16, d_model=64, n_heads=4, n_layers=2, d_ff=256)
BATCH = 32


def _gpt_step(preset, wrap):
    return gpt_step(CFG, preset, wrap)


def _compiled(lowered):
    compiled = lowered.compile()
    barriers = lowered.as_text().count("optimization_barrier")
    return compiled.memory_analysis().temp_size_in_bytes, barriers, compiled.as_text().count(" dot(")


MODES = {"data": ("data", None), "semi_auto": ("semi_auto", "data"), "auto": ("auto", None)}


@pytest.mark.parametrize("mode", MODES)
def test_checkpointed_gpt_keeps_its_recompute_and_memory_and_equals_one_device(mode):
    mode, preset = MODES[mode]
    preset = preset and models.preset(preset, 8)  # its shard calls sit inside each checkpointed block
    params = models.init_gpt(CFG, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), CFG, BATCH)
    step = _gpt_step(preset, jax.checkpoint)
    parallel = js.parallelize(step, devices=8, mode=mode)
    plan = parallel.plan(params, batch)
    jitted = jax.jit(step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)
    temp, barriers, dots = _compiled(parallel.lower(params, batch))
    jit_temp, jit_barriers, jit_dots = _compiled(jitted.lower(params, batch))
    assert barriers == jit_barriers == CFG.n_layers  # one remat region per block, kept
    assert dots == jit_dots > _compiled(jax.jit(_gpt_step(preset, lambda f: f)).lower(params, batch))[2]
    assert temp <= 1.05 * jit_temp, (temp, jit_temp)
    want = jax.jit(_gpt_step(None, lambda f: f))(params, batch)
    assert_close(parallel(params, batch), want, terms=step_terms(params, batch))


def test_emitted_program_binds_the_remat_equation_with_its_params_and_constraints_inside():
    policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

    def step(w, x):
        layer = jax.checkpoint(lambda w, x: jnp.tanh(js.shard(jnp.matmul, ((8, 1), (1, 1)))(x, w)), policy=policy)
        return jax.grad(lambda w: layer(w, x).sum())(w)

    w, x = jnp.eye(16) / 2, jnp.linspace(-1, 1, 64 * 16).reshape(64, 16)
    parallel = js.parallelize(step, devices=8)
    program = build(parallel.fn, (w, x), parallel.options, parallel.call)
    remats = [e for e in program.jitted.trace(w, x).jaxpr.eqns if e.primitive.name == "remat2"]
    assert [(e.params["policy"], e.params["prevent_cse"], e.params["differentiated"]) for e in remats] == [
        (policy, True, True)]
    assert any(e.primitive.name == "sharding_constraint" for e in remats[0].params["jaxpr"].eqns)
    assert parallel.lower(w, x).as_text().count("optimization_barrier") == 1
    assert_close(parallel(w, x), jax.jit(step)(w, x), terms=2 * 16 + 64)


class _NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(16, 16, rngs=rngs)

    def __call__(self, x):
        return jnp.tanh(js.shard(self.dense, ((8, 1),))(x))


class _LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x):
        return jnp.tanh(nn.Dense(16)(x))


def _flax_steps():
    x = jnp.linspace(-1, 1, 64 * 16).reshape(64, 16)
    block = _NnxBlock(nnx.Rngs(0))
    graphdef, state = nnx.split(block)

    @nnx.remat
    def nnx_apply(state, x):
        return nnx.merge(graphdef, state)(x)

    linen = nn.remat(_LinenBlock, policy=jax.checkpoint_policies.dots_saveable)()
    variables = linen.init(jax.random.key(0), x)
    return {
        "nnx.remat": (lambda s, x: jax.grad(lambda s: nnx_apply(s, x).sum())(s), state, x),
        "linen.remat": (lambda v, x: jax.grad(lambda v: linen.apply(v, x).sum())(v), variables, x),
    }


@pytest.mark.parametrize("which", ["nnx.remat", "linen.remat"])
@pytest.mark.parametrize("mode", ["data", "semi_auto"])
def test_flax_remat_keeps_its_recompute(which, mode):
    step, params, x = _flax_steps()[which]
    parallel = js.parallelize(step, devices=8, mode=mode)
    assert parallel.lower(params, x).as_text().count("optimization_barrier") == 1
    assert_close(parallel(params, x), jax.jit(step)(params, x), terms=16 + 64)


def _remat_dots(fn, *args) -> list[int]:
    """dot_generals inside each remat region of `fn`'s gradient: what its backward pass recomputes
    (forward matmuls) and computes (the matmuls' transposes)."""
    jaxpr = jax.make_jaxpr(jax.grad(lambda *a: fn(*a).sum()))(*args).jaxpr
    return [sum(e.primitive.name == "dot_general" for e in r.params["jaxpr"].eqns)
            for r in jaxpr.eqns if r.primitive.name == "remat2"]


def _two_matmuls(w, x):
    return jnp.sin(jnp.tanh(x @ w) @ w)


@pytest.mark.parametrize(
    "policy, dots",
    [("full", 2 + 3), ("selective", 3), ("dots_with_no_batch_dims_saveable", 3), ("everything_saveable", 3),
     (jax.checkpoint_policies.dots_saveable, 3)],
    ids=["full", "selective", "named", "everything", "callable"],
)
def test_recompute_policy_chooses_what_the_backward_pass_recomputes(policy, dots):
    w, x = jnp.eye(4) / 2, jnp.ones((2, 4))
    fn = js.recompute(_two_matmuls, policy=policy)
    assert _remat_dots(fn, w, x) == [dots]  # full: both forward matmuls again, then 3 transposes (dw twice, dh)
    assert_close(fn(w, x), _two_matmuls(w, x))
    assert fn.__name__ == "_two_matmuls"


def test_recompute_is_a_decorator_with_or_without_arguments():
    @js.recompute
    def full(w, x):
        return _two_matmuls(w, x)

    @js.recompute(policy="selective")
    def selective(w, x):
        return _two_matmuls(w, x)

    w, x = jnp.eye(4) / 2, jnp.ones((2, 4))
    assert _remat_dots(full, w, x) == [5] and _remat_dots(selective, w, x) == [3]


def test_recompute_inside_parallelize_with_shard_calls_equals_one_device():
    @js.recompute(policy="selective")
    def layer(w, x):
        return jnp.tanh(js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w))

    def step(ws, x):
        loss = lambda ws: sum(jnp.sum(layer(w, x) ** 2) for w in ws)
        return jax.grad(loss)(ws)

    ws = [jnp.linspace(-1, 1, 32 * 32).reshape(32, 32) / (k + 2) for k in range(3)]
    x = jnp.linspace(-1, 1, 16 * 32).reshape(16, 32)
    parallel = js.parallelize(step, devices=8)
    assert parallel.lower(ws, x).as_text().count("optimization_barrier") == len(ws)
    assert_close(parallel(ws, x), jax.jit(step)(ws, x), terms=2 * 32 + 16)


@pytest.mark.parametrize(
    "policy, match",
    [
        ("bogus", r"jshard.recompute\(_two_matmuls\): policy='bogus' is no recompute policy. Use one of 'full', "
                  r"'selective', 'none', 'auto', 'offload', 'nothing_saveable', .*'dots_saveable'.*, or a policy callable."),
        ("save_only_these_names", r"jshard.recompute\(_two_matmuls\): jax.checkpoint_policies.save_only_these_names "
                                  r"builds a policy from arguments; pass policy=jax.checkpoint_policies."
                                  r"save_only_these_names\(...\), or one of the named policies: 'full', "),
    ],
    ids=["unknown", "factory"],
)
def test_recompute_bad_policy_names_the_call_and_the_valid_names(policy, match):
    with pytest.raises(js.ShardingError, match=match):
        js.recompute(_two_matmuls, policy=policy)


def test_recompute_bad_policy_as_decorator_and_wrong_type():
    with pytest.raises(js.ShardingError, match=r"jshard.recompute\(policy='dots'\): policy='dots' is no"):
        js.recompute(policy="dots")
    with pytest.raises(TypeError, match=r"jshard.recompute\(_two_matmuls\): policy must be a string or a "
                                        r"jax.checkpoint_policies callable, not int \(3\)."):
        js.recompute(_two_matmuls, policy=3)
