"""The search prices recompute per region and optimizer parallel: under `mode="auto"` with a
`memory_budget` read from the memory model's own figures, a small GPT gets no recompute where none
is needed, some (not all) of its `jshard.recompute(policy="auto")` regions recomputed where only
that fits, and an optimizer-parallel level where only that fits; each compiled program within the
budget and equal to one device."""

import jax
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models
from jshard.cost import CostModel

H100 = CostModel.for_device("H100")
"""An H100 under the roofline: at this toy size (d_model 32) every operator is memory-bound, and the
search's plans must still order the policies by their recompute (each plan the fastest of the
search's runs: `search/_recursive.solve`)."""

WHOLE = 3600.0
"""`Search(time_limit=...)` for the tests of what the weighings weigh: the time limit bounds the whole of
planning, which on a loaded 2-core machine can pass before every candidate is weighed."""


@pytest.fixture(scope="module")
def layered():
    """A two-block GPT (a Python loop over blocks), each block `recompute="auto"`; the step, its
    arguments, its single-device result and the unbudgeted plan's report (the memory model's figures)."""
    cfg = models.GPTConfig(n_layers=2, recompute="auto", seq_len=16, d_model=32, n_heads=2, d_ff=64, vocab=16)
    optimizer = optax.sgd(1e-2)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    args = (params, optimizer.init(params), models.copy_task_batch(np.random.default_rng(0), cfg, 32))
    free = js.parallelize(step, devices=4, mode="auto", cost_model=H100, search=js.Search(time_limit=WHOLE)).plan(*args).search
    return step, args, jax.jit(step)(*args), {w.policy: w.peak_bytes for w in free.recompute}


def _equals_one_device(fn, args, ref):
    params, state, loss = fn(*args)
    assert_close(loss, ref[2], terms=step_terms(args[0], args[2], backward=False))
    assert_close(params, ref[0], terms=step_terms(args[0], args[2]))


def test_a_budget_the_fastest_plan_meets_recomputes_nothing(layered):
    step, args, ref, peaks = layered
    budget = 1.25 * peaks["none"]
    fn = js.parallelize(step, devices=4, mode="auto", cost_model=H100, search=js.Search(memory_budget=budget, time_limit=WHOLE))
    plan = fn.plan(*args)
    assert [r.policy for r in plan.search.regions] == ["none", "none"], plan.search.line()
    assert [w.policy for w in plan.search.recompute if w.chosen] == ["none"]
    assert not any(op.recomputed for op in plan.ops)
    assert plan.search.compiled_peak_bytes <= budget
    _equals_one_device(fn, args, ref)


def test_a_budget_between_recomputes_some_regions_not_all(layered):
    step, args, ref, peaks = layered
    budget = peaks["none"] - 0.45 * (peaks["none"] - peaks["selective"])  # one region's savings, not two
    fn = js.parallelize(step, devices=4, mode="auto", cost_model=H100, search=js.Search(memory_budget=budget, time_limit=WHOLE))
    plan = fn.plan(*args)
    report = plan.search
    chosen = [r.policy for r in report.regions]
    assert "none" in chosen and set(chosen) != {"none"}, report.line()
    assert not any(w.chosen for w in report.recompute)  # no policy for every region at once
    assert report.peak_bytes <= budget and report.compiled_peak_bytes <= budget
    assert report.seeds and all(report.seconds <= seconds for _, seconds in report.seeds)  # no seed it weighed is faster
    compiled = fn.lower(*args).compile().memory_analysis()
    assert (compiled.argument_size_in_bytes + compiled.output_size_in_bytes + compiled.temp_size_in_bytes
            - compiled.alias_size_in_bytes) <= budget
    k = chosen.index("none") ^ 1  # the recomputed region
    named = f"jshard.recompute(policy='auto' -> {chosen[k]!r}, region {k})"
    again = [op for op in plan.ops if op.recomputed and op.recompute == named]
    assert again and not any(op.recomputed for op in plan.ops if op.recompute.endswith("region %d)" % (k ^ 1)))
    assert f"the search's choice for it under the memory budget, the least recompute whose estimated peak fits: " \
           f"region {k} (" in plan.explain(again[0])
    assert "recompute per region: region 0 (" in report.line()
    _equals_one_device(fn, args, ref)


def test_only_optimizer_parallel_fits_and_the_search_chooses_its_level():
    cfg = models.GPTConfig(n_layers=1, seq_len=8, d_model=256, n_heads=2, d_ff=512, vocab=16)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    state = optimizer.init(params)
    args = (params, state, models.copy_task_batch(np.random.default_rng(0), cfg, 4))
    whole = models.Preset("data", 4, 1)  # the user keeps parameters and state whole
    replicated = whole.parameters(params, {})
    adam, *rest = models.state_strategies(replicated, params, state)
    strategies = (replicated, (adam._replace(count=whole.layout()), *rest))
    kw = dict(devices=4, mode="auto", in_strategy=(*strategies, None), out_strategy=(*strategies, None))
    peaks = {level: js.audit(js.parallelize(step, optimizer=level, **kw).lower(*args).compile()).memory.peak_bytes
             for level in (1, 3)}  # compiled, as the budget is held: the search's estimates move with its plans
    budget = (peaks[1] + peaks[3]) / 2
    fn = js.parallelize(step, search=js.Search(memory_budget=budget, time_limit=WHOLE), offload=(), **kw)  # state kept on the device: levels only
    plan = fn.plan(*args)
    weighed = {w.policy: w for w in plan.search.optimizer}
    assert list(weighed) == ["optimizer=1", "optimizer=2", "optimizer=3"]
    fits = [w for w in weighed.values() if w.seconds is not None]
    fastest = min(fits, key=lambda w: w.seconds)
    assert fastest.chosen and plan.optimizer.level == int(fastest.policy[-1]) >= 1, plan.search.line()
    assert plan.optimizer.why.startswith("chosen by the search: no plan without optimizer parallel fits")
    assert f"level {plan.optimizer.level} is the fastest that fits" in " ".join(plan.summary().split())  # wrapped
    assert plan.search.compiled_peak_bytes <= budget
    _equals_one_device(fn, args, jax.jit(step)(*args))
