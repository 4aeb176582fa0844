"""Every primitive JAX defines has a sharding rule or a documented fallback the plan names, and the
families MindSpore propagates through (incomplete gamma, zeta, Cholesky, ...) have rules."""

import jax
import jax.extend.core.primitives as primitives
import jax.numpy as jnp
from _tolerance import assert_close
from jax.extend.core import Primitive

import jshard as js
from jshard.rules import FALLBACKS, RULES

ALL = sorted({p.name for p in vars(primitives).values() if isinstance(p, Primitive)})


def test_every_primitive_has_a_rule_or_a_documented_fallback():
    assert len(ALL) > 150
    assert [name for name in ALL if name not in RULES and name not in FALLBACKS] == []
    assert not set(RULES) & set(FALLBACKS)


def test_elementwise_special_functions_propagate():
    """MindSpore's propagation passes a Mul's strategy ((8, 1), (8, 1)) through Igamma, Igammac,
    Zeta and the Bessel functions. Planned only: compiling their series on CPU would be the suite's
    slowest seconds, and an elementwise operator computes the same on any slice."""
    def net(x, y):
        out = js.shard(jnp.multiply, ((8, 1), (8, 1)))(x, y)
        out = jax.lax.igammac(jax.lax.igamma(out, y) + 1.0, y)
        return jax.lax.bessel_i0e(jax.lax.zeta(out + 1.0, y))

    x, y = jnp.full((16, 8), 1.5), jnp.full((16, 8), 2.0)
    step = js.parallelize(net, devices=8, mode="semi_auto", dataset_strategy="full_batch")
    plan = step.plan(x, y)
    for primitive in ("igamma", "igammac", "zeta", "bessel_i0e"):
        (op,) = [op for op in plan.ops if op.primitive == primitive]
        assert op.ruled and op.origin == "propagated" and op.in_strategy[0] == (8, 1), primitive


def test_cholesky_keeps_the_batch_cut():
    """A batched Cholesky: the batch dim cut as its producer's, the matrix dims whole."""
    def net(a, b):
        m = js.shard(jnp.matmul, ((8, 1, 1), (8, 1, 1)))(a, jnp.swapaxes(b, -1, -2)) + 4.0 * jnp.eye(4)[None]
        return jnp.linalg.cholesky(m)

    a = jnp.asarray(jax.random.normal(jax.random.key(0), (8, 4, 4)))
    step = js.parallelize(net, devices=8, mode="semi_auto", dataset_strategy="full_batch")
    (op,) = [op for op in step.plan(a, a).ops if op.primitive == "cholesky"]
    assert op.ruled and op.in_strategy == ((8, 1, 1),)
    assert_close(step(a, a), jax.jit(net)(a, a), terms=64)


def test_a_fallback_is_named_in_the_plan():
    """`custom_linear_solve` has no rule: its record says so and `explain` gives the fallback."""
    def net(x):
        y = js.shard(jnp.multiply, ((8,), (8,)))(x, x)
        return jax.lax.custom_linear_solve(lambda v: 2.0 * v, y, solve=lambda mv, b: b / 2.0)

    plan = js.parallelize(net, devices=8, mode="semi_auto", dataset_strategy="full_batch").plan(jnp.ones(16))
    (op,) = [op for op in plan.ops if op.primitive == "custom_linear_solve"]
    assert not op.ruled and op.origin == "default"
    assert FALLBACKS["custom_linear_solve"] in plan.explain(op)
