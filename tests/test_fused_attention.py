"""Attention through `jax.nn.dot_product_attention`: the reference GPT's `attention_implementation`,
and the rule for cuDNN's fused kernel (`jshard/rules/_attention.py`), read off a traced program."""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _loop import run_steps
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models
from jshard.rules import RULES

CFG = models.GPTConfig(n_layers=1, attention_implementation="xla")


def test_gpt_through_dot_product_attention_equals_one_device():
    params = models.init_gpt(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    batches = [models.copy_task_batch(rng, CFG, 8) for _ in range(2)]
    opt = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG), opt)
    ref = run_steps(jax.jit(step), params, opt.init(params), batches)
    einsums = models.gpt_loss(params, batches[0], models.GPTConfig(n_layers=1))
    got = run_steps(js.parallelize(step, devices=8, mode="auto"), params, opt.init(params), batches)
    terms = 2 * step_terms(params, batches[0])
    assert_close(got[2], ref[2], dtype=np.float32, terms=terms)
    assert_close(got[0], ref[0], terms=terms)
    assert_close(ref[2][0], einsums, dtype=np.float32, terms=terms)  # the same attention as the einsums


@pytest.fixture
def cudnn_traceable(monkeypatch):
    """cuDNN's attention traced on a machine without cuDNN: its version and compute-capability
    checks answered as on an H100 (tracing needs nothing else; nothing here compiles)."""
    try:
        fused = importlib.import_module("jax._src.cudnn.fused_attention_stablehlo")
    except ImportError:
        pytest.skip("this JAX has no cuDNN attention module")
    monkeypatch.setattr(fused, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(fused, "check_compute_capability", lambda capability: True)


def _attention_loss(w, x):
    q = (x @ w).reshape(8, 128, 4, 64)
    return jax.nn.dot_product_attention(q, q, q, is_causal=True, implementation="cudnn").astype(jnp.float32).sum()


def test_cudnn_attention_cuts_batch_and_heads_and_counts_its_work(cudnn_traceable):
    w, x = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((8, 128, 256), jnp.bfloat16)
    jaxpr = jax.make_jaxpr(jax.grad(_attention_loss))(w, x).jaxpr
    fused = {e.primitive.name: e for e in jaxpr.eqns if e.primitive.name.startswith("dot_product_attention")}
    assert set(fused) == {"dot_product_attention_fwd_wrapper", "dot_product_attention_bwd_wrapper"}
    forward = RULES["dot_product_attention_fwd_wrapper"](fused["dot_product_attention_fwd_wrapper"])
    backward = RULES["dot_product_attention_bwd_wrapper"](fused["dot_product_attention_bwd_wrapper"])
    full = 4 * 8 * 4 * 128 * 128 * 64
    assert forward.flops == full / 2 and backward.flops == 2.5 * full / 2  # causal: half the tiles
    batch, heads = (f for f, size in enumerate(forward.sizes) if size in (8, 4))
    assert forward.inputs[0] == ((batch,), (), (heads,), ())  # q: batch and heads, sequence and head_dim whole
    assert forward.outputs[1] == ((batch,), (heads,), ())  # the softmax statistics [batch, heads, length]
    assert all(dims == ((),) for dims in forward.inputs[3:])  # the placeholders (bias, mask, lengths): whole
    assert backward.outputs[0] == backward.inputs[0]  # dq laid out as q


def test_cudnn_attention_is_planned_cut_not_gathered(cudnn_traceable):
    def step(w, x):
        loss, g = jax.value_and_grad(_attention_loss)(w, x)
        return w - 0.1 * g, loss

    w, x = jnp.ones((256, 256), jnp.bfloat16), jnp.ones((8, 128, 256), jnp.bfloat16)
    plan = js.parallelize(step, devices=8, mode="data").plan(w, x)
    fused = [r for r in plan.ops if r.primitive.startswith("dot_product_attention")]
    assert len(fused) == 2 and all(r.ruled and not r.comms for r in fused)
    assert all(r.in_specs[0][0] is not None for r in fused)  # each device attends its own rows
    assert plan.predicted_bytes() == 256 * 256 * 2 + 4  # the weight's gradient and the loss all-reduced, nothing gathered


def test_cudnn_grouped_query_attention_keeps_the_heads_whole(cudnn_traceable):
    """The kernel's partitioning refuses queries, keys and values cut apart, and grouped-query
    attention's key/value heads cannot take the queries' cut: only the batch is cut."""
    q, kv = jnp.ones((8, 128, 4, 64), jnp.bfloat16), jnp.ones((8, 128, 2, 64), jnp.bfloat16)
    loss = lambda q, kv: jax.nn.dot_product_attention(q, kv, kv, implementation="cudnn").astype(jnp.float32).sum()
    jaxpr = jax.make_jaxpr(jax.grad(loss))(q, kv)  # differentiated: the kernels' primitives in the open
    (eqn,) = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_product_attention_fwd_wrapper"]
    f = RULES[eqn.primitive.name](eqn)
    (batch,) = (i for i, size in enumerate(f.sizes) if size == 8)
    assert f.inputs[0] == f.inputs[1] == f.inputs[2] == ((batch,), (), (), ())
    assert f.flops == 4 * 8 * 4 * 128 * 128 * 64  # no mask: every tile
