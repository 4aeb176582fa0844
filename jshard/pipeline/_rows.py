"""Data parallel written as `jshard.shard` strategies inside a pipeline's stages: the stage's axes to
run manual, each device running its own rows, its gradients reduced once per step."""

from __future__ import annotations

import warnings
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

from jshard._errors import ShardingError
from jshard._format import shape_str
from jshard.compile import abstract
from jshard.pipeline._cut import Cut, spec_axes


def manual_rows(
    call: str, mesh: Mesh, names, micro_batches: int, found: Cut, batch, taken: set, retrace
) -> tuple[tuple[str, ...], Any]:
    """Data parallel written as `jshard.shard` strategies inside the stages, in either form: the
    stage's axes (of `names`) the strategies `found` traced cut the micro-batch's rows over and no
    parameter cuts (`Cut.row_axes`; `taken`: axes `in_strategy` cuts parameters over), to run manual,
    so each device runs its own rows and the gradients are reduced once per step. Returns those
    axes and `retrace(axes)` (the step traced on one device's rows, which checks that every
    strategy still divides them), or `((), None)`: none, or rows that do not split evenly, or a
    strategy that no longer divides one device's rows. Those axes then stay automatic (XLA
    reduces each micro-batch's gradients), and a `UserWarning` says so and why."""
    rows = jax.tree.leaves(abstract(batch))[0].shape[0] // micro_batches
    taken = taken | {a for spec in found.param_specs() if spec is not None for a in spec_axes(spec)}
    axes = tuple(a for a in names if a in set(found.row_axes(rows)) - taken)
    if not axes:
        return (), None
    d = micro_batches * int(np.prod([mesh.shape[a] for a in axes]))
    uneven = [x for x in jax.tree.leaves(abstract(batch)) if x.shape[0] % d]
    if uneven:
        why = (
            f"a batch array {shape_str(uneven[0].dtype, uneven[0].shape)} does not split into micro_batches × "
            f"{'·'.join(axes)} = {d} equal parts"
        )
    else:
        try:
            return axes, retrace(axes)
        except ShardingError as e:
            why = f"the step does not trace on one device's rows ({e})"
    warnings.warn(
        f"{call}: the jshard.shard strategies inside the stages cut the micro-batch's rows over "
        f"{', '.join(axes)}, but {why}; those axes stay automatic, so XLA reduces the gradients at every "
        f"micro-batch's backward ({micro_batches} times per step) instead of once. Fix: a batch "
        f"whose rows split evenly over micro_batches and those axes.",
        UserWarning,
        stacklevel=4,
    )
    return (), None
