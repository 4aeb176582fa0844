"""Values a stage's strategies cut inside it, packed as they are cut.

The cut form (`_staged.py`) packs a stage's parameter leaves into one flat buffer per dtype, whole
on each of the stage's devices. A leaf a strategy cuts inside its stage (Megatron's column or row
cut, `Cut.param_specs`; or the cut a stage's search gave it, `SearchedCut.param_specs`) goes into
the buffer of its layout class instead (`CutClass`): the leaves of one dtype cut over the same
axes, each stored as its shards side by side (`to_rows`), so each device holds only its shard.

The values a stage stores per micro-batch (the residuals its backward reads) and sends to its
neighbours (boundary activations, their gradients) are packed the same way, by the layout they
have inside the stage (`stage_layouts`: the stage's parameters' layouts and its strategies'
constraints propagated over its forward, `jshard.propagate`), so that under Megatron's cuts the
ff hidden values stay cut over the stage's `mp` axis in their slots and on the wire, and the
residual stream, which the row cut's all-reduce leaves whole, stays whole.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from jshard.graph import flatten
from jshard.layouts import replicated, spec_from_pspec, to_pspec
from jshard.pipeline._cut import Cut, spec_axes, without_axes
from jshard.propagate import propagate


@dataclasses.dataclass(frozen=True)
class CutClass:
    """The parameter leaves of one dtype cut over the same axes inside their stages, packed as one
    `[S·v, n, width]` buffer cut over `stage` and `axes`: row `k` holds stage `k`'s leaves, each
    as its `n` shards (`to_rows`) side by side, so device `i` of the `n` holds shard `i` of each.

    Attributes:
      dtype: the leaves' dtype name.
      axes: the stage's axes that cut them, in mesh order.
      n: how many devices those axes hold.
      leaves: per (virtual) stage, the indices of its leaves of this class.
      specs: per leaf index, its `PartitionSpec` inside the stage.
      width: per device, the elements of the largest stage's shards.
    """

    dtype: str
    axes: tuple[str, ...]
    n: int
    leaves: tuple[tuple[int, ...], ...]
    specs: dict[int, P]
    width: int

    @property
    def key(self) -> str:
        """Its name among the packed buffers (`float32@d0.d1`; a dtype's whole buffer is named by the dtype)."""
        return f"{self.dtype}@{'.'.join(self.axes)}"

    def pack(self, k: int, leaves: Sequence[jax.Array], sizes: dict[str, int]) -> jax.Array:
        """Stage `k`'s leaves of the class as its `[n, width]` row, zero-padded."""
        rows = [to_rows(x, self.specs[j], self.axes, sizes) for j, x in zip(self.leaves[k], leaves)]
        used = sum(r.shape[1] for r in rows)
        pad = [jnp.zeros((self.n, self.width - used), self.dtype)] if self.width > used else []
        return jnp.concatenate([r.astype(self.dtype) for r in rows] + pad, axis=1) if rows or pad else \
            jnp.zeros((self.n, 0), self.dtype)

    def unpack(self, k: int, row: jax.Array, avals: Sequence[Any], sizes: dict[str, int]) -> list[jax.Array]:
        """Stage `k`'s leaves of the class read back from its `[n, width]` row (`avals`: all leaves')."""
        out, start = [], 0
        for j in self.leaves[k]:
            local = int(np.prod(avals[j].shape)) // self.n
            out.append(from_rows(row[:, start:start + local], self.specs[j], self.axes, sizes, avals[j].shape))
            start += local
        return out


def _split(shape: Sequence[int], spec: P, sizes: dict[str, int]) -> tuple[list[int], list[str | None]]:
    """Each dim of `shape` split into its cutting axes' sizes (major first) and the shard's extent:
    the sizes, and per split dim its axis (None: the shard's own extent)."""
    split, names = [], []
    for d, size in enumerate(shape):
        axes = spec_axes(spec[d:d + 1])
        split += [sizes[a] for a in axes] + [size // int(np.prod([sizes[a] for a in axes]))]
        names += [*axes, None]
    return split, names


def to_rows(x: jax.Array, spec: P, axes: Sequence[str], sizes: dict[str, int]) -> jax.Array:
    """`x`, laid out as `spec` cuts it over `axes`, as `[n, x.size / n]`: row `i` the flat shard of
    the device at position `i` of `axes` (major first).

    Examples:
      >>> to_rows(jnp.arange(8).reshape(2, 4), P(None, "a"), ("a",), {"a": 2}).tolist()
      [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    split, names = _split(x.shape, spec, sizes)
    order = [names.index(a) for a in axes] + [i for i, name in enumerate(names) if name is None]
    return jnp.transpose(x.reshape(split), order).reshape(int(np.prod([sizes[a] for a in axes])), -1)


def from_rows(rows: jax.Array, spec: P, axes: Sequence[str], sizes: dict[str, int], shape: Sequence[int]) -> jax.Array:
    """The array of `shape` whose `to_rows` is `rows`."""
    split, names = _split(shape, spec, sizes)
    order = [names.index(a) for a in axes] + [i for i, name in enumerate(names) if name is None]
    return jnp.transpose(rows.reshape([split[i] for i in order]), np.argsort(order)).reshape(shape)


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


def stage_vjp(cut: Cut, k: int, params_k: Sequence[Any], ins: Sequence[Any], batch: Sequence[Any]):
    """Stage `k` of `cut` under `jax.vjp` (over its parameters and float inputs):
    `(outputs, pullback of the float outputs)`."""
    floats = [n for n, x in enumerate(ins) if _inexact(x)]

    def run(params_k, xs):
        merged = list(ins)
        for n, x in zip(floats, xs):
            merged[n] = x
        outs = cut.run(k, params_k, batch, merged)
        return [y for y in outs if _inexact(y)], outs

    _, pull, outs = jax.vjp(run, list(params_k), [ins[n] for n in floats], has_aux=True)
    return outs, pull


def stored(pull, params_k: Sequence[Any]) -> tuple[Any, tuple[int | None, ...], list]:
    """`(structure, param_of, residuals)`: the pullback's leaves, each either one of the stage's
    parameters (`param_of`: its index; read again at the backward) or a residual to store."""
    leaves, tree = jax.tree.flatten(pull)
    param_of = tuple(next((j for j, p in enumerate(params_k) if leaf is p), None) for leaf in leaves)
    return tree, param_of, [jnp.asarray(leaf) for leaf, j in zip(leaves, param_of) if j is None]


@dataclasses.dataclass(frozen=True)
class StageLayouts:
    """Where a stage's strategies leave the values the pipeline stores and sends (`stage_layouts`).

    Attributes:
      boundary: per boundary `k -> k+1`, the `PartitionSpec` over the stage's axes of each value
        crossing it (`Cut.boundary[k]`) as stage `k` makes it (None: whole).
      residuals: per stage, the spec of each residual its forward stores (`stored` order).
      residual_shapes: per stage, its residuals' shapes, in the same order.
    """

    boundary: tuple[tuple[P | None, ...], ...]
    residuals: tuple[tuple[P | None, ...], ...]
    residual_shapes: tuple[tuple[tuple[int, ...], ...], ...]


def stage_layouts(cut: Cut, param_avals: Sequence[Any], param_specs: Sequence[P | None],
                  axis_sizes: dict[str, int]) -> StageLayouts:
    """Each stage's forward under `jax.vjp`, traced on shapes, with its parameters laid out as
    `param_specs` says (per leaf, as the pipeline holds it; None: whole) and its inputs as the
    previous stage made them; the layouts of its
    boundary outputs and residuals are what `jshard.propagate` gives them from those and the
    strategies' constraints inside the stage, over the stage's automatic axes (`axis_sizes`; others
    are left out). A value whose layout no rule settles, or that a spec does not divide, is whole."""
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in cut.batch_avals]
    incoming: tuple[P | None, ...] = ()
    boundary, residuals, shapes = [], [], []
    for k in range(cut.stages):
        params_k = [jax.ShapeDtypeStruct(param_avals[j].shape, param_avals[j].dtype) for j in cut.params[k]]
        ins = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (cut.boundary[k - 1] if k else ())]

        def probe(params_k, ins, batch, k=k):
            outs, pull = stage_vjp(cut, k, params_k, ins, batch)
            return outs, stored(pull, params_k)[2]

        jaxpr = jax.make_jaxpr(probe)(params_k, ins, batch).jaxpr
        found = propagated(jaxpr, [param_specs[j] for j in cut.params[k]] + list(incoming), jaxpr.outvars, axis_sizes)
        n_out = len(cut.boundary[k]) if k < cut.stages - 1 else 1
        if k < cut.stages - 1:
            boundary.append(tuple(found[:n_out]))
            incoming = boundary[-1]
        residuals.append(tuple(found[n_out:]))
        shapes.append(tuple(tuple(v.aval.shape) for v in jaxpr.outvars[n_out:]))
    return StageLayouts(tuple(boundary), tuple(residuals), tuple(shapes))


def propagated(jaxpr: jcore.Jaxpr, in_specs: Sequence[P | None], values: Sequence[Any],
               axis_sizes: dict[str, int]) -> list[P | None]:
    """The layouts of `values` (variables of `jaxpr`) that `jshard.propagate` gives them over
    `axis_sizes` from `in_specs`, the layouts of `jaxpr`'s first arguments (None, or any argument
    past them: whole), and the constraints inside it; None where a value is whole, where no rule
    settles it, or where its layout does not divide it."""
    given = list(in_specs) + [None] * (len(jaxpr.invars) - len(in_specs))
    anchors = {v: spec_from_pspec(_kept(spec, axis_sizes), v.aval.ndim) if spec is not None else replicated(v.aval.ndim)
               for v, spec in zip(jaxpr.invars, given)}
    found = propagate(flatten(jaxpr), anchors, axis_sizes, outputs=jaxpr.outvars).values
    return [_divides(found.get(v, anchors.get(v)), v.aval.shape, axis_sizes) if isinstance(v, jcore.Var) else None
            for v in values]


def _kept(spec: P, axis_sizes: dict[str, int]) -> P:
    """`spec` over the axes of `axis_sizes` only (a manual or stage axis left out)."""
    return without_axes(spec, set(spec_axes(spec)) - set(axis_sizes))


def _divides(spec, shape: Sequence[int], axis_sizes: dict[str, int]) -> P | None:
    """`spec` (a `jshard.layouts.Spec`) as a `PartitionSpec` over `axis_sizes`' axes, or None
    where it cuts nothing or does not divide `shape`."""
    if spec is None:
        return None
    kept = tuple(tuple(a for a in axes if a in axis_sizes) for axes in spec)
    if not any(kept) or any(d % int(np.prod([axis_sizes[a] for a in axes])) for d, axes in zip(shape, kept)):
        return None
    return to_pspec(kept)
