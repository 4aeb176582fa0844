"""A user target for `jshard plan tests/_cli_example.py:example` (the CLI test's MODULE:FUNCTION)."""

import jax
import jax.numpy as jnp


def mlp_step(w1, w2, x):
    """One SGD step of a two-layer MLP on a squared-activation loss."""

    def loss(w1, w2):
        return jnp.mean(jax.nn.relu(x @ w1) @ w2 ** 2)

    g1, g2 = jax.grad(loss, argnums=(0, 1))(w1, w2)
    return w1 - 0.1 * g1, w2 - 0.1 * g2


def example():
    """`(fn, args)`: the function to plan and example inputs, shapes only."""
    f32 = jnp.float32
    return mlp_step, (jax.ShapeDtypeStruct((256, 512), f32), jax.ShapeDtypeStruct((512, 128), f32),
                      jax.ShapeDtypeStruct((64, 256), f32))


def not_a_pair():
    return 42
