"""The recursive search's memory weight under a budget that binds (issue 32: planning in compile
time): the grid of λ grown from near the price per byte the cheapest fitted seed pays
(`_recursive._start`) and the tables shared by the searches of one program (`_shared.Reused`)
make the plan that growing from the grid's first step and searching afresh make, in fewer runs."""

import jax
import numpy as np
import optax

import jshard as js
from jshard import models


def _mlp():
    cfg = models.MLPConfig(64, 256, 64, 2)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.mlp_loss(p, b), optimizer)
    params = models.init_mlp(cfg, jax.random.key(0))
    return step, (params, optimizer.init(params), models.mlp_batch(np.random.default_rng(0), cfg, 64))


def _planned(step, args, budget):
    return js.parallelize(step, devices=8, mode="auto", search=js.Search(memory_budget=budget)).plan(*args)


def _same(a: js.Plan, b: js.Plan) -> None:
    assert (a.search.seconds, a.search.peak_bytes, a.search.status) == (
        b.search.seconds,
        b.search.peak_bytes,
        b.search.status,
    )
    assert a.in_specs == b.in_specs and a.out_specs == b.out_specs
    assert [(o.in_specs, o.out_specs) for o in a.ops] == [(o.in_specs, o.out_specs) for o in b.ops]


def test_the_growth_starts_near_the_seeds_price_and_finds_the_plan_growing_from_the_start_finds(monkeypatch):
    from jshard.search import _recursive

    step, args = _mlp()
    budget = 0.8 * js.parallelize(step, devices=8, mode="auto").plan(*args).search.peak_bytes
    started = []
    start = _recursive._start
    monkeypatch.setattr(_recursive, "_start", lambda *a: started.append(start(*a)) or started[-1])
    hinted = _planned(step, args, budget)
    assert max(started) > 0, started  # the seed's price starts the growth above step 0
    monkeypatch.setattr(_recursive, "_start", lambda *a: 0)
    grown = _planned(step, args, budget)
    assert "memory weight" in grown.search.status and grown.search.runs > 3, grown.search.line()
    _same(hinted, grown)
    assert hinted.search.runs < grown.search.runs, (hinted.search.line(), grown.search.line())
    assert hinted.search.peak_bytes <= budget and hinted.search.compiled_peak_bytes <= budget


def test_the_searches_of_one_program_share_their_tables_and_plan_as_apart(monkeypatch):
    from jshard.search import _search, _shared

    step, args = _mlp()
    budget = 0.8 * js.parallelize(step, devices=8, mode="auto").plan(*args).search.peak_bytes
    served, serves = [], _shared.Reused.serves

    def spied(self, g, edge_values):
        served.append((id(self), self._claimed is not None, serves(self, g, edge_values)))
        return served[-1][2]

    monkeypatch.setattr(_shared.Reused, "serves", spied)
    shared = _planned(step, args, budget)
    assert any(claimed and ok for _, claimed, ok in served), served  # a later search read an earlier one's
    monkeypatch.setattr(_search, "_reused", lambda *a: None)
    apart = _planned(step, args, budget)
    _same(shared, apart)
