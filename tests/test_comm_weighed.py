"""The search weighs multi-copy and all-reduce fusion (`mode="auto"`, no `communication=` given, the
gradient function marked by `jshard.accumulate`): with the overlap cost model, each copy count and
the all-reduces kept apart planned and priced like any other choice, the fastest kept and
`Plan.communication` saying why; where nothing overlaps, one copy. The user's setting is never
overridden. A copy count no plan of which can beat the arrangement held is traced, not searched
(`jshard.compile._least.least_step`: a plan runs a collective, at least the mesh's least latency, or
none, at least the compute of what it cannot cut): the plan kept is the one weighing every count
keeps, and the bound is never above a plan the search makes."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close, step_terms

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
    return js.accumulate(jax.value_and_grad(_loss), 1)(p, b)


def _shapes(width: int, rows: int):
    """Two MLP blocks (width -> 4 width -> width) and a batch of `rows` rows, as shapes."""
    f32 = jnp.float32
    params = [(jax.ShapeDtypeStruct((width, 4 * width), f32), jax.ShapeDtypeStruct((4 * width, width), f32))] * 2
    batch = {k: jax.ShapeDtypeStruct((rows, width), f32) for k in ("x", "y")}
    return params, batch


def _weighed(plan) -> dict[str, float | None]:
    return {w.policy: w.seconds for w in plan.communication.weighed}


def test_on_an_h100_the_search_runs_two_copies_where_one_hides_the_others_collectives():
    """At width 4096 the search cuts the blocks Megatron's way (their activations all-reduced
    between the matmuls): with two copies one copy's all-reduces run beside the other's matmuls."""
    plan = js.parallelize(_step, devices=8, mode="auto", cost_model=H100).plan(*_shapes(4096, 4096))
    weighed = _weighed(plan)
    assert set(weighed) == {"copies=1, XLA's fusion", "copies=1, allreduce size 0", "copies=2", "copies=4"}
    assert plan.communication.copies == 2
    assert weighed["copies=2"] == min(weighed.values()) < weighed["copies=1, XLA's fusion"]
    assert plan.search.seconds == weighed["copies=2"]
    assert plan.work.hidden_seconds > 0.0
    why = plan.communication.why
    assert why.startswith("chosen by the search: copies=2: the fastest predicted") and "\n" not in why
    assert "hidden behind another copy's compute" in why
    assert why in " ".join(plan.summary().split())  # the summary's communication line, wrapped


def test_where_nothing_overlaps_one_copy_is_kept_without_weighing_more():
    plan = js.parallelize(_step, devices=8, mode="auto").plan(*_shapes(4096, 4096))
    assert plan.communication.copies == 1
    assert [w.policy for w in plan.communication.weighed] == ["copies=1, XLA's fusion"]
    assert "overlaps no collective with compute" in plan.communication.why
    assert plan.search.searches == 1


def test_the_users_communication_is_never_overridden():
    plan = js.parallelize(_step, devices=8, mode="auto", cost_model=H100, communication=1).plan(*_shapes(4096, 4096))
    assert plan.communication.copies == 1 and not plan.communication.weighed


def test_copies_the_batch_cannot_be_dealt_into_are_not_weighed():
    plan = js.parallelize(_step, devices=8, mode="auto", cost_model=H100).plan(*_shapes(4096, 4098))
    assert set(_weighed(plan)) == {"copies=1, XLA's fusion", "copies=1, allreduce size 0", "copies=2"}  # 4 does not divide


@functools.cache
def _small():
    rng = np.random.default_rng(0)
    width, rows = 256, 256
    params = [(jnp.asarray(rng.normal(size=(width, 4 * width)) / 16, jnp.float32),
               jnp.asarray(rng.normal(size=(4 * width, width)) / 32, jnp.float32)) for _ in range(2)]
    batch = {k: jnp.asarray(rng.normal(size=(rows, width)), jnp.float32) for k in ("x", "y")}
    return params, batch


def test_a_chosen_multi_copy_plan_equals_one_device():
    """The width-4096 blocks' prices at width 256: the H100 with its FLOP rates 16**3 times slower and
    its bandwidths 16**2 times (each operator takes as long as at width 4096), so the search
    chooses copies here too; the program it builds is compiled and run on the CPU devices."""
    slow = dataclasses.replace(H100, flops=H100.flops / 4096, matmul_flops=H100.matmul_flops / 4096,
                               memory_bandwidth=H100.memory_bandwidth / 256, bandwidth=H100.bandwidth / 256)
    params, batch = _small()
    step = js.parallelize(_step, devices=8, mode="auto", cost_model=slow)
    assert step.plan(params, batch).communication.copies > 1
    assert_close(step(params, batch), jax.jit(jax.value_and_grad(_loss))(params, batch),
                 terms=step_terms(params, batch))


@pytest.mark.parametrize("copies", [1, 2])
def test_the_search_prices_the_combiner_off_for_multi_copy(copies):
    """XLA's all-reduce combiner is off under multi-copy: the search pays each all-reduce's latency."""
    from jshard.compile._fusion import combines

    assert combines(None) and combines(js.Communication(fusion={"allreduce": {"mode": "size", "config": 1}}))
    assert not combines(js.Communication(copies)) if copies > 1 else combines(js.Communication(copies))
    assert not combines(js.Communication(fusion={"allreduce": {"mode": "size", "config": 0}}))


def test_past_the_planning_deadline_no_further_arrangement_is_weighed():
    """The planning session's deadline bounds the weighing: once the one-copy plan fits, the others
    are left out and the plan names them."""
    plan = js.parallelize(_step, devices=8, mode="auto", cost_model=H100,
                          search=js.Search(time_limit=1e-9)).plan(*_shapes(4096, 4096))
    assert [w.policy for w in plan.communication.weighed] == ["copies=1, XLA's fusion"]
    assert plan.communication.copies == 1 and "the only arrangement weighed before the time limit" in plan.communication.why
    assert any("communication copies=2" in line for line in plan.search.skipped), plan.search.skipped


def test_a_saved_multi_copy_plan_loads_and_runs_as_it_was_made(tmp_path):
    """The copies the search chose are in the plan file: `plan=Plan.load(path)` traces the step in as
    many copies again (its operators are those copies'), so the loaded plan rebuilds the same program."""
    slow = dataclasses.replace(H100, flops=H100.flops / 4096, matmul_flops=H100.matmul_flops / 4096,
                               memory_bandwidth=H100.memory_bandwidth / 256, bandwidth=H100.bandwidth / 256)
    params, batch = _small()
    plan = js.parallelize(_step, devices=8, mode="auto", cost_model=slow).plan(params, batch)
    assert plan.communication.copies == 2
    plan.save(tmp_path / "plan.json")
    step = js.parallelize(_step, devices=8, plan=js.Plan.load(tmp_path / "plan.json"))
    again = step.plan(params, batch)
    assert again.communication.copies == 2 and js.Plan.load(tmp_path / "plan.json").ops == plan.ops
    assert [op.layout for op in again.ops] == [op.layout for op in plan.ops]  # the same program's operators, laid out as saved
    assert_close(step(params, batch), jax.jit(jax.value_and_grad(_loss))(params, batch), terms=step_terms(params, batch))
    with pytest.raises(js.ShardingError, match="made with the step's batch in 2 copies"):
        js.parallelize(_step, devices=8, plan=js.Plan.load(tmp_path / "plan.json"), communication=4).plan(params, batch)


def test_a_saved_plan_of_given_copies_loads_in_its_own_mode(tmp_path):
    """`mode="data"` runs given copies in a data-parallel manual region, not auto's global view: the
    loaded plan is traced in the mode it was made in."""
    params, batch = _small()
    js.parallelize(_step, devices=8, mode="data", communication=2).plan(params, batch).save(tmp_path / "plan.json")
    step = js.parallelize(_step, devices=8, plan=js.Plan.load(tmp_path / "plan.json"))
    assert step.plan(params, batch).choices == (("copies", 2),)
    assert_close(step(params, batch), jax.jit(jax.value_and_grad(_loss))(params, batch), terms=step_terms(params, batch))


def test_the_weighing_traces_the_gradient_function_once_per_copy_count():
    """Weighing the four arrangements of an accumulated step traces the loss three times: once for
    one copy (the micro-batch loop's body and its carry's shapes from one trace), none more for the
    all-reduces apart (the fusion changes no trace), once for each of 2 and 4 copies (one copy's
    trace run in each); each arrangement is searched once, and the plan is that of one trace each."""
    traced = []

    def loss(p, b):
        traced.append(b["x"].shape)
        return _loss(p, b)

    def step(p, b):
        return js.accumulate(jax.value_and_grad(loss))(p, b)

    plan = js.parallelize(step, devices=8, mode="auto", cost_model=H100, accumulation=4).plan(*_shapes(256, 256))
    assert len(plan.communication.weighed) == 4 and plan.search.searches == 4
    assert traced == [(64, 256), (32, 256), (16, 256)]  # a micro-batch of 256 / 4 rows, in 1, 2 and 4 copies


def test_copies_whose_trace_records_in_the_trace_context_are_each_traced():
    """A copy that records something while traced (here a `jshard.recompute(policy="auto")` region)
    is traced once per copy, each recording its own (the search gives each region its own policy)."""
    traced = []

    def loss(p, b):
        traced.append(b["x"].shape)
        return js.recompute(_loss, policy="auto")(p, b)

    def step(p, b):
        return js.accumulate(jax.value_and_grad(loss))(p, b)

    plan = js.parallelize(step, devices=8, mode="auto", communication=2, accumulation=2).plan(*_shapes(256, 256))
    assert plan.communication.copies == 2
    assert traced[:3] == [(64, 256)] * 3  # the trace to reuse, left, then each copy's own
    assert len(plan.search.regions) == 2


def _updating_step(p, b):
    """`_step` that also updates the parameters, as a train step does (its results become its arguments)."""
    loss, grads = js.accumulate(jax.value_and_grad(_loss))(p, b)
    return [(w1 - 0.1 * g1, w2 - 0.1 * g2) for (w1, w2), (g1, g2) in zip(p, grads)], loss


def _bounded_plan(width: int, rows: int):
    step = js.parallelize(_updating_step, devices=8, mode="auto", cost_model=H100, accumulation=2)
    return step.plan(*_shapes(width, rows))


def test_a_copy_count_that_cannot_beat_one_copy_is_not_searched_and_the_plan_is_unchanged(monkeypatch):
    """A step too small to cut: every plan with a collective waits at least its latency, more than
    the whole step on one device; so no plan of two or four copies, whose compute is more, nor of
    the all-reduces kept apart (which can only tie), is searched, and the plan is the one weighing
    them keeps."""
    bounded = _bounded_plan(16, 64)
    monkeypatch.setattr(_weigh, "_beaten", lambda *a: False)
    weighed = _bounded_plan(16, 64)
    others = ["copies=1, allreduce size 0", "copies=2", "copies=4"]
    assert [w.policy for w in weighed.communication.weighed] == ["copies=1, XLA's fusion", *others]
    assert [w.policy for w in bounded.communication.weighed] == ["copies=1, XLA's fusion"]
    assert bounded.communication.copies == weighed.communication.copies == 1
    assert "no plan of copies=1, allreduce size 0; copies=2; copies=4 can beat it" in bounded.communication.why
    assert (bounded.search.seconds, bounded.search.peak_bytes) == (weighed.search.seconds, weighed.search.peak_bytes)
    assert [(o.primitive, o.in_strategy, o.out_strategy) for o in bounded.ops] == [
        (o.primitive, o.in_strategy, o.out_strategy) for o in weighed.ops
    ]
    assert bounded.search.searches == weighed.search.searches - 3
    skipped = [line for line in bounded.search.skipped if "not weighed, no plan of it can beat" in line]
    assert [line.split(" not weighed")[0] for line in skipped] == others
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
    _bounded_plan(width, rows)
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
