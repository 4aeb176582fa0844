"""The optimizer-parallel stage (ZeRO; MindSpore's `enable_parallel_optimizer`): which argument
leaves are cut over the data-parallel devices, and how the gradients reach the cut.

A leaf at or above the threshold is cut over the mesh axes its layout leaves free (in data mode:
all of them), on its largest dim they divide; it is the argument's sharding and the sharding of the
result that updates it (a result subtree with the argument's tree and shapes), so it stays cut
between steps. Level 1 and 2 cut the optimizer state: the planner lays out the update cut, from
each device's slice of the summed gradients (level 1: all-reduce + dynamic-slice on XLA:CPU,
which has no reduce-scatter rewrite). Level 2 (and 3) reduce-scatter the gradients themselves: the backward
pass's product that sums a gradient over the data-parallel devices is emitted in a `shard_map`
manual over them, ending in `lax.psum_scatter` (`reduce_scattered`), so the compiled program
holds a reduce-scatter on every backend. Level 3 cuts the parameters too, which the function
all-gathers to their planned layout before use (`gathered`).
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
from jshard.layouts import place, slices, spec_from_pspec
from jshard.plan import OptimizerReport
from jshard.propagate import Result, Rewrite


@dataclasses.dataclass(frozen=True)
class Cuts:
    """The optimizer-parallel decisions for one signature.

    Attributes:
      args: argument leaf -> its cut sharding.
      results: result leaf -> the sharding of the parameter or state leaf it updates, before the
        cut and after.
      gather: parameter leaf -> the sharding it is all-gathered to before use (level 3).
      report: what the `Plan` records.
      grads: parameter leaf -> its layout and the cut its gradient is reduce-scattered to (level 2
        and 3: the state's cut, which the update reads it in).
    """

    args: dict[int, NamedSharding]
    results: dict[int, tuple[NamedSharding, NamedSharding]]
    gather: dict[int, NamedSharding]
    report: OptimizerReport
    grads: dict[int, tuple[PartitionSpec, PartitionSpec]] = dataclasses.field(default_factory=dict)


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
    assert o is not None  # called with optimizer parallel on only
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
    grads = {}
    for i in (sorted(params) if o.level >= 2 else ()):
        spec = _cut_spec(np.shape(traced.leaves[i]), layouts[i].spec, traced.axis_size)
        if _bytes(traced.leaves[i]) >= o.threshold_bytes and spec is not None:
            grads[i] = (layouts[i].spec, spec)
    return Cuts(cut, updating(traced, args, kept), gather, report, grads)


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
            leaves = [place(x, shardings[i]) if i in shardings else x
                      for i, x in enumerate(leaves)]
        return fn(*jax.tree_util.tree_unflatten(tree, leaves))

    return run


def regathered(traced: Traced, gather: dict[int, NamedSharding]) -> Rewrite | None:
    """Communication recompute (`OptimizerParallel(comm_recompute=True)`) for `traced`, whose parameter leaves
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
                again[v] = place(x, sharding)
            ins[k] = again[v]
        return ins

    return rewrite


def reduce_scattered(traced: Traced, result: Result | None, grads: dict[int, tuple[PartitionSpec, PartitionSpec]]
                     ) -> tuple[dict[int, Callable[[list], list]], dict]:
    """Level 2 and 3's gradient reduce-scatter, emitted by jshard itself (XLA:CPU's partitioner
    makes all-reduce + dynamic-slice of it, and only the GPU pipeline rewrites that into a
    reduce-scatter): `Emission.replaced` entries for the backward pass's `dot_general`s (top
    level, or in a `scan` body) that make a gradient `grads` names, a partial sum over the axes its cut adds (the plan, or
    with no plan (`propagation="xla"`) the first contracted dim they divide, lays both operands'
    contracted dim out over them). Each runs in a `jax.shard_map` manual over those axes only (the
    others stay automatic, so tensor parallel inside holds): the local product, then
    `lax.psum_scatter` onto the dim the cut adds them to. A gradient whose cut adds the axes to a
    dim another axis already cuts keeps XLA's route (the manual axes would come first there, another
    layout than the cut). In a `scan` body (stacked layers: the body makes one layer's slice of
    the stacked gradient) the product is matched against the slices of the stacked parameters.

    Returns:
      The `Emission.replaced` entries, and each replaced gradient's value -> its cut `Spec` and its
      operands -> their planned `Spec`s (for the planner to plan again from: the optimizer update
      reads the gradient cut; the backward pass stays as planned).
    """
    wanted: dict[tuple, list] = {}  # top level: the gradient's shape; in a scan: a stacked one's slice
    for i, (before, after) in grads.items():
        shape = tuple(np.shape(traced.leaves[i]))
        b, a = spec_from_pspec(before, len(shape)), spec_from_pspec(after, len(shape))
        k = next(d for d in range(len(shape)) if a[d] != b[d])
        if not b[k]:
            wanted.setdefault(("", shape), []).append((b, a[k], k))
            if k and not b[0]:
                wanted.setdefault(("scan", shape[1:]), []).append((b[1:], a[k], k - 1))
    values = {} if result is None else result.values
    consumers: dict = {}
    for n in traced.nodes:
        for v in n.inputs:
            if isinstance(v, jcore.Var):
                consumers.setdefault(v, []).append(n)
    found, cut = {}, {}
    for n in traced.nodes:
        if n.primitive != "dot_general" or n.inside not in ("", "scan") or not (n.inside or _backward(n.eqn)):
            continue
        (lc, rc), (lb, _) = n.eqn.params["dimension_numbers"]
        for grad, perm in _views(n, consumers) if not lb else ():
            hit = _match(n, grad, perm, wanted.get((n.inside, tuple(grad.aval.shape)), ()), values, traced.axis_size)
            if hit is not None:
                j, b, axes, k = hit
                found[id(n.eqn)] = _scattered(n.eqn, traced.mesh, axes, lc[j], rc[j], perm[k])
                spec = [()] * len(perm)
                for d, dim in enumerate(b):
                    spec[perm[d]] = dim + axes if d == k else dim
                cut[n.outputs[0]] = tuple(spec)
                cut.update({v: values[v] for v in n.inputs[:2] if v in values})  # its operands as planned
                break
    return found, cut


def _views(node, consumers) -> list[tuple]:
    """The values `node`'s product may be a gradient as, with the permutation of its dims each
    takes: transposed by its one consumer (`x.T @ dy` made as `(dy.T @ x).T`), then itself."""
    out = node.outputs[0]
    rank = len(out.aval.shape)
    views = [(out, tuple(range(rank)))]
    users = consumers.get(out, [])
    if len(users) == 1 and users[0].primitive == "transpose" and users[0].inside == node.inside:
        views.insert(0, (users[0].outputs[0], tuple(users[0].eqn.params["permutation"])))
    return views


def _match(node, grad, perm, wanted, values, axis_size):
    """The first of the `wanted` cuts of `grad` that `node` sums over: `(contracted pair, layout
    before, axes, dim)`; None: none."""
    (lc, rc), _ = node.eqn.params["dimension_numbers"]
    for b, axes, k in wanted:
        j = _contracted_over(node, lc, rc, axes, values, axis_size)
        if j is not None and _laid_out_as(values.get(grad), b, axes):
            return j, b, axes, k
    return None


def _contracted_over(node, lc, rc, axes: tuple[str, ...], values, axis_size) -> int | None:
    """Which contracted dim pair of `node` the plan cuts over `axes` on both operands (no plan: the
    first `axes` divide); None: the product is no partial sum over them."""
    lhs, rhs = node.inputs[:2]
    if lhs in values and rhs in values:
        ls, rs = values[lhs], values[rhs]
        hits = [j for j in range(len(lc)) if set(axes) <= set(ls[lc[j]]) and set(axes) <= set(rs[rc[j]])]
    else:
        ways = math.prod(axis_size[a] for a in axes)
        hits = [j for j in range(len(lc)) if lhs.aval.shape[lc[j]] % ways == 0]
    return hits[0] if hits else None


def _laid_out_as(spec, before, axes: tuple[str, ...]) -> bool:
    """Whether a planned gradient layout (None: no plan) is the parameter's layout `before` on the
    other axes than `axes`."""
    return spec is None or tuple(tuple(a for a in dim if a not in axes) for dim in spec) == tuple(before)


def _scattered(eqn, mesh, axes: tuple[str, ...], lc: int, rc: int, k: int) -> Callable[[list], list]:
    """`eqn` (a `dot_general`) as a `shard_map` manual over `axes`: each device's partial product of
    its slices of contracted dims `lc`/`rc`, reduce-scattered onto dim `k`."""
    params = eqn.params

    def local(lhs, rhs):
        y = jax.lax.dot_general(lhs, rhs, params["dimension_numbers"], precision=params["precision"],
                                preferred_element_type=params["preferred_element_type"])
        return jax.lax.psum_scatter(y, axes, scatter_dimension=k, tiled=True)

    on = lambda rank, d: PartitionSpec(*(axes if i == d else None for i in range(rank)))
    ranks = [len(v.aval.shape) for v in (*eqn.invars, eqn.outvars[0])]
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(on(ranks[0], lc), on(ranks[1], rc)), out_specs=on(ranks[2], k),
                           axis_names=frozenset(axes))

    def run(ins):
        with jax.named_scope(f"{JSHARD_SCOPE}reduce_scatter"):
            return [mapped(*ins)]

    return run


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


def updating(traced: Traced, args: tuple, kept: dict[int, Any]) -> dict[int, Any]:
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
    return (f"{call}: optimizer={level} cuts optimizer state over the data-parallel devices (the mesh "
            f"axes a leaf's layout leaves replicated), but no leaf of {human_bytes(_bytes(x))} or more has one: "
            f"e.g. args{traced.paths[i]} {shape_str(dtype_of(x), np.shape(x))} is laid out "
            f"{layouts[i].spec} over the mesh ({mesh}). Run on more devices than the "
            f"strategies use (a data-parallel axis), or drop optimizer=.")


def _no_accumulation_axis_error(call: str, traced: Traced, params: list[int], layouts) -> str:
    mesh = ", ".join(f"{a}={s}" for a, s in traced.axis_size.items() if s > 1) or "one device"
    example = ""
    if params:
        i = max(params, key=lambda j: _bytes(traced.leaves[j]))
        x = traced.leaves[i]
        example = f": e.g. args{traced.paths[i]} {shape_str(dtype_of(x), np.shape(x))} is laid out {layouts[i].spec}"
    return (f"{call}: Accumulation(shard=True) cuts the accumulated gradients over the data-parallel devices (the "
            f"mesh axes a parameter's layout leaves replicated), but no parameter leaf (argument 0) has such an "
            f"axis that divides it{example} over the mesh ({mesh}). Run on more devices than the strategies use "
            f"(a data-parallel axis), or drop Accumulation(shard=True).")
