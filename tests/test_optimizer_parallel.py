"""Optimizer parallel (ZeRO; `parallelize(..., optimizer=1 | 2 | 3)`): the reference GPT
with Adam under data parallel 8 and under the 2-D preset equals one device over 3 steps, with its
optimizer state (and at level 3 its parameters) cut 8 ways per leaf above the threshold, read from
the compiled program."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _loop import run_steps
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models
from jshard._format import human_bytes

STEPS = 3
CFG = models.GPTConfig(n_layers=1)
THRESHOLD = 16 * 2**10  # bytes: the attention (16 KiB) and feed-forward (64 KiB) weights, not the rest
OPT = optax.adam(1e-3)


def _problem():
    params = models.init_gpt(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    batches = [models.copy_task_batch(rng, CFG, 8) for _ in range(STEPS)]
    return params, OPT.init(params), batches



@functools.cache
def _reference():
    params, state, batches = _problem()
    return run_steps(jax.jit(models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG), OPT)), params, state, batches)


def _per_device(x, sharding) -> int:
    return math.prod(sharding.shard_shape(np.shape(x))) * np.dtype(x.dtype).itemsize


def _big(x) -> bool:
    return np.size(x) * np.dtype(x.dtype).itemsize >= THRESHOLD


def _check_cut(leaves, shardings, ways: int, cut: bool, small: bool = True):
    """Every leaf above the threshold is held `ways` times smaller per device than whole (all of them
    when `cut`), every other leaf whole (unless not `small`: the strategy lays them out)."""
    for x, sh in zip(leaves, shardings):
        whole = np.size(x) * np.dtype(x.dtype).itemsize
        if not small and not _big(x):
            continue
        assert _per_device(x, sh) == (whole // ways if cut and _big(x) else whole), (np.shape(x), sh)


def _compare(step, params, state, batches):
    got_params, got_state, got_losses = run_steps(step, params, state, batches)
    ref_params, ref_state, ref_losses = _reference()
    terms = STEPS * step_terms(params, batches[0])
    assert_close(got_losses, ref_losses, dtype=np.float32, terms=terms)
    assert_close(got_params, ref_params, terms=terms)
    return got_params, got_state


@functools.cache
def _data_parallel(level: int):
    params, state, batches = _problem()
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG), OPT)
    step = js.parallelize(train, devices=8, mode="data", optimizer=js.OptimizerParallel(level, threshold="16KiB"))
    return step, step.lower(params, state, batches[0]).compile()


@pytest.mark.parametrize("level", [1, 2, 3])
def test_data_parallel_levels_cut_state_and_equal_one_device(level):
    params, state, batches = _problem()
    step, compiled = _data_parallel(level)
    (p_sh, s_sh, _), _ = compiled.input_shardings
    p_leaves, s_leaves = jax.tree.leaves(params), jax.tree.leaves(state)
    _check_cut(s_leaves, jax.tree.leaves(s_sh), 8, cut=True)
    _check_cut(p_leaves, jax.tree.leaves(p_sh), 8, cut=level == 3)
    # XLA's buffer assignment holds exactly these bytes per device for the arguments.
    held = sum(_per_device(x, sh) for x, sh in zip(jax.tree.leaves((params, state, batches[0])),
                                                   jax.tree.leaves(compiled.input_shardings[0])))
    assert compiled.memory_analysis().argument_size_in_bytes == held
    big_params = sum(x.nbytes for x in p_leaves if _big(x))
    report = js.audit(compiled)
    # Level 1 and 2 gather the cut updates of the parameters above the threshold, level 3 the
    # parameters themselves before use; the gradients are summed over all 8 devices, once.
    assert report.bytes("all-gather") == big_params
    assert report.count("all-reduce") + report.count("reduce-scatter") > 0
    new_params, new_state = _compare(step, params, state, batches)
    _check_cut(jax.tree.leaves(new_state), [x.sharding for x in jax.tree.leaves(new_state)], 8, cut=True)
    _check_cut(jax.tree.leaves(new_params), [x.sharding for x in jax.tree.leaves(new_params)], 8, cut=level == 3)


@pytest.mark.parametrize("level", [2, 3])
def test_levels_2_and_3_reduce_scatter_the_gradients_on_cpu_with_no_more_bytes_than_level_1(level):
    """XLA:CPU makes all-reduce + dynamic-slice of a cut gradient; jshard emits the reduce-scatter
    itself: one per gradient above the threshold, no all-to-all, and no more collective bytes than
    level 1 (the HLO's operand bytes; a reduce-scatter moves half an all-reduce's on the wire)."""
    params, state, batches = _problem()
    step, compiled = _data_parallel(level)
    report, first = js.audit(compiled), js.audit(_data_parallel(1)[1])
    big = [x for x in jax.tree.leaves(params) if _big(x)]
    assert first.count("reduce-scatter") == 0
    assert report.count("reduce-scatter") == len(big) and report.bytes("reduce-scatter") == sum(x.nbytes for x in big)
    assert report.count("all-to-all") == 0
    assert report.bytes() <= first.bytes()
    assert report.bytes("all-reduce") + report.bytes("reduce-scatter") <= first.bytes("all-reduce")
    assert step.plan(params, state, batches[0]).optimizer.reduce_scattered == len(big)


def test_auto_mode_level_3_cuts_state_and_parameters_and_equals_one_device():
    params, state, batches = _problem()
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG), OPT)
    step = js.parallelize(train, devices=8, mode="auto", optimizer=js.OptimizerParallel(3, threshold=THRESHOLD))
    plan = step.plan(params, state, batches[0])
    assert plan.search is not None and plan.optimizer.state_cut > 0 and plan.optimizer.params_cut > 0
    (p_sh, s_sh, _), _ = step.lower(params, state, batches[0]).compile().input_shardings
    for x, sh in zip(jax.tree.leaves((params, state)), jax.tree.leaves((p_sh, s_sh))):
        if _big(x):  # the search left these whole (a tiny model): the cut takes all 8 devices
            assert _per_device(x, sh) == np.size(x) * np.dtype(x.dtype).itemsize // 8, (np.shape(x), sh)
    _compare(step, params, state, batches)


def test_level_2_reduce_scatters_stacked_layers_in_the_scan_body_and_equals_one_device():
    """The GPT of 2 blocks stacked under `lax.scan`: each layer's weight gradient is made in the
    loop body, where the reduce-scatter runs (6 gradients, 2 trips), and the step equals one device."""
    cfg = models.GPTConfig(n_layers=2, scan=True)
    params = models.init_gpt(cfg, jax.random.key(0))
    state, batches = OPT.init(params), _problem()[2]
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), OPT)
    step = js.parallelize(train, devices=8, mode="data", optimizer=js.OptimizerParallel(2, threshold=THRESHOLD))
    report = js.audit(step.lower(params, state, batches[0]).compile())
    big = [x for x in jax.tree.leaves(params) if _big(x)]
    assert step.plan(params, state, batches[0]).optimizer.reduce_scattered == len(big)
    assert report.count("reduce-scatter") == 2 * len(big) and report.bytes("reduce-scatter") == sum(x.nbytes for x in big)
    got = run_steps(step, params, state, batches)
    want = run_steps(jax.jit(train), params, state, batches)
    terms = STEPS * step_terms(params, batches[0])
    assert_close(got[2], want[2], dtype=np.float32, terms=terms)
    assert_close(got[0], want[0], terms=terms)


def test_the_plan_shows_the_cut():
    params, state, batches = _problem()
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG), OPT)
    plan = js.parallelize(train, devices=8, mode="data", optimizer=js.OptimizerParallel(3, threshold=THRESHOLD)).plan(params, state, batches[0])
    specs = plan.in_shardings[0]["layers"][0]["w_up"].spec, plan.in_shardings[0]["pos"].spec
    assert specs == (jax.sharding.PartitionSpec(None, ("d0", "d1", "d2")), jax.sharding.PartitionSpec())
    n_state, n_params = len(jax.tree.leaves(state)), len(jax.tree.leaves(params))
    saved = sum(x.nbytes * 7 / 8 for x in jax.tree.leaves((params, state)) if _big(x))
    line = plan.optimizer.line()
    assert line in " ".join(plan.summary().split())  # the summary wraps it at 120 columns
    assert line == (f"optimizer parallel level 3 (threshold 16 KiB): 12/{n_state} optimizer-state and "
                    f"6/{n_params} parameter leaves cut, {human_bytes(saved)} per device saved; 6 gradients "
                    f"reduce-scattered to their cut")


def test_tensor_parallel_inside_cuts_over_the_free_axis():
    """The 2-D preset (dp=2, mp=4) lays out weights and state over the mp axis; level 2 cuts the
    state over the dp axis too (8 ways in all) and reduce-scatters the gradients over dp in a
    `shard_map` manual over dp alone (mp stays automatic inside), and the result equals one device."""
    params, state, batches = _problem()
    preset = models.preset("2d", 8)
    p_strats = preset.parameters(params, models.GPT_RULES)
    s_strats = models.state_strategies(p_strats, params, state)
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG, preset), OPT)
    step = js.parallelize(train, devices=8, in_strategy=(p_strats, s_strats, tuple(preset.batch(x.ndim) for x in batches[0])),
                          out_strategy=(p_strats, s_strats, None), optimizer=js.OptimizerParallel(2, threshold=THRESHOLD))
    compiled = step.lower(params, state, batches[0]).compile()
    (_, s_sh, _), _ = compiled.input_shardings
    assert js.audit(compiled).count("reduce-scatter") == step.plan(params, state, batches[0]).optimizer.reduce_scattered > 0
    _check_cut(jax.tree.leaves(state), jax.tree.leaves(s_sh), 8, cut=True, small=False)
    _, new_state = _compare(step, params, state, batches)
    _check_cut(jax.tree.leaves(new_state), [x.sharding for x in jax.tree.leaves(new_state)], 8, cut=True, small=False)


def test_a_leaf_no_axis_divides_stays_whole_and_is_named():
    def step(w, m, x):
        return w - jnp.sum(m), m * 0.9 + jnp.sum(x), jnp.sum(x @ w)

    args = (jnp.ones((8, 8)), jnp.ones((7, 9)), jnp.ones((8, 8)))
    par = js.parallelize(step, devices=8, mode="data", optimizer=js.OptimizerParallel(1, threshold=0))
    plan = par.plan(*args)
    assert plan.in_specs[1] == jax.sharding.PartitionSpec()
    summary = " ".join(plan.summary().split())  # its lines wrap at 120 columns
    assert "0/1 optimizer-state" in summary and "kept whole (no free axis divides them): args[1]" in summary


def test_state_argnums_choose_the_state():
    def step(w, x, m):
        return w - jnp.sum(m), jnp.sum(x @ w), m * 0.9

    args = (jnp.ones((8, 8)), jnp.ones((8, 8)), jnp.ones((8, 16)))
    plan = js.parallelize(step, devices=8, mode="data", batch_argnums=1, optimizer=js.OptimizerParallel(1, threshold=0)).plan(*args)
    assert plan.in_specs[2] == jax.sharding.PartitionSpec(None, ("d0", "d1", "d2"))
    plan = js.parallelize(step, devices=8, mode="data", batch_argnums=1, optimizer=js.OptimizerParallel(1, state_argnums=(), threshold=0)).plan(*args)
    assert plan.in_specs[2] == jax.sharding.PartitionSpec()


@pytest.mark.parametrize("level", [0, 4, "2", True])
def test_a_level_outside_1_to_3_is_named(level):
    with pytest.raises(js.ShardingError, match=rf"jshard.parallelize\(<lambda>\): OptimizerParallel\(level={level!r}\) is "
                                               r"not a level; give 1 \(cut the optimizer state\), 2 .* or 3"):
        js.parallelize(lambda p, s, x: p, optimizer=js.OptimizerParallel(level))


@pytest.mark.parametrize("threshold", ["lots", [1], -1, "KiB"])
def test_a_threshold_that_is_not_a_size_is_named(threshold):
    with pytest.raises(js.ShardingError, match=r"OptimizerParallel\(threshold=.*\) is not a size; give bytes \(an int\) "
                                               r"or a string such as '64KiB'"):
        js.parallelize(lambda p, s, x: p, optimizer=js.OptimizerParallel(1, threshold=threshold))


@pytest.mark.parametrize("kw", [{"mode": "manual"}, {"pipeline": js.Pipelining(2, 2)}])
def test_modes_without_optimizer_parallel_are_named(kw):
    with pytest.raises(js.ShardingError, match=r"optimizer= \(optimizer parallel\) cuts the optimizer state over the axes the "
                                               r"strategies leave replicated, in mode='data', 'semi_auto' or 'auto'"
                                               r".*Use mode='data', 'semi_auto' or 'auto', or drop optimizer="):
        js.parallelize(lambda p, s, x: p, optimizer=1, **kw)


def test_no_data_parallel_axis_is_named():
    def step(w, m, x):
        return w - 0.1 * m, m * 0.9, jnp.sum(x @ w)

    args = (jnp.ones((8, 8)), jnp.ones((8, 8)), jnp.ones((8, 8)))
    with pytest.raises(js.ShardingError, match=r"optimizer=1 cuts optimizer state over the data-parallel "
                                               r"devices .* but no leaf of 256 B or more has one: e.g. args\[1\] "
                                               r"f32\[8,8\] is laid out P\(\) over the mesh \(one "
                                               r"device\)\. Run on more devices than the strategies use"):
        js.parallelize(step, devices=1, mode="data", optimizer=js.OptimizerParallel(1, threshold=0)).plan(*args)


def test_comm_recompute_gathers_again_in_the_backward_and_equals_one_device():
    """Level 3 with `optimizer_comm_recompute`: each cut parameter is all-gathered twice (forward,
    then again in the backward pass), so the gathered copy is not held from one to the other:
    twice the all-gather bytes, the same numbers. (Its temporary memory is no longer below the
    program that keeps the gathered copy: since level 3 reduce-scatters the gradients, that one
    holds 447 KB against 459 KB with the second gather on this model.)"""
    params, state, batches = _problem()
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, CFG), OPT)
    kept, again = (js.parallelize(train, devices=8, mode="data", optimizer=js.OptimizerParallel(3, threshold="16KiB", comm_recompute=rc)) for rc in (False, True))
    kept_c, again_c = (s.lower(params, state, batches[0]).compile() for s in (kept, again))
    big_params = sum(x.nbytes for x in jax.tree.leaves(params) if _big(x))
    assert js.audit(kept_c).bytes("all-gather") == big_params
    assert js.audit(again_c).bytes("all-gather") == 2 * big_params
    n_big = sum(_big(x) for x in jax.tree.leaves(params))
    summary = " ".join(again.plan(params, state, batches[0]).summary().split())  # its lines wrap at 120 columns
    assert f"; {n_big} parameter leaves all-gathered again in the backward pass" in summary
    _compare(again, params, state, batches)


@pytest.mark.parametrize("level", [1, 2])
def test_comm_recompute_without_level_3_is_named(level):
    with pytest.raises(js.ShardingError, match=r"OptimizerParallel\(comm_recompute=True\) gathers a parameter that level 3 "
                                               r"keeps cut again in the backward pass; this call has "
                                               rf"level={level}\. Pass level=3"):
        js.parallelize(lambda p, s, x: p, optimizer=js.OptimizerParallel(level, comm_recompute=True))


def test_the_report_lists_each_cut_leaf():
    def step(w, m, x):
        return w - jnp.sum(m), m * 0.9 + jnp.sum(x), jnp.sum(x @ w)

    args = (jnp.ones((8, 8)), jnp.ones((8, 16)), jnp.ones((8, 8)))
    report = js.parallelize(step, devices=8, mode="data", optimizer=js.OptimizerParallel(3, threshold=0)).plan(*args).optimizer
    assert report.leaves == (("args[0]", "parameter", "P()", "P(('d0', 'd1', 'd2'), None)"),
                             ("args[1]", "state", "P()", "P(None, ('d0', 'd1', 'd2'))"))
    assert report.table().splitlines()[0].split() == ["argument", "role", "laid", "out", "cut"]
