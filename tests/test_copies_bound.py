"""The weighing of copies leaves out a copy count no plan of which can beat the arrangement it holds
(`jshard.compile._least.least_step`: a plan runs a collective, at least the mesh's least latency,
or none, at least the compute of what it cannot cut): the plan kept is the one weighing every count
keeps, and the bound is never above a plan the search makes."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js
from jshard.compile import _weigh
from jshard.compile._least import least_step
from jshard.cost import CostModel

H100 = CostModel.for_device("H100")


def _loss(p, b):
    h = b["x"]
    for w1, w2 in p:
        h = jnp.tanh(h @ w1) @ w2
    return jnp.mean((h - b["y"]) ** 2)


def _step(p, b):
    loss, grads = js.accumulate(jax.value_and_grad(_loss))(p, b)
    return [(w1 - 0.1 * g1, w2 - 0.1 * g2) for (w1, w2), (g1, g2) in zip(p, grads)], loss


def _shapes(width: int, rows: int):
    """Two MLP blocks (width -> 4 width -> width) and a batch of `rows` rows, as shapes."""
    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((width, 4 * width), f32), jax.ShapeDtypeStruct((4 * width, width), f32))] * 2
    batch = {k: jax.ShapeDtypeStruct((rows, width), f32) for k in ("x", "y")}
    return params, batch


def _plan(width: int, rows: int):
    return js.parallelize(_step, devices=8, mode="auto", cost_model=H100, accumulation=2).plan(*_shapes(width, rows))


def test_a_copy_count_that_cannot_beat_one_copy_is_not_searched_and_the_plan_is_unchanged(monkeypatch):
    """A step too small to cut: every plan with a collective waits at least its latency, more than
    the whole step on one device; so no plan of two or four copies, whose compute is more, is
    searched, and the plan is the one weighing them keeps."""
    bounded = _plan(16, 64)
    monkeypatch.setattr(_weigh, "_beaten", lambda *a: False)
    weighed = _plan(16, 64)
    assert [w.policy for w in weighed.communication.weighed][2:] == ["copies=2", "copies=4"]
    assert [w.policy for w in bounded.communication.weighed] == [w.policy for w in weighed.communication.weighed][:2]
    assert bounded.communication.copies == weighed.communication.copies == 1
    assert bounded.communication.why == weighed.communication.why
    assert (bounded.search.seconds, bounded.search.peak_bytes) == (weighed.search.seconds, weighed.search.peak_bytes)
    assert [(o.primitive, o.in_strategy, o.out_strategy) for o in bounded.ops] == [
        (o.primitive, o.in_strategy, o.out_strategy) for o in weighed.ops
    ]
    assert bounded.search.searches == weighed.search.searches - 2
    skipped = [line for line in bounded.search.skipped if "not weighed, no plan of it can beat" in line]
    assert [line.split(" not weighed")[0] for line in skipped] == ["copies=2", "copies=4"]
    assert all("each runs a collective (at least 5 us)" in line for line in skipped)


@pytest.mark.parametrize("width, rows", [(16, 64), (256, 256), (1024, 1024)], ids=["small", "medium", "large"])
def test_the_bound_is_never_above_a_plan_the_search_makes(monkeypatch, width, rows):
    """Every arrangement weighed, each planned one's bound against the search's predicted seconds."""
    seen = []
    planned = _weigh._plan_regions

    def recorded(s, t, check=True):
        program = planned(s, t, check)
        seen.append((least_step(t, s.options.costs).seconds, program.plan.search.seconds))
        return program

    monkeypatch.setattr(_weigh, "_beaten", lambda *a: False)
    monkeypatch.setattr(_weigh, "_plan_regions", recorded)
    _plan(width, rows)
    assert len(seen) == 4
    for least, seconds in seen:
        assert 0 < least <= seconds * (1 + _weigh.BOUND_MARGIN)


def test_copies_whose_recompute_regions_are_traced_again_per_policy_are_still_searched():
    """A trace with `policy="auto"` regions is planned once per policy, each traced again: its bound
    says nothing of those traces, so every copy count is searched."""

    def step(p, b):
        return js.accumulate(jax.value_and_grad(js.recompute(_loss, policy="auto")))(p, b)

    plan = js.parallelize(step, devices=8, mode="auto", cost_model=H100, accumulation=2).plan(*_shapes(16, 64))
    assert [w.policy for w in plan.communication.weighed][2:] == ["copies=2", "copies=4"]
    assert not any("not weighed, no plan of it can beat" in line for line in plan.search.skipped)
