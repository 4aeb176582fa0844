"""Host and device together (`jshard.hetero`): optimizer state and parameters kept in host memory
between steps (`parallelize(..., offload=...)`), operators run on the host (`jshard.on_host`),
activations offloaded between forward and backward (`recompute(policy="offload")`); each against
one device."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _loop import run_steps
from _tolerance import assert_close, step_terms
from jax.ad_checkpoint import checkpoint_name

import jshard as js
from jshard import models
from jshard._format import human_bytes

STEPS = 3
CFG = models.MLPConfig(d_in=16, d_hidden=32, d_out=8)
OPT = optax.adam(1e-2)
HOST = "pinned_host"


def _problem():
    params = models.init_mlp(CFG, jax.random.key(0))
    rng = np.random.default_rng(1)
    return params, OPT.init(params), [models.mlp_batch(rng, CFG, 16) for _ in range(STEPS)]


def _step():
    return models.make_train_step(models.mlp_loss, OPT)


@functools.cache
def _reference():
    params, state, batches = _problem()
    return run_steps(jax.jit(_step()), params, state, batches)


def _bytes(tree) -> int:
    return sum(np.size(x) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("offload", [("optimizer",), ("parameters",), ("optimizer", "parameters")],
                         ids=["optimizer", "parameters", "both"])
def test_offloaded_state_lives_on_host_and_equals_one_device(offload):
    params, state, batches = _problem()
    step = js.parallelize(_step(), devices=8, mode="data", offload=offload)
    got_params, got_state, got_losses = run_steps(step, params, state, batches)
    ref_params, ref_state, ref_losses = _reference()
    terms = STEPS * step_terms(params, batches[0])
    assert_close(got_losses, ref_losses, dtype=np.float32, terms=terms)
    assert_close((got_params, got_state), (ref_params, ref_state), terms=terms)

    compiled = step.lower(params, state, batches[0]).compile()
    ins, outs = compiled.input_shardings[0], compiled.output_shardings
    on_host = {"parameters": (ins[0], outs[0]), "optimizer": (ins[1], outs[1])}
    for role, (arg, result) in on_host.items():
        want = HOST if role in offload else "device"
        assert {sh.memory_kind for sh in jax.tree.leaves((arg, result))} == {want}, role
    assert {x.sharding.memory_kind for x in jax.tree.leaves(got_state)} == {HOST if "optimizer" in offload else "device"}

    plan = step.plan(params, state, batches[0])
    planned = plan.in_shardings
    assert {sh.memory_kind for sh in jax.tree.leaves(planned[1])} == {HOST if "optimizer" in offload else "device"}
    report = plan.offload
    held = (_bytes(params) if "parameters" in offload else 0) + (_bytes(state) if "optimizer" in offload else 0)
    assert (report.host_bytes, report.read_bytes, report.written_bytes) == (held, held, held)  # data mode: whole leaves
    assert f"offload {'+'.join(offload)}: " in step.plan(params, state, batches[0]).summary()
    assert human_bytes(held) in report.line()


def test_no_offload_has_no_report_and_device_memory():
    params, state, batches = _problem()
    step = js.parallelize(_step(), devices=8, mode="semi_auto")
    assert step.plan(params, state, batches[0]).offload is None
    kinds = {sh.memory_kind for sh in jax.tree.leaves(step.lower(params, state, batches[0]).compile().input_shardings)}
    assert kinds == {"device"}


TABLE_ROWS, DIM = 64, 8


def _lookup_problem():
    k = jax.random.split(jax.random.key(2), 3)
    params = {"table": jax.random.normal(k[0], (TABLE_ROWS, DIM)), "w": jax.random.normal(k[1], (DIM, 1))}
    ids = jax.random.randint(k[2], (16,), 0, TABLE_ROWS)
    return params, (ids, jnp.linspace(-1.0, 1.0, 16)[:, None])


def _embedding_loss(lookup):
    def loss(params, batch):
        ids, y = batch
        return jnp.mean((lookup(params["table"], ids) @ params["w"] - y) ** 2)

    return loss


def test_on_host_lookup_runs_on_the_host_and_equals_one_device():
    params, batch = _lookup_problem()
    host = jax.value_and_grad(_embedding_loss(js.on_host(lambda t, i: t[i])))
    want = jax.jit(jax.value_and_grad(_embedding_loss(lambda t, i: t[i])))(params, batch)
    terms = 2 * step_terms(params, batch)
    assert_close(jax.jit(host)(params, batch), want, terms=terms)
    step = js.parallelize(host, devices=8, mode="data")
    assert_close(step(params, batch), want, terms=terms)
    marked = js.hetero.host_operators(step.lower(params, batch).as_text(dialect="hlo"))
    assert "gather" in marked and "scatter" in marked  # the lookup, and its gradient's scatter-add


def test_on_host_reads_a_table_kept_in_host_memory():
    params, batch = _lookup_problem()
    sgd = lambda p, g: jax.tree.map(lambda a, b: a - 0.1 * b, p, g)  # noqa: E731

    def step_of(lookup):
        def step(p, b):
            loss, grads = jax.value_and_grad(_embedding_loss(lookup))(p, b)
            return sgd(p, grads), loss

        return step

    want = jax.jit(step_of(lambda t, i: t[i]))(params, batch)
    step = js.parallelize(step_of(js.on_host(lambda t, i: t[i])), devices=8, mode="semi_auto", offload=("parameters",))
    got = step(params, batch)
    assert_close(got, want, terms=2 * step_terms(params, batch))
    assert got[0]["table"].sharding.memory_kind == HOST


def test_on_host_rejects_a_collective():
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Auto,))
    summed = js.on_host(lambda x: jax.lax.psum(x, "x"))
    fn = jax.shard_map(summed, mesh=mesh, in_specs=jax.sharding.PartitionSpec("x"), out_specs=jax.sharding.PartitionSpec())
    with pytest.raises(js.ShardingError, match=r"jshard.on_host\(<lambda>\): the host function runs psum\w* on f32\[1\] .*"
                                                r"Call psum\w* outside the host function"):
        jax.jit(fn)(jnp.ones(8))


def _offload_layer(w, x):
    h = checkpoint_name(jnp.tanh(x @ w), "h")
    return jnp.tanh(h @ w)


@pytest.mark.parametrize("policy", ["offload", js.offload_names("h")], ids=["offload", "offload_names"])
def test_activation_offload_moves_residuals_to_host_and_equals_one_device(policy):
    w, x = jnp.eye(16) * 0.5 + 0.01, jnp.linspace(-1.0, 1.0, 8 * 16).reshape(8, 16)
    layer = js.recompute(_offload_layer, policy=policy)
    grad = jax.grad(lambda w, x: layer(w, x).sum())
    jaxpr = jax.make_jaxpr(grad)(w, x).jaxpr
    remat = next(e for e in jaxpr.eqns if e.primitive.name == "checkpoint" or "remat" in e.primitive.name)
    puts = [e for e in jaxpr.eqns if e.primitive.name == "device_put"]
    assert remat.params["policy"] is not None
    assert any(v.aval.memory_space == jax.memory.Space.Host for e in puts for v in e.outvars)
    want = jax.jit(jax.grad(lambda w, x: _offload_layer(w, x).sum()))(w, x)
    assert_close(js.parallelize(grad, devices=8)(w, x), want, terms=4 * 16 + 8)


@pytest.mark.parametrize("offload, match", [
    (("activations",), r"offload=\('activations',\) names 'activations', which is not state kept between steps.*"
                       r"policy='offload'"),
    (("batch",), r"offload=\('batch',\) names 'batch', which is not state"),
])
def test_offload_of_what_is_not_state_is_rejected(offload, match):
    with pytest.raises(js.ShardingError, match=r"jshard.parallelize\(<lambda>\): " + match):
        js.parallelize(lambda p, b: p, devices=8, offload=offload)


def test_offload_of_missing_optimizer_state_is_rejected():
    step = js.parallelize(lambda p, b: p * b.sum(), devices=8, offload="optimizer")
    with pytest.raises(js.ShardingError, match=r"offload=\('optimizer',\) keeps the optimizer-state .* but this call "
                                               r"has none .*drop 'optimizer' from offload"):
        step(jnp.ones(4), jnp.ones((8, 2)))


def test_offload_type_errors():
    with pytest.raises(TypeError, match=r"offload takes names \(strings\)"):
        js.parallelize(lambda p, b: p, devices=8, offload=(1,))
    with pytest.raises(TypeError, match=r"jshard.offload_names: names are checkpoint_name strings"):
        js.offload_names(3)


def test_benchmark_table_rows_are_measured_and_equal_one_device():
    from benchmarks._hetero import CASES, hetero_table

    table = hetero_table(8, rounds=1, budget=0.0)
    assert [row[0] for row in table.rows] == list(CASES)
    assert all(row[-1].endswith(" equal") for row in table.rows), table.rows
    nothing, optimizer, both, activations = table.rows
    assert nothing[2] == "0 B" and both[1] == "0 B" and optimizer[2] != "0 B" and activations[2] != "0 B"


WD = models.WideDeepConfig(vocabulary=256, dim=4, fields=3, hidden=16)
WD_STEPS = 6


def _wide_deep_run(step, table):
    params, table0 = models.init_wide_deep(WD, jax.random.key(3))
    rng = np.random.default_rng(4)
    state, losses = OPT.init(params), []
    for _ in range(WD_STEPS):
        params, state, table, loss = step(params, state, table0 if table is None else table,
                                          models.wide_deep_batch(rng, WD, 32))
        table0, losses = None, losses + [float(loss)]
    return params, table, losses


@functools.cache
def _wide_deep_reference():
    return _wide_deep_run(jax.jit(models.wide_deep_step(OPT, 0.5)), None)


@pytest.mark.parametrize("cut_rows", [False, True], ids=["whole", "rows_cut"])
def test_wide_deep_with_a_host_table_trains_and_equals_the_device_run(cut_rows):
    _, table = models.init_wide_deep(WD, jax.random.key(3))
    step = js.parallelize(models.wide_deep_step(OPT, 0.5), devices=8, mode="data")
    params, got_table, losses = _wide_deep_run(step, js.hetero.host_table(table, cut_rows=cut_rows))
    ref_params, ref_table, ref_losses = _wide_deep_reference()
    terms = WD_STEPS * (2 * (WD.fields * WD.dim + WD.hidden + WD.fields) + 32 * WD.fields)
    assert losses[-1] < losses[0]
    assert_close(losses, ref_losses, dtype=np.float32, terms=terms)
    assert_close((params, got_table.rows), (ref_params, ref_table), terms=terms)
    assert got_table.rows.sharding.memory_kind == HOST
    assert got_table.rows.sharding.spec == (jax.sharding.PartitionSpec(("d0", "d1", "d2"), None) if cut_rows
                                            else jax.sharding.PartitionSpec())
    report = step.plan(params, OPT.init(params), got_table, models.wide_deep_batch(np.random.default_rng(0), WD, 32)).offload
    assert report.host == ("args[2].rows",) and report.read_bytes == report.written_bytes == 0
    assert report.host_bytes == table.size * 4 / (8 if cut_rows else 1)


def test_host_table_sync_moves_rows_not_the_table():
    params, table = models.init_wide_deep(WD, jax.random.key(3))
    step = js.parallelize(models.wide_deep_step(OPT, 0.5), devices=8, mode="data")
    args = (params, OPT.init(params), js.hetero.host_table(table), models.wide_deep_batch(np.random.default_rng(0), WD, 32))
    hlo = step.lower(*args).compile().as_text()
    collectives = [line for line in hlo.splitlines() if "all-reduce(" in line or "all-gather(" in line]
    assert collectives and not any(f"f32[{WD.vocabulary},{WD.dim + 1}]" in line for line in collectives)
    assert any(f"s32[32,{WD.fields}]" in line for line in collectives)  # the ids, gathered


def test_host_table_too_large_for_the_hosts_is_rejected():
    with pytest.raises(js.ShardingError, match=r"jshard.hetero.host_table: the embedding table f32\[1099511627776,1024\] "
                                               r"needs 4096 TiB on each of 1 host\(s\), but a host has .* Cut its rows over "
                                               r"at least \d+ hosts' processes"):
        js.hetero.host_table(jax.ShapeDtypeStruct((2**40, 1024), jnp.float32))


def test_host_table_rows_cut_update_moves_no_table_rows():
    params, table = models.init_wide_deep(WD, jax.random.key(3))
    step = js.parallelize(models.wide_deep_step(OPT, 0.5), devices=8, mode="data")
    args = (params, OPT.init(params), js.hetero.host_table(table, cut_rows=True),
            models.wide_deep_batch(np.random.default_rng(0), WD, 32))
    hlo = step.lower(*args).compile().as_text()
    collectives = [line for line in hlo.splitlines() if "all-reduce(" in line or "all-gather(" in line]
    assert not any(f"[{WD.vocabulary},{WD.dim + 1}]" in line for line in collectives), collectives


def test_host_table_rows_the_devices_do_not_divide_are_rejected():
    step = js.parallelize(lambda t, ids: js.hetero.lookup(t, ids), devices=8, mode="data")
    with pytest.raises(js.ShardingError, match=r"the host table args\[0\].rows has 100 rows, cut_rows=True cuts them "
                                               r"over 8 devices, but 8 does not divide 100. Pad the table to 104 rows"):
        step(js.hetero.host_table(jnp.ones((100, 4)), cut_rows=True), jnp.arange(8))


def test_offload_with_a_pipeline_is_rejected():
    with pytest.raises(js.ShardingError, match=r"offload=\('optimizer',\) keeps state in host memory in the one-program "
                                               r"path; it cannot be used with a pipeline yet"):
        js.parallelize(lambda p, b: p, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=2), offload="optimizer")


TABLE_OPTS = {"adam": optax.adam(0.1), "adagrad": optax.adagrad(0.1, initial_accumulator_value=0.1, eps=0.0)}


@functools.cache
def _table_update():
    return js.parallelize(lambda t, ids, g: js.hetero.sparse_update(t, ids, g, 0.1), devices=8, mode="data",
                          batch_argnums=(1, 2))


@pytest.mark.parametrize("cut_rows", [False, True], ids=["whole", "rows_cut"])
@pytest.mark.parametrize("optimizer", ["adam", "adagrad"])
def test_host_table_optimizer_equals_the_dense_one_on_the_touched_rows(optimizer, cut_rows):
    k = jax.random.split(jax.random.key(5), 4)
    rows = jax.random.normal(k[0], (TABLE_ROWS, DIM))
    first = jnp.array([3, 5, 3, 60, 17, 5, 9, 33])  # repeated ids: their gradients add up
    second = jnp.array([3, 3, 5, 60, 40, 41, 42, 43])  # 17, 9, 33 untouched
    grads = [jax.random.normal(k[1], (8, DIM)), jax.random.normal(k[2], (8, DIM))]
    opt, dense, state = TABLE_OPTS[optimizer], rows, TABLE_OPTS[optimizer].init(rows)
    table = js.hetero.host_table(rows, optimizer=optimizer, cut_rows=cut_rows)
    for ids, g in zip((first, second), grads):
        updates, state = opt.update(jnp.zeros_like(rows).at[ids].add(g), state, dense)
        dense, after_first = optax.apply_updates(dense, updates), table
        table = _table_update()(table, ids, g)
        touched = np.unique(np.asarray(ids))
        # per step: a row's gradient sums at most 8 rows; the moments, sqrt and division a few ulps each
        assert_close(np.asarray(table.rows)[touched], np.asarray(dense)[touched], terms=2 * (8 + 4))
    assert {x.sharding.memory_kind for x in (table.rows, *table.slots)} == {HOST}
    kept = np.setdiff1d(np.asarray(first), np.asarray(second))
    np.testing.assert_array_equal(np.asarray(table.rows)[kept], np.asarray(after_first.rows)[kept])  # lazy: not moved
    untouched = np.setdiff1d(np.arange(TABLE_ROWS), np.concatenate([first, second]))
    np.testing.assert_array_equal(np.asarray(table.rows)[untouched], np.asarray(rows)[untouched])


def test_host_table_unknown_optimizer_is_rejected():
    with pytest.raises(js.ShardingError, match=r"jshard.hetero.host_table: optimizer='lamb' is no table optimizer; "
                                               r"sparse_update applies one of \('sgd', 'adam', 'adagrad'\)"):
        js.hetero.host_table(jnp.ones((8, 2)), optimizer="lamb")
