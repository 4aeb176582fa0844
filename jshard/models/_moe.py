"""Reference mixture of experts: routed feed-forward blocks in plain JAX, in three dispatch forms.

Tokens are embedded, then each block adds `moe(layer_norm(x))` to the residual stream; a head maps
to the vocabulary. There is no load-balancing loss.

- `dispatch="dense"` (the default): Switch-style top-1. The router picks one expert per
  token (`argmax` of its logits) and scales that expert's output by its softmax gate; every expert
  computes on all tokens, with those routed elsewhere masked to zero by a one-hot, so no token is
  dropped.
- `dispatch="capacity"`: GShard's top-k dispatch as MaxText and Flax write it. Each
  sequence is a group; each expert takes at most `capacity` tokens of a group (top-1 choices first,
  then top-2, ..., in token order), the rest of its tokens dropped. One-hot dispatch and combine
  tensors `[g, s, e, c]` gather the tokens into per-expert buffers `[e, g, c, d]` by einsum and
  scatter the results back weighted by the gates. Cutting the buffers' expert dim where the tokens'
  group dim was cut is an all-to-all: expert parallel.
- `dispatch="dropless"`: MaxText's sparse form. The `top_k` choices of every token are sorted by
  expert and each expert's run multiplied by its weights (`jax.lax.ragged_dot`, group sizes counted
  at run time), then unsorted and summed with the gates; no token is dropped. The groups' bounds
  are data, so no layout cuts the experts here: their weights are gathered where cut, the tokens
  are sorted whole (expert parallel of this form takes `jax.lax.ragged_all_to_all` in a
  `shard_map`, which XLA:CPU does not compile in jax 0.10).

With a `Preset` (dense and capacity forms), the experts run expert-parallel: one `jshard.shard`
call cuts the expert dim of the dispatched tokens and of the stacked expert weights `preset.mp`
ways (the tokens' batch dim `preset.dp` ways), and the head is column-parallel. `Preset.parameters` cuts only a weight's last
two dims, so `MOE_RULES` leaves the expert weights whole and the sharded call cuts them by expert.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from jshard._errors import ShardingError
from jshard._shard import shard
from jshard.models._gpt import layer_norm
from jshard.models._presets import Preset

MOE_RULES = {r"^head$": "column"}
DISPATCHES = ("dense", "capacity", "dropless")


@dataclasses.dataclass(frozen=True, slots=True)
class MoEConfig:
    """Token sequences of `seq_len` over `vocab`; `n_layers` blocks of width `d_model`, each with
    `n_experts` feed-forward experts of hidden width `d_ff`, routed by `dispatch` (`"dense"`,
    `"capacity"`, `"dropless"`: the module docstring) to `top_k` experts per token; in the capacity
    form each expert takes `capacity` tokens of a sequence.

    Examples:
      >>> MoEConfig(seq_len=16, n_experts=8, dispatch="capacity", top_k=2).capacity
      5
    """

    vocab: int = 32
    seq_len: int = 8
    d_model: int = 64
    d_ff: int = 128
    n_experts: int = 4
    n_layers: int = 1
    dispatch: str = "dense"
    top_k: int = 1
    capacity_factor: float = 1.25

    def __post_init__(self):
        if self.dispatch not in DISPATCHES:
            raise ValueError(f"jshard.models.MoEConfig: dispatch={self.dispatch!r}; the forms are {DISPATCHES}.")
        if self.dispatch == "dense" and self.top_k != 1:
            raise ValueError(f"jshard.models.MoEConfig: top_k={self.top_k} needs dispatch='capacity' or 'dropless'; "
                             f"the dense form routes each token to one expert.")
        if not 1 <= self.top_k <= self.n_experts or self.capacity_factor <= 0:
            raise ValueError(f"jshard.models.MoEConfig: top_k={self.top_k} must be in 1..n_experts={self.n_experts} "
                             f"and capacity_factor={self.capacity_factor} positive.")

    @property
    def capacity(self) -> int:
        """Tokens each expert takes from a sequence in the capacity form: `ceil(seq_len * top_k /
        n_experts * capacity_factor)`."""
        return math.ceil(self.seq_len * self.top_k / self.n_experts * self.capacity_factor)


def init_moe(cfg: MoEConfig, key: jax.Array) -> dict:
    """Parameters: `embed`, `pos`, `layers` (dicts with `ln`, `router` `[d, E]`, `w_in` `[E, d, f]`,
    `w_out` `[E, f, d]`), `ln_f`, `head`.

    The weights are drawn on the host by a NumPy generator seeded with `key`'s data: XLA on CPU
    takes seconds to compile a `jax.random` draw for each new shape.

    Examples:
      >>> params = init_moe(MoEConfig(), jax.random.key(0))
      >>> params["layers"][0]["w_in"].shape, params["layers"][0]["w_out"].shape
      ((4, 64, 128), (4, 128, 64))
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    dense = lambda *shape: rng.normal(size=shape) / np.sqrt(shape[-2])
    norm = lambda: {"scale": np.ones(cfg.d_model), "bias": np.zeros(cfg.d_model)}
    d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
    layers = [
        {"ln": norm(), "router": dense(d, e), "w_in": dense(e, d, f), "w_out": dense(e, f, d)}
        for _ in range(cfg.n_layers)
    ]
    params = {
        "embed": rng.normal(size=(cfg.vocab, d)) * 0.02,
        "pos": rng.normal(size=(cfg.seq_len, d)) * 0.02,
        "layers": layers,
        "ln_f": norm(),
        "head": dense(d, cfg.vocab),
    }
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def _experts(x: jax.Array, w_in: jax.Array, w_out: jax.Array) -> jax.Array:
    """Every expert's feed-forward on its own copy of the tokens: `[E, b, t, d]` → `[E, b, t, d]`."""
    h = jax.nn.gelu(jnp.einsum("ebtd,edf->ebtf", x, w_in))
    return jnp.einsum("ebtf,efd->ebtd", h, w_out)


def _expert_parallel(preset: Preset, n_experts: int):
    if n_experts % preset.mp:
        raise ShardingError(
            f"jshard.models.moe_apply: preset {preset.name!r} (dp={preset.dp}, mp={preset.mp}) cuts the "
            f"expert dim {preset.mp} ways, but {preset.mp} does not divide n_experts={n_experts}. Use a "
            f"multiple of {preset.mp} experts or a preset whose mp divides {n_experts}."
        )
    tokens, weights = preset.layout("mp", "dp", "None", "None"), preset.layout("mp", "None", "None")
    return shard(_experts, in_strategy=(tokens, weights, weights), out_strategy=(tokens,))


def capacity_dispatch(logits: jax.Array, top_k: int, capacity: int) -> tuple[jax.Array, jax.Array]:
    """GShard's dispatch and combine tensors `[g, s, e, c]` from router logits `[g, s, e]`: token s
    of group g goes to slot c of expert e (dispatch, 0 or 1; combine, its gate). Each token's `top_k`
    experts take it in priority order (every token's first choice, then every second choice, in token
    order); a choice past an expert's `capacity` slots is dropped.

    Examples:
      >>> dispatch, combine = capacity_dispatch(jnp.zeros((2, 6, 4)).at[:, :, 0].set(9.0), top_k=1, capacity=2)
      >>> dispatch.shape, dispatch.sum(axis=(2, 3)).tolist()  # expert 0 takes the first two tokens of a group
      ((2, 6, 4, 2), [[1.0, 1.0, 0.0, 0.0, 0.0, 0.0], [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]])
    """
    gates, experts = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), top_k)  # [g, s, k]
    chosen = jax.nn.one_hot(experts, logits.shape[-1], dtype=jnp.int32)  # [g, s, k, e]
    # a slot per choice, in priority order: every token's first choice, then every second choice
    ranked = jnp.cumsum(chosen.transpose(0, 2, 1, 3).reshape(chosen.shape[0], -1, chosen.shape[-1]), axis=1)
    slot = ranked.reshape(chosen.shape[0], top_k, -1, chosen.shape[-1]).transpose(0, 2, 1, 3) * chosen - 1
    placed = jax.nn.one_hot(slot, capacity, dtype=logits.dtype)  # -1 (not chosen) and >= capacity: zeros
    return placed.sum(axis=2), jnp.einsum("gsk,gskec->gsec", gates, placed)


def _capacity_moe(p: dict, x: jax.Array, experts: Callable[..., jax.Array], cfg: MoEConfig) -> jax.Array:
    dispatch, combine = capacity_dispatch(x @ p["router"], cfg.top_k, cfg.capacity)
    out = experts(jnp.einsum("gsec,gsd->egcd", dispatch, x), p["w_in"], p["w_out"])
    return jnp.einsum("gsec,egcd->gsd", combine, out)


def _dropless_moe(p: dict, x: jax.Array, cfg: MoEConfig) -> jax.Array:
    tokens = x.reshape(-1, x.shape[-1])  # [t, d]
    gates, experts = jax.lax.top_k(jax.nn.softmax(tokens @ p["router"], axis=-1), cfg.top_k)  # [t, k]
    order = jnp.argsort(experts.reshape(-1), stable=True)  # the t * k choices, grouped by expert
    sizes = jnp.bincount(experts.reshape(-1), length=cfg.n_experts).astype(jnp.int32)
    h = jax.nn.gelu(jax.lax.ragged_dot(tokens[order // cfg.top_k], p["w_in"], sizes))
    out = jnp.zeros((order.size, x.shape[-1]), x.dtype).at[order].set(jax.lax.ragged_dot(h, p["w_out"], sizes))
    return jnp.einsum("tkd,tk->td", out.reshape(*gates.shape, -1), gates).reshape(x.shape)


def _moe(p: dict, x: jax.Array, experts: Callable[..., jax.Array]) -> jax.Array:
    logits = x @ p["router"]
    gates = jax.nn.softmax(logits, axis=-1)
    route = jax.nn.one_hot(jnp.argmax(logits, axis=-1), logits.shape[-1], dtype=x.dtype)
    out = experts(jnp.einsum("bte,btd->ebtd", route, x), p["w_in"], p["w_out"])
    return jnp.einsum("ebtd,bte->btd", out, route * gates)


def _block(p: dict, y: jax.Array, experts: Callable[..., jax.Array], cfg: MoEConfig) -> jax.Array:
    if cfg.dispatch == "capacity":
        return _capacity_moe(p, y, experts, cfg)
    return _moe(p, y, experts) if cfg.dispatch == "dense" else _dropless_moe(p, y, cfg)


def moe_apply(params: dict, tokens: jax.Array, cfg: MoEConfig, preset: Preset | None = None) -> jax.Array:
    """Logits `[batch, seq, vocab]` for integer `tokens` `[batch, seq]`.

    Raises:
      ShardingError: `preset.mp` does not divide `cfg.n_experts`, or a preset meets the dropless form.
    """
    if preset is not None and cfg.dispatch == "dropless":
        raise ShardingError(
            f"jshard.models.moe_apply: preset {preset.name!r} cuts the expert dim of the experts' weights, but the "
            f"dropless form's grouped matmul (jax.lax.ragged_dot) finds each expert's tokens only at run time, so "
            f"no layout cuts it by expert. Use dispatch='capacity' for expert parallel, or no preset.")
    experts = _experts if preset is None else _expert_parallel(preset, cfg.n_experts)
    x = params["embed"][tokens] + params["pos"][None, : tokens.shape[1]]
    for p in params["layers"]:
        y = layer_norm(x, p["ln"])
        x = x + _block(p, y, experts, cfg)
    head = jnp.matmul if preset is None else preset.matmul("column", 3)
    return head(layer_norm(x, params["ln_f"]), params["head"])


def moe_loss(params: dict, batch: tuple, cfg: MoEConfig, preset: Preset | None = None) -> jax.Array:
    """Mean next-token cross-entropy; `batch = (tokens, targets)`, both int32 `[batch, seq]`."""
    tokens, targets = batch
    logp = jax.nn.log_softmax(moe_apply(params, tokens, cfg, preset), axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def moe_batch(rng: np.random.Generator, cfg: MoEConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the lookup task: each target is a fixed random permutation of its token, a map
    the routed feed-forward blocks can learn token by token.

    Examples:
      >>> tokens, targets = moe_batch(np.random.default_rng(0), MoEConfig(), 2)
      >>> tokens.shape, targets.dtype
      ((2, 8), dtype('int32'))
    """
    permutation = np.random.default_rng(0).permutation(cfg.vocab)
    tokens = rng.integers(0, cfg.vocab, size=(batch, cfg.seq_len))
    return tokens.astype(np.int32), permutation[tokens].astype(np.int32)
