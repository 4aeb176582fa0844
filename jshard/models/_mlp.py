"""Reference MLP: a stack of dense layers with ReLU, regression loss; plain JAX."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jshard.models._presets import Preset

# Column-parallel then row-parallel, alternating (Megatron's FFN pairing).
MLP_RULES = {r"w\d*[02468]$": "column", r"w\d*[13579]$": "row"}


@dataclasses.dataclass(frozen=True, slots=True)
class MLPConfig:
    d_in: int = 32
    d_hidden: int = 64
    d_out: int = 16
    n_layers: int = 2


def init_mlp(cfg: MLPConfig, key: jax.Array) -> dict:
    """Parameters `w0, b0, w1, b1, ...`: alternating expand (`d_hidden`) and contract layers."""
    sizes = [cfg.d_in] + [cfg.d_hidden if i % 2 == 0 else cfg.d_in for i in range(cfg.n_layers - 1)] + [cfg.d_out]
    params = {}
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        key, sub = jax.random.split(key)
        params[f"w{i}"] = jax.random.normal(sub, (a, b), jnp.float32) / np.sqrt(a)
        params[f"b{i}"] = jnp.zeros((b,), jnp.float32)
    return params


def mlp_apply(params: dict, x: jax.Array, preset: Preset | None = None) -> jax.Array:
    """The MLP; with a preset, even layers are column-parallel and odd ones row-parallel."""
    n = len(params) // 2
    for i in range(n):
        kind = "column" if i % 2 == 0 else "row"
        mm = jnp.matmul if preset is None else preset.matmul(kind, x.ndim)
        x = mm(x, params[f"w{i}"]) + params[f"b{i}"][None, :]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def mlp_loss(params: dict, batch: tuple[jax.Array, jax.Array], preset: Preset | None = None) -> jax.Array:
    """Mean squared error against `batch = (x, y)`."""
    x, y = batch
    return jnp.mean((mlp_apply(params, x, preset) - y) ** 2)


def mlp_batch(rng: np.random.Generator, cfg: MLPConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """A regression batch: `y` is a fixed random linear map of `x`, so the loss can fall."""
    teacher = np.random.default_rng(0).normal(size=(cfg.d_in, cfg.d_out)).astype(np.float32) / np.sqrt(cfg.d_in)
    x = rng.normal(size=(batch, cfg.d_in)).astype(np.float32)
    return x, x @ teacher
