"""Planning an unrolled model: identical layers (same operators, shapes and wiring) share the
search's per-unit work (candidates, layouts, costs, redistribution tables), as a scanned body is
planned once."""

import jax
import numpy as np
import optax
import pytest

import jshard as js
import jshard.search._graph as search_graph
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

