"""Flax NNX graph objects as arguments of a parallelized function, with `nnx.jit`'s semantics.

An `nnx.Module`, an `nnx.Optimizer`, an `nnx.Rngs` stream or an `nnx.Variable` passed to a
`parallelize`d function is not a plain pytree: the function mutates it in place (an optimizer
step, batch statistics, an RNG stream's count) and the caller expects to see the mutation, as
`nnx.jit` shows it. `split_graphs` does what `nnx.jit` does at its boundary, so that the compile
core sees pytrees only:

- before the call, every graph object among the arguments (at any depth of their pytrees; objects
  shared between arguments once; a bare `nnx.Variable`, or an `nnx.State` from `nnx.split`, is a
  pytree as under `jax.jit`, so NNX's functional form keeps `jax.jit`'s semantics) is split into its graph definition and its state
  (`nnx.split`), and the argument keeps its place with the state in the object's place, so that
  `in_strategy`, `batch_argnums` and `donate_argnums` address the same arguments;
- the traced function merges them back (`nnx.merge`), runs the user's function on the objects, and
  returns, besides its result, their state after the call; a graph object in the result comes back
  split too (or as the argument it is);
- after the call, the caller's objects are updated in place with the new state (`nnx.update`), and
  the result's graph objects are merged.

The graph definitions travel as static pytree data (`GraphDef` is a pytree without leaves), so
they are part of the input signature, as `nnx.jit` keys its cache by them. Flax stays optional:
nothing here imports it unless `flax.nnx` is already loaded.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax

from jshard._errors import ShardingError


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Split:
    """One graph object's state in its argument's place. `graphdef`: the joint graph definition of
    every object of the call (on the first one only), or of one result object (`index` -1)."""

    state: Any
    index: int = dataclasses.field(metadata={"static": True})
    graphdef: Hashable = dataclasses.field(default=None, metadata={"static": True})


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class _Argument:
    """A result that is one of the call's graph objects (`return model`): given back as it is."""

    index: int = dataclasses.field(metadata={"static": True})


@dataclasses.dataclass(frozen=True)
class GraphCall:
    """One call with its graph objects split (see the module docstring).

    Attributes:
      fn: the user's function on the split arguments; returns `(result, states)`.
      args / kwargs: the arguments with each graph object's state in its place.
      finish: the result as the user's function returns it, from what `fn` returned (the caller's
        objects updated in place first).
    """

    fn: Callable[..., Any]
    args: tuple
    kwargs: dict[str, Any]
    finish: Callable[[Any], Any]


def split_graphs(fn: Callable[..., Any], args: tuple, kwargs: dict[str, Any], static: Sequence[int],
                 static_names: Sequence[str], call: str) -> GraphCall | None:
    """`fn(*args, **kwargs)` with its graph objects split, or None where it has none (or Flax is
    not loaded). Static arguments (`static`, `static_names`) are left as they are.

    Raises:
      ShardingError: the function changed a graph object's structure (added or removed an attribute
        holding state), which `nnx.jit` carries back but a compiled program's fixed results cannot.
    """
    if "flax.nnx" not in sys.modules:
        return None
    nnx = sys.modules["flax.nnx"]  # loaded, so the caller may hold graph objects
    n = len(args)
    static = {i % n for i in static if -n <= i < n}
    dynamic = (tuple(None if i in static else a for i, a in enumerate(args)),
               {k: v for k, v in kwargs.items() if k not in static_names})
    leaves, tree = jax.tree_util.tree_flatten(dynamic, is_leaf=_is_graph)
    where = [i for i, x in enumerate(leaves) if _is_graph(x)]
    if not where:
        return None
    objects = tuple(leaves[i] for i in where)
    graphdef, state = nnx.split(objects)
    for j, i in enumerate(where):
        leaves[i] = _Split(_part(state, j), j, graphdef if j == 0 else None)
    pure_args, pure_kwargs = jax.tree_util.tree_unflatten(tree, leaves)
    pure_args = tuple(args[i] if i in static else a for i, a in enumerate(pure_args))

    def pure(*args, **kwargs):
        leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=lambda x: isinstance(x, _Split))
        splits = {x.index: x for x in leaves if isinstance(x, _Split)}
        merged = nnx.merge(splits[0].graphdef, nnx.State({j: x.state for j, x in splits.items()}))
        args, kwargs = jax.tree_util.tree_unflatten(tree, [merged[x.index] if isinstance(x, _Split) else x for x in leaves])
        result = fn(*args, **kwargs)
        after, states = nnx.split(merged)
        if after != graphdef:
            raise ShardingError(_structure_error(call, objects))
        return _split_results(result, merged), [_part(states, j) for j in range(len(merged))]

    def finish(out):
        result, states = out
        nnx.update(objects, nnx.State(dict(enumerate(states))))
        def given(x):
            if isinstance(x, _Argument):
                return objects[x.index]
            return nnx.merge(x.graphdef, x.state) if isinstance(x, _Split) else x

        return jax.tree_util.tree_map(given, result, is_leaf=lambda x: isinstance(x, _Split | _Argument))

    return GraphCall(pure, pure_args, {**kwargs, **pure_kwargs}, finish)


def _is_graph(x) -> bool:
    """A graph object split at the boundary: a module, an optimizer, an RNG stream... but not a bare
    `nnx.Variable` (nor so an `nnx.State` of them, NNX's functional form), a pytree as `jax.jit` has it."""
    nnx = sys.modules["flax.nnx"]
    return nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)


def _part(state, j: int):
    """Object `j`'s part of a joint state (empty where all it holds is shared with an earlier one)."""
    return state[j] if j in state else sys.modules["flax.nnx"].State({})


def _split_results(result, merged: tuple):
    """`result` with each graph object split (`_Split`, index -1), or marked as the argument it is."""
    nnx = sys.modules["flax.nnx"]

    def split(x):
        if not _is_graph(x):
            return x
        same = [j for j, m in enumerate(merged) if m is x]
        if same:
            return _Argument(same[0])
        graphdef, state = nnx.split(x)
        return _Split(state, -1, graphdef)

    return jax.tree_util.tree_map(split, result, is_leaf=_is_graph)


def _structure_error(call: str, objects: tuple) -> str:
    kinds = ", ".join(type(o).__name__ for o in objects)
    return (f"{call}: the function changed the structure of its graph objects ({kinds}): it added or removed an "
            f"attribute that holds state (a Variable or a submodule). A compiled program returns a fixed set of "
            f"arrays, so jshard carries back updates of existing state only. Create every attribute before the "
            f"call (e.g. in __init__), and update its value inside.")
