"""A Linen transformer language model with logical axis rules and dropout, written as Flax's LM1B
example writes it: parameters made with `nn.with_logical_partitioning`, activations constrained by
`nn.with_logical_constraint`, one `LOGICAL_RULES` table mapping logical axes to the mesh axes
`("data", "model")`, and the expert sharding built the LM1B way (`nn.get_partition_spec` of the
abstract state, `nn.logical_to_mesh_sharding`) for a plain `jax.jit` with `in_shardings`."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

VOCAB, EMBED, HEADS, MLP, LENGTH, ROWS = 32, 16, 4, 32, 8, 8
MESH_SHAPE, MESH_AXES = (4, 2), ("data", "model")
LOGICAL_RULES = (("batch", "data"), ("vocab", "model"), ("heads", "model"), ("mlp", "model"),
                 ("embed", None), ("length", None), ("kv", None))


def dense(features, names, name):
    return nn.Dense(features, use_bias=False, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names),
                           name=name)


class Block(nn.Module):
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, *, train: bool):
        y = nn.LayerNorm(use_scale=False, use_bias=False)(x)
        q, k, v = (dense(EMBED, ("embed", "heads"), n)(y).reshape(*y.shape[:2], HEADS, EMBED // HEADS)
                   for n in ("query", "key", "value"))
        q = nn.with_logical_constraint(q, ("batch", "length", "heads", "kv"))
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(EMBED // HEADS)
        mask = jnp.tril(jnp.ones((LENGTH, LENGTH), bool))
        weights = nn.softmax(jnp.where(mask, logits, -1e9), axis=-1)
        weights = nn.Dropout(self.dropout_rate, deterministic=not train)(weights)
        att = jnp.einsum("bhqk,bkhd->bqhd", weights, v)
        out = dense(EMBED, ("heads", "embed"), "out")(att.reshape(y.shape))
        x = nn.with_logical_constraint(x + out, ("batch", "length", "embed"))
        y = nn.LayerNorm(use_scale=False, use_bias=False)(x)
        h = nn.relu(dense(MLP, ("embed", "mlp"), "wi")(y))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))
        h = nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        return nn.with_logical_constraint(x + dense(EMBED, ("mlp", "embed"), "wo")(h), ("batch", "length", "embed"))


class TransformerLM(nn.Module):
    layers: int = 1

    @nn.compact
    def __call__(self, tokens, *, train: bool):
        embed = nn.Embed(VOCAB, EMBED, embedding_init=nn.with_logical_partitioning(nn.initializers.normal(1.0),
                                                                                   ("vocab", "embed")))
        x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
        for i in range(self.layers):
            x = Block(name=f"block{i}")(x, train=train)
        return embed.attend(nn.LayerNorm(use_scale=False, use_bias=False)(x))


MODEL, TX = TransformerLM(), optax.sgd(0.1)


def init_state(tokens) -> train_state.TrainState:
    """The `TrainState` (SGD) of freshly initialized parameters, boxed with their logical names."""
    variables = MODEL.init(jax.random.key(0), tokens, train=False)
    return train_state.TrainState.create(apply_fn=MODEL.apply, params=variables["params"], tx=TX)


def create_state() -> tuple[train_state.TrainState, dict]:
    """A `TrainState` (parameters unboxed) and one batch `{"inputs", "targets"}`."""
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, VOCAB, size=(ROWS, LENGTH + 1)), jnp.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    return nn.meta.unbox(jax.jit(init_state)(batch["inputs"])), batch


def train_step(state, batch, dropout_rng):
    dropout_rng = jax.random.fold_in(dropout_rng, state.step)

    def loss_fn(params):
        logits = state.apply_fn({"params": params}, batch["inputs"], train=True, rngs={"dropout": dropout_rng})
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss


def make_mesh():
    """The `("data", "model")` mesh, its axes `Auto` as Linen's constraints want them."""
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)


def expert_shardings(mesh):
    """The LM1B way: the state's logical specs from the abstract init, through `LOGICAL_RULES`;
    the batch cut over `data`."""
    logical = nn.get_partition_spec(jax.eval_shape(init_state, jnp.zeros((ROWS, LENGTH), jnp.int32)))
    state = nn.logical_to_mesh_sharding(logical, mesh, LOGICAL_RULES)
    return state, {"inputs": NamedSharding(mesh, P("data")), "targets": NamedSharding(mesh, P("data"))}

