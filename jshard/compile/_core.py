"""The compile core: trace → anchors → plan → program, once per input signature.

`parallelize` calls `build` with validated `Options`. It chooses the fine mesh (refining it and
tracing again where a strategy met while tracing needs a finer one), fixes the boundary (with
`optimizer=`, cutting the optimizer state and parameters there: `_optimizer.py`; with `offload`,
choosing the state kept in host memory: `_offload.py`), asks the `Planner` the options name, and
builds the `Program`. The stages share one `Signature` record (`_stage.py`, which plans and builds
one traced signature: `build_traced`); under `mode="auto"` the weighings (`_weigh.py`: context
parallel, offload, optimizer level, communication, recompute policy) try candidates and end in one
loop, `fastest_that_fits`. With a memory budget and devices present, the searched program's compiled
memory is checked and the search asked again for less, up to `BUDGET_ROUNDS` times. The built plan's
work per device is priced last (`_work.py`: where nearly nothing is cut, beside the data-parallel plan's).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, PartitionSpec

from jshard._collector import collector_paused
from jshard._compat import ShardingTypeError
from jshard._errors import MemoryBudgetError, ShardingError
from jshard._format import human_bytes
from jshard.compile._boundary import (
    BOUNDARY,
    argument_types,
    batch_leaves,
    check_micro_batches,
    dataset_anchors,
    narrower_types,
    shard_stored,
)
from jshard.compile._collisions import warn_collisions
from jshard.compile._groups import Communication
from jshard.compile._options import Options
from jshard.compile._program import Program
from jshard.compile._session import Planning
from jshard.compile._stage import Signature, compiles
from jshard.compile._trace import Traced, adopted, devices_for, trace
from jshard.compile._weigh import context_cuts, placed, weigh_context
from jshard.compile._work import with_work
from jshard.cost import device_memory
from jshard.layouts import (
    FineMesh,
    NotRefined,
    TensorLayout,
    axis_names,
    canonicalize_in_strategy,
    canonicalize_strategy_tree,
    layout_of,
)


def build(fn: Callable[..., Any], args: tuple, options: Options, call: str,
          planning: Planning | None = None) -> Program:
    """The `Program` of `fn` for the signature of `args` (on the user's mesh where there is one:
    `mesh=`, or the one `jax.set_mesh` made current). `Search.time_limit` counts from here: the
    trace, every weighing and search, and building the plan all fall within it (`Planning`); or,
    given `planning` (a pipeline's stage: `Planning.sharing`), from when that planning began."""
    if planning is None:
        planning = Planning.of(options.search.time_limit)  # one clock for the whole of planning this signature
    with collector_paused():
        try:
            return _build(fn, args, options, call, planning)
        except MemoryBudgetError as e:
            least = compiles(planning).least
            if least == float("inf") or _LEAST_COMPILED in str(e):  # nothing compiled, or said already
                raise
            raise MemoryBudgetError(_least_compiled_error(str(e), least, compiles(planning).compiled), e.least_bytes,
                                    e.bound) from None


_LEAST_COMPILED = "for the least of them to fit"


def _least_compiled_error(message: str, least: float, compiled: int) -> str:
    return (f"{message} Compiled, the plans checked ({compiled} distinct program{'s' if compiled != 1 else ''}) held "
            f"at least {human_bytes(least)} per device: raise memory_budget to at least {least:.0f} bytes "
            f"{_LEAST_COMPILED}.")


def _build(fn: Callable[..., Any], args: tuple, options: Options, call: str, planning: Planning) -> Program:
    options = _with_loaded_choices(adopted(options, call), call)
    devices = devices_for(options)
    n = options.devices if devices is None else len(devices)
    assert n is not None  # devices_for gives None only for more devices than are present
    slots = canonicalize_in_strategy(options.in_strategy, args, call=call)
    batch = batch_leaves(args, options)
    dataset = dataset_anchors(args, batch, options, n, call)
    if options.accumulation is not None:
        cut = {i: slot for i, slot in dataset.items() if slots[i] is None}  # in_strategy comes first
        check_micro_batches(args, batch, cut, options.accumulation.steps, n, call)
    needed = _boundary_matrices(options, slots, dataset, args, n, call)
    while True:
        fine, named = _fine_mesh(options, n, needed, call)
        try:
            program = _build_on(fn, args, fine, named, devices, slots, dataset, options, call, planning)
        except NotRefined as e:
            if options.mesh is not None:
                raise ShardingError(_users_mesh_error(call, e.matrix, e.who, options)) from None
            needed.append((e.matrix, e.who, e.names))
            continue
        warn_collisions(program, slots, options, call)
        if options.context_cut is not None and options.plan is not None:  # rebuilt as loaded: saved so again
            program = dataclasses.replace(program, plan=program.plan.replace(loaded_choices=options.plan.choices))
        return _counted(with_work(program, args, batch, slots, options, call), planning)


def _with_loaded_choices(options: Options, call: str) -> Options:
    """`options` to rebuild a loaded plan with what its planning chose beyond the layouts
    (`Plan.choices`, saved in its file): multi-copy's copies (the operators were traced with the
    step's batch in that many copies, in the form the plan's mode traces them in: `mode="auto"`'s
    global view, or the data-parallel manual region of the other modes) and the state kept in host
    memory.

    Raises:
      ShardingError: `communication=` or `offload=` asks for other copies or roles than the plan was
        made with.
    """
    plan = options.plan
    if plan is None:
        return options
    chosen = dict(plan.choices)
    copies, offload = chosen.get("copies", 1), tuple(chosen.get("offload", ()))
    if chosen.get("context", 1) > 1:  # strategy=None attention calls traced with the sequence cut so
        options = dataclasses.replace(options, context_cut=chosen["context"], mode=plan.mode)
    given = 1 if options.communication is None else options.communication.copies
    if copies > 1 and options.communication is None:
        options = dataclasses.replace(options, communication=Communication(copies), mode=plan.mode)
    elif given != copies:
        raise ShardingError(
            f"{call}: the loaded plan was made with the step's batch in {copies} cop{'y' if copies == 1 else 'ies'} "
            f"(multi-copy), but communication= asks for {given}. Drop communication= to rebuild the plan as "
            f"made, or re-plan without plan=.")
    if offload and options.offload is None:
        options = dataclasses.replace(options, offload=offload)
    elif options.offload is not None and set(options.offload) != set(offload):
        raise ShardingError(
            f"{call}: the loaded plan was made with {offload or 'no state'} in host memory, but offload= asks for "
            f"{options.offload or 'none'}. Drop offload= to rebuild the plan as made, or re-plan without plan=.")
    return options


def _counted(program: Program, planning: Planning) -> Program:
    """`program` with the session's searches, what its weighings left out and by how much it passed its
    time limit, where it did, in its `SearchReport`: read last, when the plan is built."""
    search = program.plan.search
    if search is None:
        return program
    report = dataclasses.replace(search, searches=planning.searches, skipped=planning.note())
    return dataclasses.replace(program, plan=program.plan.replace(search=report))


def _build_on(fn, args, fine: FineMesh, named: dict, devices, slots, dataset, c: Options, call: str,  # noqa: PLR0913
              planning: Planning) -> Program:
    """Traces, plans and builds on one fine mesh, whose axes `named` names (`axis_names`); raises
    `NotRefined` where it is too coarse, or a `Layout` met in the trace names axes it does not. With
    `jshard.recompute(policy="auto")` regions and the search planning, chooses a policy per region;
    where no plan fits the budget and `optimizer` is not given, weighs its levels."""
    types = argument_types(args, fine, slots, dataset, c, call)
    traced, types = _typed_trace(fn, args, fine, devices, c, call, types, slots, dataset)
    stored = None if types is None else shard_stored(traced, types, slots, dataset, c)
    if stored is not None:
        traced, types = trace(fn, args, fine, devices, c, call, types=stored), stored
    for a in traced.ctx.annotations:
        for layout in (*a.in_layouts, *a.out_layouts):
            if layout is not None:
                _check_axis_names(layout, c.mesh, f"{a.name} at {a.source}", call)
    if c.mesh is None:
        for layout, who in _named_layouts(traced, c, call):
            mine = axis_names([(layout.device_matrix, layout.axis_names, who)], call)
            if any(named.get(axis) != name for axis, name in mine.items()):  # traced again, named so
                e = NotRefined(layout.device_matrix, layout.axis_names)
                e.who = who
                raise e
    budget, budget_from = _budget(c, devices)
    s = Signature(fn, args, devices, slots, dataset, c, call, budget, budget_from, types, planning)
    if c.searching and c.context_cut is None and context_cuts(traced):
        return planning.to_the_end(lambda: weigh_context(s, traced))
    return placed(s, traced)


def _typed_trace(fn, args, fine: FineMesh, devices, c: Options, call: str, types, slots, dataset) -> tuple[Traced, Any]:
    """`fn` traced with its arguments typed `types` (on `Explicit` axes); where the model's types
    do not take the batch as the default dataset policy cuts it, traced with the batch's rows cut
    over fewer mesh axes (`narrower_types`): the traced program and the types it was traced with."""
    tries: list[Any] = [types, *(narrower_types(types, args, slots, dataset, c) if types is not None else [])]
    for tried in tries[:-1]:
        try:
            return trace(fn, args, fine, devices, c, call, types=tried), tried
        except ShardingTypeError:
            continue
    return trace(fn, args, fine, devices, c, call, types=tries[-1]), tries[-1]


def _budget(c: Options, devices) -> tuple[float | None, str]:
    """The search's memory budget per device and where it came from: `memory_budget`, else the
    device's memory (the cost model's device kind, else the devices present)."""
    if c.memory_budget is not None or not c.searching:
        return c.memory_budget, "memory_budget"
    cost = c.costs
    if cost.memory is not None:
        return cost.memory, f"the memory of one {cost.device or 'device'}, no memory_budget given"
    memory = device_memory(devices or [])
    if memory is None:
        return None, "memory_budget"
    kind = devices[0].device_kind
    return memory, f"the memory of one {kind} device, no memory_budget given"


def _boundary_matrices(c: Options, slots, dataset, args, n: int, call: str) -> list[tuple[tuple[int, ...], str, Any]]:
    """Device matrices the fine mesh must refine before tracing, `in_strategy`'s and the dataset
    policy's: `(matrix, who uses it, its Layout's axis names or None)`."""
    if c.mode == "manual":
        return []
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    needed = []
    given = [(slot, f"in_strategy{path}") for slot, path in zip(slots, paths)]
    given += [(slot, f"dataset_strategy for args{paths[i]}") for i, slot in dataset.items() if slots[i] is None]
    for slot, what in given:
        if slot is not None and not isinstance(slot, PartitionSpec):
            layout = layout_of(slot, n, call=call, op=BOUNDARY, what=what)
            _check_axis_names(layout, c.mesh, what, call)
            needed.append((layout.device_matrix, what, layout.axis_names))
    return needed


def _named_layouts(traced: Traced, c: Options, call: str) -> list[tuple[TensorLayout, str]]:
    """The `Layout`s met in the trace (`shard` calls, their `parameter_plan`) and in `out_strategy`,
    with what uses each: their axis names are the plan's mesh's."""
    found = [(layout, f"{a.name} at {a.source}") for a in traced.ctx.annotations
             for layout in (*a.in_layouts, *a.out_layouts, *(lay for _, lay in a.params)) if layout is not None]
    outs = canonicalize_strategy_tree(c.out_strategy, jax.tree_util.tree_unflatten(traced.out_tree, traced.out_leaves),
                                      call=call, what="out_strategy")
    found += [(slot, f"out_strategy{path}") for path, slot in zip(traced.out_paths, outs) if isinstance(slot, TensorLayout)]
    return [(layout, who) for layout, who in found if layout.axis_names is not None]


def _check_axis_names(layout: TensorLayout, mesh: Mesh | None, who: str, call: str) -> None:
    """A `Layout` axis named like an axis of the user's mesh must be that axis: the same cut of
    the devices (size and place), or the plan would speak of two different axes by one name."""
    if mesh is None or layout.axis_names is None:
        return
    axes = FineMesh.of_mesh(mesh).axes_of(layout.device_matrix) if FineMesh.of_mesh(mesh).fits(layout.device_matrix) else None
    for i, (name, size) in enumerate(zip(layout.axis_names, layout.device_matrix)):
        if name in mesh.axis_names and (axes is None or axes[i] != (name,)):
            raise ShardingError(
                f"{call}: {who} names its device-matrix axis {i} {name!r} (size {size}, device matrix "
                f"{list(layout.device_matrix)}), but {name!r} is an axis of your mesh {dict(mesh.shape)} that "
                f"cuts the devices another way; one name would stand for two axes in the plan. Rename the "
                f"Layout's axis, or build the Layout on your mesh's axes: "
                f"Layout({tuple(mesh.devices.shape)}, {tuple(mesh.axis_names)}).")


def _fine_mesh(c: Options, n: int, needed, call: str) -> tuple[FineMesh, dict]:
    """The user's mesh as it is (its axes and names), a loaded plan's (as it was made and named), or
    jshard's own, refined for `needed`, its axes named as the user's `Layout`s name them; and those
    names (`axis_names`)."""
    if c.mesh is not None:
        users = FineMesh.of_mesh(c.mesh)
        for matrix, who, _ in needed:
            if not users.fits(matrix):
                raise ShardingError(_users_mesh_error(call, matrix, who, c))
        return users, {}
    names = axis_names([(m, a, w) for m, w, a in needed if a is not None], call)
    if c.plan is not None and c.plan.fine.device_count == n:  # a loaded plan: the mesh it was made on, as named
        return c.plan.fine, names
    fine = FineMesh.for_devices(n)
    if not all(fine.fits(m) for m, _, _ in needed):
        fine = FineMesh.refining(n, [m for m, _, _ in needed], [w for _, w, _ in needed], call=call)
    return (fine.named(names, call=call) if names else fine), names


def _users_mesh_error(call: str, matrix, who: str, c: Options) -> str:
    mesh = c.mesh
    assert mesh is not None  # the error of a user's mesh
    how = "mode='manual' keeps" if c.mode == "manual" else "jshard plans on"
    return (
        f"{call}: {who} uses device matrix {list(matrix)}, whose axes do not line up with the axes "
        f"of your mesh {dict(mesh.shape)}, and {how} the mesh as given. Use a strategy "
        f"or a jshard.Layout whose device-matrix axes each cover consecutive mesh axes (e.g. "
        f"Layout({tuple(mesh.devices.shape)}, {tuple(mesh.axis_names)})), or drop mesh= (and call "
        f"outside jax.set_mesh) so that jshard builds and refines its own mesh."
    )
