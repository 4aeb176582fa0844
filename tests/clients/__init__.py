"""Client code: small models written the way Flax's own examples write them, for jshard to run as is.

Each module holds one model and its train step as a Flax user writes them (Linen `nn.Module` with
`TrainState`, or NNX modules with `nnx.Rngs`), kept small so that every mode compiles quickly. The
`hf_*` modules import their model unmodified from Hugging Face transformers (pinned in the `test`
extra; random weights from a small config, nothing downloaded) and write only what its users write
around it: the train step, and (`hf_llama`, `hf_vit`) the partition rules of their expert plan.
`one_device` runs the reference (`jax.jit` on one device); each model's `terms()` is the term count
`tests/_tolerance.py`'s `assert_close` compares a parallelized step's results with it at.
"""

import contextlib

import jax

_COMPILED: list[list[str]] = []  # the open `compiled()` blocks' lists, innermost last


def _listen(event: str, seconds: float, **kwargs) -> None:
    if event == "/jax/core/compile/backend_compile_duration" and _COMPILED:
        _COMPILED[-1].append(kwargs.get("fun_name", "?"))


jax.monitoring.register_event_duration_secs_listener(_listen)


@contextlib.contextmanager
def compiled():
    """The names of the programs XLA compiles inside the block (`jit(run)`: a parallelized step)."""
    names: list[str] = []
    _COMPILED.append(names)
    try:
        yield names
    finally:
        _COMPILED.remove(names)


def one_device(fn, *args, jit_options: dict | None = None, **kwargs):
    """`fn(*args, **kwargs)` under `jax.jit(fn, **jit_options)` with every array on the first device."""
    first = jax.devices()[0]
    args, kwargs = jax.tree.map(lambda a: jax.device_put(a, first) if isinstance(a, jax.Array) else a, (args, kwargs))
    return jax.jit(fn, **(jit_options or {}))(*args, **kwargs)
