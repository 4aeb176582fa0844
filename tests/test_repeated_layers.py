"""Planning an unrolled model: identical layers (same operators, shapes and wiring) share the
search's per-unit work (candidates, layouts, costs, redistribution tables), as a scanned body is
planned once."""

import jax
import numpy as np
import optax
import pytest

import jshard as js
import jshard.search._graph as search_graph
import jshard.search._recursive as recursive
from jshard import models


def _plan(n_layers: int) -> js.Plan:
    cfg = models.GPTConfig(vocab=64, seq_len=16, d_model=64, n_heads=8, n_layers=n_layers, d_ff=256, scan=False)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = jax.eval_shape(lambda: models.init_gpt(cfg, jax.random.key(0)))
    batch = tuple(jax.ShapeDtypeStruct((64, 16), t) for t in (np.int32, np.int32, np.float32))
    return js.parallelize(step, devices=64, mode="auto").plan(params, jax.eval_shape(optimizer.init, params), batch)


@pytest.fixture(scope="module")
def layouts_computed():
    """Per layer count: the layouts the search derived from factors (`write_spec` calls), and the plan."""
    counted = {}
    with pytest.MonkeyPatch.context() as mp:
        calls = [0]
        original = search_graph.write_spec

        def counting(*args, **kwargs):
            calls[0] += 1
            return original(*args, **kwargs)

        mp.setattr(search_graph, "write_spec", counting)
        for n in (2, 4):
            calls[0] = 0
            plan = _plan(n)
            counted[n] = (calls[0], plan)
    return counted


def test_identical_layers_reuse_the_search_work(layouts_computed):
    (two, plan2), (four, plan4) = layouts_computed[2], layouts_computed[4]
    assert plan4.search.units > 1.7 * plan2.search.units  # twice the layers: about twice the decisions
    assert two > 0 and four <= 1.05 * two  # ... but no new layouts to derive: the new layers repeat the old



def test_identical_layers_are_weighed_once(layouts_computed):
    """The core heuristic weighs a class of identical units once: its distinct units and cost
    evaluations stay flat while the decisions double (deterministic figures, not wall time)."""
    plan2, plan4 = layouts_computed[2][1].search, layouts_computed[4][1].search
    assert plan4.units > 1.7 * plan2.units
    assert plan4.unit_classes == plan2.unit_classes > 0
    assert 0 < plan4.evaluations <= plan2.evaluations
    assert f"({plan4.unit_classes} unit classes, {plan4.evaluations} cost evaluations)" in plan4.line()


def test_weighing_a_class_once_picks_what_weighing_each_unit_picks(layouts_computed, monkeypatch):
    """The same plan with every core unit its own class (nothing shared between identical layers)."""
    original = recursive._Level._prepare_core

    def unshared(level, core):
        original(level, core)
        level._class = {k: n for n, k in enumerate(core)}
        level._table_class = list(range(len(level.tables)))

    monkeypatch.setattr(recursive._Level, "_prepare_core", unshared)
    alone = _plan(2)
    shared = layouts_computed[2][1]
    assert alone.search.unit_classes > shared.search.unit_classes
    assert alone.ops == shared.ops and alone.in_specs == shared.in_specs and alone.out_specs == shared.out_specs
