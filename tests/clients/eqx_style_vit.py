"""A small Vision Transformer written the way an equinox user writes one, without equinox: every
module a frozen dataclass registered as a pytree (`jax.tree_util.register_dataclass`, static
hyperparameters as `jax.tree.static` fields), its `__call__` written for ONE example (a `Linear`'s
weight is `(out, in)` and it maps a vector; a `LayerNorm` normalizes one token), the per-token and
per-head code `jax.vmap`-ed inside the model and the batch `jax.vmap`-ed in the loss, as equinox's
ViT and `MultiheadAttention` do (its projections without bias, equinox's default); a train step with
optax (SGD with momentum).

Its author shards it as equinox's "autoparallelism" example does (`eqx.filter_shard`: a
`jax.device_put` of the pytree outside the step, `jax.lax.with_sharding_constraint` of the same
pytree inside it, at the start and after the update), with Megatron's tensor parallel on a
`("data", "model")` mesh chosen by one function of each leaf's path (`sharding_of`): the query, key,
value and first MLP `Linear`s cut by output rows over `model`, the attention output and second MLP
`Linear`s by input columns, everything else whole; the optimizer's momentum, which mirrors the
model's pytree, by the same function; the images and labels cut by batch over `data`. Those
constraints are jshard's anchors; the expert plan is the same step under a plain `jax.jit` of the
placed pytrees."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

MESH_SHAPE, MESH_AXES = (4, 2), ("data", "model")
ROWS, CHANNELS, SIZE, PATCH, DIM, HEADS, HIDDEN, LAYERS, CLASSES = 8, 3, 8, 2, 16, 4, 32, 2, 4
COLUMN_PARALLEL, ROW_PARALLEL = ("query", "key", "value", "up"), ("output", "down")


def _init(key, shape, fan_in):
    return jax.random.uniform(key, shape, jnp.float32, -1.0, 1.0) / math.sqrt(fan_in)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Linear:
    """`weight @ x + bias` for one vector `x`; `bias` None without one (`use_bias=False`)."""

    weight: jax.Array
    bias: jax.Array | None

    @classmethod
    def create(cls, key, in_features: int, out_features: int, use_bias: bool = True) -> "Linear":
        wkey, bkey = jax.random.split(key)
        bias = _init(bkey, (out_features,), in_features) if use_bias else None
        return cls(_init(wkey, (out_features, in_features), in_features), bias)

    def __call__(self, x):
        x = self.weight @ x
        return x if self.bias is None else x + self.bias


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerNorm:
    weight: jax.Array
    bias: jax.Array
    eps: float = jax.tree.static(default=1e-5)

    @classmethod
    def create(cls, dim: int) -> "LayerNorm":
        return cls(jnp.ones((dim,)), jnp.zeros((dim,)))

    def __call__(self, x):
        mean = x.mean()
        variance = ((x - mean) ** 2).mean()
        return (x - mean) * jax.lax.rsqrt(variance + self.eps) * self.weight + self.bias


def dot_product_attention(q, k, v):
    """One head: `q`, `k`, `v` `(length, head_dim)`."""
    logits = q @ k.T / math.sqrt(q.shape[-1])
    return jax.nn.softmax(logits, axis=-1) @ v


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MultiheadAttention:
    """Self-attention over one sequence `(length, dim)`, its projections without bias (equinox's
    defaults), each head's attention `vmap`-ed."""

    query: Linear
    key: Linear
    value: Linear
    output: Linear
    heads: int = jax.tree.static()

    @classmethod
    def create(cls, key, dim: int, heads: int) -> "MultiheadAttention":
        q, k, v, o = jax.random.split(key, 4)
        return cls(*(Linear.create(part, dim, dim, use_bias=False) for part in (q, k, v, o)), heads=heads)

    def __call__(self, x):
        length, dim = x.shape
        q, k, v = (jax.vmap(proj)(x).reshape(length, self.heads, dim // self.heads)
                   for proj in (self.query, self.key, self.value))
        out = jax.vmap(dot_product_attention, in_axes=1, out_axes=1)(q, k, v)
        return jax.vmap(self.output)(out.reshape(length, dim))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Block:
    norm1: LayerNorm
    attention: MultiheadAttention
    norm2: LayerNorm
    up: Linear
    down: Linear

    @classmethod
    def create(cls, key, dim: int, heads: int, hidden: int) -> "Block":
        a, u, d = jax.random.split(key, 3)
        return cls(LayerNorm.create(dim), MultiheadAttention.create(a, dim, heads), LayerNorm.create(dim),
                   Linear.create(u, dim, hidden), Linear.create(d, hidden, dim))

    def __call__(self, x):
        x = x + self.attention(jax.vmap(self.norm1)(x))
        h = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(x)))
        return x + jax.vmap(self.down)(h)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VisionTransformer:
    embed: Linear
    position: jax.Array
    blocks: tuple[Block, ...]
    norm: LayerNorm
    head: Linear
    patch: int = jax.tree.static()

    @classmethod
    def create(cls, key, *, channels=CHANNELS, size=SIZE, patch=PATCH, dim=DIM, heads=HEADS, hidden=HIDDEN,
               layers=LAYERS, classes=CLASSES) -> "VisionTransformer":
        e, p, h, *b = jax.random.split(key, 3 + layers)
        patches = (size // patch) ** 2
        return cls(Linear.create(e, channels * patch * patch, dim), 0.02 * jax.random.normal(p, (patches, dim)),
                   tuple(Block.create(k, dim, heads, hidden) for k in b), LayerNorm.create(dim),
                   Linear.create(h, dim, classes), patch=patch)

    def __call__(self, image):
        """`image` `(channels, height, width)` -> class logits."""
        c, height, width = image.shape
        p = self.patch
        patches = image.reshape(c, height // p, p, width // p, p).transpose(1, 3, 0, 2, 4).reshape(-1, c * p * p)
        x = jax.vmap(self.embed)(patches) + self.position
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x.mean(axis=0)))


OPTIMIZER = optax.sgd(0.05, momentum=0.9)


def create(rows: int = ROWS):
    """The model, its optimizer state and one batch `(images, labels)`."""
    model = VisionTransformer.create(jax.random.key(0))
    rng = np.random.default_rng(0)
    images = jnp.asarray(rng.normal(size=(rows, CHANNELS, SIZE, SIZE)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, CLASSES, size=(rows,)), jnp.int32)
    return model, OPTIMIZER.init(model), images, labels


def make_mesh(devices=None, shape=MESH_SHAPE):
    """The `("data", "model")` mesh of `shape`, its axes `Auto`: the constraints say where things go."""
    devices = jax.devices()[: math.prod(shape)] if devices is None else devices
    return jax.make_mesh(shape, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=devices)


def sharding_of(path, leaf) -> P:
    """The author's rule, by the names along a leaf's path (for the model and for the optimizer's
    momentum alike): Megatron's column and row cuts over `model`, everything else whole."""
    names = [k.name for k in path if isinstance(k, jax.tree_util.GetAttrKey)]
    owner, field = (names[-2], names[-1]) if len(names) >= 2 else (None, None)
    if owner in COLUMN_PARALLEL:
        return P("model", None) if field == "weight" else P("model")
    if owner in ROW_PARALLEL and field == "weight":
        return P(None, "model")
    return P(*(None,) * np.ndim(leaf))


def specs(tree):
    """`sharding_of` every leaf of `tree` (the model, its optimizer state, or both)."""
    return jax.tree_util.tree_map_with_path(sharding_of, tree)


BATCH = P("data")


def loss_fn(model, images, labels):
    logits = jax.vmap(model)(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def train_step(model, opt_state, images, labels):
    """One SGD step; the current mesh (`jax.set_mesh`) is the one the constraints name."""
    model, opt_state = jax.lax.with_sharding_constraint((model, opt_state), specs((model, opt_state)))
    images, labels = jax.lax.with_sharding_constraint((images, labels), (BATCH, BATCH))
    loss, grads = jax.value_and_grad(loss_fn)(model, images, labels)
    updates, opt_state = OPTIMIZER.update(grads, opt_state, model)
    model = optax.apply_updates(model, updates)
    model, opt_state = jax.lax.with_sharding_constraint((model, opt_state), specs((model, opt_state)))
    return model, opt_state, loss


def place(mesh, model, opt_state, images, labels):
    """The author's `filter_shard` outside the step: every pytree put on its sharding over `mesh`."""
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), specs((model, opt_state)),
                             is_leaf=lambda x: isinstance(x, P))
    model, opt_state = jax.device_put((model, opt_state), shardings)
    images, labels = jax.device_put((images, labels), NamedSharding(mesh, BATCH))
    return model, opt_state, images, labels
