"""An NNX classifier trained as Flax's NNX examples train it: the step takes the model and its
`nnx.Optimizer` and updates both in place (`optimizer.update(model, grads)`), batch statistics
(`nnx.BatchNorm`) and the dropout stream (`nnx.Dropout(rngs=...)`) move on inside the model, and
the step returns the loss alone. Under `nnx.jit` the caller sees every update; under
`jshard.parallelize` too."""

import jax.numpy as jnp
import numpy as np
import optax
from _tolerance import step_terms
from flax import nnx


class Classifier(nnx.Module):
    def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
        self.linear1 = nnx.Linear(din, dhidden, use_bias=False, rngs=rngs)  # the norm's bias is its bias
        self.norm = nnx.BatchNorm(dhidden, rngs=rngs)
        self.dropout = nnx.Dropout(0.25, rngs=rngs)
        self.linear2 = nnx.Linear(dhidden, dout, rngs=rngs)

    def __call__(self, x):
        return self.linear2(self.dropout(nnx.relu(self.norm(self.linear1(x)))))


def create(rows: int = 16, features: int = 16, classes: int = 8):
    """`(model, optimizer, batch)`: a fresh model (the same for the same arguments), its AdamW
    optimizer, and one batch `{"x", "y"}` of `rows` examples."""
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(rows, features)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, classes, size=(rows,)), jnp.int32)}
    model = Classifier(features, 32, classes, rngs=nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param), batch


def train_step(model: Classifier, optimizer: nnx.Optimizer, batch):
    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss


def terms() -> int:
    """The terms one train step's results sum (`tests/_tolerance.py`); AdamW divides by the
    gradients' root mean square, which a few terms more cover."""
    model, _, batch = create()
    return step_terms(nnx.state(model, nnx.Param), batch) + 16
