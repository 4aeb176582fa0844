"""A GPT in plain JAX, written the way a researcher writes one without a framework: parameters in a
dict of arrays, a Python loop over the layers (unrolled in the trace), layer norm without scale or
bias, the token embedding reused as the output head, hand-written cross entropy and SGD.

Its author parallelizes it the MindSpore way: the usual Megatron tuples on the six weight matmuls of
each layer (query, key, value and the first MLP matmul cut by columns, the attention output and the
second MLP matmul by rows, each with the batch cut `DP` ways) are the only anchors. The expert plan
is the same function under a plain `jax.jit`, its parameters laid out as Megatron lays them on a
`("dp", "mp")` mesh (column and row cuts on `mp`, the tied embedding cut by vocabulary) and the
tokens cut by batch over `dp` (issue 15: "a GPT written by someone else")."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js

DP, MP = 2, 4
MESH_SHAPE, MESH_AXES = (DP, MP), ("dp", "mp")
LAYERS, D, HEADS, FF, VOCAB, LENGTH, ROWS = 2, 64, 8, 256, 512, 16, 8
LR = 0.1

COLUMNS = ((DP, 1, 1), (1, MP))       # x (batch, length, d) @ w (d, f): f cut MP ways
ROWS_CUT = ((DP, 1, MP), (MP, 1))     # x (batch, length, f) @ w (f, d): the contraction cut MP ways


def init(key, layers: int = LAYERS, d: int = D, ff: int = FF, vocab: int = VOCAB, length: int = LENGTH) -> dict:
    """The parameters: `embed` (vocab, d), `pos` (length, d), and per layer `wq wk wv wo w1 w2`."""
    keys = iter(jax.random.split(key, 2 + 6 * layers))
    normal = lambda shape, scale: scale * jax.random.normal(next(keys), shape, jnp.float32)  # noqa: E731
    params = {"embed": normal((vocab, d), 1.0), "pos": normal((length, d), 0.02), "layers": []}
    for _ in range(layers):
        params["layers"].append({
            "wq": normal((d, d), d ** -0.5), "wk": normal((d, d), d ** -0.5), "wv": normal((d, d), d ** -0.5),
            "wo": normal((d, d), d ** -0.5), "w1": normal((d, ff), d ** -0.5), "w2": normal((ff, d), ff ** -0.5)})
    return params


def layer_norm(x, eps=1e-5):
    mean = x.mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(((x - mean) ** 2).mean(-1, keepdims=True) + eps)


def column(x, w):
    return js.shard(jnp.matmul, in_strategy=COLUMNS)(x, w)


def row(x, w):
    return js.shard(jnp.matmul, in_strategy=ROWS_CUT)(x, w)


def attention(p, x, heads=HEADS):
    b, t, d = x.shape
    q, k, v = (column(x, p[name]).reshape(b, t, heads, d // heads) for name in ("wq", "wk", "wv"))
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // heads)
    scores = jnp.where(jnp.tril(jnp.ones((t, t), bool)), scores, -1e9)
    out = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
    return row(out.reshape(b, t, d), p["wo"])


def mlp(p, x):
    return row(jax.nn.gelu(column(x, p["w1"])), p["w2"])


def forward(params, tokens):
    x = params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]
    for p in params["layers"]:
        x = x + attention(p, layer_norm(x))
        x = x + mlp(p, layer_norm(x))
    return layer_norm(x) @ params["embed"].T


def loss_fn(params, tokens):
    logits = forward(params, tokens[:, :-1])
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()


def train_step(params, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    return jax.tree.map(lambda p, g: p - LR * g, params, grads), loss


def create(rows: int = ROWS, **sizes) -> tuple[dict, np.ndarray]:
    """Fresh parameters and one batch of tokens (`rows` sequences of `length + 1` tokens)."""
    params = init(jax.random.key(0), **sizes)
    length, vocab = params["pos"].shape[0], params["embed"].shape[0]
    tokens = np.random.default_rng(0).integers(0, vocab, size=(rows, length + 1)).astype(np.int32)
    return params, tokens


def make_mesh(devices=None):
    devices = jax.devices()[: DP * MP] if devices is None else devices
    return jax.make_mesh(MESH_SHAPE, MESH_AXES, devices=devices)


def expert_shardings(mesh, params) -> tuple[dict, NamedSharding]:
    """Megatron by hand: query/key/value/first MLP matmul cut by columns over `mp`, attention output
    and second MLP matmul by rows, the tied embedding by vocabulary, the position table whole; the
    tokens cut by batch over `dp`."""
    spec = {"wq": P(None, "mp"), "wk": P(None, "mp"), "wv": P(None, "mp"), "w1": P(None, "mp"),
            "wo": P("mp", None), "w2": P("mp", None)}
    shardings = {"embed": NamedSharding(mesh, P("mp", None)), "pos": NamedSharding(mesh, P()),
                 "layers": [{k: NamedSharding(mesh, spec[k]) for k in layer} for layer in params["layers"]]}
    return shardings, NamedSharding(mesh, P("dp"))
