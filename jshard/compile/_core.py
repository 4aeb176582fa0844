"""The compile core: trace → anchors → plan → program, once per input signature.

`parallelize` calls `build` with validated `Options`. It chooses the fine mesh (refining it and
tracing again where a strategy met while tracing needs a finer one), fixes the boundary (with
`optimizer=`, cutting the optimizer state and parameters there: `_optimizer.py`; with `offload`,
choosing the state kept in host memory: `_offload.py`), asks the `Planner` the options name, and
builds the `Program`. The stages share one `Signature` record; the three weighings under a budget
(offload, optimizer level, recompute policy) end in one loop, `fastest_that_fits`. With a memory
budget and devices present, the searched program's compiled memory is checked and the search asked
again for less, up to `BUDGET_ROUNDS` times. The built plan's work per device is priced last (`_work.py`: where nearly
nothing is cut, beside the data-parallel plan's).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._collector import collector_paused
from jshard._compat import ShardingTypeError
from jshard._errors import MemoryBudgetError, ShardingError
from jshard._format import human_bytes
from jshard._recompute import AUTO_POLICIES
from jshard.compile._boundary import (
    BOUNDARY,
    argument_leaves,
    argument_types,
    batch_leaves,
    check_micro_batches,
    dataset_anchors,
    dataset_defaulted,
    in_shardings,
    narrower_types,
    out_shardings,
    shard_stored,
)
from jshard.compile._collisions import warn_collisions
from jshard.compile._fusion import check_fusion
from jshard.compile._groups import Communication, OptimizerParallel
from jshard.compile._offload import anchored, least_streamed, offloaded, searched
from jshard.compile._optimizer import accumulator, cuts, gathered, reduce_scattered, regathered, result_shardings
from jshard.compile._options import Options
from jshard.compile._peer import weigh_peer
from jshard.compile._planners import Planned, Problem, PropagationPlanner, planner_for
from jshard.compile._program import Program, build_program, compiled_peak
from jshard.compile._session import Planning
from jshard.compile._trace import Traced, adopted, devices_for, trace
from jshard.compile._work import with_work
from jshard.cost import CostModel, device_memory
from jshard.graph import COMM_KEPT_LABEL, RECOMPUTE_SCOPE
from jshard.layouts import (
    FineMesh,
    NotRefined,
    TensorLayout,
    axis_names,
    canonicalize_in_strategy,
    canonicalize_strategy_tree,
    layout_of,
    spec_from_pspec,
    to_pspec,
)
from jshard.plan import CommunicationReport
from jshard.search import SEEDS, SearchReport, Weighed, assignment, choices, region_costs, upgrades

OPTIMIZER_LEVELS = (1, 2, 3)
"""The optimizer-parallel levels the search weighs where none is given and no plan fits without one."""

APART = Communication(fusion={"allreduce": {"mode": "size", "config": 0}})
"""The all-reduce fusion the search weighs against XLA's combiner: every all-reduce apart."""

COPIES = (2, 4)
"""The copy counts the search weighs beside one copy (MindSpore's `MicroBatchInterleaved` takes 2)."""

BUDGET_ROUNDS = 3
"""How many searches a `memory_budget` gets when XLA's compiled program holds more than estimated."""


@dataclasses.dataclass(frozen=True)
class Signature:
    """What the core's stages share for one input signature, fixed before planning.

    Attributes:
      fn: the function, as the core traces it.
      args: its arguments (arrays or shapes).
      devices: the devices it runs on, None on an abstract mesh.
      slots: each argument leaf's `in_strategy` entry, canonical.
      dataset: the dataset policy's anchors for the batch leaves `in_strategy` leaves open.
      options: the validated options (varied per candidate where a weighing tries one).
      call: the public call, for messages.
      budget: the search's memory budget per device, None for none.
      budget_from: where the budget came from (`"memory_budget"`, or a device's memory).
      types: the argument leaves' types on a user's `Explicit` axes, for tracing again.
      planning: the planning session (its deadline, the plans made): shared by every candidate.
    """

    fn: Callable[..., Any]
    args: tuple
    devices: Any
    slots: list
    dataset: dict
    options: Options
    call: str
    budget: float | None
    budget_from: str
    types: Any
    planning: Planning

    def but(self, **changes: Any) -> Signature:
        """The signature with these options changed (a candidate a weighing tries)."""
        return dataclasses.replace(self, options=dataclasses.replace(self.options, **changes))

    def trace(self, fine: FineMesh, recompute: Any = "full", **context: Any) -> Traced:
        """`fn` traced again on `fine` (with another recompute choice, or the core's context); with
        no context, once per session and communication (every offload placement and optimizer level
        weighs the same recompute policies of the same function, and the trace reads none of those
        options; `jshard.accumulate` reads the copies)."""
        def traced() -> Traced:
            return trace(self.fn, self.args, fine, self.devices, self.options, self.call, recompute, types=self.types,
                         **context)

        if context:
            return traced()
        key = ("trace", id(self.fn), fine, recompute, id(self.types), self.options.communication,
               self.options.context_cut)
        return self.planning.kept(key, traced, (self.fn, self.types))


def fastest_that_fits(keys: Any, seconds: Callable[[Any], Any], build: Callable[[Any], Program],
                      refused: Callable[[Any, MemoryBudgetError], None]) -> tuple[Any, Program] | None:
    """The one loop of the weighings (offload, optimizer level, recompute policy): of the candidates
    `keys`, fastest first by their estimate, the first whose `build` (held to the budget) fits, as
    `(key, program)`; each that does not is reported to `refused`. None: none fits."""
    for key in sorted(keys, key=seconds):
        try:
            return key, build(key)
        except MemoryBudgetError as e:
            refused(key, e)
    return None


def _searched(program: Program) -> SearchReport:
    """The search's report of a program a weighing planned (the search plans every candidate)."""
    report = program.plan.search
    assert report is not None, "a weighing's candidates are planned by the search"
    return report


def build(fn: Callable[..., Any], args: tuple, options: Options, call: str) -> Program:
    """The `Program` of `fn` for the signature of `args` (on the user's mesh where there is one:
    `mesh=`, or the one `jax.set_mesh` made current)."""
    with collector_paused():
        return _build(fn, args, options, call)


def _build(fn: Callable[..., Any], args: tuple, options: Options, call: str) -> Program:
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
    planning = Planning.of(options.search.time_limit)  # bounds the whole of planning this signature
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
        return with_work(_counted(program, planning), args, batch, slots, options, call)


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
    """`program` with the session's searches and what its weighings left out in its `SearchReport`."""
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
    if c.searching and c.context_cut is None and _context_cuts(traced):
        return planning.to_the_end(lambda: _weigh_context(s, traced))
    return _placed(s, traced)


def _placed(s: Signature, traced: Traced) -> Program:
    """Plans and builds one traced signature; under a budget the search may meet, with the state's
    placement weighed where `offload` is not given."""
    if s.options.searching and s.options.offload is None and s.budget is not None:
        return s.planning.to_the_end(lambda: _weigh_offload(s, traced))
    return _build_placed(s, traced)


CONTEXT_CUTS = 3
"""How many context-parallel cuts `_weigh_context` weighs at most: the smallest power of two that
leaves no device idle beside the batch's rows, and its doublings."""


def _context_cuts(traced: Traced) -> list[int]:
    """The sequence cuts weighed for the trace's `jshard.attention` calls without a strategy whose
    keys are past one tile (`TraceContext.open_attention`): powers of two dividing the devices and
    every such call's length, from the smallest that leaves no device idle beside the fewest batch
    rows, `CONTEXT_CUTS` of them; none where there are no such calls."""
    calls, n = traced.ctx.open_attention, traced.fine.device_count
    if not calls:
        return []
    least = max(2, n // min(b for b, _ in calls))
    cuts = [least << i for i in range(CONTEXT_CUTS)]
    return [k for k in cuts if k <= n and n % k == 0 and all(t % k == 0 for _, t in calls)]


def _weigh_context(s: Signature, traced: Traced) -> Program:
    """`mode="auto"` and `jshard.attention` calls that give no strategy over keys past one tile: the
    step traced with those calls' sequence cut by each of `_context_cuts` (context parallel, the form
    chosen as `form` says) and without a cut, each searched; the fastest predicted that fits the
    budget built (`fastest_that_fits`). `SearchReport.context` lists what was weighed, `context_cut`
    the cut chosen. The least cut is weighed first, then no cut, then the larger ones: past
    `Search.time_limit` (`Planning.weighs`) the step has been planned with every device busy."""
    planned: dict[int, tuple[Signature, Traced, Program]] = {}
    weighed: dict[int, Weighed] = {}
    cuts = _context_cuts(traced)
    for k in [*cuts[:1], 1, *cuts[1:]]:
        if not s.planning.weighs(f"context parallel {k}", bool(planned)):
            continue
        c = s.but(context_cut=k)
        try:
            t = traced if k == 1 else c.trace(traced.fine, traced.ctx.recompute_choice)
            program = _build_placed(c, t, False)
        except MemoryBudgetError as e:
            weighed[k] = Weighed(_context_name(k), None, e.least_bytes)
            continue
        except ShardingError:
            if k == 1:
                raise
            continue  # a cut the calls cannot take (a `block` that does not divide its keys): not a candidate
        planned[k], weighed[k] = (c, t, program), Weighed(_context_name(k), _searched(program).seconds,
                                                          _searched(program).peak_bytes)

    def refused(k, e: MemoryBudgetError) -> None:
        weighed[k] = dataclasses.replace(weighed[k], seconds=None, peak_bytes=e.least_bytes)

    found = fastest_that_fits(planned, lambda k: _searched(planned[k][2]).seconds,
                              lambda k: _placed(*planned[k][:2]), refused)
    if found is None:  # none fits without offload: the step as written, its state's placement weighed
        return _placed(s.but(context_cut=1), traced)
    shown = tuple(dataclasses.replace(weighed[k], chosen=k == found[0]) for k in sorted(weighed))
    plan = found[1].plan
    report = dataclasses.replace(_searched(found[1]), context=shown, context_cut=found[0])
    return dataclasses.replace(found[1], plan=plan.replace(search=report))


def _context_name(k: int) -> str:
    return f"sequence {k}" + (" (no cut)" if k == 1 else "")


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


def _build_placed(s: Signature, traced: Traced, check: bool = True) -> Program:
    """Plans and builds with the state where `offload` puts it (`check`: as `_build_traced`'s);
    where no plan fits the budget and `optimizer` is not given, weighs its levels."""
    c, budget = s.options, s.budget
    try:
        return _plan_signature(s, traced, check)
    except MemoryBudgetError as e:
        if c.optimizer is not None or budget is None or not c.searching or (e.bound and e.least_bytes > budget):
            raise  # given, no budget to meet, or nothing fits even with every tensor cut as finely as it can be
        without = e
    return s.planning.to_the_end(lambda: _weigh_optimizer(s, traced, without, check))


def _plan_signature(s: Signature, traced: Traced, check: bool = True) -> Program:
    """The program of one traced signature: where the search plans a step that marks its gradient
    function (`jshard.accumulate`) and `communication=` is not given, its copies and all-reduce
    fusion weighed (`_weigh_communication`); each candidate's `policy="auto"` recompute regions each
    given a policy."""
    if s.options.searching and s.options.communication is None and traced.ctx.accumulated:
        return s.planning.to_the_end(lambda: _weigh_communication(s, traced, check))
    return _plan_regions(s, traced, check)


def _plan_regions(s: Signature, traced: Traced, check: bool = True) -> Program:
    """The program of one traced signature, its `policy="auto"` recompute regions (when the search
    plans) each given a policy."""
    if not (s.options.searching and traced.ctx.auto_regions):
        return _build_traced(s, traced, check=check)
    return s.planning.to_the_end(lambda: _weigh_recompute(s, traced, check))


def _weigh_offload(s: Signature, traced: Traced) -> Program:
    """`mode="auto"` under a budget, no `offload=` given: plans the step with the state on the device;
    where the budget binds (the search gave up speed, or recompute, to fit it: `_binds`), plans it
    again with each of `SEARCHED` in host memory whose streaming alone (`least_streamed` on the host
    link) does not cost more than the plan on the device, each priced with its streaming
    (`CostModel.host_seconds`), and builds the fastest that fits (with `memory_budget` and devices
    present: whose compiled program fits), its `SearchReport.offload` listing what was weighed."""
    c, args = s.options, s.args
    assert s.budget is not None  # weighed only to meet a budget
    checked = c.memory_budget is not None and s.devices is not None
    cost = c.costs
    weighed: dict[tuple[str, ...], Weighed] = {}
    planned: dict[tuple[str, ...], Program] = {}
    errors: dict[tuple[str, ...], MemoryBudgetError] = {}
    place = lambda what, check: _build_placed(s.but(offload=what), traced, check)
    choices = searched(traced, args, c)
    try:
        device = place((), False)
    except MemoryBudgetError as e:
        weighed[()], errors[()] = Weighed("none", None, e.least_bytes), e
    else:
        search = device.plan.search
        assert search is not None  # the search planned it
        weighed[()], planned[()] = Weighed("none", search.seconds, search.peak_bytes), device
        least = lambda what: least_streamed(traced, args, c, what)
        choices = [what for what in choices if cost.host_seconds(least(what), least(what)) < search.seconds]
        if not _binds(search) or not choices:  # on the device, unhindered (or streaming alone costs more)
            try:
                return place((), True) if checked else device
            except MemoryBudgetError as e:
                weighed[()], errors[()] = Weighed("none", None, e.least_bytes), e
                del planned[()]
                choices = searched(traced, args, c)
    for what in choices:
        if not s.planning.weighs(f"offload {_offload_name(what)}", bool(planned)):
            continue
        try:
            program = place(what, False)
        except MemoryBudgetError as e:
            weighed[what], errors[what] = Weighed(_offload_name(what), None, e.least_bytes), e
            continue
        assert program.plan.offload is not None and program.plan.search is not None  # offloaded by the search
        host, search = program.plan.offload.seconds, program.plan.search
        weighed[what], planned[what] = Weighed(_offload_name(what), search.seconds + host, search.peak_bytes,
                                               host_seconds=host), program
    def refused(what, e: MemoryBudgetError) -> None:
        weighed[what], errors[what] = dataclasses.replace(weighed[what], seconds=None, peak_bytes=e.least_bytes), e

    found = fastest_that_fits(planned, lambda w: weighed[w].seconds,
                              lambda w: place(w, True) if checked else planned[w], refused)
    if found is not None:
        return _offload_chosen(found[1], found[0], weighed, s.budget, s.budget_from)
    least_peak = min((w.peak_bytes for w in weighed.values() if w.peak_bytes is not None), default=None)
    raise MemoryBudgetError(_offload_error(errors[()], weighed), least_peak) from None


def _binds(search) -> bool:
    """Whether the budget shaped a searched plan: the search traded speed for memory (the recursive
    search's unweighted plan did not fit; the ILP, which does not say, always counts), or a
    `policy="auto"` region recomputes."""
    return (search.status != "fits" or any(w.chosen and w.policy != "none" for w in search.recompute)
            or any(r.policy != "none" for r in search.regions))


def _offload_name(what: tuple[str, ...]) -> str:
    return "+".join(what) or "none"


def _offload_chosen(program: Program, what: tuple[str, ...], weighed: dict, budget: float, budget_from: str) -> Program:
    """`program` with the offloads weighed in its `SearchReport`, and why in its `OffloadReport`."""
    plan = program.plan
    assert plan.search is not None  # the search planned it
    shown = tuple(dataclasses.replace(w, chosen=k == what) for k, w in weighed.items())
    search = dataclasses.replace(plan.search, offload=shown)
    offload = plan.offload
    if what:
        assert offload is not None  # `what` is offloaded
        device, chosen = weighed[()], weighed[what]
        given = "memory_budget=" if budget_from == "memory_budget" else f"a budget of {budget_from}: "
        stay = (f"with the state on the device no plan fits (least peak {human_bytes(device.peak_bytes or 0)})"
                if device.seconds is None else f"with the state on the device the plan takes "
                f"{device.seconds * 1e3:.4g} ms per step (peak {human_bytes(device.peak_bytes)}), with it "
                f"{chosen.seconds * 1e3:.4g} ms")
        offload = dataclasses.replace(offload, why=f"chosen by the search under {given}{human_bytes(budget)} per "
                                                   f"device: {stay}")
    return dataclasses.replace(program, plan=plan.replace(search=search, offload=offload))


def _offload_error(device: MemoryBudgetError, weighed: dict) -> str:
    tried = "; ".join(w.text() for k, w in weighed.items() if k)
    if not tried:
        return str(device)
    return (f"{device} Offload weighed too (the state kept in host memory between steps, streamed over the "
            f"host link): {tried}; none fits.")


def _weigh_communication(s: Signature, traced: Traced, check: bool = True) -> Program:
    """`mode="auto"`, no `communication=` given, the gradient function marked: the step planned as
    traced (XLA's all-reduce combiner as it is, one copy) and, where the cost model overlaps
    collectives with compute (`CostModel.overlap`), with the combiner off (`allreduce` size 0: each
    all-reduce starts once its operand is made) and with `COPIES` copies where the batch's rows
    divide: each candidate traced and searched, and the fastest by the search's predicted seconds
    built (held to the budget as every weighing is: `fastest_that_fits`); ties keep the plan as
    traced. Where nothing overlaps, copies and split all-reduces only add latency: they are weighed
    only where no one-copy plan fits the budget (each copy holds the activations of `1/n` of the
    batch). `Plan.communication` lists what was weighed and why one won."""
    cost = s.options.costs
    candidates: list[Communication | None] = [None]
    if cost.overlap:
        candidates += [APART, *_copies(s)]
    planned: dict[Any, tuple[Signature, Traced, Program]] = {}
    weighed: dict[Any, Weighed] = {}
    failed: MemoryBudgetError | None = None

    def weigh(comm: Communication | None) -> None:
        nonlocal failed
        name = _comm_name(comm)
        if comm is not None and not s.planning.weighs(f"communication {name}", bool(planned)):
            return
        c = s if comm is None else s.but(communication=comm)
        try:
            t = traced if comm is None else c.trace(traced.fine, traced.ctx.recompute_choice)
            program = _plan_regions(c, t, False)
        except MemoryBudgetError as e:
            failed = failed or e
            weighed[comm] = Weighed(name, None, e.least_bytes)
            return
        except ShardingError:
            if comm is None:
                raise
            return  # a copy count the step cannot take (its own accumulate steps, say): not a candidate
        planned[comm], weighed[comm] = (c, t, program), Weighed(name, _searched(program).seconds,
                                                                 _searched(program).peak_bytes)

    for comm in candidates:
        weigh(comm)
    if None not in planned and not cost.overlap:  # memory may say otherwise: fewer activations per copy
        for comm in _copies(s):
            weigh(comm)
    checked = check and s.options.memory_budget is not None and s.devices is not None

    def built(comm) -> Program:
        c, t, program = planned[comm]
        return _plan_regions(c, t, True) if checked else program

    def refused(comm, e: MemoryBudgetError) -> None:
        nonlocal failed
        failed = e
        weighed[comm] = dataclasses.replace(weighed[comm], seconds=None, peak_bytes=e.least_bytes)

    found = fastest_that_fits(planned, lambda k: _searched(planned[k][2]).seconds, built, refused)
    if found is None:
        assert failed is not None  # every candidate failed the budget (a failure of another kind is raised)
        raise failed
    return _communication_chosen(found[1], found[0], weighed, cost)


def _copies(s: Signature) -> list[Communication]:
    """`Communication(n)` for each of `COPIES` that divides every batch leaf's rows (with
    `accumulation=k`, each micro-batch's)."""
    k = 1 if s.options.accumulation is None else s.options.accumulation.steps
    leaves = jax.tree_util.tree_leaves(s.args)
    rows = [np.shape(leaves[i])[0] for i in batch_leaves(s.args, s.options) if np.ndim(leaves[i])]
    return [Communication(n) for n in COPIES if rows and all(r % (k * n) == 0 for r in rows)]


def _comm_name(comm: Communication | None) -> str:
    if comm is None:
        return "copies=1, XLA's fusion"
    return f"copies={comm.copies}" if comm.fusion is None else f"copies={comm.copies}, allreduce size 0"


def _communication_chosen(program: Program, comm: Communication | None, weighed: dict, cost: CostModel) -> Program:
    """`program` with what the weighing weighed in its `CommunicationReport`, and why `comm` won."""
    plan = program.plan
    shown = tuple(dataclasses.replace(w, chosen=k == comm) for k, w in weighed.items())
    fits = [w for w in shown if w.seconds is not None]
    device = cost.device or "this device kind"
    if not cost.overlap and len(weighed) == 1:
        why = (f"one copy: on {device} the cost model overlaps no collective with compute, so more copies and "
               f"all-reduces kept apart would only add latency")
    elif len(shown) == 1:
        why = f"{_comm_name(comm)}: the only arrangement weighed before the time limit (search_time_limit) passed"
    elif len(fits) == 1:
        why = f"{_comm_name(comm)}: the only one that fits the budget"
    else:
        chosen, one = weighed[comm], weighed.get(None)
        rest = [w for k, w in weighed.items() if k != comm and w.seconds is not None]
        runner = one if comm is not None and one is not None and one.seconds is not None else min(
            rest, key=lambda w: w.seconds, default=None)
        against = "" if runner is None else f" against {runner.seconds * 1e3:.4g} ms for {runner.policy}"
        hidden = (" (one copy's collectives hidden behind another copy's compute)"
                  if comm is not None and comm.copies > 1 else "")
        why = f"{_comm_name(comm)}: the fastest predicted, {chosen.seconds * 1e3:.4g} ms per step{hidden}{against}"
    report = plan.communication or CommunicationReport(1, (), ())
    report = dataclasses.replace(report, weighed=shown, why=f"chosen by the search: {why}")
    return dataclasses.replace(program, plan=plan.replace(communication=report))


def _weigh_recompute(s: Signature, traced: Traced, check: bool = True) -> Program:
    """Chooses a recompute policy per `policy="auto"` region and builds the step so.

    The step is traced and planned once per policy (`AUTO_POLICIES`) given to every region: each
    region priced under each policy from the fastest plans (`search.region_costs`); the least
    recompute per region whose estimated peak fits the budget (a prefix of `search.upgrades`)
    planned under the budget; and of it and the uniform plans that fit, the fastest built (with
    `memory_budget` and devices present, `check`: the fastest whose compiled program fits; else
    more recompute). Its `SearchReport` lists the policies weighed (`recompute`) and each region's
    (`regions`)."""
    c, budget = s.options, s.budget
    uniform: dict[str, tuple[Traced, Program, Program | MemoryBudgetError]] = {}
    weighed: list[Weighed] = []
    for policy in AUTO_POLICIES:
        if not s.planning.weighs(f"recompute {policy!r}", any(not isinstance(u[2], MemoryBudgetError)
                                                               for u in uniform.values())):
            continue
        t = traced if policy == traced.ctx.recompute_choice else s.trace(traced.fine, policy)
        fastest, fits = _fitting(s, t, policy, traced.ctx.auto_regions > 1)
        weighed.append(Weighed(policy, None, fits.least_bytes) if isinstance(fits, MemoryBudgetError) else
                       Weighed(policy, _searched(fits).seconds, _searched(fits).peak_bytes))
        uniform[policy] = (t, fastest, fits)
    donated = argument_leaves(s.args, c.donate_argnums)
    costs = {p: region_costs(t.nodes, None if fastest is None else fastest.values, t.axis_size, t.invars, t.outvars,
                             frozenset(t.invars[i] for i in donated), c.costs) for p, (t, fastest, _) in uniform.items()}
    _, fastest, fits = uniform["none"]
    peak = _searched(fastest).peak_bytes if fastest is not None else fits.least_bytes or float("inf")
    moves = upgrades(costs, peak) if len(uniform) == len(AUTO_POLICIES) else []  # mixes need every policy
    regions = sorted(costs["none"])
    estimates = [peak] + [m[2] for m in moves]
    first = next((n for n, e in enumerate(estimates) if budget is None or e <= budget), len(moves))
    failed, tried = None, set()
    for n in range(first, len(moves) + 1):  # the estimate's prefix, then more recompute where XLA holds more
        choice = assignment(regions, moves[:n])
        candidates = {p: (u[0], u[2]) for p, u in uniform.items()
                      if not isinstance(u[2], MemoryBudgetError) and p not in tried}
        if len(set(choice)) > 1:
            t = s.trace(traced.fine, choice)
            _, fits = _fitting(s, t, choice, True)
            if isinstance(fits, MemoryBudgetError):
                failed = fits
            else:
                candidates[choice] = (t, fits)

        def held(key) -> Program:  # XLA's buffers held to the budget
            tried.add(key)
            t, program = candidates[key]
            return _build_traced(s, t, key) if check and c.memory_budget is not None and s.devices is not None else program

        def refused(key, e: MemoryBudgetError) -> None:  # XLA holds more than estimated: weighed as not fitting
            nonlocal failed, weighed
            failed = e
            weighed = [dataclasses.replace(w, seconds=None, peak_bytes=e.least_bytes) if w.policy == key else w
                       for w in weighed]

        found = fastest_that_fits(candidates, lambda k: _searched(candidates[k][1]).seconds, held, refused)
        if found is not None:
            key, program = found
            assert program.plan.search is not None  # the search planned it
            policies = (key,) * len(regions) if isinstance(key, str) else key
            report = dataclasses.replace(program.plan.search, regions=choices(costs, policies, moves),
                                         recompute=tuple(dataclasses.replace(w, chosen=key == w.policy) for w in weighed))
            return dataclasses.replace(program, plan=program.plan.replace(search=report))
    bound = all(isinstance(u[2], MemoryBudgetError) and u[2].bound for u in uniform.values())
    raise MemoryBudgetError(_recompute_error(s.call, budget, s.budget_from, weighed, traced.fine.device_count),
                            min((w.peak_bytes for w in weighed if w.peak_bytes is not None), default=None),
                            bound) from failed


def _fitting(s: Signature, t: Traced, policy, fastest_first: bool) -> tuple[Program, Program | MemoryBudgetError]:
    """The plan of `t` whose layouts price its regions (the fastest: planned without a budget), and
    its plan under `budget` (the fastest where it fits), or why none fits. Without `fastest_first`
    (one region: its policies are the uniform ones, and recomputing the last region lowers no
    estimate) planned under the budget only, the regions priced at its layouts, or (None) at the
    finest cuts."""
    budget = s.budget

    def plan(limit):
        return _build_traced(dataclasses.replace(s, budget=limit), t, policy, False)

    fastest = plan(None) if fastest_first or budget is None else None
    if fastest is not None and (budget is None or fastest.plan.search.peak_bytes <= budget):
        return fastest, dataclasses.replace(fastest, plan=fastest.plan.replace(search=dataclasses.replace(
            fastest.plan.search, budget=budget)))
    try:
        fits = plan(budget)
    except MemoryBudgetError as e:
        return fastest, e
    return fastest or fits, fits


def _weigh_optimizer(s: Signature, traced: Traced, without: MemoryBudgetError, check: bool = True) -> Program:
    """With no `optimizer` given and no plan fitting the budget without it (`without`):
    plans each level 1-3 (the state, then the gradients, then the parameters cut over the
    data-parallel axes; the search prices the collectives and the memory) and builds the fastest
    that fits, the plan saying why (`OptimizerReport.why`, `SearchReport.optimizer`)."""
    assert s.budget is not None  # weighed only to meet a budget
    planned: dict[int, Program] = {}
    weighed: dict[int, Weighed] = {}
    leveled = lambda level: s.but(optimizer=OptimizerParallel(level))
    for level in OPTIMIZER_LEVELS:
        if not s.planning.weighs(f"optimizer={level}", bool(planned)):
            continue
        try:
            program = _plan_signature(leveled(level), traced, False)
        except ShardingError as e:  # over the budget, or no data-parallel axis to cut over
            weighed[level] = Weighed(f"optimizer={level}", None, getattr(e, "least_bytes", None))
            continue
        planned[level] = program
        weighed[level] = Weighed(f"optimizer={level}", _searched(program).seconds, _searched(program).peak_bytes)
    checked = check and s.options.memory_budget is not None and s.devices is not None
    failed = without

    def refused(level: int, e: MemoryBudgetError) -> None:
        nonlocal failed
        failed = e
        weighed[level] = dataclasses.replace(weighed[level], seconds=None, peak_bytes=e.least_bytes)

    found = fastest_that_fits(planned, lambda k: _searched(planned[k]).seconds,
                              lambda k: _plan_signature(leveled(k), traced, True) if checked else planned[k], refused)
    if found is None:
        raise MemoryBudgetError(f"{without} Optimizer parallel was weighed too, and fits at no level: "
                                f"{', '.join(w.text() for w in weighed.values())}.", without.least_bytes) from failed
    level, program = found
    shown = [dataclasses.replace(w, chosen=k == level) for k, w in weighed.items()]
    why = (f"chosen by the search: no plan without optimizer parallel fits {human_bytes(s.budget)} per device (the "
           f"least it found: {human_bytes(without.least_bytes or 0)}); of the levels weighed ("
           f"{', '.join(w.text() for w in shown)}), level {level} is the fastest that fits")
    plan = program.plan
    assert plan.optimizer is not None and plan.search is not None  # planned with optimizer parallel, by the search
    return dataclasses.replace(program, plan=plan.replace(
        optimizer=dataclasses.replace(plan.optimizer, why=why),
        search=dataclasses.replace(plan.search, optimizer=tuple(shown))))


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


def _build_traced(s: Signature, traced: Traced, recompute: Any = "full", check: bool = True) -> Program:  # noqa: C901  (the build's stages in order)
    """Plans and builds one traced signature (`recompute`: the policy it gave `policy="auto"` regions;
    `check`: with `memory_budget` and devices present, hold the compiled program to the budget)."""
    fn, args, devices, slots, dataset, c, call = s.fn, s.args, s.devices, s.slots, s.dataset, s.options, s.call
    budget, budget_from = s.budget, s.budget_from
    fine = traced.fine
    in_sh = in_shardings(traced, slots, dataset, c, call)
    out_sh = out_shardings(traced, c, call)
    planning = s.planning
    planner = planner_for(c, call, planning.time_left, lambda: planning.deadline.passed)
    donated = frozenset(argument_leaves(args, c.donate_argnums))
    optimizer, gather, kept, grads = None, {}, None, {}
    sharded = c.accumulation is not None and c.accumulation.shard
    if c.optimizer is not None or sharded:
        layouts = _layouts(traced, in_sh, lambda p: planning.plan(planner, p), donated, c)
    if c.optimizer is not None:
        cut = cuts(traced, args, layouts, c, call)
        gather, grads = cut.gather, cut.grads  # level 3: the function all-gathers the cut parameters before use
        in_sh, out_sh, optimizer = [cut.args.get(i, sh) for i, sh in enumerate(in_sh)], result_shardings(out_sh, cut), cut.report
    if sharded:  # jshard.accumulate cuts its accumulated gradients over the data-parallel axes
        kept = accumulator(traced, args, layouts, c, call)
    axes = _batch_axes(in_sh, args, c) if c.accumulation is not None or c.communication is not None else None
    if gather or kept is not None or axes:  # axes: jshard.accumulate reduces once, after its loop
        traced = dataclasses.replace(s, fn=gathered(fn, gather) if gather else fn).trace(
            fine, recompute, accumulator=kept, batch_axes=axes)
    rewrite = regathered(traced, gather) if c.optimizer is not None and c.optimizer.comm_recompute else None
    if optimizer is not None:
        optimizer = dataclasses.replace(optimizer, regathered=len(gather) if rewrite is not None else 0)
    _check_comm_kept(traced, c, call)
    if traced.ctx.unreduced is not None:  # multi-copy where jshard cannot reduce the copies' gradients itself
        raise ShardingError(traced.ctx.unreduced)
    check_fusion(c.communication, None if devices is None else devices[0].platform, bool(traced.ctx.buckets), call)
    offload = offloaded(traced, args, c, call)
    in_sh, out_sh = anchored(in_sh, out_sh, offload, args, traced.mesh)
    # the program is compiled and held to the budget: here, or (check False) by the caller weighing it
    compiled = c.searching and c.memory_budget is not None and devices is not None
    checked = check and compiled
    problem = Problem(traced, in_sh, donated, budget, offload, movable=dataset_defaulted(traced, slots, dataset, c),
                      batch=frozenset(batch_leaves(args, c)), compiled=compiled)
    held, searched, tried = 0.0, 0, False

    def attempt(problem: Problem) -> tuple[Program, Problem]:
        """`problem` planned and built (planned again with the gradients jshard reduce-scatters cut
        where they are made, where there are any): the program and the problem it was planned for."""
        try:
            planned = planning.plan(planner, problem)
        except ShardingError as e:
            if not held:
                raise
            raise MemoryBudgetError(_budget_retry_error(call, c.memory_budget, held, problem.budget, e), held) from None
        scattered, made = reduce_scattered(traced, planned.result, grads)  # level 2 and 3: the gradients' reduce-scatter
        if made and not problem.made:  # plan again with those gradients cut where they are made
            problem = dataclasses.replace(problem, made=made)
            planned = planning.plan(planner, problem)
            scattered, _ = reduce_scattered(traced, planned.result, grads)
        given = planned.in_shardings or [None] * len(in_sh)
        program = build_program(traced, planned, [sh or g for sh, g in zip(in_sh, given)], out_sh, devices, c, args,
                                rewrite, offload, scattered)
        report = planned.report and dataclasses.replace(planned.report, budget_from=budget_from)
        shown = optimizer and dataclasses.replace(optimizer, reduce_scattered=len(scattered))
        return dataclasses.replace(program, plan=program.plan.replace(optimizer=shown, search=report)), problem

    def checked_peak(program: Program) -> tuple[Program, float]:
        """`program` with its compiled peak in its report (and, where it fits, the budget asked for,
        not the tighter estimate searched under), and that peak."""
        found = compiled_peak(program.jitted, args, program.in_shardings, bool(program.plan.offload))
        assert program.plan.search is not None and c.memory_budget is not None  # searched, compiled under a budget
        report = dataclasses.replace(program.plan.search, compiled_peak_bytes=found)
        if found <= c.memory_budget:
            report = dataclasses.replace(report, budget=budget)
        return dataclasses.replace(program, plan=program.plan.replace(search=report)), found

    def first_fitting(statuses: list[str]) -> Program | None:
        """Of the seeds `statuses`, in order, the first whose compiled program fits the budget."""
        for status in statuses:
            as_is, found = checked_peak(attempt(dataclasses.replace(problem, as_seeded=status))[0])
            if found <= c.memory_budget:
                return as_is
        return None

    dearer: list[str] = []  # seeds that predict more than the search's plan: tried once its searches fail
    try:
        while searched < BUDGET_ROUNDS:
            program, problem = attempt(problem)
            if not checked:
                if _peer_weighed(c, planner, devices, traced, rewrite, offload, grads):
                    return weigh_peer(program, lambda: build_program(
                        traced, Planned(None), in_sh, out_sh, devices, dataclasses.replace(c, propagation="xla"),
                        args), args)
                return program
            report = program.plan.search
            assert report is not None and c.memory_budget is not None and problem.budget is not None  # searched, held
            if report.seeds and not tried:
                # seeds that predict less but the search estimated over the budget: their compiled programs decide,
                # compiled before the search's plan (kept where one fits, whether or not the plan would), deadline
                # or not (no search: a few compiles for a plan that may be much faster)
                tried = True
                dearer = [status for status, seconds in report.seeds if seconds >= report.seconds]
                found = first_fitting([status for status, seconds in report.seeds if seconds < report.seconds])
                if found is not None:
                    return found
            program, held = checked_peak(program)
            report = program.plan.search
            assert report is not None  # as checked_peak's
            if held <= c.memory_budget:
                return program
            if problem.seeded and any(seed in report.status for seed in SEEDS):  # the search's own plans first
                problem = dataclasses.replace(problem, seeded=False)
                continue
            # XLA holds more than the search's estimate: ask for less.
            problem = dataclasses.replace(problem, budget=problem.budget * c.memory_budget / held * 0.97)
            searched += 1
        error = MemoryBudgetError(
            f"{call}: memory_budget={human_bytes(c.memory_budget)} per device: the searched plan's "
            f"compiled program still holds {human_bytes(held)} per device after {BUDGET_ROUNDS} searches with "
            f"tighter estimates (XLA's temporary buffers exceed what the search models). Raise "
            f"memory_budget, or use more devices.", held
        )
    except MemoryBudgetError as e:  # the search found nothing under a tighter estimate
        error = e
    found = first_fitting(dearer)  # the search's own plans failed: the dearer seeds, cheapest first
    if found is None:
        raise error
    return found


def _peer_weighed(c: Options, planner, devices, traced: Traced, rewrite, offload, grads) -> bool:
    """Whether `propagation="best"` weighs Shardy's plan beside jshard's: jshard propagated from the
    anchors, devices are present to compile on, and the program holds nothing only jshard's
    emission makes (the gradients' reduce-scatter, kept collectives' results, state in host memory)."""
    kept = any(_COMM_KEPT.search(n.scope) for n in traced.nodes)
    return (c.propagation == "best" and isinstance(planner, PropagationPlanner) and devices is not None
            and rewrite is None and offload is None and not grads and not kept)


def _batch_axes(in_sh: list, args: tuple, c: Options) -> tuple[str, ...] | None:
    """The mesh axes that cut the rows of every batch leaf, as laid out before planning (in_strategy
    or the dataset policy), for `jshard.accumulate` to reduce once over; None: the leaves disagree,
    one is left to the planner, or `mode="auto"` (the search plans the accumulation loop's body,
    which a manual region would hide from it)."""
    if c.mode not in ("data", "semi_auto"):
        return None
    batch = batch_leaves(args, c)
    found = set()
    for i in batch:
        if in_sh[i] is None:
            return None
        dims = spec_from_pspec(in_sh[i].spec, max(len(in_sh[i].spec), 1))
        found.add(dims[0])
    return found.pop() if len(found) == 1 and () not in found else None


def _layouts(traced, in_sh: list, plan: Callable[[Problem], Any], donated: frozenset[int], c: Options) -> list[NamedSharding]:
    """Each argument leaf's sharding before the optimizer-parallel cut: its anchor, else the one
    the planner gives it without the cut (`plan`: the session's, so each level weighed reuses it;
    else replicated, as the program would lay it out)."""
    if all(sh is not None for sh in in_sh):
        return list(in_sh)
    try:
        planned = plan(Problem(traced, in_sh, donated, c.memory_budget))
    except MemoryBudgetError:  # the cut these layouts are for is what makes the budget fit
        planned = plan(Problem(traced, in_sh, donated, None))
    given = planned.in_shardings or [None] * len(in_sh)
    values = {} if planned.result is None else planned.result.values
    return [sh or g or NamedSharding(traced.mesh, to_pspec(values[v]) if v in values else PartitionSpec())
            for sh, g, v in zip(in_sh, given, traced.invars)]


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
    assert mesh is not None  # the error of a user's mesh
    how = "mode='manual' keeps" if c.mode == "manual" else "jshard plans on"
    return (
        f"{call}: {who} uses device matrix {list(matrix)}, whose axes do not line up with the axes "
        f"of your mesh {dict(mesh.shape)}, and {how} the mesh as given. Use a strategy "
        f"or a jshard.Layout whose device-matrix axes each cover consecutive mesh axes (e.g. "
        f"Layout({tuple(mesh.devices.shape)}, {tuple(mesh.axis_names)})), or drop mesh= (and call "
        f"outside jax.set_mesh) so that jshard builds and refines its own mesh."
    )


_COMM_KEPT = re.compile(RECOMPUTE_SCOPE + r"\w*" + COMM_KEPT_LABEL + r"\b")


def _check_comm_kept(traced: Traced, c: Options, call: str) -> None:
    """Raises `ShardingError` where a `jshard.recompute(..., mp_comm_recompute=False)` region sits
    in a program jshard places no constraints in (whose collectives' results it cannot keep)."""
    mesh = traced.mesh
    why = ("mode='manual'" if c.mode == "manual" else "propagation='xla'" if c.propagation == "xla"
           else "every mesh axis Explicit" if set(mesh.explicit_axes) == set(mesh.axis_names) else None)
    kept = next((n for n in traced.nodes if _COMM_KEPT.search(n.scope)), None) if why else None
    if kept is not None and why is not None:
        raise ShardingError(_comm_kept_error(call, kept.source, why))


def _comm_kept_error(call: str, source: str, why: str) -> str:
    return (f"{call}: jshard.recompute(..., mp_comm_recompute=False) at {source} keeps the results of the "
            f"collectives jshard's constraints make, but with {why} jshard places none (XLA makes the "
            f"collectives). Use mode='semi_auto' (or 'data', 'auto') with jshard's propagation, or "
            f"mp_comm_recompute=True.")
