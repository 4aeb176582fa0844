"""One traced signature planned, built and held to its budget: the last stage of the compile core.

`Signature` is what the core's stages share for one input signature; `build_traced` plans one trace
(the optimizer-parallel cut, `jshard.accumulate`'s reduction, offload's anchors), builds the
`Program` and, with `memory_budget` and devices present, compiles it and asks the search again for
less where XLA holds more than estimated (up to `BUDGET_ROUNDS` searches); `fastest_that_fits` is
the one loop every weighing (`_weigh.py`) ends in.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import Any

from jax.sharding import NamedSharding, PartitionSpec

from jshard._errors import MemoryBudgetError, ShardingError
from jshard._format import human_bytes
from jshard.compile._boundary import (
    argument_leaves,
    batch_leaves,
    dataset_defaulted,
    in_shardings,
    out_shardings,
)
from jshard.compile._fusion import check_fusion
from jshard.compile._offload import anchored, offloaded
from jshard.compile._optimizer import accumulator, cuts, gathered, reduce_scattered, regathered, result_shardings
from jshard.compile._options import Options
from jshard.compile._peer import weigh_peer
from jshard.compile._planners import Planned, Problem, PropagationPlanner, planner_for
from jshard.compile._program import Compiles, Program, build_program
from jshard.compile._session import Planning
from jshard.compile._trace import Traced, trace
from jshard.graph import COMM_KEPT_LABEL, RECOMPUTE_SCOPE
from jshard.layouts import (
    FineMesh,
    spec_from_pspec,
    to_pspec,
)
from jshard.search import SEEDS, SearchReport

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
        options; `jshard.accumulate` reads the copies). A trace is a unit of work: the planning's
        deadline is checked before it (`Planning.check`)."""
        self.planning.check()

        def traced() -> Traced:
            return trace(self.fn, self.args, fine, self.devices, self.options, self.call, recompute, types=self.types,
                         **context)

        if context:
            return traced()
        key = ("trace", id(self.fn), fine, recompute, id(self.types), communication_read(self.options),
               self.options.context_cut)
        return self.planning.kept(key, traced, (self.fn, self.types))


def compiles(planning: Planning) -> Compiles:
    """The planning's compiled checks (one record per session): each distinct program compiled once."""
    return planning.kept(Compiles, Compiles)


def communication_read(options: Options) -> Any:
    """What a trace with no batch axes given (`build_traced` traces again with them) reads of
    `communication=`: the copies `jshard.accumulate` runs, and where `accumulation` gives no loop
    whether there is a `communication` (alone, it makes one micro-batch of a step that gives no
    count); not the all-reduce fusion, which it reads only where it reduces the gradients itself.
    Two options alike in this trace the same program."""
    comm, accumulation = options.communication, options.accumulation
    copies = 1 if comm is None else comm.copies
    return copies if accumulation is not None and accumulation.steps > 1 else (copies, comm is None)


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


def search_report(program: Program) -> SearchReport:
    """The search's report of a program a weighing planned (the search plans every candidate)."""
    report = program.plan.search
    assert report is not None, "a weighing's candidates are planned by the search"
    return report


def build_traced(s: Signature, traced: Traced, recompute: Any = "full", check: bool = True) -> Program:  # noqa: C901  (the build's stages in order)
    """Plans and builds one traced signature (`recompute`: the policy it gave `policy="auto"` regions;
    `check`: with `memory_budget` and devices present, hold the compiled program to the budget)."""
    fn, args, devices, slots, dataset, c, call = s.fn, s.args, s.devices, s.slots, s.dataset, s.options, s.call
    budget, budget_from = s.budget, s.budget_from
    fine = traced.fine
    in_sh = in_shardings(traced, slots, dataset, c, call)
    out_sh = out_shardings(traced, c, call)
    planning = s.planning
    planner = planner_for(c, call, planning.time_left, lambda: planning.deadline.passed, planning.check,
                          planning.kept)
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
        start = planning.deadline.clock()
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
        program = dataclasses.replace(program, plan=program.plan.replace(optimizer=shown, search=report))
        planning.built(start)
        return program, problem

    def checked_peak(program: Program) -> tuple[Program, float]:
        """`program` with its compiled peak and the compile's seconds in its report (and, where it
        fits, the budget asked for, not the tighter estimate searched under) and its executable (what
        calls run: the check's compile is the first call's; none where a program alike to one over
        the budget answered, `Compiles.check`), and that peak."""
        start = planning.deadline.clock()
        held = compiles(planning).check(program, args, c.memory_budget)
        planning.built(start)
        assert program.plan.search is not None and c.memory_budget is not None  # searched, compiled under a budget
        report = dataclasses.replace(program.plan.search, compiled_peak_bytes=held.peak, compile_seconds=held.seconds)
        if held.peak <= c.memory_budget:
            report = dataclasses.replace(report, budget=budget)
        return dataclasses.replace(program, plan=program.plan.replace(search=report), compiled=held.executable), held.peak

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


def _budget_retry_error(call: str, budget: float, held: float, asked: float, e: ShardingError) -> str:
    return (
        f"{call}: memory_budget={human_bytes(budget)} per device: the searched plan's compiled program held "
        f"{human_bytes(held)} per device (XLA's buffers exceed the search's estimate), and asked for "
        f"{human_bytes(asked)} instead the search found nothing: {str(e).split(': ', 1)[-1]}"
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
