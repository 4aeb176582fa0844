"""An NNX transformer block with grouped-query attention that shards itself, written as the NNX
Gemma writes it: on a mesh of `Explicit` axes `("fsdp", "tensor")` made current by `jax.set_mesh`,
parameters made with `nnx.with_partitioning` (so they are created sharded), every einsum given its
`out_sharding`, and the train step in NNX's functional form (`nnx.split` / `nnx.merge`) for a plain
`jax.jit`. The model is built on the eight-device mesh; the reference run moves it to a one-device mesh of
the same axes (`moved`)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

ROWS, LENGTH, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP, CLASSES = 8, 8, 16, 4, 2, 4, 32, 4
AXES = ("fsdp", "tensor")
ACT = P("fsdp", None, None)
"""Activations `[batch, length, embed]`: the batch cut over `fsdp`."""


def param(rngs, shape, sharding):
    return nnx.Param(nnx.with_partitioning(nnx.initializers.lecun_normal(), sharding)(rngs.params(), shape))


class Attention(nnx.Module):
    """`HEADS` query heads in `KV_HEADS` groups, each group sharing one key and value head."""

    def __init__(self, rngs: nnx.Rngs):
        self.q = param(rngs, (EMBED, HEADS, HEAD_DIM), ("fsdp", "tensor", None))
        self.kv = param(rngs, (2, EMBED, KV_HEADS, HEAD_DIM), (None, "fsdp", "tensor", None))
        self.o = param(rngs, (HEADS, HEAD_DIM, EMBED), ("tensor", None, "fsdp"))

    def __call__(self, x):
        groups = HEADS // KV_HEADS
        q = jnp.einsum("ble,ehd->blhd", x, self.q[...], out_sharding=P("fsdp", None, "tensor", None))
        q = q.reshape(ROWS, LENGTH, KV_HEADS, groups, HEAD_DIM, out_sharding=P("fsdp", None, "tensor", None, None))
        k, v = jnp.einsum("ble,cekd->cblkd", x, self.kv[...], out_sharding=P(None, "fsdp", None, "tensor", None))
        logits = jnp.einsum("blkgd,bmkd->bkglm", q, k, out_sharding=P("fsdp", "tensor", None, None, None))
        mask = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
        weights = jax.nn.softmax(jnp.where(mask, logits / np.sqrt(HEAD_DIM), -1e9), axis=-1)
        out = jnp.einsum("bkglm,bmkd->blkgd", weights, v, out_sharding=P("fsdp", None, "tensor", None, None))
        out = out.reshape(ROWS, LENGTH, HEADS, HEAD_DIM, out_sharding=P("fsdp", None, "tensor", None))
        return jnp.einsum("blhd,hde->ble", out, self.o[...], out_sharding=ACT)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.attention = Attention(rngs)
        self.norm1 = nnx.RMSNorm(EMBED, rngs=rngs)
        self.norm2 = nnx.RMSNorm(EMBED, rngs=rngs)
        self.up = param(rngs, (EMBED, MLP), ("fsdp", "tensor"))
        self.down = param(rngs, (MLP, EMBED), ("tensor", "fsdp"))
        self.head = param(rngs, (EMBED, CLASSES), ("fsdp", None))

    def __call__(self, x):
        x = x + self.attention(self.norm1(x))
        h = nnx.gelu(jnp.einsum("ble,ef->blf", self.norm2(x), self.up[...], out_sharding=P("fsdp", None, "tensor")))
        x = x + jnp.einsum("blf,fe->ble", h, self.down[...], out_sharding=ACT)
        return jnp.einsum("ble,ec->bc", x, self.head[...], out_sharding=P("fsdp", None))


def make_mesh(devices):
    """The `("fsdp", "tensor")` mesh of `Explicit` axes over `devices` (8: 4 x 2; 1: 1 x 1)."""
    shape = (4, 2) if len(devices) == 8 else (1, 1)
    return jax.make_mesh(shape, AXES, axis_types=(jax.sharding.AxisType.Explicit,) * 2, devices=devices)


def create_state(mesh):
    """`(graphdef, state, batch)` built on `mesh` (call under `jax.set_mesh(mesh)`): the model split
    and one batch `{"x", "y"}`, the batch placed over `fsdp`."""
    rng = np.random.default_rng(0)
    batch = {"x": jnp.asarray(rng.normal(size=(ROWS, LENGTH, EMBED)), jnp.float32),
             "y": jnp.asarray(rng.integers(0, CLASSES, size=(ROWS,)), jnp.int32)}
    batch = jax.device_put(batch, {"x": NamedSharding(mesh, ACT), "y": NamedSharding(mesh, P("fsdp"))})
    graphdef, state = nnx.split(create_model())
    return graphdef, state, batch


@nnx.jit
def create_model() -> Block:
    """The model, made in one compiled program (each parameter created on its sharding)."""
    return Block(nnx.Rngs(params=0))


def moved(tree, mesh):
    """`tree`'s arrays on `mesh` (another mesh of the same axes), each with its own `PartitionSpec`."""
    return jax.device_put(tree, jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), tree))


def train_step(graphdef, state, batch):
    model = nnx.merge(graphdef, state)

    def loss_fn(model):
        logits = model(batch["x"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads))
    return nnx.state(model), loss

