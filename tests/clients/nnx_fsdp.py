"""An NNX MLP language-model block with fsdp x tensor sharding of its own, written as Flax's Gemma
example and its explicit-sharding guide write it: on `jax.make_mesh((4, 2), ("fsdp", "tensor"))`
(whose axes are `Explicit` since JAX 0.9) made current by `jax.set_mesh`, every parameter made
with `nnx.with_partitioning` (its embedding dim over `fsdp`, its hidden dim over `tensor`),
gathered over `fsdp` where it is used with `jax.sharding.reshard`, the activations' batch dim put
over `fsdp` by the embedding lookup's `out_sharding` (and each contraction over a cut dim given
its own), and a train step of `nnx.Optimizer` in NNX's functional form
(`nnx.split` / `nnx.merge`) for a plain `jax.jit`. The batch comes from the host as NumPy arrays,
as a data loader gives it."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import reshard

ROWS, LENGTH, VOCAB, EMBED, MLP = 8, 4, 32, 16, 32


def partitioned(*names):
    return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class FeedForward(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.up = nnx.Linear(EMBED, MLP, kernel_init=partitioned("fsdp", "tensor"), use_bias=False, rngs=rngs)
        self.down = nnx.Linear(MLP, EMBED, kernel_init=partitioned("tensor", "fsdp"), use_bias=False, rngs=rngs)

    def __call__(self, x):
        up = reshard(self.up.kernel[...], P(None, "tensor"))  # FSDP: gather the weight's fsdp shards
        h = nnx.gelu(jnp.einsum("ble,ef->blf", x, up))
        down = reshard(self.down.kernel[...], P("tensor", None))
        return jnp.einsum("blf,fe->ble", h, down, out_sharding=P())


class Model(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, EMBED, embedding_init=nnx.with_partitioning(
            nnx.initializers.normal(), ("tensor", "fsdp")), rngs=rngs)
        self.norm = nnx.RMSNorm(EMBED, rngs=rngs)
        self.mlp = FeedForward(rngs)

    def __call__(self, tokens):
        table = reshard(self.embed.embedding[...], P())
        x = table.at[tokens].get(out_sharding=P("fsdp"))  # the activations' batch over fsdp
        x = x + self.mlp(self.norm(x))
        return jnp.einsum("ble,ve->blv", x, table)


def make_mesh(devices=None):
    """`("fsdp", "tensor")`, as `jax.make_mesh` makes it (`Explicit` axes): 4 x 2 on eight
    devices, 1 x 1 on one."""
    devices = jax.devices() if devices is None else devices
    shape = (4, 2) if len(devices) == 8 else (1, 1)
    return jax.make_mesh(shape, ("fsdp", "tensor"), devices=devices)


@nnx.jit
def create_model() -> Model:
    return Model(nnx.Rngs(params=0))


def create_state():
    """`(graphdef, state, batch)` (call under `jax.set_mesh`): the model and its optimizer split,
    and one batch of NumPy tokens `{"inputs", "targets"}`."""
    model = create_model()
    optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(ROWS, LENGTH + 1)).astype(np.int32)
    return graphdef, state, {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def train_step(graphdef, state, batch):
    model, optimizer = nnx.merge(graphdef, state)

    def loss_fn(model):
        logits = model(batch["inputs"])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), loss
