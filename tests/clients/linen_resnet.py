"""A Linen ResNet with BatchNorm, written as Flax's ImageNet example writes it: `nn.BatchNorm(
use_running_average=not train)`, a `TrainState` carrying `batch_stats`, the train step applying
the model with `mutable=["batch_stats"]`; its expert sharding is data parallel over a `("data",)`
mesh (parameters and statistics replicated, the batch cut)."""

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, SIZE, CLASSES = 16, 6, 4


class ResNetBlock(nn.Module):
    filters: int

    @nn.compact
    def __call__(self, x, *, train: bool):
        norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9)
        y = nn.relu(norm()(nn.Conv(self.filters, (3, 3), use_bias=False)(x)))
        y = norm(scale_init=nn.initializers.zeros)(nn.Conv(self.filters, (3, 3), use_bias=False)(y))
        if x.shape[-1] != self.filters:
            x = norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(x))
        return nn.relu(x + y)


class ResNet(nn.Module):
    filters: tuple[int, ...] = (16,)

    @nn.compact
    def __call__(self, x, *, train: bool):
        x = nn.relu(nn.BatchNorm(use_running_average=not train)(nn.Conv(8, (3, 3), use_bias=False)(x)))
        for f in self.filters:
            x = ResNetBlock(f)(x, train=train)
        return nn.Dense(CLASSES)(jnp.mean(x, axis=(1, 2)))


class TrainState(train_state.TrainState):
    batch_stats: dict


def create_state() -> tuple[TrainState, dict]:
    """The `TrainState` (momentum SGD, with `batch_stats`) and one batch `{"image", "label"}`."""
    rng = np.random.default_rng(0)
    batch = {"image": jnp.asarray(rng.normal(size=(ROWS, SIZE, SIZE, 3)), jnp.float32),
             "label": jnp.asarray(rng.integers(0, CLASSES, size=(ROWS,)), jnp.int32)}
    model = ResNet()
    variables = jax.jit(functools.partial(model.init, train=False))(jax.random.key(0), batch["image"])
    state = TrainState.create(apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.1, momentum=0.9),
                              batch_stats=variables["batch_stats"])
    return state, batch


def train_step(state, batch):
    def loss_fn(params):
        logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, batch["image"],
                                         train=True, mutable=["batch_stats"])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads).replace(batch_stats=updates["batch_stats"])
    return state, loss


def make_mesh():
    return jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))


def expert_shardings(mesh):
    """Data parallel: the state replicated, the batch cut over `data`."""
    return NamedSharding(mesh, P()), NamedSharding(mesh, P("data"))

