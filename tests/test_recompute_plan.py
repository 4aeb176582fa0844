"""The `Plan` shows recompute: per operator its region (`jshard.recompute` with its policy, or a bare
`jax.checkpoint`) and whether it is the backward pass's run of it again; `explain` says why; the
summary gives the memory model's peak with the recompute and with the recomputed values kept; a
saved plan keeps the operators' recompute fields (plans only); and the collectives inside a region
are run again with it (MindSpore's `mp_comm_recompute`), read from the compiled program."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _remat_gpt import gpt_step

import jshard as js
from jshard import models

CFG = models.GPTConfig(vocab=32, seq_len=16, d_model=32, n_heads=4, n_layers=2, d_ff=128)
BATCH = 32


def _plan(wrap):
    params = models.init_gpt(CFG, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), CFG, BATCH)
    return js.parallelize(gpt_step(CFG, None, wrap), devices=8, mode="data").plan(params, batch)


WRAPS = {
    "recompute-full": (js.recompute, "jshard.recompute(policy='full')"),
    "recompute-selective": (lambda f: js.recompute(f, policy="selective"), "jshard.recompute(policy='selective')"),
    "checkpoint": (jax.checkpoint, "jax.checkpoint(policy=full)"),
}


@pytest.mark.parametrize("wrap", WRAPS)
def test_ops_name_their_region_and_the_backward_runs_them_again(wrap):
    fn, region = WRAPS[wrap]
    plan = _plan(fn)
    again = [op for op in plan.ops if op.recomputed]
    assert again and all(op.backward and op.recompute == region for op in again)
    forward = [op for op in plan.ops if op.recompute and not op.backward]
    # each op run again comes from a forward line of its region (its forward run, or, for the
    # residuals the linearization makes, such as tanh's 1 - y**2, the line it differentiates)
    assert {op.source for op in again} <= {op.source for op in forward}
    assert {op.recompute for op in plan.ops} == {"", region}
    assert not any(op.recompute for op in plan.ops if "_masked_nll" in op.source and not op.backward)
    (name, count, rerun), = plan.recompute.regions
    assert (name, count, rerun) == (region, sum(op.recompute == region for op in plan.ops), len(again))
    first = plan.explain(again[0]).splitlines()[-1]
    who = "the user's jax.checkpoint (or a remat built on it)" if wrap == "checkpoint" else "the user's jshard.recompute call"
    assert first == (f"  recomputed: the backward pass runs this forward operator again instead of keeping its "
                     f"result ({region}, {who})")


def test_selective_keeps_the_matmuls_and_reruns_the_rest():
    plan = _plan(lambda f: js.recompute(f, policy="selective"))
    assert not any(op.recomputed and op.primitive == "dot_general" for op in plan.ops)
    dot = next(op for op in plan.ops if op.primitive == "dot_general" and op.recompute and not op.backward)
    assert plan.explain(dot).splitlines()[-1] == (
        "  in a recompute region (jshard.recompute(policy='selective'), the user's jshard.recompute call): not run "
        "again in the backward pass (its policy saves the result, or the backward pass does not need it)")
    tanh = next(op for op in plan.ops if op.primitive in ("tanh", "exp") and op.recompute and not op.backward)
    assert plan.explain(tanh).endswith("its result is not kept for the backward pass, which runs it again")


def test_the_summary_gives_the_peak_with_and_without_recompute():
    plan = _plan(js.recompute)
    report = plan.recompute
    # the memory model holds the recomputed values only in the backward pass; kept, from the forward
    assert 0 < report.peak_bytes < report.kept_peak_bytes
    assert " ".join(report.line().split()) in " ".join(plan.summary().split())  # the summary wraps at 120 columns
    assert _plan(lambda f: f).recompute is None


def test_a_saved_plan_keeps_the_recompute_fields(tmp_path):
    plan = _plan(js.recompute)
    plan.save(tmp_path / "plan.json")
    loaded = js.Plan.load(tmp_path / "plan.json")
    assert loaded.ops == plan.ops
    assert sum(op.recomputed for op in loaded.ops) == plan.recompute.regions[0][2]


def _two_layers(wrap):
    def layer(w, x):
        h = jnp.tanh(js.shard(jnp.matmul, ((8, 1), (1, 1)))(x, w))  # rows cut 8 ways
        return js.shard(jnp.matmul, ((1, 1), (1, 8)))(h, w * 1.0)  # rows whole: h all-gathered

    f = wrap(layer)
    step = js.parallelize(jax.grad(lambda w, x: f(w, f(w, x)).sum()), devices=8)
    return js.audit(step.lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile())


def test_the_gathers_inside_a_region_run_again_in_the_backward_pass():
    kept, again = _two_layers(lambda f: f), _two_layers(js.recompute)
    # each layer gathers h (64 x 64 f32, 16 KiB) once forward; recomputed, again in the backward pass
    assert kept.count("all-gather") == 2 and kept.bytes("all-gather") == 2 * 16 * 2**10
    assert again.count("all-gather") > kept.count("all-gather")
    assert again.bytes("all-gather") >= 2 * kept.bytes("all-gather")
