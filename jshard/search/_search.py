"""Strategy search (`mode="auto"`): a strategy for every operator with no annotations.

`search(...)` builds the `SearchGraph` of a traced program, runs the recursive bisection or the ILP
over it and turns the choice into the engine's `Result`, so a searched plan is emitted, explained,
audited and saved exactly like a propagated one (its operators have `origin="searched"`). The
user's annotations (`shard` calls, `in_strategy`) stay as fixed units the search plans around.

The ILP hands out the mesh in two groups of axes (a 2-D logical mesh) and solves once per way to
split the mesh's axes in two (for 8 devices: 2×4 and 4×2; each also covers the 1-D 8), keeping the
cheaper; the recursive search hands out one axis per level.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from jshard._errors import MemoryBudgetError, ShardingError
from jshard._format import human_bytes, var_str
from jshard.cost import CostModel, LiveRanges, value_bytes
from jshard.graph import Node
from jshard.propagate import Result
from jshard.rules import OpTable
from jshard.search import _chains, _ilp, _recursive, _seeded
from jshard.search._assemble import assemble
from jshard.search._graph import REPLICATED_SHARE, Infeasible, SearchGraph, Solved
from jshard.search._regions import RegionChoice, finest_cut
from jshard.search._shared import Reused
from jshard.search._units import Assignment

SEARCHES = ("recursive", "ilp", "propagation")
_TOP_TENSORS = 5
MEASURABLY = 0.1
"""Under a budget, a plan that leaves every device (nearly) the whole work (`REPLICATED_SHARE`) is
kept over the data-parallel plan only where it predicts at least this share less (`_split`)."""


@dataclasses.dataclass(frozen=True)
class Weighed:
    """One choice the search weighed: a recompute policy for `jshard.recompute(policy="auto")`
    regions (`SearchReport.recompute`), an optimizer-parallel level (`SearchReport.optimizer`), or
    the state kept in host memory (`SearchReport.offload`), or a sequence cut of `jshard.attention`
    calls without a strategy (`SearchReport.context`).

    Attributes:
      policy: the recompute policy (`"none"`, `"selective"`, `"full"`), `"optimizer=<level>"`,
        or the offloaded roles (`"none"`, `"optimizer"`, `"optimizer+parameters"`).
      seconds: its plan's predicted seconds per call, or None where no plan fits the budget.
      peak_bytes: its plan's estimated peak per device, or (no plan) the least the search estimated.
      chosen: whether the program uses it.
      host_seconds: of `seconds`, the state streamed between host and device memory per call
        (`CostModel.host_seconds`).
    """

    policy: str
    seconds: float | None
    peak_bytes: float | None
    chosen: bool = False
    host_seconds: float = 0.0

    def text(self) -> str:
        peak = "?" if self.peak_bytes is None else human_bytes(self.peak_bytes)
        if self.seconds is None:
            return f"{self.policy}: no plan fits (least peak {peak})"
        host = f" ({_time(self.host_seconds)} host<->device)" if self.host_seconds else ""
        return f"{self.policy}: {_time(self.seconds)}{host}, peak {peak}" + (" (chosen)" if self.chosen else "")


def _time(seconds: float) -> str:
    return f"{seconds:.4g} s" if seconds >= 1 else f"{seconds * 1e3:.4g} ms"


@dataclasses.dataclass(frozen=True)
class SearchReport:
    """How a searched plan was found.

    Attributes:
      search: `"recursive"` or `"ilp"`.
      status: how the search ended (`optimal`, a time limit with the best solution found, or the
        memory weight the recursive search needed to fit the budget).
      seconds: the plan's predicted cost per call (collectives and compute, α–β).
      peak_bytes: the plan's estimated per-device memory at its peak program point.
      budget: the memory budget per device, or None.
      mesh: how the search handed out the mesh (`"2×4"`, or the recursive levels `"2·2·2"`).
      units / candidates: the decisions and the candidate strategies they chose among.
      planning_seconds: the search's own time.
      compiled_peak_bytes: with a budget and devices present, what the compiled program holds per
        device (XLA's memory analysis), else None.
      compile_seconds: with them, the seconds XLA took to compile that program, else None: its
        executable is the one calls run (`Program.compiled`), the compile a first call would make,
        so it is part of planning's time but not planning's own work.
      budget_from: where the budget came from: `"memory_budget"`, or the device whose memory it is
        (`parallelize` without `memory_budget`).
      unit_classes: the recursive search's distinct units of the heuristic core, summed over its
        levels and runs: units of identical layers (the same costs and redistribution tables) are
        one class, so it does not grow with an unrolled loop's depth. None for the ILP.
      evaluations: the recursive search's cost evaluations in the core (a unit's cost per candidate
        against its neighbours' picks, a pair's joint move), each computed once per class and picks,
        summed over its levels and runs; does not grow with an unrolled loop's depth. None for the ILP.
      runs: the recursive search's runs, each a descent at one memory weight (without a budget one or
        two; under one that binds, its growth and bisection). None for the ILP.
      recompute: with `jshard.recompute(policy="auto")` regions, each policy weighed for all of
        them at once (`Weighed`).
      regions: with such regions, the policy each got (`RegionChoice`): the least recompute whose
        estimated peak fits the budget, moves chosen by bytes saved per second of recompute.
      optimizer: where `optimizer_parallel` was not given and no plan without it fit the budget,
        each level weighed (`Weighed`, policy `"optimizer=<level>"`).
      offload: where the budget binds and the user gave no `offload=`, each placement of the state
        weighed (`Weighed`: on the device, the optimizer state in host memory, and the parameters
        too), its seconds with the streaming priced on the host link.
      kept: the ILP's: which plan it kept (its own, or its warm start) and why.
      seeds: under a budget, the seeds (`_seeded.seeds`: the plan propagated from the anchors, the
        data-parallel and fully-sharded plans around them) as made but the plan returned, cheapest
        first: `(status, predicted seconds per call)`. Where one predicts less than the plan but its
        estimated peak is over the budget, or the plan's compiled program is over it, `parallelize`
        compiles them in this order and keeps the first whose compiled program fits (the estimate
        keeps activations XLA may fuse away, and misses buffers XLA adds).
      searches: the searches planning this signature ran (every weighing's candidates; those a
        weighing asked for again were reused, not searched again), 0 where not counted.
      context: where `mode="auto"` steps call `jshard.attention` without a strategy over keys past
        one tile, each sequence cut weighed for those calls (`Weighed`: no cut, and context
        parallel over 2, 4, ... devices); `context_cut` the cut chosen (1: none), else None.
      skipped: one line where `Search.time_limit`, which bounds the whole of planning, stopped it:
        the candidates the weighings left out (those stopped while planned say so), and, where the
        planning passed the limit (no plan was complete before it), by how much; and one line per
        weighing that left candidates out because none could beat its plan; or nothing.
    """

    search: str
    status: str
    seconds: float
    peak_bytes: float
    budget: float | None
    mesh: str
    units: int
    candidates: int
    planning_seconds: float
    compiled_peak_bytes: float | None = None
    compile_seconds: float | None = None
    budget_from: str = "memory_budget"
    recompute: tuple[Weighed, ...] = ()
    unit_classes: int | None = None
    evaluations: int | None = None
    runs: int | None = None
    regions: tuple[RegionChoice, ...] = ()
    optimizer: tuple[Weighed, ...] = ()
    offload: tuple[Weighed, ...] = ()
    kept: str = ""
    seeds: tuple[tuple[str, float], ...] = ()
    searches: int = 0
    skipped: tuple[str, ...] = ()
    context: tuple[Weighed, ...] = ()
    context_cut: int | None = None

    @property
    def held_bytes(self) -> float:
        """What the plan holds per device, as far as known: the compiled program's peak where it was
        compiled (`compiled_peak_bytes`), else the search's estimate (`peak_bytes`)."""
        return self.peak_bytes if self.compiled_peak_bytes is None else self.compiled_peak_bytes

    def context_line(self) -> str | None:
        """`Plan.summary`'s line on the sequence cuts weighed (`context`), None where none was."""
        if not self.context:
            return None
        return "context parallel weighed for jshard.attention without a strategy: " + "; ".join(
            w.text() for w in self.context
        )

    def line(self) -> str:
        budget = "no memory budget" if self.budget is None else f"budget {human_bytes(self.budget)}"
        if self.budget is not None and self.budget_from != "memory_budget":
            budget += f" ({self.budget_from})"
        if self.budget is not None and self.held_bytes > self.budget:
            budget += " (over: the plan does not fit)"
        weighed = (
            ""
            if self.unit_classes is None
            else (f" ({self.unit_classes} unit classes, {self.evaluations} cost evaluations)")
        )
        return (
            f"search={self.search} over mesh {self.mesh}: {self.status}; {self.units} decisions among "
            f"{self.candidates} candidates{weighed} in {self.planning_seconds:.2f} s; predicted "
            f"{self.seconds * 1e6:.6g} us per call; estimated peak {human_bytes(self.peak_bytes)} per device, {budget}"
            + ("" if self.compiled_peak_bytes is None else f"; compiled {human_bytes(self.compiled_peak_bytes)}")
            + ("" if not self.recompute else "; recompute weighed: " + ", ".join(w.text() for w in self.recompute))
            + ("" if not self.regions else "; recompute per region: " + ", ".join(r.text() for r in self.regions))
            + (
                ""
                if not self.optimizer
                else "; optimizer parallel weighed: " + ", ".join(w.text() for w in self.optimizer)
            )
            + ("" if not self.offload else "; offload weighed: " + ", ".join(w.text() for w in self.offload))
            + ("" if not self.kept else f"; kept {self.kept}")
            + ("" if not self.searches else f"; {self.searches} searches in all")
            + "".join(f"; {line}" for line in self.skipped)
        )


def search(  # noqa: PLR0913  (the search's inputs and the options it reads, one keyword each)
    nodes: Sequence[Node],
    args: Sequence,
    outvars: Sequence,
    fixed: Mapping,
    axis_size: Mapping[str, int],
    *,
    how: str,
    cost: CostModel | None = None,
    budget: float | None = None,
    donated: frozenset = frozenset(),
    host: frozenset = frozenset(),
    names: Mapping | None = None,
    call: str = "jshard.parallelize",
    time_limit: float = 60.0,
    replay: bool = True,
    table: OpTable | None = None,
    batch: Sequence = (),
    seeded: bool = True,
    as_seeded: str | None = None,
    compiled: bool = False,
    combined: bool = True,
    passed: Callable[[], bool] | None = None,
    check: Callable[[], None] | None = None,
    memo: _seeded.Memo | None = None,
    ranges: LiveRanges | None = None,
) -> tuple[Result, SearchReport]:
    """Searches a strategy for every operator of `nodes`; see the module docstring.

    Args:
      nodes: the flattened program.
      args: its arguments (jaxpr invars and constvars).
      outvars: its results.
      fixed: argument var -> `Spec` the user fixed.
      axis_size: the fine mesh, major to minor.
      how: `"recursive"` or `"ilp"`.
      budget: bytes per device the plan must fit, or None.
      donated: arguments whose buffers the results reuse.
      host: arguments and results kept in host memory between steps (on the device only while the
        step uses them).
      names: var -> a name for errors (an argument's pytree path).
      replay: the recursive search decides the interior layers of a repeated run as one, then
        improves that unit by unit (`Search(replay=...)`).
      table: the nodes' `OpTable`, where one is at hand.
      batch: the batch arguments (the data-parallel and fully-sharded seeds cut their rows).
      seeded: weigh the seeds too (`_seeded.seeds`), each kept where it predicts less than the
        search's plan and fits the budget (moved to fit it where it does not: `_seeded.fit_budget`).
      as_seeded: return the seed of this status (`SearchReport.seeds`) as made, without searching
        (for its compiled program to be held to the budget), or None.
      compiled: the caller compiles the plan and holds its compiled program to `budget`: where no
        plan fits the search's estimate, the cheapest seed is returned as made (its compiled
        program decides) rather than none.
      combined: XLA's all-reduce combiner runs (`SearchGraph.combined_latency`); False where the
        program is compiled with it off (multi-copy, an all-reduce fusion threshold of 0).
      passed: whether the planning's deadline (`Search.time_limit`) has passed: the recursive
        search then makes no further run once it has a plan that fits (`_recursive.solve`).
      check: read between the search's units of work (a seed's moves, the recursive search's
        levels): raises, out of the search, where the planning stops it (`Planning.check`).
      memo: where the seeds' propagations and the recursive search's run at memory weight 0
        (`_unweighed`) are kept across the searches of one planning session (`_seeded.Memo`), or None.
      ranges: the program's `cost.live_ranges` for these arguments, donated and host-kept ones
        (with `rules.FUSION`), where made already (`compile.Traced.live_ranges`); None: made here.

    Raises:
      MemoryBudgetError: nothing the search can find fits `budget` (and, with `compiled`, there is
        no seed).
    """
    start = time.perf_counter()
    g = SearchGraph(nodes, args, outvars, fixed, axis_size, cost, donated, host, table, combined, ranges)
    axes = [(a,) for a, n in axis_size.items() if n > 1]
    least = budget is not None and _least_peak(g) > budget
    if least and (not compiled or _boundary_peak(g) > budget):  # nothing can fit: say so before searching
        raise _too_big(g, budget, names or {}, call, how)
    made = (
        _seeded.seeds(g, args, outvars, fixed, batch, budget, only=as_seeded, memo=memo)
        if (seeded or as_seeded is not None) and how in SEARCHES[:2]
        else []
    )
    # the seeds moved to fit the budget, where the search weighs them (not as made, nor where nothing fits)
    fitted = (
        []
        if as_seeded is not None or least
        else [s for s in (_seeded.fit_budget(g, raw, budget, check) for raw in made) if s is not None]
    )
    seed = min(fitted, key=lambda s: s.seconds, default=None)
    mesh_text, kept = "·".join(str(axis_size[a]) for (a,) in axes) or "1", ""
    candidates = g.candidate_count(axes[:1])
    if as_seeded is not None:
        solved = _as_made({s.status: s for s in made}[as_seeded], "its compiled program decides")
    elif least:
        solved = _unfitted(made if compiled else [], _too_big(g, budget, names or {}, call, how))
    elif how == "recursive":
        try:
            solved = _better(
                _recursive.solve(
                    g,
                    axes,
                    budget,
                    replay,
                    passed,
                    check,
                    _unweighed(memo, g, fixed, replay),
                    _reused(memo, g, fixed, replay),
                    None if seed is None else (seed.seconds, seed.peak),
                ),
                seed,
            )
        except Infeasible:
            solved = (
                _unfitted(made if compiled else [], _too_big(g, budget, names or {}, call, how))
                if seed is None
                else dataclasses.replace(
                    seed, status=f"{seed.status}: the recursive search found none under the budget"
                )
            )
    elif how == "ilp":
        solved, groups, kept = _ilp_or_warm(g, axes, budget, time_limit, seed, passed, check)
        if solved is None:
            solved = _unfitted(made if compiled else [], _too_big(g, budget, names or {}, call, how))
        elif groups is not None:
            mesh_text = "×".join(str(math.prod(axis_size[a] for a in grp)) for grp in groups) or "1"
            candidates = g.candidate_count(groups)
    else:
        raise ShardingError(f"{call}: search={how!r} is not one of {SEARCHES}.")
    if as_seeded is None and not least:  # each free argument's chain moved whole to a seed's layouts, where faster
        solved = _chains.moved(g, solved, made, budget, check)
    if budget is not None and as_seeded is None:
        solved = _split(g, solved, next((s for s in fitted if s.status.startswith(_seeded.DATA_PARALLEL)), None))
    choice, seconds, peak, status = solved.choice, solved.seconds, solved.peak, solved.status
    result = assemble(g, choice)
    others = () if budget is None or as_seeded is not None else _others(made, choice)
    report = SearchReport(
        how,
        status,
        seconds,
        peak,
        budget,
        mesh_text,
        sum(u.free for u in g.units),
        candidates,
        time.perf_counter() - start,
        unit_classes=solved.unit_classes,
        evaluations=solved.evaluations,
        runs=solved.runs,
        kept=kept,
        seeds=others,
    )
    return result, report


def _others(made: Sequence[Solved], choice: Sequence[Assignment]) -> tuple[tuple[str, float], ...]:
    """`SearchReport.seeds`: the seeds of `made` as `(status, seconds)`, cheapest first, but those
    that choose as `choice` (the plan returned) or as a seed before them."""
    out, seen = [], [choice]
    for s in sorted(made, key=lambda s: s.seconds):
        if s.choice not in seen:
            out.append((s.status, s.seconds))
            seen.append(s.choice)
    return tuple(out)


def _as_made(seed: Solved, why: str) -> Solved:
    """`seed` (one of `_seeded.seeds`) as made, whatever its estimated peak, and `why`."""
    return dataclasses.replace(seed, status=f"{seed.status}, as made: {why} (estimated peak {human_bytes(seed.peak)})")


def _unfitted(made: Sequence[Solved], error: MemoryBudgetError) -> Solved:
    """Where no plan fits the search's estimate of the budget: the cheapest seed of `made` as made
    (with `search(compiled=True)`: its compiled program decides); raises `error` where there is none."""
    if not made:
        raise error
    return _as_made(
        min(made, key=lambda s: s.seconds), "no plan fits the search's estimate, its compiled program decides"
    )


def _better(solved: Solved, seed: Solved | None) -> Solved:
    """The recursive search's plan, or the cheapest seed that fits the budget (`seed`) where that
    predicts fewer seconds; both priced by `SearchGraph.seconds`."""
    if seed is None or seed.seconds >= solved.seconds:
        return solved
    return dataclasses.replace(
        seed,
        status=f"{seed.status}: it predicts {_time(seed.seconds)} per call, the recursive "
        f"search's plan {_time(solved.seconds)} ({solved.status})",
        unit_classes=solved.unit_classes,
        evaluations=solved.evaluations,
        runs=solved.runs,
    )


def _split(g: SearchGraph, solved: Solved, data: Solved | None) -> Solved:
    """`solved`, or the data-parallel seed (`data`, fitted to the budget) where `solved` leaves every
    device (nearly) the whole work (`REPLICATED_SHARE`) and predicts less than `MEASURABLY` less: a
    plan that computes the whole batch on every device is kept only where that is measurably faster
    (the plan's `WorkReport` then says why in one line)."""
    if data is None or data.choice == solved.choice or solved.seconds <= data.seconds * (1 - MEASURABLY):
        return solved
    share = g.work_share(solved.choice)
    if share < REPLICATED_SHARE:
        return solved
    return dataclasses.replace(
        data,
        status=(
            f"{data.status}: the search's plan ({solved.status}) leaves each device {share:.0%} of the work and predicts "
            f"{_time(solved.seconds)} per call against its {_time(data.seconds)}, less than {MEASURABLY:.0%} faster"
        ),
        unit_classes=solved.unit_classes,
        evaluations=solved.evaluations,
        runs=solved.runs,
    )


def _ilp_or_warm(
    g: SearchGraph,
    axes: list,
    budget: float | None,
    time_limit: float,
    seed: Solved | None = None,
    passed: Callable[[], bool] | None = None,
    check: Callable[[], None] | None = None,
) -> tuple[Solved | None, list | None, str]:
    """The ILP's plan, never worse than the recursive search's: the recursive plan is found first
    (the warm start; the cheapest seed that fits, `seed`, where that predicts less), the
    ILP solved once per split of the mesh into two groups, and the warm start kept where every ILP
    plan predicts more seconds, or none fits within the time limit. All are priced by one measure
    (`SearchGraph.seconds`). Returns the plan kept, the ILP's groups (None: the recursive plan's
    levels) and why it was kept (`SearchReport.kept`). `time_limit` bounds the ILP's splits together
    (what is left of planning's time limit: a split starts only while some is left); `passed` and
    `check` are the warm start's (`_recursive.solve`), `check` read before each split too."""
    end = time.perf_counter() + time_limit
    try:
        warm = _recursive.solve(g, axes, budget, passed=passed, check=check)
        warm = _better(dataclasses.replace(warm, seconds=g.seconds(warm.choice)), seed)
    except Infeasible:
        warm = seed
    best, splits, failed = None, _splits(axes), []
    for n, groups in enumerate(splits):
        if check is not None:
            check()
        left = end - time.perf_counter()
        if left <= 0:
            failed.append(f"the time limit passed before {len(splits) - n} of {len(splits)} splits of the mesh")
            break
        try:
            solved = _ilp.solve(g, groups, budget, left / (len(splits) - n))
        except Infeasible as e:
            failed.append(str(e))
            continue
        solved = dataclasses.replace(solved, seconds=g.seconds(solved.choice))
        if best is None or solved.seconds < best[0].seconds:
            best = (solved, groups)
    if best is None:
        if warm is None:
            return None, None, ""
        why = "; ".join(dict.fromkeys(failed)) or "no split"
        return (
            dataclasses.replace(warm, status=f"the recursive search's plan ({warm.status})"),
            None,
            f"the recursive plan (the warm start): the ILP found none{' under the budget' if budget else ''} ({why})",
        )
    solved, groups = best
    if warm is not None and warm.seconds < solved.seconds:
        return (
            dataclasses.replace(warm, status=f"the recursive search's plan ({warm.status})"),
            None,
            f"the recursive plan (the warm start): it predicts {_time(warm.seconds)} per call, the ILP's "
            f"best {_time(solved.seconds)} ({solved.status})",
        )
    if warm is None:
        return solved, groups, "the ILP's plan: the recursive search found none under the budget"
    return (
        solved,
        groups,
        (
            f"the ILP's plan: it predicts {_time(solved.seconds)} per call, the recursive "
            f"plan (the warm start) {_time(warm.seconds)}"
        ),
    )


def _splits(axes: list) -> list[list[tuple[str, ...]]]:
    """The ways to hand the mesh out as two groups of consecutive axes (one group for one axis)."""
    names = [a for (a,) in axes]
    if len(names) <= 1:
        return [[tuple(names)]] if names else [[]]
    return [[tuple(names[:s]), tuple(names[s:])] for s in range(1, len(names))]


def _unweighed(memo: _seeded.Memo | None, g: SearchGraph, fixed: Mapping, replay: bool) -> Callable | None:
    """The recursive search's store of its run at λ = 0 (`_recursive.solve`'s `unweighed`), through
    `memo` where there is one: keyed by what that run's costs read (the program's nodes, by identity,
    held meanwhile, its mesh, the layouts fixed, replay, the combiner; the session's one cost model),
    not the memory model, which weighs nothing at λ = 0. Replay's classes read the values held at
    the replicated plan's peak, which the memory model places: the run kept is the first search's,
    classed on its peak (on table 2b's models each placement's own run made the same plan)."""
    if memo is None:
        return None
    key = ("unweighed", id(g.nodes), tuple(g.axis_size.items()), frozenset(fixed.items()), replay, g.combinable)
    return lambda make: memo(key, make, g.nodes)


def _reused(memo: _seeded.Memo | None, g: SearchGraph, fixed: Mapping, replay: bool) -> Reused | None:
    """The recursive search's tables and shared levels (`_recursive.solve`'s `reused`), held through
    `memo` for the searches of one program whose graphs differ in their memory model only, on the
    key of `_unweighed` (none of it reads the memory model). On table 2b's GPT scan under 0.8 times
    its unbudgeted peak, the placements of the state weighed make three searches of one program."""
    if memo is None:
        return None
    key = ("reused", id(g.nodes), tuple(g.axis_size.items()), frozenset(fixed.items()), replay, g.combinable)
    return memo(key, Reused, g.nodes)


def _least(g: SearchGraph) -> dict:
    """Each memory value's bytes per device, cut as finely as its dims allow."""
    return {v: value_bytes(v) / finest_cut(v.aval.shape, g.axis_size) for v in g.memory_values}


def _boundary(g: SearchGraph, least: Mapping) -> dict:
    """Of `least` (memory value -> bytes), the arguments and results."""
    return {v: b for v, b in least.items() if v in g.arg_unit or g.last.get(v) == g.end}


def _boundary_peak(g: SearchGraph) -> float:
    """A lower bound on every compiled program's peak: the arguments and results held at once, each
    cut as finely as its dims allow."""
    return float(g.live_bytes(_boundary(g, _least(g))).max())


def _least_peak(g: SearchGraph) -> float:
    """A lower bound on every plan's estimated peak: each value held cut as finely as its dims allow."""
    return float(g.live_bytes(_least(g)).max())


def _too_big(g: SearchGraph, budget: float, names: Mapping, call: str, how: str) -> MemoryBudgetError:
    """Why no plan fits: the least the arguments and results need (a true lower bound: each cut as
    finely as its dims allow), the search's own least estimate with the activations kept between
    operators, what is missing and the tensors that dominate."""
    least = _least(g)
    boundary = _boundary(g, least)
    bound = g.live_bytes(boundary)
    live = g.live_bytes(least)
    n = math.prod(g.axis_size.values())
    head = f"{call}: memory_budget={human_bytes(budget)} per device cannot be met on {n} devices (search={how!r}): "
    if bound.max() > budget:
        t = int(np.argmax(bound))
        why = (
            f"the arguments and results alone, each cut as finely as its dims allow, hold {human_bytes(bound[t])} "
            f"per device at once ({human_bytes(bound[t] - budget)} missing)."
        )
        shown = boundary
    else:
        t = int(np.argmax(live))
        why = (
            f"the search found no plan under it. With every tensor cut as finely as its dims allow, it estimates "
            f"{human_bytes(live[t])} per device live at {_where(g, t)} ({human_bytes(max(live[t] - budget, 0))} over; the "
            f"arguments and results alone need {human_bytes(bound.max())}; the estimate counts activations the "
            f"backward pass keeps, which XLA may fuse away)."
        )
        shown = least
    top = sorted((v for v in g.live_at(t) if v in shown), key=lambda v: shown[v], reverse=True)[:_TOP_TENSORS]
    rows = "; ".join(
        f"{_name(g, v, names)} {var_str(v, short=False)} ({human_bytes(least[v])} per device at best)" for v in top
    )
    return MemoryBudgetError(
        head + why + f" Largest: {rows}. Raise memory_budget, use more devices, donate the "
        f"state (donate_argnums), shrink the batch, or recompute the layers in the backward "
        f"pass (jshard.recompute(layer, policy='auto')).",
        float(live.max()),
        bound=True,
    )


def _name(g: SearchGraph, v, names: Mapping) -> str:
    if v in names:
        return names[v]
    k, _ = g.makers[v]
    node = g.nodes[g.units[k].node] if g.units[k].node >= 0 else None
    return "a value" if node is None else f"the {node.primitive} result at {node.source or 'no source'}"


def _where(g: SearchGraph, t: int) -> str:
    if t >= len(g.nodes):
        return "the end of the program"
    node = g.nodes[t]
    return f"{node.primitive} ({node.source or 'no source'})"
