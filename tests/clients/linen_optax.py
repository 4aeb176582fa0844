"""A Flax Linen MLP language model trained as Flax's examples train one: a `TrainState` holding
the parameters and an optax AdamW state, a step `train_step(state, batch) -> (state, metrics)`
that differentiates the loss and applies the gradients. The one line jshard asks of it marks the
gradient function (`jshard.accumulate(jax.value_and_grad(loss_fn))`), so that under
`pipeline=` the pipeline runs it and under `accumulation=` its micro-batches do
(`reference_step` is the step without it, run on one device)."""

import flax.linen as nn
import jax
import numpy as np
import optax
from flax.training import train_state

import jshard as js

VOCAB, D, LENGTH, ROWS, BLOCKS = 32, 16, 8, 32, 2


class Block(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm()(x)
        return x + nn.Dense(D)(nn.gelu(nn.Dense(2 * D)(h)))


class LM(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, D)(tokens)
        for _ in range(BLOCKS):
            x = Block()(x)
        return nn.Dense(VOCAB)(nn.LayerNorm()(x))


def create(rows: int = ROWS):
    """`(state, batch)`: a fresh `TrainState` (AdamW) and one batch `{"tokens", "targets"}`."""
    model = LM()
    tokens = np.random.default_rng(0).integers(0, VOCAB, (rows, LENGTH)).astype(np.int32)
    params = model.init(jax.random.key(0), tokens)["params"]
    state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adamw(3e-3))
    return state, {"tokens": tokens, "targets": np.roll(tokens, -1, axis=1)}


def loss_fn(apply_fn, params, batch):
    logits = apply_fn({"params": params}, batch["tokens"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()


def train_step(state, batch):
    grad_fn = jax.value_and_grad(lambda params, batch: loss_fn(state.apply_fn, params, batch))
    loss, grads = js.accumulate(grad_fn)(state.params, batch)
    state = state.apply_gradients(grads=grads)
    return state, {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def reference_step(state, batch):
    """The same step with no mark, as the author wrote it before jshard: the one-device reference."""
    loss, grads = jax.value_and_grad(lambda params: loss_fn(state.apply_fn, params, batch))(state.params)
    return state.apply_gradients(grads=grads), {"loss": loss, "grad_norm": optax.tree.norm(grads)}


def terms() -> int:
    """The term count for `assert_close`: the widest dot (2·D), the rows of the mean, the blocks' chain."""
    return 2 * D + ROWS * LENGTH + 16 * BLOCKS
