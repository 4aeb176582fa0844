"""A traced value moved to a layout on whatever axis types the mesh has, with JAX's own means.

On `Auto` axes a layout is a hint for XLA: `with_sharding_constraint`. On `Explicit` axes
(`jax.make_mesh`'s default since JAX 0.9) a value's layout is part of its type, and
`with_sharding_constraint` only asserts it; the move is `jax.sharding.reshard`, which retypes the
value. A mesh of both kinds takes both: `reshard` over its `Explicit` axes, then the constraint over
its `Auto` ones. `Manual` axes (inside a `shard_map`) are each device's own and left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Sequence
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec

from jshard._compat import source_info_util

source_info_util.register_exclusion(__file__)  # operators' source lines name the caller, not this module


def _axes(entry) -> tuple[str, ...]:
    if entry is None or entry is PartitionSpec.UNCONSTRAINED:
        return ()
    return entry if isinstance(entry, tuple) else (entry,)


def keep_axes(spec: PartitionSpec, keep: Collection[str]) -> PartitionSpec:
    """`spec` with only the axes in `keep` (a dim cut over none of them left whole)."""
    def entry(e):
        if e is PartitionSpec.UNCONSTRAINED:
            return e
        axes = tuple(a for a in _axes(e) if a in keep)
        return None if not axes else axes[0] if len(axes) == 1 else axes
    return PartitionSpec(*map(entry, spec))


def _typed(x) -> PartitionSpec | None:
    """The spec `x`'s type carries, or None where it carries none."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    return None if sharding is None or sharding.mesh.empty else sharding.spec


def place(x, sharding: NamedSharding):
    """`x` laid out as `sharding` says, by the means its mesh's axis types allow.

    The axis types are those of `x`'s type (inside a region `on_auto_axes` runs, its axes are
    `Auto`), else of the context mesh, else of `sharding`'s mesh. `Explicit` axes are moved by
    `jax.sharding.reshard` (only where `x`'s type differs); `Auto` axes by
    `with_sharding_constraint`; `Manual` axes (inside a `shard_map`) are each device's own and
    left out.
    """
    typed, context = _type_mesh(x), jax.sharding.get_abstract_mesh()
    mesh = typed if typed is not None else context if not context.empty else sharding.mesh.abstract_mesh
    scoped = typed is not None and typed != context
    if not scoped and context.empty:  # no mesh to resolve a PartitionSpec against: name the mesh
        return _place(x, sharding.spec, mesh, lambda spec: NamedSharding(sharding.mesh, spec))
    with jax.sharding.use_abstract_mesh(mesh) if scoped else contextlib.nullcontext():
        return _place(x, sharding.spec, mesh, lambda spec: spec)


def _place(x, spec: PartitionSpec, mesh, named: Callable[[PartitionSpec], Any]):
    explicit, auto = set(mesh.explicit_axes), set(mesh.auto_axes)
    if explicit:
        want, have, ndim = keep_axes(spec, explicit), _typed(x), jax.typeof(x).ndim
        if have is None or _normal(have, ndim) != _normal(want, ndim):
            x = jax.sharding.reshard(x, named(want))
    if auto and (not explicit or any(a in auto for e in spec for a in _axes(e))):
        x = jax.lax.with_sharding_constraint(x, named(keep_axes(spec, auto)))
    return x


def _type_mesh(x):
    """The (abstract) mesh `x`'s type names, or None where it names none."""
    sharding = getattr(jax.typeof(x), "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return None if mesh is None or mesh.empty else mesh


def _normal(spec: PartitionSpec, ndim: int) -> tuple:
    entries = [tuple(_axes(e)) for e in spec] + [()] * (ndim - len(spec))
    return tuple(entries[:ndim])


def on_auto_axes(fn: Callable[..., tuple[list, list]], *args):
    """`fn(*args)` run with the context mesh's `Explicit` axes made `Auto`, as
    `jax.sharding.auto_axes` runs a function: for an operator whose result layout is known (a
    `shard` call's rule or `out_strategy`) but that types alone may leave ambiguous (a contraction
    over a cut dim). `fn` returns its result leaves and the `NamedSharding` (or None: replicated)
    each leaves the region typed with. Arguments that are not arrays pass through. Where no axis is
    `Explicit`, `fn` runs as it is."""
    mesh = jax.sharding.get_abstract_mesh()
    explicit = tuple(mesh.explicit_axes)
    if not explicit:
        return fn(*args)[0]
    inner = mesh.update_axis_types({a: jax.sharding.AxisType.Auto for a in explicit})
    with jax.sharding.use_abstract_mesh(inner):
        args = jax.tree_util.tree_map(lambda x: _untyped(x, explicit) if isinstance(x, jax.Array) else x, args)
        leaves, shardings = fn(*args)
    return [jax.sharding.reshard(x, PartitionSpec() if s is None else keep_axes(s.spec, explicit))
            for x, s in zip(leaves, shardings)]


def _untyped(x, explicit: Sequence[str]):
    """`x` entering an `Auto` region over `explicit`: its type without those axes."""
    have = _typed(x)
    return x if have is None else jax.sharding.reshard(x, keep_axes(have, [a for a in _axes_of(have) if a not in explicit]))


def _axes_of(spec: PartitionSpec) -> list[str]:
    return [a for e in spec for a in _axes(e)]
