"""The compile core: trace → anchors → plan → program, once per input signature.

`parallelize` calls `build` with validated `Options`. It chooses the fine mesh (refining it and
tracing again where a strategy met while tracing needs a finer one), fixes the boundary (with
`optimizer_parallel`, cutting the optimizer state and parameters there: `_optimizer.py`; with
`offload`, choosing the state kept in host memory: `_offload.py`), asks the
`Planner` the options name, and builds the `Program`. With `memory_budget` and devices present, the
searched program's compiled memory is checked and the search asked again for less, up to
`BUDGET_ROUNDS` times.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._errors import MemoryBudgetError, ShardingError
from jshard._format import human_bytes
from jshard._recompute import AUTO_POLICIES
from jshard.compile._boundary import (
    BOUNDARY,
    argument_leaves,
    argument_types,
    check_micro_batches,
    dataset_anchors,
    in_shardings,
    out_shardings,
)
from jshard.compile._offload import anchored, offloaded
from jshard.compile._optimizer import accumulator, cuts, gathered, reduce_scattered, regathered, result_shardings
from jshard.compile._options import Options
from jshard.compile._planners import Problem, planner_for
from jshard.compile._program import Program, build_program, compiled_peak
from jshard.compile._trace import Traced, adopted, devices_for, trace
from jshard.cost import CostModel, device_memory
from jshard.layouts import (
    FineMesh,
    NotRefined,
    TensorLayout,
    canonicalize_in_strategy,
    layout_of,
    spec_from_pspec,
    to_pspec,
)
from jshard.search import Weighed

BUDGET_ROUNDS = 3
"""How many searches a `memory_budget` gets when XLA's compiled program holds more than estimated."""


def build(fn: Callable[..., Any], args: tuple, options: Options, call: str) -> Program:
    """The `Program` of `fn` for the signature of `args` (on the user's mesh where there is one:
    `mesh=`, or the one `jax.set_mesh` made current)."""
    options = adopted(options, call)
    devices = devices_for(options)
    n = options.devices if devices is None else len(devices)
    slots = canonicalize_in_strategy(options.in_strategy, args, call=call)
    batch = argument_leaves(args, (len(args) - 1,) if options.batch_argnums is None else options.batch_argnums)
    dataset = dataset_anchors(args, batch, options, n, call)
    if options.accumulation is not None:
        cut = {i: slot for i, slot in dataset.items() if slots[i] is None}  # in_strategy comes first
        check_micro_batches(args, batch, cut, options.accumulation.steps, n, call)
    needed = _boundary_matrices(options, slots, dataset, args, n, call)
    while True:
        fine = _fine_mesh(options, n, needed, call)
        try:
            return _build_on(fn, args, fine, devices, slots, dataset, options, call)
        except NotRefined as e:
            if options.mesh is not None:
                raise ShardingError(_users_mesh_error(call, e.matrix, e.who, options)) from None
            needed.append((e.matrix, e.who))


def _build_on(fn, args, fine: FineMesh, devices, slots, dataset, c: Options, call: str) -> Program:
    """Traces, plans and builds on one fine mesh; raises `NotRefined` where it is too coarse. With
    `jshard.recompute(policy="auto")` regions and the search planning, weighs each recompute policy."""
    types = argument_types(args, fine, slots, dataset, c, call)
    traced = trace(fn, args, fine, devices, c, call, types=types)
    for a in traced.ctx.annotations:
        for layout in (*a.in_layouts, *a.out_layouts):
            if layout is not None:
                _check_axis_names(layout, c.mesh, f"{a.name} at {a.source}", call)
    budget, budget_from = _budget(c, devices)
    if not (c.searching and traced.ctx.auto_regions):
        return _build_traced(fn, traced, args, devices, slots, dataset, c, call, budget, budget_from, types=types)
    return _weigh_recompute(fn, traced, args, devices, slots, dataset, c, call, budget, budget_from, types)


def _weigh_recompute(fn, traced: Traced, args, devices, slots, dataset, c: Options, call: str, budget: float | None,
                     budget_from: str, types) -> Program:
    """Plans the step once per recompute policy of its `policy="auto"` regions (`AUTO_POLICIES`) on
    the search's estimates, then builds the fastest that fits (with `memory_budget` and devices
    present: whose compiled program fits), its `SearchReport.recompute` listing what was weighed."""
    fine = traced.fine
    planned: dict[str, tuple[Traced, Program]] = {}
    weighed = []
    for policy in AUTO_POLICIES:  # each policy planned on the search's estimates; the compiled check after
        t = traced if policy == traced.ctx.recompute_choice else trace(fn, args, fine, devices, c, call, policy, types=types)
        try:
            program = _build_traced(fn, t, args, devices, slots, dataset, c, call, budget, budget_from, policy, False, types)
        except MemoryBudgetError as e:
            weighed.append(Weighed(policy, None, e.least_bytes))
            continue
        planned[policy] = (t, program)
        weighed.append(Weighed(policy, program.plan.search.seconds, program.plan.search.peak_bytes))
    failed = None
    for best in sorted(planned, key=lambda p: planned[p][1].plan.search.seconds):
        t, program = planned[best]
        try:
            if c.memory_budget is not None and devices is not None:  # XLA's buffers checked against the budget
                program = _build_traced(fn, t, args, devices, slots, dataset, c, call, budget, budget_from, best, types=types)
        except MemoryBudgetError as e:
            failed = e
            weighed = [dataclasses.replace(w, seconds=None, peak_bytes=e.least_bytes) if w.policy == best else w
                       for w in weighed]
            continue
        report = dataclasses.replace(program.plan.search, recompute=tuple(
            dataclasses.replace(w, chosen=w.policy == best) for w in weighed))
        return dataclasses.replace(program, plan=dataclasses.replace(program.plan, search=report))
    raise MemoryBudgetError(_recompute_error(call, budget, budget_from, weighed, fine.device_count),
                            min((w.peak_bytes for w in weighed if w.peak_bytes is not None), default=None)) from failed


def _budget(c: Options, devices) -> tuple[float | None, str]:
    """The search's memory budget per device and where it came from: `memory_budget`, else the
    device's memory (the cost model's device kind, else the devices present)."""
    if c.memory_budget is not None or not c.searching:
        return c.memory_budget, "memory_budget"
    cost = c.cost_model or CostModel()
    if cost.memory is not None:
        return cost.memory, f"the memory of one {cost.device or 'device'}, no memory_budget given"
    memory = device_memory(devices or [])
    if memory is None:
        return None, "memory_budget"
    kind = devices[0].device_kind
    return memory, f"the memory of one {kind} device, no memory_budget given"


def _build_traced(fn, traced: Traced, args, devices, slots, dataset, c: Options, call: str, budget: float | None,
                  budget_from: str, recompute: str = "full", check: bool = True, types=None) -> Program:
    """Plans and builds one traced signature (`recompute`: the policy it gave `policy="auto"` regions;
    `check`: with `memory_budget` and devices present, hold the compiled program to the budget;
    `types`: the argument leaves' types on a user's `Explicit` axes, for tracing again)."""
    fine = traced.fine
    in_sh = in_shardings(traced, slots, dataset, c, call)
    out_sh = out_shardings(traced, c, call)
    planner = planner_for(c, call)
    donated = frozenset(argument_leaves(args, c.donate_argnums))
    optimizer, gather, kept, grads = None, {}, None, {}
    sharded = c.accumulation is not None and c.accumulation.shard
    if c.optimizer is not None or sharded:
        layouts = _layouts(traced, in_sh, planner, donated, c)
    if c.optimizer is not None:
        cut = cuts(traced, args, layouts, c, call)
        gather, grads = cut.gather, cut.grads  # level 3: the function all-gathers the cut parameters before use
        in_sh, out_sh, optimizer = [cut.args.get(i, sh) for i, sh in enumerate(in_sh)], result_shardings(out_sh, cut), cut.report
    if sharded:  # jshard.accumulate cuts its accumulated gradients over the data-parallel axes
        kept = accumulator(traced, args, layouts, c, call)
    axes = _batch_axes(in_sh, args, c) if c.accumulation is not None else None
    if gather or kept is not None or axes:  # axes: jshard.accumulate reduces once, after its loop
        traced = trace(gathered(fn, gather) if gather else fn, args, fine, devices, c, call, recompute,
                       accumulator=kept, types=types, batch_axes=axes)
    rewrite = regathered(traced, gather) if c.optimizer_comm_recompute else None
    if optimizer is not None:
        optimizer = dataclasses.replace(optimizer, regathered=len(gather) if rewrite is not None else 0)
    offload = offloaded(traced, args, c, call)
    in_sh, out_sh = anchored(in_sh, out_sh, offload, args, traced.mesh)
    problem = Problem(traced, in_sh, donated, budget)
    checked = check and c.searching and c.memory_budget is not None and devices is not None
    held = 0.0
    for attempt in range(BUDGET_ROUNDS):
        try:
            planned = planner.plan(problem)
        except ShardingError as e:
            if attempt == 0:
                raise
            raise MemoryBudgetError(_budget_retry_error(call, c.memory_budget, held, problem.budget, e), held) from None
        scattered, made = reduce_scattered(traced, planned.result, grads)  # level 2 and 3: the gradients' reduce-scatter
        if made and not problem.made:  # plan again with those gradients cut where they are made
            problem = dataclasses.replace(problem, made=made)
            planned = planner.plan(problem)
            scattered, _ = reduce_scattered(traced, planned.result, grads)
        given = planned.in_shardings or [None] * len(in_sh)
        program = build_program(traced, planned, [sh or g for sh, g in zip(in_sh, given)], out_sh, devices, c, args,
                                rewrite, offload, scattered)
        report = planned.report and dataclasses.replace(planned.report, budget_from=budget_from)
        shown = optimizer and dataclasses.replace(optimizer, reduce_scattered=len(scattered))
        program = dataclasses.replace(program, plan=dataclasses.replace(program.plan, optimizer=shown, search=report))
        if not checked:
            return program
        held = compiled_peak(program.jitted, args, program.in_shardings)
        report = dataclasses.replace(report, compiled_peak_bytes=held)
        if held <= c.memory_budget:
            return dataclasses.replace(program, plan=dataclasses.replace(program.plan, search=report))
        # XLA holds more than the search's estimate: ask for less.
        problem = dataclasses.replace(problem, budget=problem.budget * c.memory_budget / held * 0.97)
    raise MemoryBudgetError(
        f"{call}: memory_budget={human_bytes(c.memory_budget)} per device: the searched plan's "
        f"compiled program still holds {human_bytes(held)} per device after {BUDGET_ROUNDS} searches with "
        f"tighter estimates (XLA's temporary buffers exceed what the search models). Raise "
        f"memory_budget, or use more devices.", held
    )


def _batch_axes(in_sh: list, args: tuple, c: Options) -> tuple[str, ...] | None:
    """The mesh axes that cut the rows of every batch leaf, as laid out before planning (in_strategy
    or the dataset policy), for `jshard.accumulate` to reduce once over; None: the leaves disagree,
    one is left to the planner, or `mode="auto"` (the search plans the accumulation loop's body,
    which a manual region would hide from it)."""
    if c.mode not in ("data", "semi_auto"):
        return None
    batch = argument_leaves(args, (len(args) - 1,) if c.batch_argnums is None else c.batch_argnums)
    found = set()
    for i in batch:
        if in_sh[i] is None:
            return None
        dims = spec_from_pspec(in_sh[i].spec, max(len(in_sh[i].spec), 1))
        found.add(dims[0])
    return found.pop() if len(found) == 1 and () not in found else None


def _layouts(traced, in_sh: list, planner, donated: frozenset[int], c: Options) -> list[NamedSharding]:
    """Each argument leaf's sharding before the optimizer-parallel cut: its anchor, else the one
    the planner gives it without the cut (else replicated, as the program would lay it out)."""
    if all(sh is not None for sh in in_sh):
        return list(in_sh)
    planned = planner.plan(Problem(traced, in_sh, donated, c.memory_budget))
    given = planned.in_shardings or [None] * len(in_sh)
    values = {} if planned.result is None else planned.result.values
    return [sh or g or NamedSharding(traced.mesh, to_pspec(values[v]) if v in values else PartitionSpec())
            for sh, g, v in zip(in_sh, given, traced.invars)]


def _boundary_matrices(c: Options, slots, dataset, args, n: int, call: str) -> list[tuple[tuple[int, ...], str]]:
    """Device matrices the fine mesh must refine before tracing: the mesh's, `in_strategy`'s and
    the dataset policy's."""
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
            needed.append((layout.device_matrix, what))
    return needed


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


def _fine_mesh(c: Options, n: int, needed, call: str) -> FineMesh:
    """The user's mesh as it is (its axes and names), or jshard's own, refined for `needed`."""
    if c.mesh is not None:
        users = FineMesh.of_mesh(c.mesh)
        for matrix, who in needed:
            if not users.fits(matrix):
                raise ShardingError(_users_mesh_error(call, matrix, who, c))
        return users
    default = FineMesh.for_devices(n)
    if all(default.fits(m) for m, _ in needed):
        return default
    return FineMesh.refining(n, [m for m, _ in needed], [w for _, w in needed], call=call)


def _budget_retry_error(call: str, budget: float, held: float, asked: float, e: ShardingError) -> str:
    return (
        f"{call}: memory_budget={human_bytes(budget)} per device: the searched plan's compiled program held "
        f"{human_bytes(held)} per device (XLA's buffers exceed the search's estimate), and asked for "
        f"{human_bytes(asked)} instead the search found nothing: {str(e).split(': ', 1)[-1]}"
    )


def _recompute_error(call: str, budget: float, budget_from: str, weighed, n: int) -> str:
    tried = "; ".join(w.text() for w in weighed)
    least = min(weighed, key=lambda w: w.peak_bytes if w.peak_bytes is not None else float("inf"))
    given = "memory_budget=" if budget_from == "memory_budget" else f"a budget of {budget_from}: "
    return (f"{call}: {given}{human_bytes(budget)} per device cannot be met on {n} devices with any recompute "
            f"policy of the jshard.recompute(policy='auto') regions ({tried}). The smallest peak the search "
            f"estimated is {human_bytes(least.peak_bytes or 0)} per device, with recompute {least.policy!r}. "
            f"Raise memory_budget to at least that, use more devices, shrink the batch, or recompute more of "
            f"the model (wrap more of it in jshard.recompute).")


def _users_mesh_error(call: str, matrix, who: str, c: Options) -> str:
    mesh = c.mesh
    how = "mode='manual' keeps" if c.mode == "manual" else "jshard plans on"
    return (
        f"{call}: {who} uses device matrix {list(matrix)}, whose axes do not line up with the axes "
        f"of your mesh {dict(mesh.shape)}, and {how} the mesh as given. Use a strategy "
        f"or a jshard.Layout whose device-matrix axes each cover consecutive mesh axes (e.g. "
        f"Layout({tuple(mesh.devices.shape)}, {tuple(mesh.axis_names)})), or drop mesh= (and call "
        f"outside jax.set_mesh) so that jshard builds and refines its own mesh."
    )
