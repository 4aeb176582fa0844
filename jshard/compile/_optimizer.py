"""The optimizer-parallel stage (ZeRO; MindSpore's `enable_parallel_optimizer`): which argument
leaves are cut over the data-parallel devices, and how.

A leaf at or above the threshold is cut over the mesh axes its layout leaves free (in data mode:
all of them), on its largest dim they divide; it is the argument's sharding and the sharding of the
result that updates it (a result subtree with the argument's tree and shapes), so it stays cut
between steps. Level 1 and 2 cut the optimizer state: the planner lays out the update cut, from
each device's slice of the summed gradients (all-reduce + dynamic-slice on XLA:CPU, which has no
reduce-scatter rewrite; so level 2 builds level 1's program). Level 3 cuts the parameters too,
which the function all-gathers to their planned layout before use (`gathered`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from jshard._errors import ShardingError
from jshard._format import human_bytes, shape_str
from jshard.compile._boundary import argument_leaves
from jshard.compile._options import Options
from jshard.compile._signature import dtype_of
from jshard.compile._trace import Traced
from jshard.graph import CONSTRAINT, JSHARD_SCOPE
from jshard.layouts import slices, spec_from_pspec
from jshard.plan import OptimizerReport
from jshard.propagate import Rewrite


@dataclasses.dataclass(frozen=True)
class Cuts:
    """The optimizer-parallel decisions for one signature.

    Attributes:
      args: argument leaf -> its cut sharding.
      results: result leaf -> the sharding of the parameter or state leaf it updates, before the
        cut and after.
      gather: parameter leaf -> the sharding it is all-gathered to before use (level 3).
      report: what the `Plan` records.
    """

    args: dict[int, NamedSharding]
    results: dict[int, tuple[NamedSharding, NamedSharding]]
    gather: dict[int, NamedSharding]
    report: OptimizerReport


def roles(args: tuple, options: Options) -> tuple[set[int], set[int]]:
    """The parameter and optimizer-state argument leaves: argument 0, and `state_argnums` (default
    every argument but 0 and the batch)."""
    n = len(args)
    batch = {i % n for i in ((n - 1,) if options.batch_argnums is None else options.batch_argnums) if -n <= i < n}
    given = None if options.optimizer is None else options.optimizer.state_argnums
    state = [i for i in range(1, n) if i not in batch] if given is None else [i % n for i in given if -n <= i < n]
    return argument_leaves(args, (0,)), argument_leaves(args, [i for i in state if i != 0])


def cuts(traced: Traced, args: tuple, layouts: Sequence[NamedSharding], options: Options, call: str) -> Cuts:
    """The cuts for `traced`, whose argument leaves are laid out as `layouts` before the cut.

    Raises:
      ShardingError: no leaf at or above the threshold has a mesh axis its layout leaves free.
    """
    o = options.optimizer
    params, state = roles(args, options)
    targets = sorted(state | params) if o.level == 3 else sorted(state)
    big = [i for i in targets if _bytes(traced.leaves[i]) >= o.threshold_bytes]
    cut, whole, saved = {}, [], 0.0
    for i in big:
        x, sh = traced.leaves[i], layouts[i]
        spec = _cut_spec(np.shape(x), sh.spec, traced.axis_size)
        if spec is None:
            whole.append(f"args{traced.paths[i]}")
            continue
        cut[i] = NamedSharding(sh.mesh, spec)
        saved += _bytes(x) / _ways(sh.spec, traced.axis_size) - _bytes(x) / _ways(spec, traced.axis_size)
    if big and not cut and all(_free(sh.spec, traced.axis_size) == () for sh in (layouts[i] for i in big)):
        raise ShardingError(_no_axis_error(call, traced, big, layouts, o.level))
    leaves = tuple((f"args{traced.paths[i]}", "parameter" if i in params else "state", str(layouts[i].spec),
                    str(sh.spec)) for i, sh in sorted(cut.items()))
    report = OptimizerReport(o.level, o.threshold_bytes, len(cut.keys() & state), len(state),
                             len(cut.keys() & params), len(params), saved, tuple(whole), leaves=leaves)
    gather = {i: layouts[i] for i in cut if i in params}
    kept = {i: (layouts[i], cut.get(i, layouts[i])) for i in params | state}
    return Cuts(cut, updating(traced, args, kept), gather, report)


def accumulator(traced: Traced, args: tuple, layouts: Sequence[NamedSharding], options: Options, call: str) -> tuple:
    """With `accumulation_shard`: the parameters' tree, and per parameter leaf its shape and the
    sharding its accumulated gradient takes (its layout with the free axes cut in, as optimizer
    parallel cuts it; None: kept as laid out, a leaf below the optimizer-parallel threshold or
    one no free axis divides).

    Raises:
      ShardingError: no parameter leaf has a free (data-parallel) axis that divides it.
    """
    threshold = 0.0 if options.optimizer is None else options.optimizer.threshold_bytes
    params = sorted(argument_leaves(args, (0,)))
    cut = []
    for i in params:
        x, sh = traced.leaves[i], layouts[i]
        spec = _cut_spec(np.shape(x), sh.spec, traced.axis_size) if _bytes(x) >= threshold else None
        cut.append((tuple(np.shape(x)), None if spec is None else NamedSharding(sh.mesh, spec)))
    if all(sh is None for _, sh in cut):
        raise ShardingError(_no_accumulation_axis_error(call, traced, params, layouts))
    return jax.tree_util.tree_structure(args[0]), tuple(cut)


def result_shardings(out_sh: Sequence[NamedSharding | None], c: Cuts) -> list:
    """The results' shardings with the cuts: a result that updates a parameter or state leaf is laid
    out as that leaf (cut or not), unless `out_strategy` gave it another layout than the leaf's."""
    out = []
    for i, sh in enumerate(out_sh):
        before, after = c.results.get(i, (None, None))
        out.append(after if after is not None and (sh is None or sh.spec == before.spec) else sh)
    return out


def gathered(fn: Callable[..., Any], shardings: dict[int, NamedSharding]) -> Callable[..., Any]:
    """`fn` with the argument leaves `shardings` names laid out so before use (an all-gather of a
    parameter level 3 keeps cut)."""

    def run(*args):
        leaves, tree = jax.tree_util.tree_flatten(args)
        with jax.named_scope(f"{JSHARD_SCOPE}gather"):
            leaves = [jax.lax.with_sharding_constraint(x, shardings[i]) if i in shardings else x
                      for i, x in enumerate(leaves)]
        return fn(*jax.tree_util.tree_unflatten(tree, leaves))

    return run


def regathered(traced: Traced, gather: dict[int, NamedSharding]) -> Rewrite | None:
    """Communication recompute (`optimizer_comm_recompute`) for `traced`, whose parameter leaves
    `gather` are all-gathered before use: a `Rewrite` for emission under which the backward pass
    gathers each cut parameter again at its first use there (behind `lax.optimization_barrier`
    with that equation's other inputs, so that XLA neither merges the two gathers nor moves the
    second one before the backward reaches it), and the equations after the backward began that
    are not part of it (the optimizer update) read the cut parameter. The forward pass's gathered
    copy so dies with its last forward use. None: nothing is gathered, or there is no backward pass.
    """
    eqns = traced.closed.jaxpr.eqns
    cut_vars = {traced.invars[i]: sh for i, sh in gather.items()}
    gathered = {e.outvars[0]: (e.invars[0], cut_vars[e.invars[0]]) for e in eqns
                if e.primitive.name == CONSTRAINT and isinstance(e.invars[0], jcore.Var) and e.invars[0] in cut_vars}
    start = next((t for t, e in enumerate(eqns) if _backward(e)), None)
    if not gathered or start is None:
        return None
    return functools.partial(_regather, gathered, start)


def _regather(gathered: dict, start: int):
    """One run's rewrite for `regathered` (each run gathers again, once per parameter)."""
    again: dict = {}

    def rewrite(t, eqn, ins, read):
        hits = [k for k, v in enumerate(eqn.invars) if isinstance(v, jcore.Var) and v in gathered]
        if t < start or not hits:
            return ins
        ins = list(ins)
        if not _backward(eqn):
            for k in hits:
                ins[k] = read(gathered[eqn.invars[k]][0])
            return ins
        others = [k for k, v in enumerate(eqn.invars) if k not in hits and isinstance(v, jcore.Var)]
        for k in hits:
            v = eqn.invars[k]
            if v not in again:
                cut, sharding = gathered[v]
                # the others pass through the barrier: the gather waits for them
                x, *rest = jax.lax.optimization_barrier((read(cut), *(ins[j] for j in others)))
                for j, y in zip(others, rest):
                    ins[j] = y
                again[v] = jax.lax.with_sharding_constraint(x, sharding)
            ins[k] = again[v]
        return ins

    return rewrite


def _backward(eqn) -> bool:
    return "transpose(" in str(eqn.source_info.name_stack)


def _cut_spec(shape: tuple[int, ...], spec: PartitionSpec, axis_size: dict[str, int]) -> PartitionSpec | None:
    """`spec` with the free axes added to the largest dim (per device) they divide; None: none."""
    free = _free(spec, axis_size)
    if not free:
        return None
    dims = list(spec_from_pspec(spec, len(shape)))
    ways = math.prod(axis_size[a] for a in free)
    local = [(d // c, k) for k, (d, c) in enumerate(zip(shape, slices(spec, len(shape), axis_size)))]
    fits = [(n, -k) for n, k in local if n % ways == 0]
    if not fits:
        return None
    k = -max(fits)[1]
    dims[k] += free
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else a for a in dims))


def _free(spec: PartitionSpec, axis_size: dict[str, int]) -> tuple[str, ...]:
    used = {a for axes in spec_from_pspec(spec, len(spec)) for a in axes}
    return tuple(a for a, s in axis_size.items() if a not in used and s > 1)


def _ways(spec: PartitionSpec, axis_size: dict[str, int]) -> int:
    return math.prod(slices(spec, len(spec), axis_size))


def _bytes(x) -> float:
    return float(math.prod(np.shape(x)) * np.dtype(dtype_of(x)).itemsize) if _is_array(x) else 0.0


def _is_array(x) -> bool:
    return not jax.dtypes.issubdtype(dtype_of(x), jax.dtypes.extended)


def updating(traced: Traced, args: tuple, kept: dict[int, tuple]) -> dict[int, tuple]:
    """Result leaf -> `kept`'s entry for the argument leaf it updates (here: its sharding before the
    cut and after, so that the next step takes it as it is; offload: the leaf): a result subtree with an argument's tree structure, shapes
    and dtypes (as a train step returns its new parameters and state)."""
    starts = np.cumsum([0] + [len(jax.tree_util.tree_leaves(a)) for a in args])
    trees = [jax.tree_util.tree_structure(a) for a in args]
    outs = jax.tree_util.tree_unflatten(traced.out_tree, range(len(traced.out_leaves)))
    found: dict[int, tuple] = {}
    for part in outs if isinstance(outs, (tuple, list)) else (outs,):
        ids = jax.tree_util.tree_leaves(part)
        for a, tree in enumerate(trees):
            ins = range(starts[a], starts[a + 1])
            same = tree == jax.tree_util.tree_structure(part) and all(
                np.shape(traced.out_leaves[o]) == np.shape(traced.leaves[i]) for o, i in zip(ids, ins))
            if same and any(i in kept for i in ins):
                found.update({o: kept[i] for o, i in zip(ids, ins) if i in kept})
                break
    return found


def _no_axis_error(call: str, traced: Traced, big: list[int], layouts, level: int) -> str:
    i = big[0]
    x = traced.leaves[i]
    mesh = ", ".join(f"{a}={s}" for a, s in traced.axis_size.items() if s > 1) or "one device"
    return (f"{call}: optimizer_parallel={level} cuts optimizer state over the data-parallel devices (the mesh "
            f"axes a leaf's layout leaves replicated), but no leaf of {human_bytes(_bytes(x))} or more has one: "
            f"e.g. args{traced.paths[i]} {shape_str(dtype_of(x), np.shape(x))} is laid out "
            f"{layouts[i].spec} over the mesh ({mesh}). Run on more devices than the "
            f"strategies use (a data-parallel axis), or drop optimizer_parallel.")


def _no_accumulation_axis_error(call: str, traced: Traced, params: list[int], layouts) -> str:
    mesh = ", ".join(f"{a}={s}" for a, s in traced.axis_size.items() if s > 1) or "one device"
    example = ""
    if params:
        i = max(params, key=lambda j: _bytes(traced.leaves[j]))
        x = traced.leaves[i]
        example = f": e.g. args{traced.paths[i]} {shape_str(dtype_of(x), np.shape(x))} is laid out {layouts[i].spec}"
    return (f"{call}: accumulation_shard=True cuts the accumulated gradients over the data-parallel devices (the "
            f"mesh axes a parameter's layout leaves replicated), but no parameter leaf (argument 0) has such an "
            f"axis that divides it{example} over the mesh ({mesh}). Run on more devices than the strategies use "
            f"(a data-parallel axis), or drop accumulation_shard.")
