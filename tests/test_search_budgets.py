"""The searches under budgets (issue 15): the ILP never returns a plan worse than the recursive
search's (its warm start), and under a budget the expert plan fits in, the ILP finds a plan that
fits too."""

import jax
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms
from clients import loop_gpt
from jax.sharding import NamedSharding

import jshard as js
from benchmarks import _plans, _zoo
from benchmarks._models import model_table, workload
from benchmarks._search import fsdp_spec
from jshard import models
from jshard.search import DATA_PARALLEL, PROPAGATED, SEEDS


def _step(cfg, init, loss, make_batch, rows):
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: loss(p, b, cfg), optimizer)
    params = init(cfg, jax.random.key(0))
    return step, (params, optimizer.init(params), make_batch(np.random.default_rng(0), cfg, rows))


MODELS = {
    "mlp": (models.MLPConfig(64, 256, 64, 2), models.init_mlp, lambda p, b, cfg: models.mlp_loss(p, b),
            models.mlp_batch, 64),
    "gpt": (models.GPTConfig(vocab=32, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=64, scan=True),
            models.init_gpt, models.gpt_loss, models.copy_task_batch, 8),
    "moe": (models.MoEConfig(), models.init_moe, models.moe_loss, models.moe_batch, 8),
}


@pytest.mark.parametrize("name", list(MODELS))
def test_ilp_is_never_worse_than_the_recursive_plan(name):
    step, args = _step(*MODELS[name])
    recursive = js.parallelize(step, devices=8, mode="auto", search="recursive").plan(*args).search
    ilp = js.parallelize(step, devices=8, mode="auto", search=js.Search("ilp", time_limit=4)).plan(*args).search
    assert ilp.seconds <= recursive.seconds * (1 + 1e-9), (ilp.line(), recursive.line())
    assert ilp.kept.startswith(("the ILP's plan", "the recursive plan (the warm start)"))
    assert f"kept {ilp.kept}" in ilp.line()
    if ilp.kept.startswith("the recursive plan"):  # kept whole: the recursive search's own plan and price
        assert ilp.seconds == pytest.approx(recursive.seconds, rel=1e-12)


@pytest.fixture(scope="module")
def loop_case():
    """Issue 15's case, smaller (its weights still dominate): the GPT written by someone else, and the
    audit of its Megatron expert plan under a plain `jax.jit`."""
    params, tokens = loop_gpt.create(layers=2, d=256, ff=1024, vocab=2048)
    mesh = loop_gpt.make_mesh()
    shardings, batch = loop_gpt.expert_shardings(mesh, params)
    expert = jax.jit(loop_gpt.train_step, in_shardings=(shardings, batch), out_shardings=(shardings, None))
    return params, tokens, js.audit(expert.lower(params, tokens).compile())


def test_ilp_fits_where_the_expert_fits(loop_case):
    """Under the Megatron plan's own compiled peak as the budget (read from its memory analysis): the
    ILP returns a plan (its own, or its warm start where HiGHS finds none in the time limit, or a
    seed whose compiled program fits where the search's estimate puts it over) that fits in the
    compiled program, says which, and equals one device."""
    params, tokens, expert = loop_case
    budget = expert.memory.peak_bytes
    step = js.parallelize(loop_gpt.train_step, devices=8, mode="auto", search=js.Search("ilp", memory_budget=budget, time_limit=4))
    report = step.plan(params, tokens).search
    assert report.compiled_peak_bytes <= budget, report.line()
    assert report.kept or "its compiled program decides" in report.status, report.line()
    _, loss = step(params, tokens)
    _, ref = jax.jit(loop_gpt.train_step)(params, tokens)
    assert_close(loss, ref, terms=step_terms(params, tokens, backward=False))


def test_search_keeps_the_plan_propagated_from_the_anchors(loop_case):
    """Under a budget the Megatron plan fits in with room (twice its compiled peak; data parallel does
    not fit), the recursive search weighs the plan propagated from the model's own `shard` tuples
    and keeps it: the compiled step moves at most 1.05x the expert's bytes (the recursive search
    alone: 1.40x), fits, and equals one device."""
    params, tokens, expert = loop_case
    budget = 2 * expert.memory.peak_bytes
    step = js.parallelize(loop_gpt.train_step, devices=8, mode="auto", search=js.Search(memory_budget=budget))
    report = step.plan(params, tokens).search
    assert report.status.startswith(PROPAGATED), report.line()
    compiled = js.audit(step.lower(params, tokens).compile())
    assert compiled.bytes() <= 1.05 * expert.bytes(), (compiled.bytes(), expert.bytes())
    assert compiled.memory.peak_bytes <= budget
    # at the expert's layouts it holds no more temporaries (the embedding gradient written in its vocab rows)
    assert compiled.memory.temp_bytes <= expert.memory.temp_bytes, (compiled.memory.temp_bytes, expert.memory.temp_bytes)
    _, loss = step(params, tokens)
    _, ref = jax.jit(loop_gpt.train_step)(params, tokens)
    assert_close(loss, ref, terms=step_terms(params, tokens, backward=False))


def test_search_holds_the_propagated_plan_to_its_compiled_peak():
    """linen_lm (the zoo's Flax Linen LM, its logical constraints the anchors) under its author's
    plan's own compiled peak: the search estimates the plan propagated from those anchors over the
    budget (it counts activations XLA fuses away), so it is compiled as propagated and kept, its
    compiled program fitting: the expert's bytes, equal to one device (before, no plan: the
    search's own plans compiled over the budget, 36 KiB of 27.4, and the tighter estimates found none)."""
    report = _meets_the_authors_plan_at_its_peak("linen_lm")
    assert report.status.startswith(f"{PROPAGATED}, as made"), report.line()
    assert "does not fit" not in report.line(), report.line()


def _meets_the_authors_plan_at_its_peak(name: str):
    """The zoo model `name` searched under its author's plan's own compiled peak (the batch as the
    author places it): see `_meets_at_its_peak`."""
    expert = _zoo.measure(name, "given", "expert").audit  # shared with test_zoo
    case = _zoo.case(name)
    return _meets_at_its_peak(case, case.args["given"], expert)


def _meets_at_its_peak(case, args: tuple, expert: js.Audit):
    """The zoo `case` searched on `args` under `expert`'s compiled peak: its compiled program fits,
    moves at most 1.05x the expert's bytes and equals one device. Returns the plan's `SearchReport`."""
    budget = expert.memory.peak_bytes
    with case.context():
        step = js.parallelize(case.step, mode="auto", search=js.Search(memory_budget=budget), **case.options["given"])
        report = step.plan(*args).search
        compiled = step.lower(*args).compile()
        outputs = jax.device_get(compiled(*jax.device_put(args, compiled.input_shardings[0])))
    assert report.compiled_peak_bytes <= budget, report.line()
    found = js.audit(compiled)
    assert found.bytes() <= 1.05 * expert.bytes(), (found.bytes(), expert.bytes())
    assert found.memory.peak_bytes <= budget
    assert_close(outputs, case.reference, terms=step_terms(case.params, case.batch))
    return report


def test_search_fits_the_fully_sharded_linen_resnet_at_its_peak():
    """linen_resnet with its state placed as the fsdp expert places it (each array cut over the
    batch's mesh axis on its largest dim, ZeRO-3; a committed placement is an anchor), under that
    expert's compiled peak under a plain `jax.jit` (table 5's `least`): the plan propagated from
    the anchors fits. Before, propagation cut the batch norms' backward broadcasts over the
    channels, as the sharded scales are, and moved whole activations into the batch cut
    (all-to-alls), and gathered each reversed kernel again: 75.93 KiB of 60.93, no plan fit."""
    case = _zoo.case("linen_resnet")
    state, batch = case.args["given"]
    sharding = jax.tree.leaves(batch)[0].sharding
    mesh, axes = sharding.mesh, sharding.spec[0]
    placed = (jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, fsdp_spec(x, mesh, axes))), state), batch)
    with case.context():
        expert = js.audit(jax.jit(case.step).lower(*placed).compile())
    report = _meets_at_its_peak(case, placed, expert)
    assert report.status.startswith(PROPAGATED), report.line()


def test_search_weighs_the_data_parallel_plan_of_a_scanned_gpt():
    """The scanned reference GPT (the benchmarks' full size) under the data-parallel plan's own
    compiled peak: the recursive search hands out one mesh axis per level and misses the plain data
    parallelism of the scanned body (2.55x the expert's bytes before); the data-parallel seed (the
    batch cut over every mesh axis, the rest propagated from it) predicts less and fits, so it is
    kept: the expert's bytes, within the budget, equal to one device."""
    w = workload(next(m for m in model_table() if m.name == "GPT scan"), "full")
    args = w.args()
    expert = js.audit(_plans.expert("data", w, 8).lower(*args).compile())
    budget = expert.memory.peak_bytes
    step = js.parallelize(w.step(None), devices=8, mode="auto", search=js.Search(memory_budget=budget), offload=())
    report = step.plan(*args).search
    assert report.status.startswith(DATA_PARALLEL), report.line()
    found = js.audit(step.lower(*args).compile())
    assert found.bytes() <= 1.05 * expert.bytes(), (found.bytes(), expert.bytes())
    assert found.memory.peak_bytes <= budget
    ref = jax.jit(w.step(None))(*args)[2]
    assert_close(step(*args)[2], ref, terms=step_terms(w.params, w.batch, backward=False))


def test_search_meets_the_expert_that_fits_where_the_estimate_misses():
    """linen_resnet (the zoo's Flax Linen ResNet with BatchNorm; its author's plan is data parallel:
    the state whole, the batch cut) under that plan's own compiled peak: the search's own plan
    compiles to twice its estimate (190 KiB of 94), and the tighter estimates found none; the seeds
    it listed (the plan propagated from the batch, here the data-parallel plan) are compiled
    cheapest first and the first that fits is kept: the expert's bytes, equal to one device."""
    report = _meets_the_authors_plan_at_its_peak("linen_resnet")
    assert report.status.startswith(SEEDS) and "its compiled program decides" in report.status, report.line()


def test_search_meets_the_fsdp_plan_where_data_parallel_does_not_fit():
    """The reference ResNet (the benchmarks' full size) under a budget midway between the
    data-parallel and the FSDP plans' compiled peaks. The memory model held each result only from
    where it is made, where XLA gives it its own buffer for the whole program: the search's plans
    compiled over the budget at every tighter estimate, and the fully-sharded seed was kept (1.87x
    the FSDP plan's bytes). Held from the start, the search's own plan fits: no more bytes than the
    FSDP plan, within the budget, equal to one device."""
    w = workload(next(m for m in model_table() if m.name == "ResNet"), "full")
    args = w.args()
    data, fsdp = (js.audit(_plans.expert(name, w, 8).lower(*args).compile()) for name in ("data", "fsdp"))
    budget = (data.memory.peak_bytes + fsdp.memory.peak_bytes) / 2
    step = js.parallelize(w.step(None), devices=8, mode="auto", search=js.Search(memory_budget=budget))
    report = step.plan(*args).search
    assert report.compiled_peak_bytes <= budget, report.line()
    found = js.audit(step.lower(*args).compile())
    assert found.bytes() <= 1.05 * fsdp.bytes(), (found.bytes(), fsdp.bytes(), report.line())
    assert found.memory.peak_bytes <= budget
    ref = jax.jit(w.step(None))(*args)[2]
    assert_close(step(*args)[2], ref, terms=step_terms(w.params, w.batch, backward=False))


def test_the_budgeted_search_stops_bisecting_once_it_finds_no_new_plan(monkeypatch):
    """Under a budget that binds, the recursive search's bisection of its memory weight ends after
    `_STALE` runs in a row that find no plan it had not found (issue 32: planning in compile time):
    fewer runs than bisecting `_BISECTIONS` times, and the same plan, which fits (estimated and
    compiled). Counted by `SearchReport.runs`."""
    from jshard.search import _recursive

    step, args = _step(*MODELS["mlp"])
    free = js.parallelize(step, devices=8, mode="auto").plan(*args).search
    budget = 0.8 * free.peak_bytes

    def planned():
        return js.parallelize(step, devices=8, mode="auto", search=js.Search(memory_budget=budget)).plan(*args).search

    stale = planned()
    monkeypatch.setattr(_recursive, "_STALE", _recursive._BISECTIONS + 1)  # never stale: every bisection made
    every = planned()
    assert "memory weight" in every.status and every.runs > 2, every.line()  # the budget binds: grown, bisected
    assert stale.runs < every.runs, (stale.line(), every.line())
    assert (stale.seconds, stale.peak_bytes, stale.status) == (every.seconds, every.peak_bytes, every.status)
    assert stale.peak_bytes <= budget and stale.compiled_peak_bytes <= budget
    assert stale.compile_seconds is not None and stale.compile_seconds > 0


@pytest.mark.parametrize("name", ["mlp", "gpt"])  # gpt: a scanned body, whose peak joins its loop's point
def test_fitting_a_seed_reads_each_peak_from_its_kept_bytes_as_the_whole_choice_gives_it(name, monkeypatch):
    """`_seeded.fitted` reads the peak from the live bytes `_Peak` keeps as units move: each read is
    the one `SearchGraph.peak` gives the whole choice, bit for bit, so the seed fitted is the same."""
    from jshard.cost import CostModel
    from jshard.graph import flatten
    from jshard.search import _seeded
    from jshard.search._graph import SearchGraph, Solved

    step, args = _step(*MODELS[name])
    closed = jax.make_jaxpr(step)(*args)
    invars, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    g = SearchGraph(flatten(closed.jaxpr), invars, outvars, {}, dict.fromkeys(("d0", "d1", "d2"), 2), CostModel())
    whole = [{} for _ in g.units]
    seed = Solved(whole, g.seconds(whole), g.peak(whole)[0], "whole")
    read, reads = _seeded._Peak.peak, []
    monkeypatch.setattr(_seeded._Peak, "peak", lambda self: reads.append((read(self), self.g.peak(self.choice))) or
                        reads[-1][0])
    fitted = _seeded.fit_budget(g, seed, seed.peak / 2)
    assert fitted is not None and fitted.peak <= seed.peak / 2 and len(reads) > 1
    assert all(kept == whole for kept, whole in reads)
    monkeypatch.setattr(_seeded, "_exact", lambda g: False)  # every peak read from the whole choice
    again = _seeded.fit_budget(g, seed, seed.peak / 2)
    assert again is not None and again.choice == fitted.choice and again.seconds == fitted.seconds


def test_optimizer_levels_that_cut_nothing_are_held_to_the_budget_once(monkeypatch):
    """Where no optimizer level cuts a leaf or reduce-scatters a gradient, every level builds the same
    program: the first one's compiled check refuses the others, without compiling them again."""
    import types

    from jshard._errors import MemoryBudgetError
    from jshard.compile import _weigh
    from jshard.compile._session import Planning
    from jshard.plan import OptimizerReport

    def program(level, leaves=()):
        report = OptimizerReport(level, 0.0, 0, 2, 0, 2, 0.0, leaves=leaves)
        search = types.SimpleNamespace(seconds=1e-3 * level, peak_bytes=100.0)
        return types.SimpleNamespace(plan=types.SimpleNamespace(optimizer=report, search=search))

    held = []

    def built(s, traced, check=True):
        if not check:
            return program(s.options.optimizer.level, s.leaves)
        held.append(s.options.optimizer.level)
        raise MemoryBudgetError(f"level {s.options.optimizer.level} holds 120 B", 120.0)

    def signature(leaves):
        def but(optimizer):
            return types.SimpleNamespace(options=types.SimpleNamespace(optimizer=optimizer), leaves=leaves)
        return types.SimpleNamespace(budget=100.0, but=but, planning=Planning.of(60.0), devices=("cpu",),
                                     options=types.SimpleNamespace(memory_budget=100.0))

    monkeypatch.setattr(_weigh, "_plan_signature", built)
    without = MemoryBudgetError("nothing fits 100 B", 120.0)
    with pytest.raises(MemoryBudgetError, match="fits at no level: optimizer=1: no plan fits .*optimizer=3: no plan"):
        _weigh._weigh_optimizer(signature(()), None, without)
    assert held == [1]  # levels 2 and 3: the same program, refused as level 1 was
    held.clear()
    with pytest.raises(MemoryBudgetError):  # levels that cut leaves: each held to the budget
        _weigh._weigh_optimizer(signature((("args[1]", "state", "P()", "P('d0')"),)), None, without)
    assert held == [1, 2, 3]


@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_polishing_passes_by_settled_units_and_moves_as_visiting_every_unit(name, monkeypatch):
    """`_seeded.polished` passes by a unit whose last visit found no faster move until it or a
    unit beside it moves: the choice is the one a polish visiting every unit each sweep makes, with
    fewer units priced."""
    from jshard.cost import CostModel
    from jshard.graph import flatten
    from jshard.search import _seeded
    from jshard.search._graph import SearchGraph

    step, args = _step(*MODELS[name])
    closed = jax.make_jaxpr(step)(*args)
    g = SearchGraph(flatten(closed.jaxpr), closed.jaxpr.invars, closed.jaxpr.outvars, {},
                    dict.fromkeys(("d0", "d1", "d2"), 2), CostModel())
    whole = [{} for _ in g.units]
    budget = g.peak(whole)[0] / 2
    start = _seeded.fitted(g, list(whole), budget)
    assert start is not None

    def every_unit(choice):  # the polish before settling: every free unit priced in every sweep
        joins, peak = g.joins(choice), _seeded._Peak(g, choice)
        local, visits = _seeded._Local(g, choice, joins), 0
        for _ in range(_seeded._SWEEPS):
            better = False
            for k, u in enumerate(g.units):
                if u.free:
                    visits += 1
                    now = local.seconds(k, choice[k])
                    for seconds, _, a in sorted((local.seconds(k, a), n, a)
                                                for n, a in enumerate(_seeded.moves(g, k, choice[k]))):
                        if seconds >= now * (1 - 1e-9) or not g.expressible(k, a):
                            break
                        if peak.fits(k, a, budget):
                            peak.move(k, a)
                            joins.moved(k, a)
                            local.moved(k)
                            better = True
                            break
            if not better:
                break
        return choice, visits

    reference, visits = every_unit([dict(a) for a in start])
    priced, polish = [], _seeded._polish
    monkeypatch.setattr(_seeded, "_polish", lambda g, k, *rest: priced.append(k) or polish(g, k, *rest))
    polished = _seeded.polished(g, [dict(a) for a in start], budget)
    assert polished == reference and g.peak(polished)[0] <= budget
    assert polished != start and len(priced) < visits
