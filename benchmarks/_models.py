"""The table of reference models the benchmarks run: one `Model` entry each, at three sizes.

Sizes: `quick` (a smoke test), `full` (the benchmark on 8 devices) and `wide` (planning only, on 64
and 512 devices: abstract parameters, and the dims the 2-D preset cuts divisible by 256).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jshard import models

SIZES = ("quick", "full", "wide")


@dataclasses.dataclass(frozen=True)
class Model:
    """One reference model.

    Attributes:
      name: as the tables show it.
      configs: size → (model config, global batch size).
      init: `init(config, key) -> params`.
      loss: `loss(params, batch, config, preset) -> scalar`; `preset=None` is the plain model.
      batch: `batch(rng, config, batch_size) -> tuple of arrays`.
      tensor_dims: regex on a parameter's path → the dim that the hand-written Megatron and 2-D plans
        cut over the tensor-parallel axis (parameters no regex matches are replicated).
    """

    name: str
    configs: Mapping[str, tuple[Any, int]]
    init: Callable[[Any, jax.Array], Any]
    loss: Callable[[Any, tuple, Any, Any], jax.Array]
    batch: Callable[[np.random.Generator, Any, int], tuple]
    tensor_dims: Mapping[str, int]


@dataclasses.dataclass(frozen=True)
class Workload:
    """A model at one size, ready to step: parameters, Adam state, one batch."""

    name: str
    params: Any
    opt_state: Any
    batch: tuple
    loss: Callable[[Any, tuple, Any], jax.Array]
    optimizer: optax.GradientTransformation
    tensor_dims: Mapping[str, int]

    def step(self, preset) -> Callable[..., Any]:
        """`step(params, opt_state, batch) -> (params, opt_state, loss)`, sharded by `preset`'s
        `shard` calls inside `jshard.parallelize` (plain JAX elsewhere), or unannotated (`None`)."""
        return models.make_train_step(lambda p, b: self.loss(p, b, preset), self.optimizer)

    def args(self) -> tuple:
        return self.params, self.opt_state, self.batch

    def abstract_args(self) -> tuple:
        return _abstract(self.args())

    def describe(self) -> str:
        count = sum(int(np.prod(np.shape(x))) for x in jax.tree.leaves(self.params))
        return f"{count:,} parameters, Adam, batch {np.shape(self.batch[0])[0]}"


def workload(model: Model, size: str, **changes: Any) -> Workload:
    """`model` at `size`, its config fields replaced by `changes`; at `wide` its parameters and
    optimizer state are abstract (shapes only)."""
    config, batch_size = model.configs[size]
    config = dataclasses.replace(config, **changes)
    init = functools.partial(model.init, config)
    optimizer = optax.adam(1e-3)
    shapes_only = size == "wide"
    params = _shapes(init) if shapes_only else init(jax.random.key(0))
    opt_state = jax.eval_shape(optimizer.init, params) if shapes_only else optimizer.init(params)
    batch = model.batch(np.random.default_rng(0), config, batch_size)
    loss = lambda p, b, preset: model.loss(p, b, config, preset)
    return Workload(model.name, params, opt_state, batch, loss, optimizer, model.tensor_dims)


def _abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def _shapes(init: Callable[[jax.Array], Any]):
    """The parameters `init` makes, as shapes and dtypes only: traced, or (an init that draws on the
    host with NumPy) made once and dropped."""
    try:
        return jax.eval_shape(init, jax.random.key(0))
    except jax.errors.TracerArrayConversionError:
        return _abstract(init(jax.random.key(0)))


def model_table() -> list[Model]:
    """The reference models: MLP, GPT, GPT scan, ResNet, MoE."""
    return [_mlp(), _gpt(scan=False), _gpt(scan=True), _resnet(), _moe()]


def _dims(rules: Mapping[str, str]) -> dict[str, int]:
    """A model's Megatron rules as dims to cut: `column` the last dim, `row` the one before."""
    return {pattern: -1 if kind == "column" else -2 for pattern, kind in rules.items()}


def _mlp() -> Model:
    c = models.MLPConfig
    return Model(
        "MLP",
        {"quick": (c(32, 64, 16, 2), 16), "full": (c(256, 1024, 256, 4), 64), "wide": (c(1024, 4096, 1024, 4), 64)},
        models.init_mlp,
        lambda p, b, config, preset: models.mlp_loss(p, b, preset),
        models.mlp_batch,
        # Megatron cuts a column-parallel layer's bias with its columns.
        {**_dims(models.MLP_RULES), r"^b\d*[02468]$": -1},
    )


def _gpt(scan: bool) -> Model:
    c = functools.partial(models.GPTConfig, scan=scan)
    return Model(
        "GPT scan" if scan else "GPT",
        {
            "quick": (c(vocab=32, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=64), 8),
            "full": (c(vocab=64, seq_len=32, d_model=128, n_heads=8, n_layers=2, d_ff=512), 16),
            "wide": (c(vocab=512, seq_len=16, d_model=1024, n_heads=16, n_layers=2, d_ff=4096), 16),
        },
        models.init_gpt,
        models.gpt_loss,
        models.copy_task_batch,
        _dims(models.GPT_RULES),
    )


def _resnet() -> Model:
    config = models.ResNetConfig
    return Model(
        "ResNet",
        {
            "quick": (config(), 8),
            "full": (config(image_size=16, widths=(32, 64)), 32),
            "wide": (config(image_size=16, widths=(256, 512)), 16),
        },
        models.init_resnet,
        models.resnet_loss,
        models.resnet_batch,
        {**_dims(models.RESNET_RULES), r"^head/b$": -1},
    )


def _moe() -> Model:
    config = models.MoEConfig
    return Model(
        "MoE",
        {
            "quick": (config(vocab=32, seq_len=8, d_model=32, d_ff=64, n_experts=8, n_layers=1), 8),
            "full": (config(vocab=64, seq_len=16, d_model=128, d_ff=256, n_experts=8, n_layers=1), 16),
            "wide": (config(vocab=512, seq_len=16, d_model=256, d_ff=512, n_experts=256, n_layers=1), 16),
        },
        models.init_moe,
        models.moe_loss,
        models.moe_batch,
        # Expert parallelism: the stacked expert weights are cut by expert.
        {**_dims(models.MOE_RULES), r"/(w_in|w_out)$": 0},
    )
