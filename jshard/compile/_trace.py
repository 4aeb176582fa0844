"""The trace stage: the devices and the fine mesh a signature runs on, and the user function traced
to a jaxpr under a `TraceContext` (so `shard` calls become sharding constraints), as a `Traced`.

A user's mesh (`mesh=`, or the one `jax.set_mesh` makes current when the call is made) is adopted:
the function is traced under it, as `jax.jit` would trace it, so the model's own constraints (a
`with_sharding_constraint` with a `PartitionSpec`, Linen's logical constraints, `out_sharding=` and
`reshard` on `Explicit` axes) resolve against it and reach the jaxpr in its axis names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import re
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh

from jshard import _context
from jshard._distributed import host_major
from jshard._errors import ShardingError
from jshard.compile._options import Options
from jshard.compile._signature import context_mesh, dtype_of, weak_type
from jshard.cost import LiveRanges, live_ranges
from jshard.graph import Node, distinct_calls, flatten
from jshard.layouts import FineMesh, typed_spec
from jshard.rules import FUSION, OpTable


@dataclasses.dataclass(frozen=True)
class Traced:
    """One signature of the user function, traced.

    Attributes:
      closed: the jaxpr of the function of the flat argument leaves.
      nodes: its `Node`s (the OpGraph every planner reads).
      ctx: the trace context: the meshes and the `shard` calls met (`ctx.annotations`).
      leaves / treedef / paths: the argument leaves, their tree and their `keystr` paths.
      out_leaves / out_tree / out_paths: the same for the results (as shapes).
    """

    closed: jcore.ClosedJaxpr
    nodes: list[Node]
    ctx: _context.TraceContext
    leaves: list
    treedef: Any
    paths: list[str]
    out_leaves: list
    out_tree: Any
    out_paths: list[str]
    _ranges: dict = dataclasses.field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def fine(self) -> FineMesh:
        return self.ctx.fine

    @property
    def mesh(self) -> Mesh:
        return self.ctx.mesh

    @property
    def invars(self) -> list:
        return self.closed.jaxpr.invars

    @property
    def outvars(self) -> list:
        return self.closed.jaxpr.outvars

    @property
    def axis_size(self) -> dict[str, int]:
        return dict(zip(self.fine.names, self.fine.sizes))

    @functools.cached_property
    def table(self) -> OpTable:
        """The nodes' `OpTable` (operands and factors), read once for the search and the work stage."""
        return OpTable(self.nodes)

    def live_ranges(self, args: Sequence, donated: frozenset = frozenset(),
                    host: frozenset = frozenset()) -> LiveRanges:
        """`cost.live_ranges` of the nodes (XLA's fusion, `rules.FUSION`), made once per arguments,
        donated and host-kept ones: the search's memory model and the built plan's peak
        (`plan.planned_peak`) read the same."""
        key = (tuple(args), donated, host)
        found = self._ranges.get(key)
        if found is None:
            found = self._ranges[key] = live_ranges(self.nodes, args, self.outvars, donated, host, FUSION)
        return found

    def typed(self) -> dict:
        """Value -> `Spec` for every value whose type fixes its layout (`Explicit` mesh axes)."""
        found = {}
        for v in self.invars:
            spec = typed_spec(v.aval)
            if spec is not None:
                found[v] = spec
        for node in self.nodes:
            for v in node.outputs:
                spec = typed_spec(getattr(v, "aval", None))
                if spec is not None:
                    found[v] = spec
        return found


def adopted(options: Options, call: str) -> Options:
    """`options` with the user's mesh: `mesh=`, else the context mesh (`jax.set_mesh`), else none.

    Raises:
      ShardingError: `devices=` disagrees with the context mesh's size.
    """
    if options.mesh is not None:
        return options
    mesh = context_mesh()
    if mesh is None:
        return options
    if options.devices is not None and options.devices != mesh.devices.size:
        raise ShardingError(
            f"{call}: devices={options.devices}, but the call runs under jax.set_mesh with a mesh of "
            f"{mesh.devices.size} devices {dict(mesh.shape)}; jshard plans on the mesh it is given. Drop "
            f"devices= (the mesh sets the count), or call outside jax.set_mesh.")
    return dataclasses.replace(options, mesh=mesh)


_UNBOUND = re.compile(r"unbound axis name: (?P<axis>[^\s.]+)\.?(?: To fix this, please call (?P<op>\w+))?")
"""JAX's error for a collective (`lax.psum`, `pmean`, `axis_index`, ...) over an axis name that no
`pmap`, `vmap` or `shard_map` binds."""


def _collective_error(call: str, axis: str, op: str | None, where: str) -> str:
    what = f"`{op}`" if op else "a collective"
    return (f"{call}: {what} over the axis name {axis!r} at {where} has no such axis to run on: this is pmap-era "
            f"code (lax.psum/pmean/all_gather/axis_index over a named axis, or a BatchNorm with axis_name={axis!r}, "
            f"which calls pmean). Under jshard the function sees the global batch, one array over all devices, so a "
            f"mean over the batch dim is already the mean over every device: drop the collective (jnp.mean over "
            f"the batch dim for lax.pmean) and the BatchNorm's axis_name=. To write the per-device program and its "
            f"collectives yourself, run them inside jax.shard_map over a mesh with an axis {axis!r} "
            f"(mode='manual', mesh=...).")


def _user_line(e: BaseException) -> str:
    """The innermost frame of `e`'s traceback outside JAX, Flax and jshard: the user's line."""
    skip = tuple(os.path.dirname(m.__file__) for m in (jax, sys.modules.get("flax"), sys.modules.get("jshard"))
                 if m is not None and getattr(m, "__file__", None))
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not f.filename.startswith(skip)]
    return "?" if not frames else f"{os.path.basename(frames[-1].filename)}:{frames[-1].lineno}"


def devices_for(options: Options) -> list[jax.Device] | None:
    """The devices to run on; None for more than are present (an abstract mesh: plan only)."""
    if options.mesh is not None:
        return list(options.mesh.devices.flat)
    have = host_major(jax.devices())  # ranks fill one host before the next
    want = len(have) if options.devices is None else options.devices
    return None if want > len(have) else have[:want]


def trace(fn: Callable[..., Any], args: tuple, fine: FineMesh, devices: list | None, options: Options,
          call: str, recompute: str = "full", accumulator: tuple | None = None,
          types: Sequence | None = None, batch_axes: tuple[str, ...] | None = None) -> Traced:
    """`fn(*args)` traced on the mesh of `fine` (the user's mesh where there is one, an abstract one
    without devices), `jshard.recompute(policy="auto")` regions recomputed by `recompute`;
    `jshard.accumulate` calls in it read `options.accumulation` and `accumulator` (the accumulated
    gradients' cut, with `accumulation_shard`) and `batch_axes` (the axes that cut the batch's rows:
    each device sums its micro-batches, then one reduction); `types`: each argument leaf's sharding
    its type carries (`Explicit` axes).

    Raises:
      ShardingError: `accumulation_steps` is given but `fn` calls no `jshard.accumulate`.
    """
    leaves, treedef = jax.tree_util.tree_flatten(args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]

    def flat_fn(*flat):
        return fn(*jax.tree_util.tree_unflatten(treedef, flat))

    if options.mesh is not None:
        mesh = options.mesh
    elif devices is None:
        mesh = jax.sharding.AbstractMesh(fine.sizes, fine.names)
    else:
        mesh = fine.jax_mesh(devices)
    steps = None if options.accumulation is None else options.accumulation.steps
    types = types or [None] * len(leaves)
    avals = [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x), sharding=t, weak_type=weak_type(x))
             for x, t in zip(leaves, types)]
    ctx = _context.TraceContext(call, fine, mesh, options.mode, accumulation_steps=steps, accumulator=accumulator,
                                batch_axes=batch_axes, recompute=options.recompute, recompute_choice=recompute,
                                communication=options.communication, cost=_priced(options),
                                context_cut=options.context_cut)
    with _context.tracing(ctx), _users_mesh(options.mesh):
        try:
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
        except NameError as e:
            unbound = _UNBOUND.search(str(e))
            if unbound is None:
                raise
            raise ShardingError(_collective_error(call, unbound["axis"], unbound["op"], _user_line(e))) from None
    if not ctx.accumulated and options.communication is not None and options.communication.copies > 1:
        raise ShardingError(
            f"{call}: Communication(copies={options.communication.copies}), but the function calls no "
            f"jshard.accumulate, so jshard cannot tell which part of it to run on each copy. Wrap the gradient "
            f"function in the step: loss, grads = jshard.accumulate(jax.value_and_grad(loss_fn))(params, batch); "
            f"or drop copies.")
    if steps is not None and not ctx.accumulated:
        raise ShardingError(
            f"{call}: accumulation={steps}, but the function calls no jshard.accumulate, so jshard cannot tell "
            f"which part of it makes the gradients. Wrap the gradient function in the step: loss, grads = "
            f"jshard.accumulate(jax.value_and_grad(loss_fn))(params, batch); or drop accumulation=.")
    closed = distinct_calls(closed)
    out_paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    return Traced(closed, flatten(closed.jaxpr), ctx, leaves, treedef, paths,
                  [x for _, x in out_paths], out_tree, [jax.tree_util.keystr(p) for p, _ in out_paths])


def _users_mesh(mesh: Mesh | None):
    """The user's mesh made current while tracing (as under `jax.set_mesh`); nothing without one."""
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def _priced(options):
    """The options' cost model, its memory the search's budget where one is given."""
    budget = options.memory_budget
    return options.costs if budget is None else dataclasses.replace(options.costs, memory=budget)
