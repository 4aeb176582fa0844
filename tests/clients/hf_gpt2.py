"""GPT-2 from Hugging Face transformers, imported unmodified (`FlaxGPT2LMHeadModel`, pinned in the
`test` extra), built from a small config with random weights (no download), and trained as the
library's Flax causal-LM example trains it (`run_clm_flax.py`): a `TrainState` with AdamW, a loss
on the shifted labels, `jax.value_and_grad` and `apply_gradients`. Dropout is off (`train=False`),
so one device and every mode compute the same values. AdamW's `eps` is 1e-3 rather than 1e-8:
the attention's key bias gets a zero gradient (softmax is shift-invariant), which Adam with a
tiny `eps` turns into `lr * sign(rounding noise)`, different for every summation order."""

import jax
import numpy as np
import optax
from flax.training import train_state
from transformers import FlaxGPT2LMHeadModel, GPT2Config

VOCAB, LENGTH, ROWS = 64, 8, 16


def create(rows: int = ROWS):
    """`(state, batch)`: a 2-layer GPT-2 of width 32 in a `TrainState` (AdamW), and one batch."""
    config = GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=32, n_layer=2, n_head=2)
    model = FlaxGPT2LMHeadModel(config, seed=0)
    state = train_state.TrainState.create(apply_fn=model.__call__, params=model.params, tx=optax.adamw(1e-3, eps=1e-3))
    ids = np.random.default_rng(0).integers(0, VOCAB, (rows, LENGTH)).astype(np.int32)
    return state, {"input_ids": ids, "labels": ids}


def loss_fn(apply_fn, params, batch):
    logits = apply_fn(input_ids=batch["input_ids"], params=params, train=False)[0]
    shift_logits, shift_labels = logits[..., :-1, :], batch["labels"][..., 1:]
    return optax.softmax_cross_entropy(shift_logits, jax.nn.one_hot(shift_labels, shift_logits.shape[-1])).mean()


def train_step(state, batch):
    loss, grad = jax.value_and_grad(lambda params: loss_fn(state.apply_fn, params, batch))(state.params)
    return state.apply_gradients(grads=grad), {"loss": loss}


def terms() -> int:
    """The term count for `assert_close`: the widest dot (4·32), the rows of the mean, two layers' chain."""
    return 4 * 32 + ROWS * LENGTH + 64
