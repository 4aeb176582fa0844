"""A stage chunk's forward run under `jax.vjp` in the stacked pipeline program (`_engine.py`): the
run switched on the stage (`stage_runner`), the residuals its pullback stores (`residuals`: its
leaves that are not the chunk's own parameters), and how to rebuild the pullback from them
(`PullbackShape`)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp


def stage_runner(fns, stage):
    return lambda chunk, x: jax.lax.switch(stage, fns, chunk, x)


def residuals(run, chunk, x):
    """`(stored, y, pullback)`: `run(chunk, x)` under `jax.vjp`; `stored` are the pullback's leaves
    that are not the chunk's own parameters (those are read again at the backward)."""
    y, pull = jax.vjp(run, chunk, x)
    params = jax.tree.leaves(chunk)
    leaves = jax.tree.leaves(pull)
    return [jnp.asarray(leaf) for leaf in leaves if not any(leaf is p for p in params)], y, pull


@dataclasses.dataclass(frozen=True)
class PullbackShape:
    """How to rebuild a chunk's pullback: its pytree structure, and for each leaf the index of the
    chunk parameter it is (None: a stored residual). Read once per program from one `jax.vjp`."""

    tree: Any
    param_of: tuple[int | None, ...]
    stored: tuple[jax.ShapeDtypeStruct, ...]

    @classmethod
    def of(cls, run, chunk, act) -> PullbackShape:
        found = {}

        def probe(chunk, x):
            _, pull = jax.vjp(run, chunk, x)
            params = jax.tree.leaves(chunk)
            leaves, found["tree"] = jax.tree.flatten(pull)
            found["param_of"] = tuple(next((k for k, p in enumerate(params) if leaf is p), None) for leaf in leaves)
            return [leaf for leaf, k in zip(leaves, found["param_of"]) if k is None]

        shapes = lambda t: jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), t)
        stored = jax.eval_shape(probe, shapes(chunk), shapes(act))
        return cls(found["tree"], found["param_of"], tuple(stored))

    def rebuild(self, chunk, stored):
        params, it = jax.tree.leaves(chunk), iter(stored)
        return jax.tree.unflatten(self.tree, [next(it) if k is None else params[k] for k in self.param_of])
