"""The weighings of `mode="auto"`: candidates the search plans side by side, the fastest that fits kept.

Called in this order from the compile core, each wrapping the next: the context-parallel cut of
`jshard.attention` calls (`weigh_context`), the state's placement in host memory under a budget
(`_weigh_offload`), the optimizer-parallel level where nothing fits without one
(`_weigh_optimizer`), multi-copy and all-reduce fusion where the step marks its gradient function
(`_weigh_communication`), and a recompute policy per `policy="auto"` region (`_auto_recompute.py`).
Each candidate is traced (once per session: `Signature.trace`) and planned by the search; the
fastest predicted that fits the budget is built (`fastest_that_fits`), and the plan's report lists
what was weighed and why one won.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jshard._errors import MemoryBudgetError, ShardingError
from jshard._format import human_bytes
from jshard.compile._auto_recompute import weigh_recompute
from jshard.compile._boundary import (
    batch_leaves,
)
from jshard.compile._groups import Communication, OptimizerParallel
from jshard.compile._least import least_step
from jshard.compile._offload import least_seconds, least_streamed, searched
from jshard.compile._program import Program
from jshard.compile._stage import Signature, build_traced, communication_read, fastest_that_fits, search_report
from jshard.compile._trace import Traced
from jshard.cost import CostModel
from jshard.plan import CommunicationReport
from jshard.search import Weighed

OPTIMIZER_LEVELS = (1, 2, 3)
"""The optimizer-parallel levels the search weighs where none is given and no plan fits without one."""


APART = Communication(fusion={"allreduce": {"mode": "size", "config": 0}})
"""The all-reduce fusion the search weighs against XLA's combiner: every all-reduce apart."""


COPIES = (2, 4)
"""The copy counts the search weighs beside one copy (MindSpore's `MicroBatchInterleaved` takes 2)."""


def placed(s: Signature, traced: Traced) -> Program:
    """Plans and builds one traced signature; under a budget the search may meet, with the state's
    placement weighed where `offload` is not given."""
    if s.options.searching and s.options.offload is None and s.budget is not None:
        return s.planning.to_the_end(lambda: _weigh_offload(s, traced))
    return _build_placed(s, traced)


CONTEXT_CUTS = 3
"""How many context-parallel cuts `weigh_context` weighs at most: the smallest power of two that
leaves no device idle beside the batch's rows, and its doublings."""


def context_cuts(traced: Traced) -> list[int]:
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


def weigh_context(s: Signature, traced: Traced) -> Program:
    """`mode="auto"` and `jshard.attention` calls that give no strategy over keys past one tile: the
    step traced with those calls' sequence cut by each of `context_cuts` (context parallel, the form
    chosen as `form` says) and without a cut, each searched; the fastest predicted that fits the
    budget built (`fastest_that_fits`). `SearchReport.context` lists what was weighed, `context_cut`
    the cut chosen. The least cut is weighed first, then no cut, then the larger ones: past
    `Search.time_limit` (`Planning.weighs`) the step has been planned with every device busy."""
    planned: dict[int, tuple[Signature, Traced, Program]] = {}
    weighed: dict[int, Weighed] = {}
    cuts = context_cuts(traced)

    def weigh(k: int) -> None:
        c = s.but(context_cut=k)
        try:
            t = traced if k == 1 else c.trace(traced.fine, traced.ctx.recompute_choice)
            program = _build_placed(c, t, False)
        except MemoryBudgetError as e:
            weighed[k] = Weighed(_context_name(k), None, e.least_bytes)
            return
        except ShardingError:
            if k == 1:
                raise
            return  # a cut the calls cannot take (a `block` that does not divide its keys): not a candidate
        planned[k], weighed[k] = (c, t, program), Weighed(_context_name(k), search_report(program).seconds,
                                                          search_report(program).peak_bytes)

    for k in [*cuts[:1], 1, *cuts[1:]]:
        s.planning.candidate(f"context parallel {k}", bool(planned), lambda: weigh(k))

    def refused(k, e: MemoryBudgetError) -> None:
        weighed[k] = dataclasses.replace(weighed[k], seconds=None, peak_bytes=e.least_bytes)

    found = fastest_that_fits(planned, lambda k: search_report(planned[k][2]).seconds,
                              lambda k: placed(*planned[k][:2]), refused)
    if found is None:  # none fits without offload: the step as written, its state's placement weighed
        return placed(s.but(context_cut=1), traced)
    shown = tuple(dataclasses.replace(weighed[k], chosen=k == found[0]) for k in sorted(weighed))
    plan = found[1].plan
    report = dataclasses.replace(search_report(found[1]), context=shown, context_cut=found[0])
    return dataclasses.replace(found[1], plan=plan.replace(search=report))


def _context_name(k: int) -> str:
    return f"sequence {k}" + (" (no cut)" if k == 1 else "")


def _build_placed(s: Signature, traced: Traced, check: bool = True) -> Program:
    """Plans and builds with the state where `offload` puts it (`check`: as `build_traced`'s);
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
        return build_traced(s, traced, check=check)
    return s.planning.to_the_end(lambda: weigh_recompute(s, traced, check))


def _weigh_offload(s: Signature, traced: Traced) -> Program:  # noqa: C901  (the device first, the placements, those left out)
    """`mode="auto"` under a budget, no `offload=` given: plans the step with the state on the device;
    where the budget binds (the search gave up speed, or recompute, to fit it: `_binds`), plans it
    again with each of `SEARCHED` in host memory, each priced with its streaming
    (`CostModel.host_seconds`), and builds the fastest that fits (with `memory_budget` and devices
    present: whose compiled program fits), its `SearchReport.offload` listing what was weighed.
    A placement that cannot beat the plan on the device (`_offload_bounds`: the work split evenly
    over every device plus the least streaming, not below its seconds) is not planned unless the
    plan on the device fails its compiled check; `SearchReport.skipped` says so."""
    c, args = s.options, s.args
    assert s.budget is not None  # weighed only to meet a budget
    checked = c.memory_budget is not None and s.devices is not None
    weighed: dict[tuple[str, ...], Weighed] = {}
    planned: dict[tuple[str, ...], Program] = {}
    errors: dict[tuple[str, ...], MemoryBudgetError] = {}
    place = lambda what, check: _build_placed(s.but(offload=what), traced, check)
    choices, beaten, bounds = searched(traced, args, c), [], {}
    try:
        device = place((), False)
    except MemoryBudgetError as e:
        weighed[()], errors[()] = Weighed("none", None, e.least_bytes), e
    else:
        search = device.plan.search
        assert search is not None  # the search planned it
        weighed[()], planned[()] = Weighed("none", search.seconds, search.peak_bytes), device
        bounds = _offload_bounds(traced, args, c, choices)
        beaten = [what for what in choices if bounds[what][0] >= search.seconds]
        choices = [what for what in choices if what not in beaten]
        if not _binds(search) or not choices:  # on the device, unhindered (or no placement can beat it)
            try:
                program = place((), True) if checked else device
                if _binds(search):
                    s.planning.bounded(_bounded_note(beaten, bounds, search.seconds, traced.fine.device_count))
                return program
            except MemoryBudgetError as e:  # the placements weighed after all: the plan on the device does not fit
                weighed[()], errors[()] = Weighed("none", None, e.least_bytes), e
                del planned[()]
                choices, beaten = choices + beaten, []

    def planned_with(what: tuple[str, ...]) -> None:
        try:
            program = place(what, False)
        except MemoryBudgetError as e:
            weighed[what], errors[what] = Weighed(_offload_name(what), None, e.least_bytes), e
            return
        assert program.plan.offload is not None and program.plan.search is not None  # offloaded by the search
        host, search = program.plan.offload.seconds, program.plan.search
        weighed[what], planned[what] = Weighed(_offload_name(what), search.seconds + host, search.peak_bytes,
                                               host_seconds=host), program

    def weigh(what: tuple[str, ...]) -> None:
        s.planning.candidate(f"offload {_offload_name(what)}", bool(planned), lambda: planned_with(what))

    def refused(what, e: MemoryBudgetError) -> None:
        weighed[what], errors[what] = dataclasses.replace(weighed[what], seconds=None, peak_bytes=e.least_bytes), e

    for what in choices:
        weigh(what)
    built: dict[tuple[str, ...], Program] = {}
    found = fastest_that_fits(planned, lambda w: weighed[w].seconds,
                              lambda w: built.get(w) or (place(w, True) if checked else planned[w]), refused)
    if beaten and () in weighed and weighed[()].seconds is None:  # their bound beat only the plan on the device
        for what in beaten:
            weigh(what)
        if found is not None:
            built[found[0]] = found[1]  # built already: held to the budget again at no cost
        found = fastest_that_fits([w for w in planned if weighed[w].seconds is not None],
                                  lambda w: weighed[w].seconds,
                                  lambda w: built.get(w) or (place(w, True) if checked else planned[w]), refused)
    elif beaten:
        s.planning.bounded(_bounded_note(beaten, bounds, search_report(planned[()]).seconds, traced.fine.device_count))
    if found is not None:
        return _offload_chosen(found[1], found[0], weighed, s.budget, s.budget_from)
    least_peak = min((w.peak_bytes for w in weighed.values() if w.peak_bytes is not None), default=None)
    raise MemoryBudgetError(_offload_error(errors[()], weighed), least_peak) from None


def _offload_bounds(traced: Traced, args: tuple, c, choices: list) -> dict[tuple[str, ...], tuple[float, float, float]]:
    """Per placement of `choices`, the fewest seconds per step any plan with it takes: the step's
    work split evenly over every device with nothing communicated (`least_seconds`), plus its
    least streaming (`least_streamed`, on the host link): `(bound, work, streaming)`."""
    work, cost = least_seconds(traced, c.costs), c.costs
    least = {what: least_streamed(traced, args, c, what) for what in choices}  # each way: read and written back
    streaming = {what: cost.host_seconds(least[what], least[what]) for what in choices}
    return {what: (work + streaming[what], work, streaming[what]) for what in choices}


def _bounded_note(beaten: list, bounds: dict, seconds: float, n: int) -> str:
    """`SearchReport.skipped`'s line for the placements `_weigh_offload` did not plan: none can beat
    the plan on the device (`seconds`), by their `_offload_bounds`; empty where there are none."""
    if not beaten:
        return ""
    each = ", ".join(f"{_offload_name(what)} (at least {bounds[what][0] * 1e3:.4g} ms: the work split over {n} "
                     f"devices {bounds[what][1] * 1e3:.4g} ms, the least streaming {bounds[what][2] * 1e3:.4g} ms)"
                     for what in beaten)
    return (f"offload not weighed, no plan with it can beat the plan on the device "
            f"({seconds * 1e3:.4g} ms per step): {each}")


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
    divide: each candidate traced (the fusion alone changes no trace: `communication_read`) and
    searched, and the fastest by the search's predicted seconds built (held to the budget as every
    weighing is: `fastest_that_fits`); ties keep the plan as traced. Where nothing overlaps, copies
    and split all-reduces only add latency: they are weighed only where no one-copy plan fits the
    budget (each copy holds the activations of `1/n` of the batch). A copy count is traced but not searched
    where no plan of its trace can beat the fastest arrangement planned (`_beaten`). `Plan.communication`
    lists what was weighed and why one won; `SearchReport.skipped` what was not, and why."""
    cost = s.options.costs
    candidates: list[Communication | None] = [None, *([APART, *_copies(s)] if cost.overlap else [])]
    planned: dict[Any, tuple[Signature, Traced, Program]] = {}
    weighed: dict[Any, Weighed] = {}
    failed: MemoryBudgetError | None = None
    bounded: list[Communication | None] = []  # not searched: no plan of theirs can beat one planned (`_beaten`)

    def weigh(comm: Communication | None) -> None:
        if comm is None:
            planned_with(comm)
        else:
            s.planning.candidate(f"communication {_comm_name(comm)}", bool(planned), lambda: planned_with(comm))

    def planned_with(comm: Communication | None) -> None:
        nonlocal failed
        name = _comm_name(comm)
        c = s if comm is None else s.but(communication=comm)
        try:
            alike = communication_read(c.options) == communication_read(s.options)  # the all-reduce fusion alone
            t = traced if alike else c.trace(traced.fine, traced.ctx.recompute_choice)
            if _beaten(s, t, comm, planned, weighed, checked):
                bounded.append(comm)
                return
            program = _plan_regions(c, t, False)
        except MemoryBudgetError as e:
            failed = failed or e
            weighed[comm] = Weighed(name, None, e.least_bytes)
            return
        except ShardingError:
            if comm is None:
                raise
            return  # a copy count the step cannot take (its own accumulate steps, say): not a candidate
        planned[comm], weighed[comm] = (c, t, program), Weighed(name, search_report(program).seconds,
                                                                 search_report(program).peak_bytes)

    checked = check and s.options.memory_budget is not None and s.devices is not None
    for comm in candidates:
        weigh(comm)
    if None not in planned and not cost.overlap:  # memory may say otherwise: fewer activations per copy
        for comm in _copies(s):
            weigh(comm)

    def built(comm) -> Program:
        c, t, program = planned[comm]
        return _plan_regions(c, t, True) if checked else program

    def refused(comm, e: MemoryBudgetError) -> None:
        nonlocal failed
        failed = e
        weighed[comm] = dataclasses.replace(weighed[comm], seconds=None, peak_bytes=e.least_bytes)

    found = fastest_that_fits(planned, lambda k: search_report(planned[k][2]).seconds, built, refused)
    if found is None:
        assert failed is not None  # every candidate failed the budget (a failure of another kind is raised)
        raise failed
    return _communication_chosen(found[1], found[0], weighed, cost, bounded)


def _copies(s: Signature) -> list[Communication]:
    """`Communication(n)` for each of `COPIES` that divides every batch leaf's rows (with
    `accumulation=k`, each micro-batch's)."""
    k = 1 if s.options.accumulation is None else s.options.accumulation.steps
    leaves = jax.tree_util.tree_leaves(s.args)
    rows = [np.shape(leaves[i])[0] for i in batch_leaves(s.args, s.options) if np.ndim(leaves[i])]
    return [Communication(n) for n in COPIES if rows and all(r % (k * n) == 0 for r in rows)]


def _beaten(s: Signature, t: Traced, comm: Communication | None, planned: dict, weighed: dict, checked: bool) -> bool:
    """Whether no plan of arrangement `comm`'s trace `t` (copies, or the all-reduces apart) can beat
    the fastest arrangement planned so far, by its `least_step` bound (read before it is searched);
    where so, the planning's report says why it was not weighed. A bound within `BOUND_MARGIN` of
    that arrangement's seconds beats it by no more than the order of a float sum: ties keep the
    arrangement planned first, so it is not searched either. Not where the kept arrangement may
    fail its compiled check (`checked`), nor where `policy="auto"` regions are traced again per policy."""
    if comm is None or not planned or checked or t.ctx.auto_regions:
        return False
    best = min(planned, key=lambda k: weighed[k].seconds)
    least = least_step(t, s.options.costs)
    if least.seconds < weighed[best].seconds * (1 - BOUND_MARGIN):
        return False
    n = len(t.nodes)
    s.planning.bounded(f"{_comm_name(comm)} not weighed, no plan of it can beat {_comm_name(best)} "
                       f"({weighed[best].seconds * 1e6:.6g} us per step): each runs a collective (at least "
                       f"{least.latency * 1e6:.3g} us) or computes at least {least.compute * 1e6:.6g} us ({least.whole} "
                       f"of its {n} operators cut by none)")
    return True


BOUND_MARGIN = 1e-9
"""The share of the fastest arrangement's seconds a `least_step` bound must fall below for its
arrangement to be searched: the bound and the search sum the same seconds in another order, so a
plan within it ties (and ties keep the arrangement planned first)."""


def _comm_name(comm: Communication | None) -> str:
    if comm is None:
        return "copies=1, XLA's fusion"
    return f"copies={comm.copies}" if comm.fusion is None else f"copies={comm.copies}, allreduce size 0"


def _communication_chosen(program: Program, comm: Communication | None, weighed: dict, cost: CostModel,
                          bounded: Sequence[Communication | None] = ()) -> Program:
    """`program` with what the weighing weighed in its `CommunicationReport`, and why `comm` won
    (`bounded`: the arrangements not searched, their least step time no less)."""
    plan = program.plan
    shown = tuple(dataclasses.replace(w, chosen=k == comm) for k, w in weighed.items())
    fits = [w for w in shown if w.seconds is not None]
    device = cost.device or "this device kind"
    if not cost.overlap and len(weighed) == 1:
        why = (f"one copy: on {device} the cost model overlaps no collective with compute, so more copies and "
               f"all-reduces kept apart would only add latency")
    elif len(shown) == 1 and bounded:
        why = (f"{_comm_name(comm)}: no plan of {'; '.join(map(_comm_name, bounded))} can beat it, by their least "
               f"step time (a collective's latency, or the compute no cut splits; SearchReport.skipped)")
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


def _weigh_optimizer(s: Signature, traced: Traced, without: MemoryBudgetError, check: bool = True) -> Program:
    """With no `optimizer` given and no plan fitting the budget without it (`without`):
    plans each level 1-3 (the state, then the gradients, then the parameters cut over the
    data-parallel axes; the search prices the collectives and the memory) and builds the fastest
    that fits, the plan saying why (`OptimizerReport.why`, `SearchReport.optimizer`)."""
    assert s.budget is not None  # weighed only to meet a budget
    planned: dict[int, Program] = {}
    weighed: dict[int, Weighed] = {}
    leveled = lambda level: s.but(optimizer=OptimizerParallel(level))

    def weigh(level: int) -> None:
        try:
            program = _plan_signature(leveled(level), traced, False)
        except ShardingError as e:  # over the budget, or no data-parallel axis to cut over
            weighed[level] = Weighed(f"optimizer={level}", None, getattr(e, "least_bytes", None))
            return
        planned[level] = program
        weighed[level] = Weighed(f"optimizer={level}", search_report(program).seconds, search_report(program).peak_bytes)

    for level in OPTIMIZER_LEVELS:
        s.planning.candidate(f"optimizer={level}", bool(planned), lambda: weigh(level))
    checked = check and s.options.memory_budget is not None and s.devices is not None
    failed = without
    alike = {k for k, program in planned.items() if _cuts_nothing(program)}  # each one and the same program
    alike_failed: list[MemoryBudgetError] = []

    def held(level: int) -> Program:
        """The level's program held to the budget; a level that cuts nothing fails as the first such did."""
        if level in alike and alike_failed:
            raise alike_failed[0]
        try:
            return _plan_signature(leveled(level), traced, True) if checked else planned[level]
        except MemoryBudgetError as e:
            if level in alike:
                alike_failed.append(e)
            raise

    def refused(level: int, e: MemoryBudgetError) -> None:
        nonlocal failed
        failed = e
        weighed[level] = dataclasses.replace(weighed[level], seconds=None, peak_bytes=e.least_bytes)

    found = fastest_that_fits(planned, lambda k: search_report(planned[k]).seconds, held, refused)
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


def _cuts_nothing(program: Program) -> bool:
    """Whether an optimizer level's program cuts no leaf and reduce-scatters no gradient: then every
    level's build is the same (the same arguments' layouts, results laid out as the leaves they
    update, nothing gathered or reduce-scattered; only the report's level differs), so one held to
    the budget answers for all (nnx_gqa under 0.8x its unbudgeted peak: 3 compiles per level)."""
    report = program.plan.optimizer
    return report is not None and not report.leaves and not report.reduce_scattered


