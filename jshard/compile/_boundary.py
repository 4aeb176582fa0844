"""The anchors at the function boundary: each argument's and result's sharding before planning.

An argument takes, in order: its `in_strategy`; on the user's mesh, the model's own layout
(`model_anchor`: the sharding its type carries on `Explicit` axes, in every mode; in `semi_auto`
and `auto`, the sharding an array was placed on over that mesh, as `jax.jit` takes a committed
argument's); the sharding of a `shard` call or a model's constraint it flows straight into
(`semi_auto`, `auto`); the dataset policy where it is the batch (`dataset_anchors`: a tuple
`dataset_strategy` has one entry per batch leaf); else it is left to the planner (`semi_auto`,
`auto` with jshard's engine) or replicated. A leaf left so that mirrors a leaf `in_strategy` cuts
(`mirrored`: optax's `mu` and `nu` beside the parameters they follow) takes that leaf's sharding,
as MindSpore lays out a parameter's optimizer state as the parameter. A result takes its
`out_strategy`, or is left to the planner.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from jshard._errors import ShardingError
from jshard._format import shape_str, var_str
from jshard.compile._options import Options
from jshard.compile._signature import dtype_of
from jshard.compile._trace import Traced
from jshard.graph import CONSTRAINT, JSHARD_SCOPE
from jshard.layouts import (
    FineMesh,
    NotRefined,
    Slot,
    canonicalize_strategy_tree,
    check_batch_rows,
    check_divides,
    dataset_slots,
    layout_of,
    spec_from_pspec,
    to_pspec,
    typed_spec,
)

BOUNDARY = "the function boundary"


def argument_leaves(args: tuple, argnums: Sequence[int]) -> set[int]:
    """Leaf indices of the positional arguments `argnums` (negative counts from the end)."""
    ids, start = set(), 0
    for i, a in enumerate(args):
        count = len(jax.tree_util.tree_leaves(a))
        if i in argnums or i - len(args) in argnums:
            ids.update(range(start, start + count))
        start += count
    return ids


def batch_leaves(args: tuple, options: Options) -> set[int]:
    """Leaf indices of the batch arguments (`batch_argnums`; by default the last argument)."""
    return argument_leaves(args, (len(args) - 1,) if options.batch_argnums is None else options.batch_argnums)


def dataset_anchors(args: tuple, batch: set[int], options: Options, n: int, call: str) -> dict[int, Slot]:
    """The batch leaves the dataset policy lays out, each with its slot (before tracing).

    A tuple or `Layout`-call `dataset_strategy` gives every leaf of the batch arguments its entry,
    in leaf order, in every mode but manual. `"data_parallel"` cuts dim 0 of the batch's arrays
    (not its scalars), except where the strategy search decides the batch too; `"full_batch"`
    and manual mode lay out nothing here.
    """
    strategy = options.dataset_strategy
    if options.mode == "manual" or strategy == "full_batch":
        return {}
    ndims = [np.ndim(x) for x in jax.tree_util.tree_leaves(args)]
    if strategy != "data_parallel":
        ids = sorted(batch)
    elif options.mode == "auto" and options.search.method != "propagation":
        return {}
    else:
        ids = [i for i in sorted(batch) if ndims[i] > 0]
    return dict(zip(ids, dataset_slots([ndims[i] for i in ids], strategy, n, call=call)))


def check_micro_batches(args: tuple, batch: set[int], dataset: dict[int, Slot], k: int, n: int, call: str) -> None:
    """With `accumulation=k`: k divides the rows of every batch leaf, and where the dataset
    policy cuts the rows, each micro-batch's rows are cut as evenly.

    Raises:
      ShardingError: naming the batch leaf, its shape and the fix.
    """
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    leaves = jax.tree_util.tree_leaves(args)
    for i in sorted(batch):
        x = leaves[i]
        if not np.ndim(x):
            continue
        rows, shape = np.shape(x)[0], shape_str(dtype_of(x), np.shape(x))
        ways = 1 if i not in dataset else layout_of(dataset[i], n, call=call, op=BOUNDARY, what="dataset_strategy").strategy[0]
        if rows % k:
            fits = [d for d in range(1, rows + 1) if rows % d == 0]
            raise ShardingError(f"{call}: accumulation={k} does not divide the {rows} rows of the batch "
                                f"args{paths[i]} {shape}. Give a k that divides {rows} ({', '.join(map(str, fits))}), or "
                                f"a batch of a multiple of {k} rows.")
        if (rows // k) % ways:
            fits = [d for d in range(1, rows + 1) if rows % d == 0 and (rows // d) % ways == 0]
            raise ShardingError(f"{call}: accumulation={k} cuts the batch args{paths[i]} {shape} into "
                                f"micro-batches of {rows // k} rows, which the dataset strategy cannot cut into "
                                f"{ways} equal parts as it cuts the batch. Give a k whose micro-batches it divides "
                                f"({', '.join(map(str, fits)) or 'none'}), or a batch of a multiple of {k * ways} rows.")


def argument_types(args: tuple, fine: FineMesh, slots: Sequence[Slot], dataset: dict[int, Slot], options: Options,
                   call: str) -> list[NamedSharding] | None:
    """On a user's mesh with `Explicit` axes, the sharding each argument leaf's type carries while
    tracing, as `jax.jit` types what it is given: its `in_strategy`; else the sharding it was
    placed on over the mesh, where it is cut; else its dataset layout (the batch); else replicated. None on other
    meshes (types carry no layout there)."""
    mesh = options.mesh
    if mesh is None or not mesh.explicit_axes or options.mode == "manual":
        return None
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    out = []
    for i, (x, slot, path) in enumerate(zip(jax.tree_util.tree_leaves(args), slots, paths)):
        if slot is not None and not isinstance(slot, PartitionSpec):
            out.append(_layout_sharding(fine, mesh, slot, x, f"in_strategy{path}", call))
        elif _placed(x, mesh):
            out.append(x.sharding)
        elif i in dataset:
            if options.dataset_strategy == "data_parallel":
                check_batch_rows(np.shape(x), fine.device_count, call=call, where=f"args{path}")
            out.append(_layout_sharding(fine, mesh, dataset[i], x, f"dataset_strategy for args{path}", call))
        else:
            out.append(NamedSharding(mesh, PartitionSpec()))
    return out


def narrower_types(types: list[NamedSharding], args: tuple, slots: Sequence[Slot], dataset: dict[int, Slot],
                   options: Options) -> list[list[NamedSharding]]:
    """Where the model's own types do not take the batch as the default dataset policy cuts it
    (rows over every mesh axis: a batch meeting a parameter cut over `tensor`), the typings to try
    next, in order: the rows of those batch leaves cut over one mesh axis fewer (the minor
    first), down to whole, as `jax.jit` takes a batch not placed on the mesh. None to try where
    no leaf is typed by the default policy (`in_strategy`, placement or a given
    `dataset_strategy` decide)."""
    if options.dataset_strategy != "data_parallel":
        return []
    mesh = options.mesh
    assert mesh is not None  # `types` (its one caller passes argument_types' list, not None) are on the user's mesh
    leaves = jax.tree_util.tree_leaves(args)
    free = [i for i in dataset if slots[i] is None and not _placed(leaves[i], mesh)]
    if not free:
        return []
    rows = spec_from_pspec(types[free[0]].spec, max(np.ndim(leaves[free[0]]), 1))[0]
    out = []
    for k in range(len(rows) - 1, -1, -1):
        cut = NamedSharding(mesh, PartitionSpec(rows[:k] or None))
        out.append([cut if i in free else t for i, t in enumerate(types)])
    return out


def shard_stored(traced: Traced, types: list[NamedSharding], slots: Sequence[Slot], dataset: dict[int, Slot],
                 options: Options) -> list[NamedSharding] | None:
    """On `Explicit` axes in `semi_auto` and `auto`: the argument types with each leaf typed whole
    by default (no `in_strategy`, placement or dataset layout) that flows straight into a `shard`
    call's `reshard` typed as that call takes it, as a parameter is stored as the operator that
    uses it takes it (on `Auto` axes: `boundary_anchors`); None where no leaf is."""
    if options.mode not in ("semi_auto", "auto"):
        return None
    index = {v: i for i, v in enumerate(traced.invars)}
    out, changed = list(types), False
    for node in traced.nodes:
        i = index.get(node.inputs[0]) if node.inputs and isinstance(node.inputs[0], jcore.Var) else None
        if (node.primitive != "reshard" or JSHARD_SCOPE not in node.scope or node.inside or i is None
                or slots[i] is not None or i in dataset or _placed(traced.leaves[i], types[i].mesh)
                or out[i] is not types[i] or not types[i].is_fully_replicated):
            continue
        out[i], changed = NamedSharding(types[i].mesh, node.eqn.params["dst_sharding"].spec), True
    return out if changed else None


def _placed(x, mesh) -> bool:
    """Whether `x` was placed cut on `mesh` (a replicated placement fixes nothing, as in
    `model_anchor`, and as the signature counts it)."""
    sharding = getattr(x, "sharding", None)
    return (isinstance(sharding, NamedSharding) and sharding.mesh.axis_names == mesh.axis_names
            and not sharding.is_fully_replicated)


def in_shardings(traced: Traced, slots: Sequence[Slot], dataset: dict[int, Slot], options: Options, call: str) -> list:
    """Each argument leaf's `NamedSharding`, or None where the planner decides it (`dataset`: the
    batch leaves' slots from `dataset_anchors`)."""
    anchors = boundary_anchors(traced, call)
    found = [_in_sharding(traced, path, x, v, slot, anchors.get(v), dataset.get(i), options, call)
             for i, (path, x, slot, v) in enumerate(zip(traced.paths, traced.leaves, slots, traced.invars))]
    if options.mode == "manual":
        return found
    left = {i for i, (x, slot, v) in enumerate(zip(traced.leaves, slots, traced.invars))
            if slot is None and i not in dataset and v not in anchors and model_anchor(traced, v, x, options) is None}
    given = {i for i, slot in enumerate(slots) if slot is not None and found[i] is not None
             and not found[i].is_fully_replicated}
    for i, j in mirrored(traced, given, left).items():
        found[i] = found[j]
    return found


def mirrored(traced: Traced, given: set[int], left: set[int]) -> dict[int, int]:
    """Leaf `i` of `left` -> the leaf of `given` it mirrors: a subtree of the arguments whose leaves
    are all `left` has the tree, the key paths below it and the shapes and dtypes of another
    subtree holding `given` leaves (optax's `mu`, `nu`, a momentum or an average of the parameters:
    `TrainState.opt_state[0].mu` beside `TrainState.params`), and its leaf at the same key path
    below is mirrored to a given one. The largest subtrees are matched first; subtrees inside a
    matched one are not matched again, and siblings (two layers of one model) are parts, not
    mirrors."""
    args = jax.tree_util.tree_unflatten(traced.treedef, traced.leaves)
    keyed = [path for path, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    below: dict[tuple, list[tuple[tuple, int]]] = {}
    for i, path in enumerate(keyed):
        for k in range(len(path)):
            below.setdefault(path[:k], []).append((path[k:], i))
    typed = [(np.shape(x), str(dtype_of(x))) for x in traced.leaves]  # once per leaf, not once per prefix above it
    groups: dict[tuple, list[tuple]] = {}
    for prefix, leaves in below.items():
        kind = tuple([(rest, *typed[i]) for rest, i in leaves])
        groups.setdefault(kind, []).append(prefix)
    found: dict[int, int] = {}
    used: list[tuple] = []
    for prefixes in sorted(groups.values(), key=lambda ps: min(map(len, ps))):
        sources = [p for p in prefixes if any(i in given for _, i in below[p]) and not _inside(p, used)]
        for p in (p for p in prefixes if sources and not _inside(p, used)):
            source = sources[0]
            if p[:-1] == source[:-1] or not all(i in left and i not in found for _, i in below[p]):
                continue
            found.update({i: j for (_, i), (_, j) in zip(below[p], below[source]) if j in given})
            used += [p, source]
    return found


def _inside(prefix: tuple, subtrees: list[tuple]) -> bool:
    return any(prefix[: len(p)] == p for p in subtrees)


def dataset_defaulted(traced: Traced, slots: Sequence[Slot], dataset: dict[int, Slot], options: Options) -> frozenset[int]:
    """The batch leaves the planner may move once at the start into the layout the anchors want (in
    `semi_auto` with jshard's propagation, under `"data_parallel"`): those the default dataset policy
    alone lays out (no `in_strategy`, model sharding or `shard` call fixes them), and those given a
    strategy tuple that cuts their rows alone (`(2, 1)`). A lone tuple is its own device matrix, its
    cut on the mesh's major axes, where the parameters' tuples put theirs too; the batch arrives as
    the user cut it and is moved once where that is cheaper than every matrix product
    redistributing it (a `Layout`, whose axes the user chose, binds)."""
    if options.mode != "semi_auto" or options.propagation == "xla" or options.dataset_strategy != "data_parallel":
        return frozenset()
    anchors = boundary_anchors(traced, "")
    return frozenset(i for i, (x, slot, v) in enumerate(zip(traced.leaves, slots, traced.invars))
                     if i in dataset and (slot is None or _rows_tuple(slot)) and v not in anchors
                     and model_anchor(traced, v, x, options) is None)


def _rows_tuple(slot: Slot) -> bool:
    """Whether `slot` is a strategy tuple that cuts dim 0 alone (a `PartitionSpec` is a tuple too)."""
    return type(slot) is tuple and len(slot) > 0 and slot[0] > 1 and all(n == 1 for n in slot[1:])


def out_shardings(traced: Traced, options: Options, call: str) -> list:
    """Each result leaf's `NamedSharding` from `out_strategy`, or None where the planner decides it."""
    slots = canonicalize_strategy_tree(options.out_strategy, jax.tree_util.tree_unflatten(traced.out_tree, traced.out_leaves),
                                       call=call, what="out_strategy")
    return [None if slot is None else _given(traced, slot, x, f"out_strategy{path}", options, call)
            for path, x, slot in zip(traced.out_paths, traced.out_leaves, slots)]


def model_anchor(traced: Traced, v, x, c: Options) -> NamedSharding | None:
    """An argument's layout the model gives it on the user's mesh: the one its type carries
    (`Explicit` axes), else, in `semi_auto` and `auto`, the mesh sharding it was placed on (a
    replicated placement fixes nothing); None without a user mesh."""
    if c.mesh is None or c.mode == "manual":
        return None
    spec = typed_spec(v.aval)
    if spec is not None:
        return NamedSharding(traced.mesh, to_pspec(spec))
    sharding = getattr(x, "sharding", None)
    if (c.mode in ("semi_auto", "auto") and isinstance(sharding, NamedSharding) and sharding.mesh == traced.mesh
            and not sharding.is_fully_replicated):
        return sharding
    return None


def _in_sharding(traced: Traced, path, x, v, slot, anchor, rows, c: Options, call: str):
    """Argument leaf `x`'s sharding (at `path`, the jaxpr's `v`), or None where the planner decides it."""
    if slot is not None:
        return _given(traced, slot, x, f"in_strategy{path}", c, call)
    model = model_anchor(traced, v, x, c)
    if model is not None:
        return model
    if anchor is not None and c.mode in ("semi_auto", "auto"):
        return anchor
    if rows is not None:
        if c.dataset_strategy == "data_parallel":
            check_batch_rows(np.shape(x), traced.fine.device_count, call=call, where=f"args{path}")
        return _layout_sharding(traced.fine, traced.mesh, rows, x, f"dataset_strategy for args{path}", call)
    free = c.mode in ("semi_auto", "auto") and c.propagation != "xla"
    return None if free else NamedSharding(traced.mesh, PartitionSpec())


def _given(traced: Traced, slot, x, what: str, c: Options, call: str) -> NamedSharding:
    if isinstance(slot, PartitionSpec) and c.mode == "manual":
        return NamedSharding(traced.mesh, slot)
    return _layout_sharding(traced.fine, traced.mesh, slot, x, what, call)


def _layout_sharding(fine: FineMesh, mesh, slot, x, what: str, call: str) -> NamedSharding:
    layout = layout_of(slot, fine.device_count, call=call, op=BOUNDARY, what=what)
    check_divides(layout, np.shape(x), call=call, op=BOUNDARY, what=what, dtype=dtype_of(x))
    try:
        return NamedSharding(mesh, fine.partition_spec(layout))
    except NotRefined as e:
        e.who = what
        raise


def boundary_anchors(traced: Traced, call: str) -> dict:
    """Arguments that flow straight into a user constraint take its sharding as their own.

    Raises:
      ShardingError: one argument constrained two different ways by two `shard` calls.
    """
    top = set(traced.invars)
    found: dict = {}
    where: dict = {}
    for node in traced.nodes:
        if node.primitive != CONSTRAINT or node.inside or node.inputs[0] not in top:
            continue
        v, sharding = node.inputs[0], _settled(node.eqn.params["sharding"], traced.mesh)
        if v in found and found[v].spec != sharding.spec:
            raise ShardingError(
                f"{call}: one argument ({var_str(v, short=False)}) is constrained two ways: {found[v].spec} by "
                f"{where[v]} and {sharding.spec} by {node.source}. Configure one strategy for this value, "
                f"or make the redistribution explicit by sharding a copy."
            )
        found.setdefault(v, sharding)
        where.setdefault(v, node.source)
    return found


def _settled(sharding: NamedSharding, mesh) -> NamedSharding:
    """`sharding` on `mesh` (a model's constraint names the abstract mesh it was traced under) with
    its unconstrained dims (a `vmap`ped constraint's batch dim) left whole, as an argument's
    sharding must fix every dim."""
    spec = PartitionSpec(*(None if p is PartitionSpec.UNCONSTRAINED else p for p in sharding.spec))
    return NamedSharding(mesh, spec)
