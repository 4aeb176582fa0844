"""Reference ResNet: a small residual convnet for NHWC images in plain JAX, and a task it can learn.

A 3x3 stem convolution, a 3x3 stride-2 max-pool, two residual blocks (the second with stride 2
and a 1x1 projection on its skip path), global average pooling and a dense head. Normalisation is
a layer norm over channels, so the forward pass is a pure function of the parameters (no batch
statistics to carry). With a `Preset`, the head is column-parallel through `jshard.shard`; the
convolutions carry no strategy, and XLA follows the layout of their kernels.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jshard.models._presets import Preset

# An HWIO kernel's last dim is its output channels, so "column" cuts them as it cuts a dense
# weight's columns.
RESNET_RULES = {r"/(conv\d?|proj)$": "column", r"^head/w$": "column"}
_WAVES = ((0, 1), (1, 0), (1, 1), (1, -1), (0, 2), (2, 0), (2, 2), (2, -2))
"""The task's classes: plane waves `(f_h, f_w)` (cycles per image along height and width)."""


@dataclasses.dataclass(frozen=True, slots=True)
class ResNetConfig:
    """Square `image_size` images with `channels` channels; `widths` are the channels of the stem and
    first block, and of the second block; `n_classes` outputs (the wave task has at most 8)."""

    image_size: int = 8
    channels: int = 3
    widths: tuple[int, int] = (32, 32)
    n_classes: int = 8


def init_resnet(cfg: ResNetConfig, key: jax.Array) -> dict:
    """Parameters: `stem` and `blocks` (dicts of HWIO kernels and norms), `head` (`w`, `b`).

    The weights are drawn on the host by a NumPy generator seeded with `key`'s data: XLA on CPU
    takes seconds to compile a `jax.random` draw for each new shape.

    Examples:
      >>> params = init_resnet(ResNetConfig(), jax.random.key(0))
      >>> params["blocks"][1]["proj"].shape, params["head"]["w"].shape
      ((1, 1, 32, 32), (32, 8))
    """
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    conv = lambda k, i, o: rng.normal(size=(k, k, i, o)) / np.sqrt(k * k * i)
    norm = lambda c: {"scale": np.ones(c), "bias": np.zeros(c)}
    c1, c2 = cfg.widths
    params = {
        "stem": {"conv": conv(3, cfg.channels, c1), "norm": norm(c1)},
        "blocks": [
            {"conv1": conv(3, c1, c1), "norm1": norm(c1), "conv2": conv(3, c1, c1), "norm2": norm(c1)},
            {
                "conv1": conv(3, c1, c2), "norm1": norm(c2), "conv2": conv(3, c2, c2), "norm2": norm(c2),
                "proj": conv(1, c1, c2),
            },
        ],
        "head": {"w": rng.normal(size=(c2, cfg.n_classes)) / np.sqrt(c2), "b": np.zeros(cfg.n_classes)},
    }
    return jax.tree.map(lambda a: jnp.asarray(a, jnp.float32), params)


def _conv(x: jax.Array, kernel: jax.Array, stride: int = 1) -> jax.Array:
    return jax.lax.conv_general_dilated(
        x, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
    )


def _norm(x: jax.Array, p: dict) -> jax.Array:
    """Layer norm over channels: each pixel normalised on its own."""
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * p["scale"].reshape(1, 1, 1, -1) + p["bias"].reshape(1, 1, 1, -1)


def _block(p: dict, x: jax.Array, stride: int) -> jax.Array:
    h = jax.nn.relu(_norm(_conv(x, p["conv1"], stride), p["norm1"]))
    h = _norm(_conv(h, p["conv2"]), p["norm2"])
    skip = _conv(x, p["proj"], stride) if "proj" in p else x
    return jax.nn.relu(h + skip)


def resnet_apply(params: dict, images: jax.Array, cfg: ResNetConfig, preset: Preset | None = None) -> jax.Array:
    """Logits `[batch, n_classes]` for `images` `[batch, height, width, channels]`.

    The architecture is read off `params`; `cfg` is taken so that every reference model's apply
    and loss have one signature.
    """
    x = jax.nn.relu(_norm(_conv(images, params["stem"]["conv"]), params["stem"]["norm"]))
    x = jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    for p, stride in zip(params["blocks"], (1, 2)):
        x = _block(p, x, stride)
    pooled = x.mean(axis=(1, 2))
    matmul = jnp.matmul if preset is None else preset.matmul("column", 2)
    return matmul(pooled, params["head"]["w"]) + params["head"]["b"][None, :]


def resnet_loss(params: dict, batch: tuple, cfg: ResNetConfig, preset: Preset | None = None) -> jax.Array:
    """Mean softmax cross-entropy; `batch = (images, labels)` with int32 `labels` `[batch]`."""
    images, labels = batch
    logp = jax.nn.log_softmax(resnet_apply(params, images, cfg, preset), axis=-1)
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def resnet_batch(rng: np.random.Generator, cfg: ResNetConfig, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """A batch of the wave task: class `k` is a plane wave of frequency `_WAVES[k]`, random phase and
    colour, in noise. Convolutions then a global average pool tell the waves apart wherever they sit.

    Raises:
      ValueError: `cfg.n_classes` is more than the task's 8 waves.

    Examples:
      >>> images, labels = resnet_batch(np.random.default_rng(0), ResNetConfig(), 4)
      >>> images.shape, images.dtype, labels.dtype
      ((4, 8, 8, 3), dtype('float32'), dtype('int32'))
    """
    if cfg.n_classes > len(_WAVES):
        raise ValueError(f"jshard.models.resnet_batch: the wave task has {len(_WAVES)} classes, not {cfg.n_classes}.")
    labels = rng.integers(0, cfg.n_classes, size=batch)
    freq = np.array(_WAVES, np.float32)[labels]
    grid = np.arange(cfg.image_size, dtype=np.float32) * 2 * np.pi / cfg.image_size
    phase = (
        freq[:, 0, None, None] * grid[None, :, None]
        + freq[:, 1, None, None] * grid[None, None, :]
        + rng.uniform(0, 2 * np.pi, size=(batch, 1, 1))
    )
    colour = rng.uniform(0.5, 1.0, size=(batch, 1, 1, cfg.channels))
    noise = rng.normal(scale=0.3, size=(batch, cfg.image_size, cfg.image_size, cfg.channels))
    return (np.cos(phase)[..., None] * colour + noise).astype(np.float32), labels.astype(np.int32)
