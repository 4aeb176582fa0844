"""`Spec`: a value's layout over the fine mesh's named axes, and its `PartitionSpec` forms.

The engine, the search, the cost model and emission all reason in `Spec`s (per dim, the mesh axes
that cut it, major to minor); JAX speaks `PartitionSpec`. These are the only conversions.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping

from jax.sharding import PartitionSpec

Spec = tuple[tuple[str, ...], ...]
"""A value's layout: per dimension, the fine-mesh axes that cut it (major to minor); `()`: whole."""


def replicated(rank: int) -> Spec:
    """Every dim whole."""
    return tuple(() for _ in range(rank))


@functools.lru_cache(maxsize=8192)
def to_pspec(spec: Spec) -> PartitionSpec:
    """`spec` as a `PartitionSpec` (trailing whole dims dropped)."""
    entries = [None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in spec]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def constraint_spec(sharding, rank: int) -> Spec:
    """The `Spec` of a `NamedSharding` on a value of `rank` dims (unconstrained dims whole)."""
    return spec_from_pspec(sharding.spec, rank)


def spec_from_pspec(pspec: PartitionSpec, rank: int) -> Spec:
    """A `PartitionSpec` on a value of `rank` dims as a `Spec` (unconstrained dims whole)."""
    spec = tuple(pspec) + (None,) * (rank - len(pspec))
    out = []
    for p in spec:
        if p is None or p is PartitionSpec.UNCONSTRAINED:
            out.append(())
        else:
            out.append(tuple(p) if isinstance(p, tuple) else (p,))
    return tuple(out)


def slices(pspec: PartitionSpec, rank: int, axis_size: Mapping[str, int]) -> tuple[int, ...]:
    """How many slices a `PartitionSpec` cuts each of a value's `rank` dims into, on a mesh with
    `axis_size`.

    Examples:
      >>> slices(PartitionSpec(("d0", "d1"), None), 3, {"d0": 2, "d1": 4})
      (8, 1, 1)
    """
    return tuple(math.prod(axis_size[a] for a in axes) for axes in spec_from_pspec(pspec, rank))


def typed_spec(aval) -> Spec | None:
    """The layout a value's type fixes on a mesh with `Explicit` axes (JAX's sharding in types:
    `jax.sharding.AxisType.Explicit`, `out_sharding=`, `reshard`), or None where its type leaves
    the layout free (no mesh, or `Auto` axes only)."""
    sharding = getattr(aval, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    if mesh is None or mesh.empty or not mesh.explicit_axes:
        return None
    explicit = set(mesh.explicit_axes)
    spec = spec_from_pspec(sharding.spec, len(aval.shape))
    return tuple(tuple(a for a in axes if a in explicit) for axes in spec)
