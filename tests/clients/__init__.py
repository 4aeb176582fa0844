"""Client code: small models written the way Flax's own examples write them, for jshard to run as is.

Each module holds one model and its train step as a Flax user writes them (Linen `nn.Module` with
`TrainState`, or NNX modules with `nnx.Rngs`), kept small so that every mode compiles quickly.
`one_device` runs the reference (`jax.jit` on one device); each model's `terms()` is the term count
`tests/_tolerance.py`'s `assert_close` compares a parallelized step's results with it at.
"""

import jax


def one_device(fn, *args, jit_options: dict | None = None, **kwargs):
    """`fn(*args, **kwargs)` under `jax.jit(fn, **jit_options)` with every array on the first device."""
    first = jax.devices()[0]
    args, kwargs = jax.tree.map(lambda a: jax.device_put(a, first) if isinstance(a, jax.Array) else a, (args, kwargs))
    return jax.jit(fn, **(jit_options or {}))(*args, **kwargs)
