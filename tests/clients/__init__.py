"""Client code: small models written the way Flax's own examples write them, for jshard to run as is.

Each module holds one model and its train step as a Flax user writes them (Linen `nn.Module` with
`TrainState`, or NNX modules with `nnx.Rngs`), kept small so that every mode compiles quickly.
`one_device` runs the reference (`jax.jit` on one device) and `assert_close` compares a
parallelized result with it.
"""

import jax
import jax.numpy as jnp
import numpy as np

ULPS = 64
"""How many units of the dtype's eps (times the reference's largest magnitude) results may differ by:
cutting a sum over devices changes its order of additions, nothing else."""


def one_device(fn, *args, jit_options: dict | None = None, **kwargs):
    """`fn(*args, **kwargs)` under `jax.jit(fn, **jit_options)` with every array on the first device."""
    first = jax.devices()[0]
    args, kwargs = jax.tree.map(lambda a: jax.device_put(a, first) if isinstance(a, jax.Array) else a, (args, kwargs))
    return jax.jit(fn, **(jit_options or {}))(*args, **kwargs)


def assert_close(got, want) -> None:
    """Every leaf of `got` equals `want`'s: floats within `ULPS` eps of the largest magnitude of the
    reference leaf, integers, booleans and PRNG keys (their key data) exactly."""
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for a, b in zip(got_leaves, want_leaves):
        if jax.dtypes.issubdtype(b.dtype, jax.dtypes.prng_key):
            assert jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        a, b = np.asarray(a), np.asarray(b)
        assert a.shape == b.shape and a.dtype == b.dtype
        if jnp.issubdtype(b.dtype, jnp.inexact):
            scale = float(np.abs(b).max(initial=0.0)) or 1.0
            np.testing.assert_allclose(a, b, rtol=0, atol=ULPS * float(jnp.finfo(b.dtype).eps) * scale)
        else:
            np.testing.assert_array_equal(a, b)
