"""Input signatures: the per-signature cache every front end keeps, and arguments as shapes or
placed on their planned shardings."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import jax
import numpy as np

T = TypeVar("T")


def dtype_of(x: Any) -> np.dtype:
    """The dtype of an array, a `ShapeDtypeStruct` or a Python scalar."""
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


def context_mesh() -> jax.sharding.Mesh | None:
    """The mesh `jax.set_mesh` made current, or None."""
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def signature(args: Any) -> Hashable:
    """What a compiled program depends on: the tree structure, each leaf's shape and dtype (and
    its sharding where its type carries one: `Explicit` mesh axes), and the context mesh (`jax.set_mesh`)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((np.shape(x), dtype_of(x), _typed(x)) for x in leaves), context_mesh()


def _typed(x: Any) -> Any:
    sharding = getattr(x, "sharding", None)
    mesh = getattr(sharding, "mesh", None)
    return sharding if mesh is not None and not mesh.empty and mesh.explicit_axes else None


def abstract(args: Any) -> Any:
    """`args` as shapes and dtypes: what a plan keeps to lower its program (not the arrays, which
    may be large or donated)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), dtype_of(x)), args)


def placed(args: Any, shardings: Any) -> Any:
    """`args` on their planned shardings; arrays already there pass untouched (a train loop feeds
    back its own outputs, so the hot path moves nothing)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    targets = jax.tree_util.tree_leaves(shardings)
    moved = [
        x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s)
        for x, s in zip(leaves, targets)
    ]
    return jax.tree_util.tree_unflatten(treedef, moved)


class SignatureCache(Generic[T]):
    """One built entry per input signature, as `jax.jit` keeps one executable per signature."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, T] = {}

    def get(self, args: Any, build: Callable[[], T], static: Hashable = ()) -> T:
        """The entry for `args`' signature and the `static` values (a call's static arguments, as
        `jax.jit` keys its executables by them), built by `build()` the first time."""
        key = (signature(args), static)
        if key not in self._entries:
            self._entries[key] = build()
        return self._entries[key]
