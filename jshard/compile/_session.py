"""One signature's planning as a whole: its deadline and the plans already made.

`Search(time_limit=...)` bounds the whole of planning one signature, not each search: one clock,
started when `compile.build` meets the signature (before it traces), is read by every stage. A
pipeline plans each of its stages through `compile.build` in a session of its own on the step's
one deadline (`Planning.sharing`), started when the pipeline meets the signature. The
weighings (sequence cuts, offload placements, optimizer levels, communication, recompute policies,
the seeds' compiled checks) each search again, and each asks the `Planning` session first.
`Planning.plan` makes a planner's answer to a `Problem` once: a weighing that asks again for a
problem already planned (the unconstrained plan, the same placement planned and then held to the
budget) reuses it.

Past the deadline a weighing plans no further candidate once one fits; a candidate planned while
the weighing holds one that fits already is stopped where the deadline passes (`Planning.check`,
read by the search between its runs, levels and moves, and by the stages between traces and
searches), and what it made is dropped: the plan kept is always one built whole. The deadline
keeps back time for what follows the last check (`Deadline.reserve`: the kept plan built and
priced), measured on this planning's own builds. Where no plan is complete when it passes, the
first to complete is kept and the report says by how much the limit was passed. The plan names what
was left out (`SearchReport.skipped`); where the candidates it kept then fail the compiled check, it
weighs again with every candidate (`Planning.to_the_end`: a plan found beats the time limit); an ILP
search gets at most half the time left (`Planning.time_left`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, TypeVar

from jshard._errors import MemoryBudgetError
from jshard.compile._planners import Planned, Planner, Problem

T = TypeVar("T")

ILP_SHARE = 0.5
"""The share of the planning's time left that one ILP search may take (`Planning.time_left`)."""

RESERVE_FACTOR = 3
"""The time a deadline keeps back for what follows its last check, in the longest tail measured
(`Planning.built`: a candidate's work from its last check to its program built, or compiled): the
search stopped finishing its unit of work, the kept plan built again, its records priced and the
session released."""


class Stopped(Exception):
    """The deadline passed while a candidate was planned that its weighing may leave out
    (`Planning.check`); the weighing drops it (`Planning.candidate`)."""


@dataclasses.dataclass
class Deadline:
    """When planning one signature must end: `seconds` after it began, on `clock`.

    Attributes:
      seconds: the time limit (`Search.time_limit`).
      clock: seconds from a fixed point (`time.monotonic`; tests give a deterministic one).
      reserve: the seconds kept back for what follows the last check (`Planning.built`).
    """

    seconds: float
    clock: Callable[[], float] = time.monotonic
    start: float = dataclasses.field(init=False)
    reserve: float = 0.0

    def __post_init__(self) -> None:
        self.start = self.clock()

    def left(self) -> float:
        """Seconds left before the deadline (0 once it has passed)."""
        return max(self.seconds - self.elapsed(), 0.0)

    def elapsed(self) -> float:
        """Seconds since the planning began."""
        return self.clock() - self.start

    @property
    def passed(self) -> bool:
        """Whether no further work may start: no more than `reserve` is left."""
        return self.left() <= self.reserve


@dataclasses.dataclass
class Planning:
    """The session of one signature's planning (`compile.build` makes one per signature).

    Attributes:
      deadline: when planning ends (`Search.time_limit` after it began).
      searches: the planner runs made (each a search where the search plans).
      reused: the answers taken from an earlier run of the same problem.
      skipped: the candidates a weighing left out past the deadline, one line each (those stopped
        while planned say so).
      forced: every candidate is weighed, deadline or not (`to_the_end`).
      passed_over: the candidates a weighing did not plan because none could beat the plan it kept
        (a lower bound of their seconds over its predicted seconds), one line per weighing.
      completed: when the first candidate's program was built (`Deadline.elapsed`), None before.
    """

    deadline: Deadline
    searches: int = 0
    reused: int = 0
    skipped: list[str] = dataclasses.field(default_factory=list)
    forced: bool = False
    passed_over: list[str] = dataclasses.field(default_factory=list)
    completed: float | None = None
    _made: dict = dataclasses.field(default_factory=dict, repr=False)
    _checked: float = -float("inf")  # when `check` was last read, on the deadline's clock
    _tail: float = 0.0  # the longest tail `built` measured
    _optional: int = 0  # candidates being planned that their weighing may drop (`candidate`)

    @classmethod
    def of(cls, time_limit: float, clock: Callable[[], float] | None = None) -> Planning:
        return cls(Deadline(time_limit) if clock is None else Deadline(time_limit, clock))

    def sharing(self) -> Planning:
        """A session of its own (searches, notes, plans made) on this one's deadline: a part of one
        planning planned apart (a pipeline's stage, `compile.build` once each), so that the time
        limit bounds the whole and not each part."""
        return Planning(self.deadline)

    def time_left(self, limit: float) -> float:
        """The time a search (the ILP) may take: `limit`, or less where the deadline comes first, and at
        most `ILP_SHARE` of what is left (the weighings and checks after it need some)."""
        return min(limit, ILP_SHARE * max(self.deadline.left() - self.deadline.reserve, 0.0))

    def check(self) -> None:
        """Read between units of work (the search's runs, levels and moves, a stage's traces and
        searches): raises `Stopped` where the deadline has passed and what is planned now is a
        candidate its weighing may leave out (it holds one that fits: `candidate`)."""
        self._checked = self.deadline.clock()
        if self._optional and not self.forced and self.deadline.passed:
            raise Stopped

    def candidate(self, what: str, fits: bool, make: Callable[[], T]) -> T | None:
        """`make()`, a weighing's candidate `what` planned, or None where the deadline leaves it out:
        before it starts (`weighs`), or, where the weighing holds one that fits already (`fits`),
        while it is planned (`check`: what it made is dropped, the line says it was stopped)."""
        if not self.weighs(what, fits):
            return None
        if not fits or self.forced:
            return make()
        self._optional += 1
        try:
            return make()
        except Stopped:
            self.skipped.append(f"{what} (stopped while planned)")
            return None
        finally:
            self._optional -= 1

    def built(self, since: float) -> None:
        """A candidate's program was built, or compiled, by work begun at `since` (on the deadline's
        clock): its tail, from the later of `since` and the last check to now, measured, the deadline
        keeps back `RESERVE_FACTOR` times the longest tail for what follows its last check (the
        longest any session on it measured: `sharing`)."""
        now = self.deadline.clock()
        self._tail = max(self._tail, now - max(since, self._checked))
        self.deadline.reserve = max(self.deadline.reserve, RESERVE_FACTOR * self._tail)
        if self.completed is None:
            self.completed = now - self.deadline.start

    def plan(self, planner: Planner, problem: Problem) -> Planned:
        """`planner`'s answer to `problem`, made once per session (a raised error is raised again, but
        `Stopped`: the problem is planned afresh where asked again); a planner that reads nothing but
        `problem` and its `options` (the search, propagation)."""
        if not hasattr(planner, "options"):  # Shardy's (nothing to make) or a loaded plan's (read once)
            return planner.plan(problem)
        key = (_planner_key(planner), _problem_key(problem))
        found = self._made.get(key)
        if found is not None:
            self.reused += 1
            answer, error, _ = found
            if error is not None:
                raise error
            return answer
        self.searches += 1
        try:
            answer = planner.plan(problem)
        except Stopped:
            raise
        except Exception as e:
            self._made[key] = (None, e, problem.traced)  # the traced program held: its id stays its own
            raise
        self._made[key] = (answer, None, problem.traced)
        return answer

    def kept(self, key: Any, make: Callable[[], T], holds: Any = None) -> T:
        """`make()`, made once per session per `key` (`holds`: what ids in `key` stand for, held so
        that they stay theirs)."""
        found = self._made.get(key)
        if found is None:
            found = self._made[key] = (make(), None, holds)
        return found[0]

    def weighs(self, what: str, fits: bool) -> bool:
        """Whether a weighing plans its candidate `what`: always before the deadline, and after it
        only while none it planned fits (`fits`: one does); a candidate left out is recorded."""
        if self.forced or not fits or not self.deadline.passed:
            return True
        self.skipped.append(what)
        return False

    def bounded(self, line: str) -> None:
        """Records `line` (`passed_over`), where there is one: candidates a weighing left out because
        none could beat the plan it kept."""
        if line and line not in self.passed_over:
            self.passed_over.append(line)

    def to_the_end(self, weigh: Callable[[], T]) -> T:
        """`weigh()` (a weighing); where it finds nothing that fits after leaving candidates out past
        the deadline, `weigh()` again with every candidate weighed (the searches made are reused)."""
        before = len(self.skipped)
        try:
            return weigh()
        except MemoryBudgetError:
            if self.forced or len(self.skipped) == before:
                raise
        del self.skipped[before:]  # weighed now
        self.forced = True
        try:
            return weigh()
        finally:
            self.forced = False

    def note(self) -> tuple[str, ...]:
        """`SearchReport.skipped`: what the weighings left out, and why, and by how much the planning
        passed its time limit where it did, or nothing."""
        late = self._late()
        return (*((late,) if late else ()), *self.passed_over)

    def _late(self) -> str:
        """The line on the time limit: what it left out, where it was passed and by how much."""
        over = self.deadline.elapsed() - self.deadline.seconds
        left_out = ", ".join(dict.fromkeys(self.skipped))
        if not left_out and over <= 0:
            return ""
        line = f"the time limit ({self.deadline.seconds:g} s, search_time_limit)"
        if over <= 0:
            return f"{line} stopped the planning: not weighed: {left_out}"
        why = ("no plan was complete before it, the first complete one kept"
               if self.completed is None or self.completed > self.deadline.seconds else "building the plan kept")
        return f"{line} passed by {over:.3g} s ({why})" + (f": not weighed: {left_out}" if left_out else "")


def _planner_key(planner: Any) -> Any:
    """The options the search and the propagation read besides the problem (the cost model by
    identity: one session's options share it; the communication, which says whether XLA combines
    the all-reduces)."""
    options = planner.options
    return type(planner), options.search, id(options.cost_model), options.mode, options.communication


def _problem_key(p: Problem) -> tuple:
    """What makes two problems the same (the traced program by identity: the session holds it)."""
    offload = None if p.offload is None else (p.offload.what, p.offload.args, tuple(sorted(p.offload.results.items())),
                                              p.offload.resident)
    return (id(p.traced), tuple(p.in_shardings), p.donated, p.budget, offload, tuple(p.made.items()), p.movable,
            p.batch, p.seeded, p.as_seeded, p.compiled)
