"""A Llama-class decoder for the scale plans (table 20): RMSNorm, rotary positions, grouped-query
attention, SwiGLU feed-forward or a Mixtral-style mixture of SwiGLU experts, its layers stacked under
`lax.scan`, each marked `jshard.recompute(policy="auto")` so the search chooses what to keep.

What differs from the real models: attention is `jshard.attention(causal=True)` (grouped-query;
`Decoder.context`, its strategy, may cut the sequence: context parallel), computed in tiles of 1024
keys with the softmax online and the backward recomputing each tile (flash attention's schedule
written in JAX, where the peers run a fused kernel: cuDNN, Pallas, or torch's SDPA), except
Mixtral's 4,096-token attention, taken whole (`attention_block=4096`, the scores held: it fits);
the experts take GShard's
capacity-based dispatch (`jshard.models.capacity_dispatch`, each sequence a group, capacity factor
1.25: tokens over capacity dropped, as MaxText's `mixtral_8x7b_dropped`), where Megatron's run is
dropless; no load-balancing loss; parameters and Adam state in float32, the layers computing in
bfloat16 (MaxText's default `weight_dtype=float32, dtype=bfloat16`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jshard as js
from jshard import models

COMPUTE = jnp.bfloat16


@dataclasses.dataclass(frozen=True, slots=True)
class Decoder:
    """A Llama-class decoder's sizes; `n_experts` > 0 makes each feed-forward a mixture of that many
    SwiGLU experts, `top_k` of them per token (Mixtral). `context`: the queries' strategy
    `[batch, seq, heads, head_dim]` for `jshard.attention` (None: none of its own), run in
    `context_form` where it cuts the sequence; `attention_block`: its keys per tile (None: its
    default, tiles of 1024 past 1024 keys; `seq_len`: the keys whole, plain attention)."""

    name: str
    vocab: int
    seq_len: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    n_layers: int
    n_experts: int = 0
    top_k: int = 2
    capacity_factor: float = 1.25
    rope_theta: float = 500_000.0
    context: tuple[int, ...] | js.TensorLayout | None = None
    context_form: str = "auto"
    attention_block: int | None = None

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def capacity(self) -> int:
        """Tokens each expert takes from a sequence: `ceil(seq_len * top_k / n_experts * capacity_factor)`."""
        return math.ceil(self.seq_len * self.top_k / self.n_experts * self.capacity_factor)

    def parameters(self) -> int:
        return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(abstract_params(self)))

    def describe(self) -> str:
        experts = f", {self.n_experts} experts top-{self.top_k}" if self.n_experts else ""
        return (
            f"{self.parameters() / 1e9:.1f}B parameters: {self.n_layers} layers, d_model {self.d_model}, "
            f"{self.n_heads} heads ({self.n_kv_heads} KV), d_ff {self.d_ff}{experts}, vocab {self.vocab}, "
            f"seq {self.seq_len:,}"
        )


def abstract_params(cfg: Decoder) -> dict:
    """The parameters as `jax.ShapeDtypeStruct`s (float32), layers stacked on a leading axis."""
    f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
    L, d, f, e, hd = cfg.n_layers, cfg.d_model, cfg.d_ff, cfg.n_experts, cfg.head_dim
    layers = {
        "ln1": f32(L, d),
        "wq": f32(L, d, cfg.n_heads * hd),
        "wk": f32(L, d, cfg.n_kv_heads * hd),
        "wv": f32(L, d, cfg.n_kv_heads * hd),
        "wo": f32(L, cfg.n_heads * hd, d),
        "ln2": f32(L, d),
    }
    if e:
        layers |= {
            "router": f32(L, d, e),
            "w_gate": f32(L, e, d, f),
            "w_up": f32(L, e, d, f),
            "w_down": f32(L, e, f, d),
        }
    else:
        layers |= {"w_gate": f32(L, d, f), "w_up": f32(L, d, f), "w_down": f32(L, f, d)}
    return {"embed": f32(cfg.vocab, d), "layers": layers, "ln_f": f32(d), "head": f32(d, cfg.vocab)}


def init_params(cfg: Decoder, seed: int = 0) -> dict:
    """Real parameters of `abstract_params`'s shapes (for the small configurations the tests run)."""
    rng = np.random.default_rng(seed)
    draw = lambda s: jnp.asarray(
        rng.normal(size=s.shape) / np.sqrt(s.shape[-2] if len(s.shape) > 1 else 1), jnp.float32
    )
    params = jax.tree.map(draw, abstract_params(cfg))
    norms = {"ln1", "ln2"}
    params["layers"] = {k: jnp.ones_like(v) if k in norms else v for k, v in params["layers"].items()}
    params["ln_f"] = jnp.ones_like(params["ln_f"])
    return params


def _rms_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt((x32 * x32).mean(-1, keepdims=True) + 1e-5) * scale[None, None, :]).astype(x.dtype)


def _rope(x: jax.Array, theta: float) -> jax.Array:
    """Rotary positions on `x` `[b, t, heads, hd]`, the rotate-half form (Llama's as Hugging Face writes it)."""
    t, hd = x.shape[1], x.shape[-1]
    angle = (
        jnp.arange(t, dtype=jnp.float32)[:, None] * theta ** (-jnp.arange(0, hd, 2, dtype=jnp.float32) / hd)[None, :]
    )
    cos, sin = (f(angle)[None, :, None, :].astype(x.dtype) for f in (jnp.cos, jnp.sin))
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _attention(p: dict, x: jax.Array, cfg: Decoder) -> jax.Array:
    b, t, _ = x.shape
    hd = cfg.head_dim
    q = _rope((x @ p["wq"]).reshape(b, t, cfg.n_heads, hd), cfg.rope_theta)
    k = _rope((x @ p["wk"]).reshape(b, t, cfg.n_kv_heads, hd), cfg.rope_theta)
    v = (x @ p["wv"]).reshape(b, t, cfg.n_kv_heads, hd)
    out = js.attention(q, k, v, causal=True, strategy=cfg.context, form=cfg.context_form, block=cfg.attention_block)
    return out.reshape(b, t, cfg.n_heads * hd) @ p["wo"]


def _swiglu(p: dict, x: jax.Array) -> jax.Array:
    return (jax.nn.silu(x @ p["w_gate"]) * (x @ p["w_up"])) @ p["w_down"]


def _experts(p: dict, x: jax.Array, cfg: Decoder) -> jax.Array:
    """Mixtral's routed SwiGLU experts with GShard's capacity dispatch: `[g, s, d]` -> `[g, s, d]`."""
    dispatch, combine = models.capacity_dispatch((x @ p["router"]).astype(jnp.float32), cfg.top_k, cfg.capacity)
    buffers = jnp.einsum("gsec,gsd->egcd", dispatch.astype(x.dtype), x)
    gate = jnp.einsum("egcd,edf->egcf", buffers, p["w_gate"])
    h = jax.nn.silu(gate) * jnp.einsum("egcd,edf->egcf", buffers, p["w_up"])
    out = jnp.einsum("egcf,efd->egcd", h, p["w_down"])
    return jnp.einsum("gsec,egcd->gsd", combine.astype(x.dtype), out)


def _block(p: dict, x: jax.Array, cfg: Decoder) -> jax.Array:
    p = jax.tree.map(lambda w: w.astype(COMPUTE), p)
    x = x + _attention(p, _rms_norm(x, p["ln1"]), cfg)
    y = _rms_norm(x, p["ln2"])
    return x + (_experts(p, y, cfg) if cfg.n_experts else _swiglu(p, y))


def loss(params: dict, batch: tuple, cfg: Decoder, recompute: str | None = "auto") -> jax.Array:
    """Mean next-token cross-entropy; `batch = (tokens, targets)`, int32 `[batch, seq]`."""
    tokens, targets = batch
    block = lambda p, x: _block(p, x, cfg)
    if recompute is not None:
        block = js.recompute(block, policy=recompute)
    x = params["embed"][tokens].astype(COMPUTE)
    x, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, params["layers"])
    logits = _rms_norm(x, params["ln_f"].astype(COMPUTE)) @ params["head"].astype(COMPUTE)
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def train_step(cfg: Decoder, recompute: str | None = "auto"):
    """`step(params, opt_state, batch) -> (params, opt_state, loss)`: one Adam step."""
    return models.make_train_step(lambda p, b: loss(p, b, cfg, recompute), optax.adam(1e-4))


def abstract_args(cfg: Decoder, batch: int) -> tuple:
    """`(params, opt_state, (tokens, targets))` as shapes only."""
    params = abstract_params(cfg)
    tokens = jax.ShapeDtypeStruct((batch, cfg.seq_len), jnp.int32)
    return params, jax.eval_shape(optax.adam(1e-4).init, params), (tokens, tokens)


def flops(cfg: Decoder, batch: int) -> float:
    """Model FLOPs of a train step without recompute: 3x the forward's matmuls, attention's causal
    half counted (the convention MaxText and torchtitan report), the experts' top-k work (not the
    capacity dispatch's einsums)."""
    b, s, d, hd = batch, cfg.seq_len, cfg.d_model, cfg.head_dim
    qkvo = 2 * b * s * d * hd * (2 * cfg.n_heads + 2 * cfg.n_kv_heads)
    attention = 2 * b * s * s * cfg.n_heads * hd  # QK^T and PV, 2 each per multiply-add, causal half
    ffn = 2 * b * s * 3 * d * cfg.d_ff * (cfg.top_k if cfg.n_experts else 1)
    router = 2 * b * s * d * cfg.n_experts
    return 3.0 * (cfg.n_layers * (qkvo + attention + ffn + router) + 2 * b * s * d * cfg.vocab)
