"""`Search(time_limit=...)` bounds the whole of planning one signature (issue 32 item 3): the
weighings under a budget share one deadline, a problem planned twice is searched once, and past the
deadline no weighing plans a further candidate once one fits, the plan naming what it left out; a
candidate planned when the deadline passes is stopped between the search's levels where its weighing
holds one that fits, and dropped whole (the plan kept runs, equal to one device), else finished and
the overrun said. Measured by counting searches and by a deterministic clock (`Planning.of` given a
`Clock` the test moves), never by the wall clock."""

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms

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
    assert planning.note() == ("the time limit (10 s, search_time_limit) stopped the planning: not weighed: optimizer=3",)
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
    # no plan is complete at 0 s: the first complete one is kept, and the line says by how much the limit was passed
    assert len(bounded.skipped) == 1 and re.fullmatch(
        r"the time limit \(0 s, search_time_limit\) passed by [0-9.e+-]+ s \(no plan was complete before it, the "
        rf"first complete one kept\): not weighed: {re.escape(left_out)}", bounded.skipped[0]), bounded.skipped
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


def test_a_candidate_its_weighing_may_drop_stops_at_the_deadline_less_the_time_kept_back():
    """`Planning.check` raises only inside a candidate whose weighing holds one that fits already;
    the deadline passes `Deadline.reserve` early, the reserve measured from the builds."""
    clock = Clock()
    planning = Planning.of(60.0, clock)
    planning.check()
    clock.now = 102.0
    planning.built(since=101.0)  # built 1 s after its work began, the last check before that
    assert planning.deadline.reserve == 3.0 and planning.completed == 2.0
    planning.check()
    clock.now = 104.0
    planning.built(since=101.0)  # its tail counted from the last check: 2 s, 6 s kept back
    assert planning.deadline.reserve == 6.0 and planning.completed == 2.0

    def planned(name: str, at: list[float]):
        def make():
            for t in at:  # units of work, checked between
                clock.now = 100.0 + t
                planning.check()
            return name
        return make

    assert planning.candidate("a", fits=False, make=planned("a", [10.0, 20.0])) == "a"  # nothing else: not stopped
    assert planning.candidate("b", fits=True, make=planned("b", [53.9, 54.0, 59.0])) is None  # stopped at 54 s
    assert clock.now == 154.0
    assert not planning.weighs("c", fits=True)  # and nothing more is started
    assert planning.note() == (
        "the time limit (60 s, search_time_limit) stopped the planning: not weighed: b (stopped while planned), c",)


@pytest.fixture
def clock(monkeypatch):
    """The planning's deadline read on a `Clock` (`Planning.of`), which moves only when a test moves it."""
    clock, of = Clock(), Planning.of.__func__
    monkeypatch.setattr(Planning, "of", classmethod(lambda cls, limit, _=None: of(cls, limit, clock)))
    return clock


def _at_each_level(monkeypatch, clock: Clock, during: str, to: float) -> list[str]:
    """Moves `clock` to `to` after each level the recursive search solves while the weighing's
    candidate `during` is planned; returns the names of the candidates planned, in order."""
    from jshard.search import _recursive

    planned, now = [], []
    candidate, level = Planning.candidate, _recursive._Recursive._level

    def named(self, what, fits, make):
        def made():
            planned.append(what)
            now.append(what)
            try:
                return make()
            finally:
                now.pop()
        return candidate(self, what, fits, made)

    def timed(self, *args, **kwargs):
        out = level(self, *args, **kwargs)
        if during in now:
            clock.now = to
        return out

    monkeypatch.setattr(Planning, "candidate", named)
    monkeypatch.setattr(_recursive._Recursive, "_level", timed)
    return planned


def test_past_the_deadline_a_weighing_stops_its_candidate_and_keeps_the_plan_that_fits(gpt, clock, monkeypatch):
    """The deadline passes after the first level of the search planning recompute 'full', while
    'selective' fits already: that search stops at its next level, 'full' is dropped, and the plan
    kept is 'selective''s, whole."""
    step, args, peaks = gpt
    budget = (peaks["none"] + peaks["selective"]) / 2  # recomputing nothing does not fit
    make = lambda limit: js.parallelize(step, devices=16, mode="auto", cost_model=H100,
                                        search=js.Search(memory_budget=budget, time_limit=limit))
    whole = make(3600.0).plan(*args)
    planned = _at_each_level(monkeypatch, clock, "recompute 'full'", 160.0)
    stopped = make(60.0).plan(*args)
    assert planned == ["recompute 'none'", "recompute 'selective'", "recompute 'full'"]
    report = stopped.search
    assert [(w.policy, w.chosen) for w in report.recompute] == [("none", False), ("selective", True)]
    assert report.skipped == (
        "the time limit (60 s, search_time_limit) stopped the planning: not weighed: recompute 'full' (stopped while "
        "planned)",)
    assert report.skipped[0] in " ".join(stopped.summary().split())
    # the plan kept is 'selective''s as the whole planning weighed it (which went on to 'full' and a
    # policy per region), built whole: every operator laid out
    selective = next(w for w in whole.search.recompute if w.policy == "selective")
    assert (report.seconds, report.peak_bytes) == (selective.seconds, selective.peak_bytes) and report.peak_bytes <= budget
    assert stopped.ops and all(op.layout is not None for op in stopped.ops)


def test_where_no_plan_is_complete_at_the_deadline_the_first_is_finished_and_the_overrun_said(gpt, clock, monkeypatch):
    """The deadline passes during the first candidate's search, with nothing planned yet: the
    planning goes on to the first plan that fits (never an error with nothing), weighs nothing after
    it, and says by how much the limit was passed."""
    step, args, peaks = gpt
    budget = (peaks["none"] + peaks["selective"]) / 2
    _at_each_level(monkeypatch, clock, "recompute 'none'", 200.0)  # 100 s in: 90 s past a limit of 10 s
    plan = js.parallelize(step, devices=16, mode="auto", cost_model=H100,
                          search=js.Search(memory_budget=budget, time_limit=10.0)).plan(*args)
    report = plan.search
    assert [(w.policy, w.seconds is not None, w.chosen) for w in report.recompute] == [("none", True, True)]
    assert report.peak_bytes <= budget
    assert report.skipped == (
        "the time limit (10 s, search_time_limit) passed by 90 s (no plan was complete before it, the first complete "
        "one kept): not weighed: recompute 'selective', recompute 'full'",)


def _attention_step():
    """One attention layer's step, its `jshard.attention` given no strategy (the planning weighs its
    sequence cut), over 2048 keys (tiled)."""
    def loss(p, x):
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[w]) for w in ("wq", "wk", "wv"))
        o = js.attention(q, k, v, causal=True, strategy=None, form="ring")
        return jnp.mean(jnp.einsum("bthe,hed->btd", o, p["wo"]) ** 2)

    def step(p, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

    rng = np.random.default_rng(0)
    shapes = {"wq": (16, 2, 64), "wk": (16, 2, 64), "wv": (16, 2, 64), "wo": (2, 64, 16)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    return step, (p, jnp.asarray(rng.normal(size=(1, 2048, 16)), jnp.float32))


def test_a_sequence_cut_stopped_at_the_deadline_leaves_the_plan_kept_whole_and_equal_to_one_device(clock, monkeypatch):
    """The context-parallel weighing (the 128k Llama's, in small): the sequence cut 8 is planned
    first, then the step without a cut, whose search the deadline stops after its first level. The
    cut kept is 8, its plan built whole: it runs, equal to one device, and the report names the cut
    that was stopped."""
    step, args = _attention_step()
    planned = _at_each_level(monkeypatch, clock, "context parallel 1", 160.0)
    par = js.parallelize(step, devices=8, mode="auto", search=js.Search(time_limit=60.0))
    plan = par.plan(*args)
    assert planned[0] == "context parallel 8" and "context parallel 1" in planned
    assert plan.search.context_cut == 8 and plan.choices == (("context", 8),)
    assert [(w.policy, w.chosen) for w in plan.search.context] == [("sequence 8", True)]
    assert plan.search.skipped == (
        "the time limit (60 s, search_time_limit) stopped the planning: not weighed: context parallel 1 (stopped while "
        "planned)",)
    assert_close(par(*args), jax.jit(step)(*args), terms=step_terms(*args) + 3 * 2048)


def test_a_pipelines_stages_plan_on_one_deadline(clock, monkeypatch):
    """`mode="auto"` with a pipeline plans each stage through `compile.build`; the time limit bounds
    the step's planning, not each stage's. The first stage's planning takes 100 s of a 10 s limit
    (the clock moved when its build returns): the second stage's search starts past the deadline,
    and its report says by how much (on a clock of its own, it started afresh and said nothing)."""
    from jshard.pipeline import _stagesearch

    build = _stagesearch.build

    def slow(*args, **kwargs):
        program = build(*args, **kwargs)
        clock.now += 100.0
        return program

    monkeypatch.setattr(_stagesearch, "build", slow)
    rng = np.random.default_rng(0)
    params = [jnp.asarray(rng.normal(size=(16, 16)) / 4, jnp.float32) for _ in range(4)]
    batch = jnp.asarray(rng.normal(size=(8, 16)), jnp.float32)

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.mean(x ** 2)

    step = js.parallelize(loss, devices=8, mode="auto", pipeline=js.Pipelining(stages=2, micro_batches=2),
                          search=js.Search(time_limit=10.0))
    first, second = step.program(params, batch).cut.plans
    late = "the time limit (10 s, search_time_limit) passed by"
    assert not any(line.startswith(late) for line in first.search.skipped)
    assert f"{late} 90 s (no plan was complete before it, the first complete one kept)" in second.search.skipped
