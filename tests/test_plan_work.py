"""`Plan.work` (`WorkReport`): the share of the single-device work each device does, and where
nearly nothing is cut, the summary saying so beside the data-parallel plan's predicted time."""

import jax
import jax.numpy as jnp
import pytest

import jshard as js
from jshard._examples import build
from jshard.cost import CostModel
from jshard.search import DATA_PARALLEL, _search


def _one_line(text: str) -> str:
    return " ".join(text.split())  # the summary wraps at 120 columns


@pytest.fixture(scope="module")
def mlp():
    return build("mlp", {}, None)


def _plan(example, **options):
    return js.parallelize(example.fn, **{**example.options, "devices": 8, **options}).plan(*example.args)


def test_a_replicated_auto_plan_says_so_beside_the_data_parallel_plan(mlp):
    auto, data = _plan(mlp, mode="auto"), _plan(mlp, mode="data")
    work = auto.work
    assert work.device_flops == work.flops and work.share == 1.0  # the search cut nothing: a step of microseconds
    assert work.data_seconds == data.work.seconds  # priced on the same trace as mode="data" plans it
    assert work.data_seconds > work.seconds
    summary = _one_line(auto.summary())
    assert (f"nothing is cut: each of the 8 devices does 100% of the single-device work; the data-parallel plan would "
            f"take {work.data_seconds * 1e6:.3g} us per call against {work.seconds * 1e6:.3g} us for this one: the cost "
            f"model says the step is too small to cut (cutting the batch saves ") in summary
    assert "of compute per device and costs" in summary and "of collectives)" in summary


def test_a_plan_that_cuts_the_work_says_nothing_of_it(mlp):
    data = _plan(mlp, mode="data")
    assert data.work.share < 0.9 and data.work.data_seconds is None
    assert data.work.line() is None and " is cut:" not in data.summary()


def _matmul(w, x):
    return x @ w


def test_a_replicated_plan_slower_than_data_parallel_names_mode_data():
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((1024, 1024), f32), jax.ShapeDtypeStruct((4096, 1024), f32))
    plan = js.parallelize(_matmul, devices=8, dataset_strategy="full_batch").plan(*args)
    assert plan.work.share == 1.0 and plan.work.data_seconds < plan.work.seconds
    assert ("nothing is cut: each of the 8 devices does 100% of the single-device work; the data-parallel plan would "
            "take ") in _one_line(plan.summary())
    assert "the data-parallel plan is predicted faster (it saves" in _one_line(plan.summary())
    assert "parallelize(mode='data') plans it" in _one_line(plan.summary())


def test_a_batch_that_does_not_divide_says_why_there_is_no_data_parallel_plan():
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((64, 64), f32), jax.ShapeDtypeStruct((12, 64), f32))
    plan = js.parallelize(_matmul, devices=8, dataset_strategy="full_batch").plan(*args)
    assert plan.work.data_seconds is None
    assert ("nothing is cut: each of the 8 devices does 100% of the single-device work; no data-parallel plan to "
            "compare: dataset_strategy='data_parallel' cuts dim 0 of the batch input args[1] (shape [12, 64]) over 8 "
            "devices, but 8 does not divide 12.") in _one_line(plan.summary())


def _mostly_parameters(w, x):
    return (w @ w).sum() + x.sum()


def test_data_mode_where_little_follows_the_batch():
    f32 = jnp.float32
    args = (jax.ShapeDtypeStruct((256, 256), f32), jax.ShapeDtypeStruct((8, 4), f32))
    plan = js.parallelize(_mostly_parameters, devices=8, mode="data").plan(*args)
    assert 0.999 < plan.work.share < 1.0  # shown as 99.9%, never as 100% for a plan that cuts something
    assert ("little is cut: each of the 8 devices does 99.9% of the single-device work; mode='data' "
            "cuts only the batch arguments, and little of this program's work follows them") in _one_line(plan.summary())

H100 = CostModel.for_device("H100")


def test_on_a_known_device_the_budget_is_its_memory_and_a_whole_batch_per_device_says_why(mlp):
    """Issue 32 item 4: `mode="auto"` on an H100's cost model is held to its 80 GiB and weighs the
    data-parallel plan; it keeps every device computing the whole batch only where that predicts
    at least `MEASURABLY` less, and the summary says why in one line."""
    plan = _plan(mlp, mode="auto", cost_model=H100)
    report, work = plan.search, plan.work
    assert report.budget == 80 * 2**30 and report.budget_from == "the memory of one H100, no memory_budget given"
    assert work.replicated and work.seconds <= (1 - _search.MEASURABLY) * work.data_seconds  # measurably faster
    line = work.line()
    assert line in _one_line(plan.summary()) and "the cost model says the step is too small to cut" in line


def test_on_a_known_device_a_whole_batch_not_measurably_faster_gives_way_to_data_parallel(mlp, monkeypatch):
    monkeypatch.setattr(_search, "MEASURABLY", 1.0)  # no plan is measurably faster than data parallel
    plan = _plan(mlp, mode="auto", cost_model=H100)
    assert plan.search.status.startswith(f"{DATA_PARALLEL}: the search's plan (")
    assert "of the work and predicts" in plan.search.status and "less than 100% faster" in plan.search.status
    assert not plan.work.replicated and plan.work.line() is None
