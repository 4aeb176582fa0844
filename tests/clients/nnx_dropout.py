"""An NNX classifier with dropout and its train step, written as Flax's NNX examples write them
(`nnx.Rngs` streams, `nnx.Dropout(rngs=...)`, `nnx.value_and_grad`), in NNX's functional form for a
plain `jax.jit`: the step takes the graph definition and the state (`nnx.split`), merges them,
reseeds the dropout stream with the step's key and returns the new state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _tolerance import step_terms
from flax import nnx


class MLP(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def create_state(rows: int = 16, features: int = 16, classes: int = 8):
    """`(graphdef, state, batch)`: the model split, and one batch `{"x", "y"}` of `rows` examples."""
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, classes, size=(rows,)), jnp.int32)}
    graphdef, state = nnx.split(MLP(features, 32, classes, rngs=nnx.Rngs(params=0, dropout=1)))
    return graphdef, state, batch


def train_step(graphdef, state, dropout_key, batch):
    model = nnx.merge(graphdef, state)
    nnx.reseed(model, dropout=dropout_key)

    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return nnx.state(model), loss


def terms() -> int:
    """The terms one train step's results sum (`tests/_tolerance.py`): what `assert_close` allows for."""
    _, state, batch = create_state()
    return step_terms(state, batch)
