"""The trace stage: the devices and the fine mesh a signature runs on, and the user function traced
to a jaxpr under a `TraceContext` (so `shard` calls become sharding constraints), as a `Traced`."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh

from jshard import _context
from jshard._distributed import host_major
from jshard.compile._options import Options
from jshard.compile._signature import dtype_of
from jshard.graph import Node, distinct_calls, flatten
from jshard.layouts import FineMesh


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


def devices_for(options: Options) -> list[jax.Device] | None:
    """The devices to run on; None for more than are present (an abstract mesh: plan only)."""
    if options.mesh is not None:
        return list(options.mesh.devices.flat)
    have = host_major(jax.devices())  # ranks fill one host before the next
    want = len(have) if options.devices is None else options.devices
    return None if want > len(have) else have[:want]


def trace(fn: Callable[..., Any], args: tuple, fine: FineMesh, devices: list | None, options: Options,
          call: str) -> Traced:
    """`fn(*args)` traced on the mesh of `fine` (the user's mesh in manual mode, an abstract one
    without devices)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    avals = [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)) for x in leaves]

    def flat_fn(*flat):
        return fn(*jax.tree_util.tree_unflatten(treedef, flat))

    if options.mode == "manual":
        mesh = options.mesh
    elif devices is None:
        mesh = jax.sharding.AbstractMesh(fine.sizes, fine.names)
    else:
        mesh = fine.jax_mesh(devices)
    ctx = _context.TraceContext(call, fine, mesh, options.mode)
    with _context.tracing(ctx):
        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
    closed = distinct_calls(closed)
    out_paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
    return Traced(closed, flatten(closed.jaxpr), ctx, leaves, treedef, paths,
                  [x for _, x in out_paths], out_tree, [jax.tree_util.keystr(p) for p, _ in out_paths])
