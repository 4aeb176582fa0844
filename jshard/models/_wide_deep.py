"""Reference Wide&Deep recommendation model: one embedding table (its last column the wide part's
weights) and an MLP over the concatenated embeddings (the deep part); logistic loss.

`wide_deep_step` trains it with the table either on the host (`jshard.hetero.HostTable`: looked up
and updated sparsely there, MindSpore's parameter-server mode) or on the device (a plain array,
the same SGD on the rows through the dense gradient): the two are the same computation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jshard.hetero import HostTable, lookup, sparse_update


@dataclasses.dataclass(frozen=True, slots=True)
class WideDeepConfig:
    vocabulary: int = 1024
    dim: int = 8
    fields: int = 4
    hidden: int = 32


def init_wide_deep(cfg: WideDeepConfig, key: jax.Array) -> tuple[dict, jax.Array]:
    """The deep part's parameters and the table `(vocabulary, dim + 1)` (column `dim`: wide weights)."""
    k = jax.random.split(key, 3)
    d_in = cfg.fields * cfg.dim
    params = {"w0": jax.random.normal(k[0], (d_in, cfg.hidden)) / np.sqrt(d_in), "b0": jnp.zeros(cfg.hidden),
              "w1": jax.random.normal(k[1], (cfg.hidden, 1)) / np.sqrt(cfg.hidden), "b1": jnp.zeros(1)}
    return params, jax.random.normal(k[2], (cfg.vocabulary, cfg.dim + 1)) * 0.1


def wide_deep_loss(params: dict, rows: jax.Array, labels: jax.Array) -> jax.Array:
    """Logistic loss from the looked-up `rows` `(batch, fields, dim + 1)`."""
    deep = rows[..., :-1].reshape(rows.shape[0], -1)
    hidden = jax.nn.relu(deep @ params["w0"] + params["b0"][None, :])
    logit = (hidden @ params["w1"])[:, 0] + params["b1"][0] + rows[..., -1].sum(-1)
    return optax.sigmoid_binary_cross_entropy(logit, labels).mean()


def wide_deep_step(optimizer: optax.GradientTransformation, table_learning_rate: float) -> Callable[..., Any]:
    """`step(params, opt_state, table, batch) -> (params, opt_state, table, loss)`: the deep part by
    `optimizer`, the table by SGD on the rows the batch touched. `table` is a `HostTable` (looked up
    and updated on the host) or an array (on the device)."""

    def step(params, opt_state, table, batch):
        ids, labels = batch
        rows = lookup(table, ids) if isinstance(table, HostTable) else table[ids]
        loss, (grads, row_grads) = jax.value_and_grad(wide_deep_loss, argnums=(0, 1))(params, rows, labels)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        if isinstance(table, HostTable):
            table = sparse_update(table, ids, row_grads, table_learning_rate)
        else:
            table = table.at[ids].add(-table_learning_rate * row_grads)
        return optax.apply_updates(params, updates), opt_state, table, loss

    return step


def wide_deep_batch(rng: np.random.Generator, cfg: WideDeepConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids `(batch, fields)` and labels from a fixed random rule on them (a few ids click), so the loss falls."""
    ids = rng.integers(0, cfg.vocabulary, size=(batch, cfg.fields)).astype(np.int32)
    clicky = np.random.default_rng(0).random(cfg.vocabulary) < 0.3
    return ids, (clicky[ids].sum(-1) >= 2).astype(np.float32)
