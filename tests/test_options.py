"""`parallelize`'s option groups (`js.Search`, `js.Pipelining`, `js.OptimizerParallel`,
`js.Accumulation`, `js.CostModel`): the keywords they replaced still build the same `Options`, with a
`DeprecationWarning` naming the new spelling, for one release."""

import inspect
import warnings

import pytest

import jshard as js
from jshard.compile import Options

OLD_AND_NEW = [
    (dict(mode="auto", search="ilp", memory_budget="1GiB", search_time_limit=5, search_replay=False),
     dict(mode="auto", search=js.Search("ilp", memory_budget="1GiB", time_limit=5, replay=False))),
    (dict(pipeline_stages=2, micro_batches=4, schedule="gpipe", virtual_stages=1, pipeline_result_broadcast=True),
     dict(pipeline=js.Pipelining(2, 4, schedule="gpipe", result_broadcast=True))),
    (dict(optimizer_parallel=3, optimizer_parallel_threshold="16KiB", optimizer_state_argnums=1,
          optimizer_comm_recompute=True),
     dict(optimizer=js.OptimizerParallel(3, threshold="16KiB", state_argnums=(1,), comm_recompute=True))),
    (dict(optimizer_parallel=2), dict(optimizer=2)),
    (dict(accumulation_steps=4, accumulation_shard=True), dict(accumulation=js.Accumulation(4, shard=True))),
    (dict(accumulation_steps=4), dict(accumulation=4)),
    (dict(enable_alltoall=False), dict(cost_model=js.CostModel(alltoall=False))),
]


@pytest.mark.parametrize("old, new", OLD_AND_NEW, ids=lambda kw: ",".join(kw))
def test_old_keywords_build_the_same_options_and_warn_with_the_new_spelling(old, new):
    with pytest.warns(DeprecationWarning, match=r"jshard.parallelize: \w+= is deprecated; write \w+=js\.\w+\(\w+=\.\.\.\)"):
        was = Options.create(**old)
    assert was == Options.create(**new)


def test_the_warning_points_at_the_callers_line():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        js.parallelize(lambda x: x, devices=8, accumulation_steps=2)
    assert [w.filename for w in caught] == [__file__]


def test_old_keywords_at_their_defaults_ask_for_nothing():
    with pytest.warns(DeprecationWarning):
        options = Options.create(schedule="1f1b", optimizer_parallel=None, accumulation_steps=None)
    assert (options.pipeline, options.optimizer, options.accumulation) == (None, None, None)


def test_a_group_given_both_ways_is_refused():
    with pytest.raises(TypeError, match=r"pipeline= and micro_batches= both set the pipeline options; give "
                                        r"pipeline=js\.Pipelining\(\.\.\.\) alone"), pytest.warns(DeprecationWarning):
        js.parallelize(lambda x: x, pipeline=js.Pipelining(2, 4), micro_batches=8)


@pytest.mark.parametrize("kw, message", [
    (dict(search=3), r"search= takes a js\.Search\(\.\.\.\), or str \(method\), got int 3"),
    (dict(pipeline=2), r"pipeline= takes a js\.Pipelining\(\.\.\.\), got int 2"),
    (dict(optimizer="2"), r"optimizer= takes a js\.OptimizerParallel\(\.\.\.\), or int \(level\), got str '2'"),
    (dict(memory_budgets=1), r"got an unexpected keyword argument 'memory_budgets'"),
])
def test_a_wrong_kind_of_group_is_named(kw, message):
    with pytest.raises(TypeError, match=message):
        js.parallelize(lambda x: x, **kw)


def test_parallelize_reads_like_jit():
    keywords = [p for p in inspect.signature(js.parallelize).parameters.values() if p.kind is p.KEYWORD_ONLY]
    # 21: jit's own, where it runs, the strategies, and one group per concern (communication the last added)
    assert len(keywords) <= 21, [p.name for p in keywords]
    assert len(inspect.getsource(inspect.getmodule(js.parallelize)).splitlines()) < 200  # a front end, not a builder
