"""The searches under budgets (issue 15): the ILP never returns a plan worse than the recursive
search's (its warm start), and under a budget the expert plan fits in, the ILP finds a plan that
fits too."""

import jax
import numpy as np
import optax
import pytest

import jshard as js
from jshard import models


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
    ilp = js.parallelize(step, devices=8, mode="auto", search="ilp", search_time_limit=4).plan(*args).search
    assert ilp.seconds <= recursive.seconds * (1 + 1e-9), (ilp.line(), recursive.line())
    assert ilp.kept.startswith(("the ILP's plan", "the recursive plan (the warm start)"))
    assert f"kept {ilp.kept}" in ilp.line()
    if ilp.kept.startswith("the recursive plan"):  # kept whole: the recursive search's own plan and price
        assert ilp.seconds == pytest.approx(recursive.seconds, rel=1e-12)
