"""Reference GPT: a decoder-only transformer in plain JAX, and a copy task it can learn.

Each block is pre-LayerNorm causal self-attention then a GELU feed-forward. With a `Preset`, the
query/key/value and up projections are column-parallel and the attention output and down
projections row-parallel (Megatron-LM), with MindSpore strategy tuples through `jshard.shard`.

With `GPTConfig(scan=True)` the blocks' parameters are stacked on a leading `n_layers` axis and
the blocks run under `jax.lax.scan`: one traced block instead of `n_layers`, the same numbers.
A stacked weight keeps its matrix in its last two dims, so `GPT_RULES` cut the same dims.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from jshard._recompute import recompute
from jshard.context import attention
from jshard.models._presets import Preset
from jshard.pipeline import Pipeline, pipeline_stage

GPT_RULES = {r"/(wq|wk|wv|w_up)$": "column", r"/(wo|w_down)$": "row", r"^head$": "column"}
BOS, SEP, EOS = 0, 1, 2


@dataclasses.dataclass(frozen=True, slots=True)
class GPTConfig:
    """The reference GPT's sizes. `scan` stacks the blocks under `lax.scan`; `recompute` marks each
    block `jshard.recompute(block, policy=recompute)` (`"full"`, `"selective"`, `"auto"`: the search
    decides under `parallelize(mode="auto")`), None: not marked. `kv_heads`: grouped-query
    attention's key/value heads (None: `n_heads`, multi-head). `context`: the queries' strategy
    `[batch, seq, heads, head_dim]` for `jshard.attention`, whose sequence cut runs the attention
    context parallel in `context_form` (`"auto"`, `"gather"`, `"ring"`, `"ulysses"`); None: the
    attention as einsums and a softmax, laid out by the plan, or, with `attention_implementation`
    (`"xla"`, `"cudnn"`: cuDNN's fused flash attention on NVIDIA GPUs), as
    `jax.nn.dot_product_attention(..., is_causal=True, implementation=attention_implementation)`.
    `fence_grads`: the residual stream's gradient is made whole at each residual add (`fence`): the
    same values; on GPUs, XLA's fusion otherwise recomputes the gradient's chain of layer norms
    through every later block in each of its consumers (`benchmarks._gpu_profile`)."""

    vocab: int = 32
    seq_len: int = 16
    d_model: int = 64
    n_heads: int = 8
    n_layers: int = 2
    d_ff: int = 256
    scan: bool = False
    recompute: str | None = None
    kv_heads: int | None = None
    context: tuple[int, ...] | None = None
    context_form: str = "auto"
    attention_implementation: Literal["xla", "cudnn"] | None = None
    fence_grads: bool = False


def gpt_split_problems(cfg: GPTConfig, preset: Preset, batch: int) -> list[str]:
    """What keeps `preset` from splitting the GPT of `cfg` and a batch of `batch` rows (empty: it fits).

    Data parallel cuts the batch `dp` ways; tensor parallel cuts the dims `GPT_RULES` name `mp`
    ways: `d_model` (attention), `d_ff` (feed-forward) and `vocab` (the head).

    Examples:
      >>> gpt_split_problems(GPTConfig(), Preset("2d", 2, 3), 16)
      ['tensor parallel 3 does not divide d_model 64, d_ff 256, vocab 32']
      >>> gpt_split_problems(GPTConfig(), Preset("tensor", 1, 64), 16)
      ['tensor parallel 64 does not divide vocab 32']
    """
    problems = []
    if batch % preset.dp:
        problems.append(f"data parallel {preset.dp} does not divide the batch of {batch}")
    cut = {"d_model": cfg.d_model, "d_ff": cfg.d_ff, "vocab": cfg.vocab}
    if uncut := [f"{name} {size}" for name, size in cut.items() if size % preset.mp]:
        problems.append(f"tensor parallel {preset.mp} does not divide {', '.join(uncut)}")
    return problems


def init_gpt(cfg: GPTConfig, key: jax.Array) -> dict:
    """Parameters: `embed`, `pos`, `layers`, `ln_f`, `head`.

    `layers` is a list of per-block dicts, or with `cfg.scan` one dict of the same arrays stacked
    on a leading `n_layers` axis.

    Examples:
      >>> params = init_gpt(GPTConfig(n_layers=3, scan=True), jax.random.key(0))
      >>> params["layers"]["w_up"].shape
      (3, 64, 256)
    """
    keys = iter(jax.random.split(key, 3 + 6 * cfg.n_layers))
    dense = lambda a, b: jax.random.normal(next(keys), (a, b), jnp.float32) / np.sqrt(a)
    norm = lambda: {"scale": jnp.ones((cfg.d_model,), jnp.float32), "bias": jnp.zeros((cfg.d_model,), jnp.float32)}
    d = cfg.d_model
    kv = d // cfg.n_heads * (cfg.kv_heads or cfg.n_heads)
    layers = [
        {
            "ln1": norm(), "wq": dense(d, d), "wk": dense(d, kv), "wv": dense(d, kv), "wo": dense(d, d),
            "ln2": norm(), "w_up": dense(d, cfg.d_ff), "w_down": dense(cfg.d_ff, d),
        }
        for _ in range(cfg.n_layers)
    ]
    if cfg.scan:
        layers = jax.tree.map(lambda *a: jnp.stack(a), *layers)
    return {
        "embed": jax.random.normal(next(keys), (cfg.vocab, d), jnp.float32) * 0.02,
        "pos": jax.random.normal(next(keys), (cfg.seq_len, d), jnp.float32) * 0.02,
        "layers": layers,
        "ln_f": norm(),
        "head": dense(d, cfg.vocab),
    }


def layer_norm(x: jax.Array, p: dict) -> jax.Array:
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"][None, None, :] + p["bias"][None, None, :]


def _matmul(preset: Preset | None, kind: str):
    return jnp.matmul if preset is None else preset.matmul(kind, 3)


def _attention(p: dict, x: jax.Array, cfg: GPTConfig, preset: Preset | None) -> jax.Array:
    b, t, d = x.shape
    col, hd = _matmul(preset, "column"), d // cfg.n_heads
    q, k, v = (col(x, p[w]).reshape(b, t, -1, hd) for w in ("wq", "wk", "wv"))
    if cfg.context is not None:
        out = attention(q, k, v, causal=True, strategy=cfg.context, form=cfg.context_form).reshape(b, t, d)
        return _matmul(preset, "row")(out, p["wo"])
    if cfg.attention_implementation is not None:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=cfg.attention_implementation)
        return _matmul(preset, "row")(out.reshape(b, t, d), p["wo"])
    causal = jnp.tril(jnp.ones((t, t), bool))[None, None]
    if k.shape[2] == cfg.n_heads:
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)  # a Python float: keeps bf16 scores bf16
        weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", weights, v).reshape(b, t, d)
    else:  # grouped-query: each key/value head serves a group of query heads
        grouped = q.reshape(b, t, k.shape[2], -1, hd)
        scores = jnp.einsum("bqkgd,bskd->bkgqs", grouped, k) / math.sqrt(hd)
        weights = jax.nn.softmax(jnp.where(causal[None], scores, -1e9), axis=-1)
        out = jnp.einsum("bkgqs,bskd->bqkgd", weights, v).reshape(b, t, d)
    return _matmul(preset, "row")(out, p["wo"])


def _feed_forward(p: dict, x: jax.Array, preset: Preset | None) -> jax.Array:
    h = jax.nn.gelu(_matmul(preset, "column")(x, p["w_up"]))
    return _matmul(preset, "row")(h, p["w_down"])


@jax.custom_vjp
def fence(x: jax.Array) -> jax.Array:
    """`x` itself; its gradient passes `lax.optimization_barrier`, so the compiler computes that
    gradient once, as one array, instead of fusing the computation that makes it into each of its
    consumers (XLA's GPU backend does, through a chain of blocks' layer norms: each block's
    gradient recomputed from every later block's, quadratic in depth)."""
    return x


def _fence_forward(x: jax.Array) -> tuple[jax.Array, None]:
    return x, None


def _fence_backward(_, g: jax.Array) -> tuple[jax.Array]:
    return (jax.lax.optimization_barrier(g),)


fence.defvjp(_fence_forward, _fence_backward)


def _block(p: dict, x: jax.Array, cfg: GPTConfig, preset: Preset | None) -> jax.Array:
    held = fence if cfg.fence_grads else (lambda v: v)
    x = held(x)
    x = held(x + _attention(p, layer_norm(x, p["ln1"]), cfg, preset))
    return x + _feed_forward(p, layer_norm(x, p["ln2"]), preset)


def gpt_apply(params: dict, tokens: jax.Array, cfg: GPTConfig, preset: Preset | None = None) -> jax.Array:
    """Logits `[batch, seq, vocab]` for integer `tokens` `[batch, seq]`."""
    x = _embed(params, tokens)
    block = _layer(cfg, preset)
    if cfg.scan:
        x, _ = jax.lax.scan(lambda h, p: (block(p, h), None), x, params["layers"])
    else:
        for p in params["layers"]:
            x = block(p, x)
    return _logits(params, x, preset)


def _layer(cfg: GPTConfig, preset: Preset | None):
    """One block as a function of its parameters and input, recomputed as `cfg.recompute` says."""

    def block(p: dict, x: jax.Array) -> jax.Array:
        return _block(p, x, cfg, preset)

    return block if cfg.recompute is None else recompute(block, policy=cfg.recompute)


def _embed(params: dict, tokens: jax.Array) -> jax.Array:
    return params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]


def _logits(params: dict, x: jax.Array, preset: Preset | None) -> jax.Array:
    return _matmul(preset, "column")(layer_norm(x, params["ln_f"]), params["head"])


def _masked_nll(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    logp = jax.nn.log_softmax(logits, axis=-1)
    nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    return (nll * mask).sum() / mask.sum()


def gpt_loss(params: dict, batch: tuple, cfg: GPTConfig, preset: Preset | None = None) -> jax.Array:
    """Masked next-token cross-entropy; `batch = (tokens, targets, mask)`."""
    tokens, targets, mask = batch
    return _masked_nll(gpt_apply(params, tokens, cfg, preset), targets, mask)


def gpt_pipeline(cfg: GPTConfig, preset: Preset | None = None) -> Pipeline:
    """The GPT as a `jshard.Pipeline`: embedding first, the stacked blocks, then head and loss.

    Needs `cfg.scan` (blocks stacked under `params["layers"]`). `pipe.loss(params, batch)` is
    `gpt_loss`; under `parallelize(pipe, pipeline=js.Pipelining(S, M))` the loss is the mean
    of the micro-batches' masked means, equal to it when every row's mask counts the same tokens
    (as in `copy_task_batch`). `preset`'s strategies apply inside each stage (its `dp * mp` is the
    stage's device count).

    Examples:
      >>> cfg = GPTConfig(n_layers=2, scan=True)
      >>> params = init_gpt(cfg, jax.random.key(0))
      >>> batch = copy_task_batch(np.random.default_rng(0), cfg, 4)
      >>> got, want = gpt_pipeline(cfg).loss(params, batch), gpt_loss(params, batch, cfg)

      The two sum the same terms in another order: within `terms * eps * scale` (the bound of
      `tests/_tolerance.py`), terms being every weight's fan-in plus the tokens the loss averages.

      >>> terms = sum(math.prod(w.shape[:-1]) for w in jax.tree.leaves(params) if w.ndim >= 2) + batch[0].size
      >>> bool(abs(got - want) <= terms * jnp.finfo(want.dtype).eps * abs(want))
      True
    """
    if not cfg.scan:
        raise ValueError("gpt_pipeline: needs GPTConfig(scan=True), whose blocks are stacked on a layer axis.")
    return Pipeline(
        first=lambda p, batch: _embed(p, batch[0]),
        layer=_layer(cfg, preset),
        last=lambda p, x, batch: _masked_nll(_logits(p, x, preset), batch[1], batch[2]),
        head=lambda p, x: _logits(p, x, preset),
    )


def gpt_staged_loss(cfg: GPTConfig, stages: int, preset: Preset | None = None):
    """`loss(params, batch)`, the GPT of unrolled blocks (`scan=False`) as a MindSpore user tags
    it for `parallelize(loss, pipeline=js.Pipelining(stages, ...))`: the embedding on stage 0, the blocks
    in contiguous runs (stage `s` takes blocks `s·L/S ..`, the first stages one more where `S`
    does not divide `L`), the head on the last stage, the loss untagged (it joins the head's).

    Examples:
      >>> cfg = GPTConfig(n_layers=3)
      >>> params = init_gpt(cfg, jax.random.key(0))
      >>> batch = copy_task_batch(np.random.default_rng(0), cfg, 4)
      >>> bool(jnp.allclose(gpt_staged_loss(cfg, 2)(params, batch), gpt_loss(params, batch, cfg)))
      True
    """
    if cfg.scan:
        raise ValueError("gpt_staged_loss: needs GPTConfig(scan=False), whose blocks are a Python list to tag.")
    block = _layer(cfg, preset)
    runs = np.array_split(np.arange(cfg.n_layers), stages)
    stage_of = {int(i): s for s, run in enumerate(runs) for i in run}

    def loss(params: dict, batch: tuple) -> jax.Array:
        tokens, targets, mask = batch
        x = pipeline_stage(_embed, 0)(params, tokens)
        for i, p in enumerate(params["layers"]):
            x = pipeline_stage(block, stage_of[i])(p, x)
        logits = pipeline_stage(lambda p, h: _logits(p, h, preset), stages - 1)(params, x)
        return _masked_nll(logits, targets, mask)

    return loss


def copy_task_batch(rng: np.random.Generator, cfg: GPTConfig, batch: int) -> tuple[np.ndarray, ...]:
    """A batch of the copy task: `BOS x1..xk SEP x1..xk EOS`; the loss counts the second copy.

    A model that attends back over the sequence reaches near-zero loss; one that does not stays
    near `log(vocab - 3)`.
    """
    k = (cfg.seq_len - 2) // 2
    body = rng.integers(3, cfg.vocab, size=(batch, k))
    pad = cfg.seq_len + 1 - (2 * k + 3)
    seq = np.concatenate(
        [np.full((batch, 1), BOS), body, np.full((batch, 1), SEP), body, np.full((batch, 1 + pad), EOS)], axis=1
    )
    mask = np.zeros((batch, cfg.seq_len), np.float32)
    mask[:, k + 1 : 2 * k + 1] = 1.0
    return seq[:, :-1].astype(np.int32), seq[:, 1:].astype(np.int32), mask
