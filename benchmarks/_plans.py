"""The plans compared: jshard's propagation and Shardy's from the anchors of the 2-D preset, and the
expert plans written by hand with PartitionSpecs and plain `jax.jit` (no jshard in the loop).

The anchors are the model's `shard` calls under `preset("2d", n)` and the batch cut `dp` ways;
parameters and optimizer state get no `in_strategy`, so the propagation lays them out. The expert
plans run the unannotated train step with every argument's sharding written out:

- `data`: parameters and optimizer state replicated, the batch cut over all devices;
- `fsdp`: each parameter and optimizer-state leaf cut over all devices on its largest dim that the
  device count divides, the batch cut over all devices;
- `megatron`: the model's column/row-parallel weights cut over all devices (`Model.tensor_dims`),
  optimizer state with its parameter, the batch replicated;
- `2d`: the same cuts over `mp = n/2` devices and the batch over `dp = 2`: preset `2d` by hand.
"""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import jshard as js
from benchmarks._models import Workload
from jshard import models

PLANS = ("jshard", "shardy", "data", "fsdp", "megatron", "2d")
MATCHING_EXPERT = "2d"
"""The expert plan written to match the anchors' preset."""


def parallelized(w: Workload, devices: int, propagation: str = "jshard", batch: str = "given") -> js.Parallelized:
    """The train step from the 2-D preset's anchors, as a fresh `Parallelized` (an empty cache);
    `batch`: `given` (cut `dp` ways by an `in_strategy`) or `default` (left to the dataset strategy)."""
    preset = models.preset("2d", devices)
    rows = tuple(preset.batch(len(np.shape(x))) for x in w.batch)
    given = None if batch == "default" else (None, None, rows)
    return js.parallelize(w.step(preset), devices=devices, in_strategy=given, propagation=propagation)


def same_shardings(w: Workload, plan: js.Plan, devices: int) -> Any:
    """Plain `jax.jit` of the train step that jshard planned, with the argument and result shardings
    jshard gives `jax.jit` (its `shard` calls are plain functions outside `jshard.parallelize`)."""
    step = w.step(models.preset("2d", devices))
    return jax.jit(step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings)


def expert(name: str, w: Workload, devices: int) -> Any:
    """The expert plan `name` (`data`, `fsdp`, `megatron` or `2d`) as a `jax.jit` of the plain step."""
    mesh, params, state, batch = _EXPERTS[name](w, devices)
    named = lambda tree: jax.tree.map(lambda spec: NamedSharding(mesh, spec), tree)
    return jax.jit(
        w.step(None),
        in_shardings=(named(params), named(state), named(batch)),
        out_shardings=(named(params), named(state), NamedSharding(mesh, PartitionSpec())),
    )


def _mesh(devices: int, shape: tuple[int, ...], axes: tuple[str, ...]) -> Mesh:
    return Mesh(np.array(jax.devices()[:devices]).reshape(shape), axes)


def _data(w: Workload, n: int):
    replicated = lambda tree: jax.tree.map(lambda _: PartitionSpec(), tree)
    return _mesh(n, (n,), ("dp",)), replicated(w.params), replicated(w.opt_state), _batch(w, "dp")


def _fsdp(w: Workload, n: int):
    cut = lambda tree: jax.tree.map(lambda x: _largest_dim(np.shape(x), "dp", n), tree)
    return _mesh(n, (n,), ("dp",)), cut(w.params), cut(w.opt_state), _batch(w, "dp")


def _megatron(w: Workload, n: int):
    params = _tensor_parallel(w, "mp", n)
    return _mesh(n, (n,), ("mp",)), params, _following(params, w), _batch(w, None)


def _two_d(w: Workload, n: int):
    params = _tensor_parallel(w, "mp", n // 2)
    return _mesh(n, (2, n // 2), ("dp", "mp")), params, _following(params, w), _batch(w, "dp")


_EXPERTS = {"data": _data, "fsdp": _fsdp, "megatron": _megatron, "2d": _two_d}


def _batch(w: Workload, axis: str | None):
    return tuple(PartitionSpec(axis) for _ in w.batch)


def _largest_dim(shape: tuple[int, ...], axis: str, n: int) -> PartitionSpec:
    """`axis` on the largest dim that `n` divides (the first of equals), or replicated if none."""
    dims = [d for d in range(len(shape)) if shape[d] % n == 0]
    if not dims:
        return PartitionSpec()
    best = max(dims, key=lambda d: (shape[d], -d))
    return PartitionSpec(*(axis if d == best else None for d in range(len(shape))))


def _tensor_parallel(w: Workload, axis: str, n: int):
    """Each parameter cut `n` ways on its `tensor_dims` dim (the first regex that matches its path)."""

    def one(path, x):
        name = jax.tree_util.keystr(path, simple=True, separator="/")
        dim = next((d for pattern, d in w.tensor_dims.items() if re.search(pattern, name)), None)
        shape = np.shape(x)
        if dim is None:
            return PartitionSpec()
        dim %= len(shape)
        if shape[dim] % n:
            raise ValueError(f"benchmarks: {w.name} parameter {name} {list(shape)}: {n} does not divide dim {dim}.")
        return PartitionSpec(*(axis if d == dim else None for d in range(len(shape))))

    return jax.tree_util.tree_map_with_path(one, w.params)


def _following(param_specs, w: Workload):
    """Optimizer state laid out like the parameter it tracks; the rest (step counts) replicated."""
    specs = models.state_strategies(param_specs, w.params, w.opt_state)
    return jax.tree.map(lambda _, spec: PartitionSpec() if spec is None else spec, w.opt_state, specs)
