"""One canonicalizer for strategy pytrees: `in_strategy` / `out_strategy` / a stage's strategies.

In the spirit of JAX's `prepare_axis_resources`: every front end (`parallelize`, the pipeline)
passes its public name and the argument's name in, and gets one canonical `Slot` per leaf of the
value the strategies describe, or one `ShardingError` that names the call.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec

from jshard._errors import ShardingError
from jshard.layouts._slots import Slot, canonicalize_slot
from jshard.layouts._strategy import TensorLayout


def is_slot(x: object) -> bool:
    """Whether `x` is one strategy slot (a leaf of a strategy pytree), not a container of them."""
    return x is None or isinstance(x, (TensorLayout, PartitionSpec)) or (
        isinstance(x, (tuple, list)) and len(x) > 0 and all(isinstance(i, int) for i in x))


@dataclasses.dataclass(frozen=True)
class _Repeat:
    """One strategy slot standing for `count` leaves of the value it describes."""

    slot: Slot
    count: int


def canonicalize_strategy_tree(prefix: Any, tree: Any, *, call: str, what: str) -> list[Slot]:
    """One canonical slot per leaf of `tree`, from `prefix`, a pytree prefix of it holding slots.

    Examples:
      >>> canonicalize_strategy_tree({"w": (2, 1), "b": None}, {"w": 0, "b": 1}, call="f", what="s")
      [None, (2, 1)]
    """
    if prefix is None:
        return [None] * len(jax.tree_util.tree_leaves(tree))
    try:
        parts = jax.tree_util.tree_map(
            lambda slot, sub: _Repeat(canonicalize_slot(slot, call=call, what=what), len(jax.tree_util.tree_leaves(sub))),
            prefix, tree, is_leaf=is_slot,
        )
    except ValueError as e:
        if isinstance(e, ShardingError):
            raise
        _check_no_none_dims(prefix, call, what)
        raise ShardingError(f"{call}: {what} is not a pytree prefix of the value it describes: {e}") from None
    repeats = jax.tree_util.tree_leaves(parts, is_leaf=lambda x: isinstance(x, _Repeat))
    return [r.slot for r in repeats for _ in range(r.count)]


def _check_no_none_dims(prefix: Any, call: str, what: str) -> None:
    """Where `prefix` is no prefix of its value: a tuple of ints and Nones (`(None, None, 1)`) was
    meant as one strategy, but JAX reads its Nones as empty subtrees, and its prefix error names
    another leaf: name this one."""
    found = jax.tree_util.tree_flatten_with_path(prefix, is_leaf=_none_dims)[0]
    for path, x in found:
        if _none_dims(x):
            where = f"{what}{jax.tree_util.keystr(path)}"
            raise ShardingError(_none_dims_error(call, where, x))


def _none_dims(x: object) -> bool:
    return isinstance(x, (tuple, list)) and len(x) > 0 and None in x and all(i is None or isinstance(i, int) for i in x)


def _none_dims_error(call: str, where: str, x: Any) -> str:
    fixed = tuple(1 if i is None else i for i in x)
    return (f"{call}: {where}={tuple(x)!r} holds None for a dim; a strategy tuple takes an integer per dim (1: the "
            f"dim whole). Write {fixed!r}, or None alone for a leaf left to the planner.")


def canonicalize_in_strategy(prefix: Any, args: tuple, *, call: str) -> list[Slot]:
    """`in_strategy` (one entry per positional argument, each a pytree prefix) as one slot per leaf
    of `args`."""
    if prefix is None:
        return [None] * len(jax.tree_util.tree_leaves(args))
    if not isinstance(prefix, (tuple, list)) or len(prefix) != len(args):
        raise ShardingError(_in_strategy_count_error(call, prefix, len(args)))
    return [s for i, (p, a) in enumerate(zip(prefix, args))
            for s in canonicalize_strategy_tree(p, a, call=call, what=f"in_strategy[{i}]")]


def _in_strategy_count_error(call: str, prefix: Any, nargs: int) -> str:
    sequence = isinstance(prefix, (tuple, list))
    hint = ""
    if sequence and prefix and all(isinstance(v, int) for v in prefix):
        one = tuple(prefix)
        hint = f" in_strategy={one} looks like one strategy; for one argument write in_strategy=({one},)."
    return (
        f"{call}: in_strategy has {len(prefix) if sequence else 1} entries but the function was called "
        f"with {nargs} positional arguments. Give one entry per argument (None: the default for that "
        f"argument).{hint}"
    )
