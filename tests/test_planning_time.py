"""`Search(time_limit=...)` bounds the whole of planning one signature (issue 32 item 3): the
weighings under a budget share one deadline, a problem planned twice is searched once, and past the
deadline no weighing plans a further candidate once one fits, the plan naming what it left out.
Measured by counting searches and by a deterministic clock, never by the wall clock."""

import types

import jax
import numpy as np
import optax
import pytest

import jshard as js
from jshard import models
from jshard.compile._planners import Planned
from jshard.compile._session import Deadline, Planning
from jshard.cost import CostModel

H100 = CostModel.for_device("H100")


class Clock:
    """A clock that moves only when told."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_the_deadline_reads_its_clock():
    clock = Clock()
    deadline = Deadline(5.0, clock)
    assert deadline.left() == 5.0 and not deadline.passed
    clock.now += 4.0
    assert deadline.left() == pytest.approx(1.0)
    clock.now += 2.0
    assert deadline.left() == 0.0 and deadline.passed


def test_a_session_searches_a_problem_once_and_stops_weighing_past_its_deadline():
    clock, runs = Clock(), []

    class Counting:  # a planner that reads its problem and options only, as the search does
        options = types.SimpleNamespace(search=js.Search(), cost_model=None, mode="auto", communication=None)

        def plan(self, problem):
            runs.append(problem)
            return Planned(None)

    planning = Planning.of(10.0, clock)
    problem = js.compile.Problem(object(), [None], frozenset(), 1e9)
    first = planning.plan(Counting(), problem)
    assert planning.plan(Counting(), problem) is first and len(runs) == 1
    assert (planning.searches, planning.reused) == (1, 1)
    assert planning.weighs("optimizer=2", fits=True)  # before the deadline: every candidate
    clock.now += 10.0
    assert planning.weighs("optimizer=2", fits=False)  # past it: only while none fits
    assert not planning.weighs("optimizer=3", fits=True)
    assert planning.note() == ("the time limit (10 s, search_time_limit) passed: not weighed: optimizer=3",)
    assert planning.time_left(60.0) == 0.0


@pytest.fixture(scope="module")
def gpt():
    """A two-block GPT whose blocks are `recompute(policy="auto")`, planned for 16 devices (an
    abstract mesh: nothing compiled), and its estimated peaks per uniform policy without a budget."""
    cfg = models.GPTConfig(n_layers=2, recompute="auto", seq_len=16, d_model=32, n_heads=2, d_ff=64, vocab=16)
    optimizer = optax.sgd(1e-2)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    args = (params, optimizer.init(params), models.copy_task_batch(np.random.default_rng(0), cfg, 32))
    free = js.parallelize(step, devices=16, mode="auto", cost_model=H100).plan(*args).search
    return step, args, {w.policy: w.peak_bytes for w in free.recompute}


def test_a_time_limit_bounds_the_whole_planning_not_each_search(gpt):
    step, args, peaks = gpt
    budget = (peaks["none"] + peaks["selective"]) / 2  # recomputing nothing does not fit
    plans = {limit: js.parallelize(step, devices=16, mode="auto", cost_model=H100,
                                   search=js.Search(memory_budget=budget, time_limit=limit)).plan(*args).search
             for limit in (3600.0, 0.0)}
    whole, bounded = plans[3600.0], plans[0.0]
    assert not whole.skipped and f"{whole.searches} searches in all" in whole.line()
    # past the deadline from the start: each weighing plans until one candidate fits, then stops
    assert bounded.searches < whole.searches, (bounded.line(), whole.line())
    assert [w.policy for w in whole.recompute] == ["none", "selective", "full"]
    weighed = [w.policy for w in bounded.recompute]
    assert weighed == ["none", "selective", "full"][:len(weighed)] and len(weighed) < 3
    assert [w.seconds is not None for w in bounded.recompute] == [False] * (len(weighed) - 1) + [True]  # the first that fits
    left_out = ", ".join(f"recompute {p!r}" for p in ["none", "selective", "full"][len(weighed):])
    assert bounded.skipped == (f"the time limit (0 s, search_time_limit) passed: not weighed: {left_out}",)
    assert bounded.skipped[0] in bounded.line()
    assert bounded.peak_bytes <= budget and whole.peak_bytes <= budget


def test_past_the_deadline_a_weighing_that_then_fits_nothing_weighs_every_candidate():
    planning = Planning.of(0.0, Clock())  # passed from the start

    def weigh():  # "a" fits the estimate, but only "b"'s compiled program fits
        kept = [c for c in ("a", "b") if planning.weighs(c, fits=c != "a")]
        if "b" not in kept:
            raise js.MemoryBudgetError("a's compiled program does not fit", None)
        return kept

    assert planning.to_the_end(weigh) == ["a", "b"]
    assert planning.skipped == [] and not planning.forced  # weighed after all: nothing left out


def test_past_the_deadline_the_recursive_search_stops_once_a_plan_fits(gpt, monkeypatch):
    """The time limit bounds the search inside a weighing too: past the deadline the recursive search
    makes no further run once a plan fits (no bisection of its memory weight), counted by its runs."""
    from jshard.search import _recursive

    step, args, peaks = gpt
    budget = (peaks["none"] + peaks["selective"]) / 2
    made = []
    init = _recursive._Recursive.__init__

    def counted(self, *a, **k):
        init(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(_recursive._Recursive, "__init__", counted)
    runs = {}
    for limit in (3600.0, 0.0):
        made.clear()
        plan = js.parallelize(step, devices=16, mode="auto", cost_model=H100,
                              search=js.Search(memory_budget=budget, time_limit=limit)).plan(*args).search
        runs[limit] = [(r.runs, r.bisections) for r in made]
        assert plan.peak_bytes <= budget
    whole, bounded = runs[3600.0], runs[0.0]
    # the first search fits unweighted: its run at the memory price's scale is left out; the second's
    # budget binds: the same runs until one fits, then no bisection; then the weighing stops
    assert whole[1][1] > 0 and bounded == [(whole[0][0] - 1, 0), (whole[1][0] - whole[1][1], 0)], runs
