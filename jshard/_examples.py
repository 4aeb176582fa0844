"""What `jshard plan` plans: a reference model's train step at a given size, or a user's function.

Everything here is shapes only: parameters and optimizer state are `jax.ShapeDtypeStruct` pytrees
(`jax.eval_shape` on the init function and on `optimizer.init`, or the init's shapes written out for
the models that draw their weights on the host with NumPy), and the batch is one small example
batch's leaves with the batch dim set. A 175B-parameter GPT plans in the memory of its graph.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import jax
import numpy as np
import optax

from jshard import models

MODEL_NAMES = ("gpt", "gpt-scan", "mlp", "resnet", "moe")

SIZE_OPTIONS: dict[str, tuple[str, type, str]] = {
    # option -> (dest, type, help)
    "--layers": ("layers", int, "blocks / layers (gpt, gpt-scan, mlp, moe)"),
    "--d-model": ("d_model", int, "model width (gpt, gpt-scan, moe)"),
    "--heads": ("heads", int, "attention heads (gpt, gpt-scan)"),
    "--seq-len": ("seq_len", int, "sequence length (gpt, gpt-scan, moe)"),
    "--vocab": ("vocab", int, "vocabulary size (gpt, gpt-scan, moe)"),
    "--d-ff": ("d_ff", int, "feed-forward hidden width (gpt, gpt-scan, moe)"),
    "--experts": ("experts", int, "experts per layer (moe)"),
    "--d-in": ("d_in", int, "input width (mlp)"),
    "--d-hidden": ("d_hidden", int, "hidden width (mlp)"),
    "--d-out": ("d_out", int, "output width (mlp)"),
    "--image-size": ("image_size", int, "image height and width (resnet)"),
    "--channels": ("channels", int, "input channels (resnet)"),
    "--widths": ("widths", str, "channels of the two stages, e.g. 64,128 (resnet)"),
    "--classes": ("classes", int, "output classes, at most 8 (resnet)"),
}
"""The sizing options `jshard plan` takes for a reference model (each defaults to the model's own
small config); `--batch` applies to every model."""

_FIELDS: dict[str, dict[str, str]] = {
    # model -> option dest -> config field
    "gpt": {"layers": "n_layers", "d_model": "d_model", "heads": "n_heads", "seq_len": "seq_len",
            "vocab": "vocab", "d_ff": "d_ff"},
    "mlp": {"layers": "n_layers", "d_in": "d_in", "d_hidden": "d_hidden", "d_out": "d_out"},
    "resnet": {"image_size": "image_size", "channels": "channels", "widths": "widths", "classes": "n_classes"},
    "moe": {"layers": "n_layers", "d_model": "d_model", "seq_len": "seq_len", "vocab": "vocab", "d_ff": "d_ff",
            "experts": "n_experts"},
}
_FIELDS["gpt-scan"] = _FIELDS["gpt"]
DEFAULT_BATCH = 16


class TargetError(ValueError):
    """The target cannot be built: an unknown name, an option that does not apply, a module or
    function that cannot be imported or called, or one that returns something else."""


@dataclasses.dataclass(frozen=True)
class Example:
    """A function to plan and example inputs for it.

    Attributes:
      name: as `jshard plan` shows it.
      fn: the function to parallelize.
      args: its positional arguments (arrays or `jax.ShapeDtypeStruct`s).
      options: extra `jshard.parallelize` keyword arguments (a train step donates its state).
      describe: a line on its size.
    """

    name: str
    fn: Callable[..., Any]
    args: tuple
    options: Mapping[str, Any]
    describe: str


def build(target: str, sizes: Mapping[str, Any], batch: int | None) -> Example:
    """The `Example` for `target`: a name in `MODEL_NAMES` (sized by `sizes`, option dest -> value,
    None where not given, and `batch`), or `MODULE:FUNCTION`.

    Raises:
      TargetError: see its docstring.
    """
    given = {k: v for k, v in sizes.items() if v is not None}
    if target in MODEL_NAMES:
        return reference(target, given, DEFAULT_BATCH if batch is None else batch)
    if ":" not in target:
        raise TargetError(f"unknown target {target!r}: name a reference model ({', '.join(MODEL_NAMES)}) or a "
                          f"user function as MODULE:FUNCTION (e.g. mypkg.train:example).")
    if given or batch is not None:
        flags = sorted(_flag(k) for k in given) + (["--batch"] if batch is not None else [])
        raise TargetError(f"{', '.join(flags)} size a reference model; {target} builds its own inputs.")
    return user_function(target)


def reference(name: str, sizes: Mapping[str, Any], batch: int) -> Example:
    """A reference model's Adam train step, `step(params, opt_state, batch)`, on abstract inputs."""
    fields = _FIELDS[name]
    wrong = [k for k in sizes if k not in fields]
    if wrong:
        allowed = ", ".join(_flag(k) for k in fields)
        raise TargetError(f"{', '.join(_flag(k) for k in wrong)} does not apply to {name} "
                          f"(its options: {allowed}, --batch).")
    if batch < 1 or any(isinstance(v, int) and v < 1 for v in sizes.values()):
        raise TargetError("sizes must be positive integers.")
    changes: dict[str, Any] = {fields[k]: _widths(v) if k == "widths" else v for k, v in sizes.items()}
    if name in ("gpt", "gpt-scan"):
        # the scanned GPT marks its block jshard.recompute(policy="auto"), as a model author would: the
        # search recomputes it where the memory budget needs it
        config = models.GPTConfig(scan=name == "gpt-scan", recompute="auto" if name == "gpt-scan" else None)
        config = dataclasses.replace(config, **changes)
        if config.d_model % config.n_heads:
            raise TargetError(f"--heads {config.n_heads} must divide --d-model {config.d_model}.")
        if config.seq_len < 4:
            raise TargetError(f"--seq-len must be at least 4 (the copy task), got {config.seq_len}.")
        params = jax.eval_shape(lambda key: models.init_gpt(config, key), jax.random.key(0))
        loss, batch_fn = (lambda p, b: models.gpt_loss(p, b, config)), models.copy_task_batch
        title = "GPT scan" if config.scan else "GPT"
        shape = (f"{config.n_layers} layers, d_model {config.d_model}, {config.n_heads} heads, d_ff {config.d_ff}, "
                 f"seq_len {config.seq_len}, vocab {config.vocab}")
    elif name == "mlp":
        config = dataclasses.replace(models.MLPConfig(), **changes)
        params = jax.eval_shape(lambda key: models.init_mlp(config, key), jax.random.key(0))
        loss, batch_fn, title = (lambda p, b: models.mlp_loss(p, b)), models.mlp_batch, "MLP"
        shape = f"{config.n_layers} layers, {config.d_in} -> {config.d_hidden} -> {config.d_out}"
    elif name == "resnet":
        config = dataclasses.replace(models.ResNetConfig(), **changes)
        if config.n_classes > 8:
            raise TargetError(f"--classes is at most 8 (the wave task), got {config.n_classes}.")
        params = resnet_shapes(config)
        loss, batch_fn, title = (lambda p, b: models.resnet_loss(p, b, config)), models.resnet_batch, "ResNet"
        shape = (f"{config.image_size}x{config.image_size}x{config.channels} images, widths {config.widths}, "
                 f"{config.n_classes} classes")
    else:
        config = dataclasses.replace(models.MoEConfig(), **changes)
        params = moe_shapes(config)
        loss, batch_fn, title = (lambda p, b: models.moe_loss(p, b, config)), models.moe_batch, "MoE"
        shape = (f"{config.n_layers} layers, d_model {config.d_model}, {config.n_experts} experts of "
                 f"d_ff {config.d_ff}, seq_len {config.seq_len}, vocab {config.vocab}")
    optimizer = optax.adam(1e-3)
    opt_state = jax.eval_shape(optimizer.init, params)
    # One example of the batch (small: the batch functions draw on the host), its batch dim set.
    example = batch_fn(np.random.default_rng(0), config, 1)
    batch_shapes = tuple(jax.ShapeDtypeStruct((batch,) + np.shape(x)[1:], np.asarray(x).dtype) for x in example)
    step = models.make_train_step(loss, optimizer)
    count = sum(math.prod(x.shape) for x in jax.tree.leaves(params))
    return Example(f"{title} train step", step, (params, opt_state, batch_shapes), {"donate_argnums": (0, 1)},
                   f"{shape}; {_count(count)} parameters, Adam, batch {batch}")


def resnet_shapes(cfg: models.ResNetConfig) -> dict:
    """`init_resnet(cfg, key)`'s shapes and dtypes (it draws on the host, so `eval_shape` cannot
    trace it)."""
    c1, c2 = cfg.widths
    conv = lambda k, i, o: _f32(k, k, i, o)
    norm = lambda c: {"scale": _f32(c), "bias": _f32(c)}
    return {
        "stem": {"conv": conv(3, cfg.channels, c1), "norm": norm(c1)},
        "blocks": [
            {"conv1": conv(3, c1, c1), "norm1": norm(c1), "conv2": conv(3, c1, c1), "norm2": norm(c1)},
            {"conv1": conv(3, c1, c2), "norm1": norm(c2), "conv2": conv(3, c2, c2), "norm2": norm(c2),
             "proj": conv(1, c1, c2)},
        ],
        "head": {"w": _f32(c2, cfg.n_classes), "b": _f32(cfg.n_classes)},
    }


def moe_shapes(cfg: models.MoEConfig) -> dict:
    """`init_moe(cfg, key)`'s shapes and dtypes (it draws on the host, so `eval_shape` cannot
    trace it)."""
    d, f, e = cfg.d_model, cfg.d_ff, cfg.n_experts
    norm = lambda: {"scale": _f32(d), "bias": _f32(d)}
    return {
        "embed": _f32(cfg.vocab, d),
        "pos": _f32(cfg.seq_len, d),
        "layers": [{"ln": norm(), "router": _f32(d, e), "w_in": _f32(e, d, f), "w_out": _f32(e, f, d)}
                   for _ in range(cfg.n_layers)],
        "ln_f": norm(),
        "head": _f32(d, cfg.vocab),
    }


def user_function(target: str) -> Example:
    """`MODULE:FUNCTION`: imports MODULE (a dotted name, found from the current directory too, or a
    path to a `.py` file), calls FUNCTION() and takes `(fn, args)` or `(fn, args, options)` from it."""
    module_name, _, attr = target.rpartition(":")
    if not module_name or not attr:
        raise TargetError(f"{target!r} is not MODULE:FUNCTION (e.g. mypkg.train:example).")
    module = _import(module_name)
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{module_name} has no attribute {attr!r} (target {target}).")
        obj = getattr(obj, part)
    if not callable(obj):
        raise TargetError(f"{target} is not a function: {type(obj).__name__}.")
    try:
        made = obj()
    except Exception as e:  # the user's code: report it as the target's failure
        raise TargetError(f"{target}() raised {type(e).__name__}: {e}") from e
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TargetError(f"{target}() must return (fn, args) or (fn, args, options); it returned "
                          f"{type(made).__name__}{'' if not isinstance(made, tuple) else f' of length {len(made)}'}.")
    fn, args = made[0], made[1]
    options = made[2] if len(made) == 3 else {}
    if not callable(fn):
        raise TargetError(f"{target}() returned a first item that is not callable ({type(fn).__name__}).")
    if not isinstance(args, (tuple, list)):
        raise TargetError(f"{target}() must return the example arguments as a tuple, got {type(args).__name__}.")
    if not isinstance(options, Mapping):
        raise TargetError(f"{target}() returned options that are not a dict of jshard.parallelize arguments.")
    leaves = jax.tree.leaves(tuple(args))
    count = sum(math.prod(np.shape(x)) for x in leaves)
    name = getattr(fn, "__name__", type(fn).__name__)
    return Example(f"{name} from {target}", fn, tuple(args), dict(options),
                   f"{len(args)} argument(s), {len(leaves)} array(s), {_count(count)} elements")


def _import(module_name: str):
    if module_name.endswith(".py") or os.sep in module_name:
        path = os.path.abspath(module_name)
        if not os.path.isfile(path):
            raise TargetError(f"no such file: {module_name}.")
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise TargetError(f"cannot import {module_name}: not a Python file; name a .py file or a module.")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:
            raise TargetError(f"importing {module_name} raised {type(e).__name__}: {e}") from e
        return module
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as `python -m` finds modules in the current directory
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise TargetError(f"cannot import {module_name!r}: {e}.") from e
    except Exception as e:
        raise TargetError(f"importing {module_name} raised {type(e).__name__}: {e}") from e


def _f32(*shape: int) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, np.float32)


def _widths(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise TargetError(f"--widths takes two channel counts, e.g. 64,128; got {text!r}.") from None
    return a, b


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def _count(n: int) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)
