"""Input signatures: the per-signature cache every front end keeps, and arguments as shapes or
placed on their planned shardings."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

import jax
import numpy as np

T = TypeVar("T")


def dtype_of(x: Any) -> Any:
    """The dtype of an array, a `ShapeDtypeStruct` or a Python scalar, as `jax.jit` takes it: a NumPy
    float64 or int64 argument is float32 / int32 unless `jax_enable_x64` is on (JAX 0.12 warns where a
    `ShapeDtypeStruct` is asked for a 64-bit dtype it will not hold)."""
    dtype = x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
    return jax.dtypes.canonicalize_dtype(dtype, allow_extended_dtype=True)


def weak_type(x: Any) -> bool:
    """Whether `x` is weakly typed as `jax.jit` types it: a Python scalar (not a bool), or an
    array or `ShapeDtypeStruct` that says so (`jnp.asarray(0) + 1` is; a `TrainState`'s
    `step=0` is), so its dtype gives way to the other operand's."""
    if isinstance(x, (int, float, complex)) and not isinstance(x, (bool, np.generic)):
        return True
    return bool(getattr(x, "weak_type", False))


def shape_of(x: Any) -> jax.ShapeDtypeStruct:
    """`x` as the shape, canonical dtype (int32 for a Python int without x64) and weak type
    `jax.jit` traces it with."""
    dtype = dtype_of(x)
    dtype = dtype if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else jax.dtypes.canonicalize_dtype(dtype)
    return jax.ShapeDtypeStruct(np.shape(x), dtype, weak_type=weak_type(x))


def context_mesh() -> jax.sharding.Mesh | None:
    """The mesh `jax.set_mesh` made current, or None."""
    mesh = jax.sharding.get_mesh()
    return None if mesh.empty else mesh


def signature(args: Any) -> Hashable:
    """What a compiled program depends on, as `jax.jit` keys it: the tree structure, each leaf's
    shape, canonical dtype and weak type (a loop feeding back a weakly typed result, as a
    `TrainState`'s `step` is, keeps one signature), and its sharding where its type carries one
    (`Explicit` mesh axes), and the context mesh (`jax.set_mesh`)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    return treedef, tuple((shape_of(x), _typed(x)) for x in leaves), context_mesh()


def _typed(x: Any) -> Any:
    """The sharding `x` brings to its type on `Explicit` axes: its placement, where it is cut (a
    replicated placement fixes nothing: it is typed as an array not placed on the mesh is, so a
    loop's first call on host arrays and the next on the results keep one signature)."""
    sharding: Any = getattr(x, "sharding", None)
    return sharding if _typed_mesh(sharding) and not sharding.is_fully_replicated else None


def _typed_mesh(sharding: Any) -> bool:
    """Whether `sharding` is on a mesh with `Explicit` axes (so a value's type carries it)."""
    mesh = getattr(sharding, "mesh", None)
    return mesh is not None and not mesh.empty and bool(mesh.explicit_axes)


def abstract(args: Any, shardings: Any = None) -> Any:
    """`args` as shapes and dtypes: what a plan keeps to lower its program (not the arrays, which
    may be large or donated). With `shardings` (a pytree like `args`), a leaf on a mesh with
    `Explicit` axes carries its sharding too, as its type does when the program is called."""
    if shardings is None:
        return jax.tree_util.tree_map(shape_of, args)
    leaves, treedef = jax.tree_util.tree_flatten(args)
    types = [s if _typed_mesh(s) else None for s in jax.tree_util.tree_leaves(shardings)]
    return jax.tree_util.tree_unflatten(treedef, [jax.ShapeDtypeStruct(np.shape(x), dtype_of(x), sharding=t,
                                                                       weak_type=weak_type(x))
                                                  for x, t in zip(leaves, types)])


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
