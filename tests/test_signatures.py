"""One compiled program per input signature, keyed as `jax.jit` keys it (issue 30, item 2): weak
types kept in results and in the cache, so a loop feeding back its own results compiles once."""

import jax
import jax.numpy as jnp
import pytest
from clients import compiled

import jshard as js


def step(n, w, x):
    return n + 1, w - 0.1 * jnp.tanh(x @ w).mean(0, keepdims=True)


@pytest.mark.parametrize("mode", ["data", "semi_auto", "auto"])
def test_a_weakly_typed_counter_fed_back_compiles_once_as_under_jax_jit(mode):
    # was: two compiles; `n + 1` with n = 0 came back a strong int32, a new signature for the second call
    mesh = jax.make_mesh((2, 4), ("dp", "mp"))  # Explicit axes
    parallel = js.parallelize(step, mesh=mesh, mode=mode)

    def reference(n, w, x):  # a new function each time, so that jax.jit compiles it here
        return step(n, w, x)

    for name, fn in (("jit(reference)", jax.jit(reference)), ("jit(run)", parallel)):
        n, w, x = 0, jnp.eye(8), jnp.ones((8, 8))
        with compiled() as names:
            for _ in range(3):
                n, w = fn(n, w, x)
        assert names.count(name) == 1, names
        assert (int(n), n.dtype, n.weak_type) == (3, jnp.int32, True)


def test_a_python_scalar_and_the_weak_array_it_becomes_share_one_plan():
    parallel = js.parallelize(step, devices=8)
    w, x = jnp.eye(8), jnp.ones((8, 8))
    assert parallel.plan(0, w, x) is parallel.plan(jnp.asarray(0) + 0, w, x)
    assert parallel.plan(0, w, x) is not parallel.plan(jnp.int32(0), w, x)  # a strong int32 is another signature
