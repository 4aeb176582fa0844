"""A Linen classifier with dropout and its train step, written as Flax's Linen examples write them
(`nn.compact`, `nn.Dropout(deterministic=not train)`, `TrainState`, `rngs={"dropout": ...}`, the
step's dropout key folded with the step count as the LM1B example does), and its loop: a Python
`for` over the batches feeding each step the state the last one returned, on `jax.make_mesh`'s
mesh (`Explicit` axes)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tolerance import step_terms
from flax.training import train_state


class MLP(nn.Module):
    features: int = 32
    classes: int = 8
    dropout_rate: float = 0.25

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.Dense(self.features)(x)
        x = nn.relu(x)
        x = nn.Dropout(rate=self.dropout_rate, deterministic=not train)(x)
        return nn.Dense(self.classes)(x)


def create_state(rows: int = 16, features: int = 16) -> tuple[train_state.TrainState, dict]:
    """A `TrainState` (SGD) and one batch `{"x", "y"}` of `rows` examples."""
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, MLP.classes, size=(rows,)), jnp.int32)}
    model = MLP()
    params = model.init(jax.random.key(0), batch["x"], train=False)["params"]
    return train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.sgd(0.1)), batch


def train_step(state, batch, dropout_rng):
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["x"], train=True, rngs={"dropout": dropout_rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def terms() -> int:
    """The terms one train step's results sum (`tests/_tolerance.py`): what `assert_close` allows for."""
    state, batch = create_state()
    return step_terms(state.params, batch)


def make_mesh():
    """The data-parallel mesh over every device, as `jax.make_mesh` makes it (`Explicit` axes)."""
    return jax.make_mesh((len(jax.devices()),), ("data",))


def batches(steps: int, rows: int = 16, features: int = 16) -> list[dict]:
    """`steps` batches `{"x", "y"}` of NumPy arrays, as a data loader yields them."""
    rng = np.random.default_rng(1)
    return [{"x": rng.normal(size=(rows, features)).astype(np.float32),
             "y": rng.integers(0, MLP.classes, size=(rows,)).astype(np.int32)} for _ in range(steps)]


def train(step, state, loader, rng):
    """The loop: every batch through `step`, the state fed back; the last state and the losses."""
    losses = []
    for batch in loader:
        state, loss = step(state, batch, rng)
        losses.append(loss)
    return state, losses
