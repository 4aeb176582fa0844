"""The pipeline's own checks, each raising a `ShardingError` that names the call, the value and the
fix (its options, its layers and batch, its parameters), and the pipeline's mesh: a leading `stage`
axis of S, then each stage's own fine mesh over `devices / S` devices."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from jshard._errors import DeviceCountError, ShardingError
from jshard._format import shape_str
from jshard.compile import Options, dtype_of
from jshard.layouts import FineMesh, check_dataset_strategy
from jshard.pipeline._engine import STAGE
from jshard.pipeline._model import Pipeline, check_stage_ids
from jshard.pipeline._schedule import SCHEDULES


class Checked(NamedTuple):
    """`options.pipeline` as `_check_options` passed it: `stages` and `micro_batches` given."""

    stages: int
    micro_batches: int
    schedule: str
    virtual_stages: int
    result_broadcast: bool


def check_config(call: str, pipe: Pipeline, options: Options) -> Checked:
    c = _check_options(call, options)
    if pipe.tagged:
        if c.virtual_stages != 1:
            raise ShardingError(
                f"{call}: per-stage functions (pipeline_stage) run one chunk per stage; "
                f"virtual_stages={c.virtual_stages} needs one layer function instead."
            )
        check_stage_ids(call, list(pipe.layer), c.stages)
    return c


def check_staged(call: str, options: Options) -> Checked:
    """The options a step cut by `pipeline_stage` tags takes: no `in_strategy` (interleaved: the
    tags number `stages × virtual_stages` stages, `Staged`)."""
    c = _check_options(call, options)
    if options.in_strategy:
        raise ShardingError(
            f"{call}: in_strategy= sets strategies inside the stages of a jshard.Pipeline; a step cut "
            f"by jshard.pipeline_stage tags packs each stage's parameters into one buffer per dtype, "
            f"which takes no per-leaf strategy. Drop in_strategy= and give the operators strategies "
            f"with jshard.shard inside the stages (they hold on each stage's devices), or use a "
            f"jshard.Pipeline."
        )
    return c


def _check_options(call: str, options: Options) -> Checked:
    """The pipeline options every pipelined step checks (stages, schedule, micro-batches, dataset),
    returned with `stages` and `micro_batches` known to be given."""
    c = options.pipeline
    assert c is not None  # `pipelined` makes a pipelined step only with one
    if not isinstance(c.stages, int) or c.stages < 2:
        raise ShardingError(
            f"{call}: stages={c.stages!r}; a pipeline needs at least 2 stages (drop pipeline= to run without one)."
        )
    if c.schedule not in SCHEDULES:
        raise ShardingError(f"{call}: schedule={c.schedule!r} is not one of {SCHEDULES}.")
    if c.micro_batches is None or c.micro_batches < c.stages:
        raise ShardingError(
            f"{call}: micro_batches={c.micro_batches} with stages={c.stages}: every stage needs a "
            f"micro-batch in flight, so micro_batches must be at least {c.stages}. Pass micro_batches="
            f"{2 * c.stages} or more (the bubble is (S-1)/(M+S-1))."
        )
    if c.virtual_stages != 1 and c.schedule != "interleaved":
        raise ShardingError(
            f"{call}: virtual_stages={c.virtual_stages} needs schedule='interleaved' (got {c.schedule!r})."
        )
    if not isinstance(c.virtual_stages, int) or c.virtual_stages < 1:
        raise ShardingError(f"{call}: virtual_stages={c.virtual_stages!r} must be a positive int.")
    if c.schedule == "interleaved" and c.micro_batches % c.stages:
        raise ShardingError(
            f"{call}: schedule='interleaved' runs micro-batches in groups of stages={c.stages}, but "
            f"micro_batches={c.micro_batches} is not a multiple of {c.stages}. Use micro_batches="
            f"{math.ceil(c.micro_batches / c.stages) * c.stages}."
        )
    check_dataset_strategy(options.dataset_strategy, call=call, tuples=False)
    return Checked(c.stages, c.micro_batches, c.schedule, c.virtual_stages, c.result_broadcast)


def _check_divides_devices(call: str, n: int, stages: int) -> None:
    if n % stages:
        raise ShardingError(
            f"{call}: devices={n} is not divisible by stages={stages}; each stage runs on "
            f"devices / stages devices. Use stages in {_divisors(n)[1:]}, or a device "
            f"count that is a multiple of {stages}."
        )


def check_layers(call: str, layers: int, stages: int, virtual: int) -> None:
    chunks = stages * virtual
    if layers % chunks:
        raise ShardingError(
            f"{call}: the layer stack has {layers} layers, which stages={stages} × virtual_stages="
            f"{virtual} = {chunks} chunks cannot share equally. Use a layer count that is a multiple of "
            f"{chunks}, or stages × virtual_stages in {_divisors(layers)}."
        )


def check_batch(call: str, batch: Any, micro: int, data: int) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        where = f"batch{jax.tree_util.keystr(path)} (shape {list(np.shape(x))})"
        if not np.ndim(x):
            raise ShardingError(
                f"{call}: {where} is a scalar; every batch array needs a leading row dim "
                f"that micro_batches={micro} cuts. Pass scalars in params, or give them rows."
            )
        rows = np.shape(x)[0]
        if rows % micro:
            raise ShardingError(
                f"{call}: micro_batches={micro} must divide the batch's rows, but {where} has "
                f"{rows} rows. Use a batch size that is a multiple of {micro}, or micro_batches in "
                f"{[d for d in _divisors(rows) if d > 1]}."
            )
        if (rows // micro) % data:
            raise ShardingError(
                f"{call}: {where} gives micro-batches of {rows // micro} rows, which the stage's "
                f"{data} devices cannot cut equally (dataset_strategy='data_parallel'). Use a batch size "
                f"that is a multiple of {micro * data}, fewer micro_batches, or dataset_strategy='full_batch'."
            )


def check_float_params(call: str, params: Any) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not jax.numpy.issubdtype(dtype_of(x), jax.numpy.inexact):
            raise ShardingError(
                f"{call}: params{jax.tree_util.keystr(path)} ({dtype_of(x)}{list(np.shape(x))}) is not a float array; "
                f"a pipelined step differentiates every parameter. Pass integer state in the batch, or close over it."
            )


def pipeline_mesh(call: str, options: Options) -> tuple[int, FineMesh, Mesh]:
    """`(devices, the stage's fine mesh, the pipeline's mesh)`: a leading `stage` axis of S, then
    each stage's own fine mesh over `devices / S` devices."""
    assert options.pipeline is not None and options.pipeline.stages is not None  # _check_options checked both
    have, stages = jax.devices(), options.pipeline.stages
    n = len(have) if options.devices is None else options.devices
    if n > len(have):
        raise DeviceCountError(
            f"{call}: devices={n}, but only {len(have)} device(s) are present; a pipelined "
            f"step runs on devices present. On a CPU call jshard.simulate_devices({n}) first."
        )
    _check_divides_devices(call, n, stages)
    inner = FineMesh.for_devices(n // stages)
    return n, inner, Mesh(np.asarray(have[:n], dtype=object).reshape(stages, *inner.sizes), (STAGE, *inner.names))


def name_of(pipe) -> str:
    return getattr(pipe, "__name__", type(pipe).__name__)


def signature(tree: Any) -> tuple:
    """The shapes and dtypes of `tree`'s leaves, and its structure: which program takes it."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(dtype_of(x))) for x in leaves)


def shapes(arrays) -> list[str] | dict[str, str]:
    """`arrays` (a list, or a dict by name) as shape strings, for errors."""
    if isinstance(arrays, dict):
        return {k: shape_str(dtype_of(v), np.shape(v)) for k, v in arrays.items()}
    return [shape_str(dtype_of(x), np.shape(x)) for x in arrays]


def not_built(call: str, what: str, given, batch, verb: str) -> ShardingError:
    """`train` called on parameters `pack` never made for these shapes (`given`, as `shapes` writes them)."""
    return ShardingError(
        f"{call}.train: no pipeline was built for {what} {given} and a batch of shapes "
        f"{shapes(jax.tree.leaves(batch))}. {verb} them with {call}.pack(params, batch) for a batch of these "
        f"shapes first."
    )


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
