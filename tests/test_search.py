"""Strategy search (`mode="auto"`): numerics against one device, memory budgets in the compiled
program, the plans a user expects at the two extremes, save/load, errors, abstract meshes."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models


def _mlp_step(cfg):
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.mlp_loss(p, b), optimizer)
    params = models.init_mlp(cfg, jax.random.key(0))
    return step, params, optimizer.init(params)


def _specs(tree):
    return [s.spec for s in jax.tree_util.tree_leaves(tree)]


@pytest.fixture(scope="module")
def wide_mlp():
    """Weights (4 x 256x1024) dwarf the activations (batch 16)."""
    cfg = models.MLPConfig(256, 1024, 256, 4)
    step, params, opt_state = _mlp_step(cfg)
    batch = models.mlp_batch(np.random.default_rng(0), cfg, 16)
    return step, (params, opt_state, batch), jax.jit(step)(params, opt_state, batch)[2]


@pytest.mark.parametrize("how", ["recursive", "ilp"])
def test_tight_budget_on_weight_heavy_mlp_cuts_weights_and_fits_compiled(wide_mlp, how):
    step, args, ref = wide_mlp
    free = js.parallelize(step, devices=8, mode="auto", search=how).plan(*args)
    budget = free.search.peak_bytes / 4
    auto = js.parallelize(step, devices=8, mode="auto", search=js.Search(how, memory_budget=budget))
    plan = auto.plan(*args)
    weights = _specs(plan.in_shardings[0])
    assert any(spec != jax.sharding.PartitionSpec() for spec in weights), weights  # weights are cut
    assert plan.search.compiled_peak_bytes <= budget  # read from the compiled program's memory_analysis
    _, _, loss = auto(*args)
    assert_close(loss, ref, terms=step_terms(args[0], args[2], backward=False))  # the loss: forward only
    assert f"budget {plan.search.budget / 2**20:.4g} MiB" in plan.search.line()


@pytest.mark.parametrize("how", ["recursive", "ilp"])
def test_huge_batch_tiny_weights_is_data_parallel(how):
    cfg = models.MLPConfig(64, 256, 64, 2)
    step, params, opt_state = _mlp_step(cfg)
    batch = models.mlp_batch(np.random.default_rng(0), cfg, 65536)
    auto = js.parallelize(step, devices=8, mode="auto", search=how)
    plan = auto.plan(params, opt_state, batch)
    names = plan.fine.names
    x_spec, y_spec = _specs(plan.in_shardings[2])
    assert x_spec == jax.sharding.PartitionSpec(names) and y_spec == jax.sharding.PartitionSpec(names)
    weights = {k: s.spec for k, s in plan.in_shardings[0].items() if k.startswith("w")}
    assert all(s == jax.sharding.PartitionSpec() for s in weights.values()), weights  # replicated
    assert plan.predicted().get("all-reduce", 0) >= 0.6 * plan.predicted_bytes()  # the gradients'


@pytest.fixture(scope="module")
def gpt():
    cfg = models.GPTConfig(vocab=32, seq_len=8, d_model=32, n_heads=4, n_layers=2, d_ff=64, scan=True)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    args = (params, optimizer.init(params), models.copy_task_batch(np.random.default_rng(0), cfg, 8))
    return step, args, jax.jit(step)(*args)[2]


@pytest.mark.parametrize("how", ["recursive"])  # the ILP's numerics: the budget test above (MLP)
def test_searched_gpt_equals_one_device_and_is_explained(gpt, how):
    step, args, ref = gpt
    auto = js.parallelize(step, devices=8, mode="auto", search=js.Search(how, time_limit=8))
    _, _, loss = auto(*args)
    assert_close(loss, ref, terms=step_terms(args[0], args[2], backward=False))
    plan = auto.plan(*args)
    assert {op.origin for op in plan.ops} == {"searched"}
    assert f"search={how}" in plan.summary()
    dot = next(op for op in plan.ops if op.primitive == "dot_general")
    text = plan.explain(dot)
    assert "origin searched" in text and "chosen by the strategy search" in text
    assert "best rejected alternative" in text
    assert plan.audit().bytes() == pytest.approx(plan.predicted_bytes(), rel=0.1, abs=1024)


def test_searched_moe_and_resnet_equal_one_device():
    for cfg, init, loss, make_batch in [
        (models.MoEConfig(), models.init_moe, models.moe_loss, models.moe_batch),
        (models.ResNetConfig(), models.init_resnet, models.resnet_loss, models.resnet_batch),
    ]:
        optimizer = optax.adam(1e-3)
        step = models.make_train_step(lambda p, b, cfg=cfg, loss=loss: loss(p, b, cfg), optimizer)
        params = init(cfg, jax.random.key(0))
        args = (params, optimizer.init(params), make_batch(np.random.default_rng(0), cfg, 8))
        ref = jax.jit(step)(*args)[2]
        _, _, got = js.parallelize(step, devices=8, mode="auto")(*args)
        assert_close(got, ref, terms=step_terms(params, args[2], backward=False))


def test_save_load_rebuilds_the_same_program(gpt, tmp_path):
    step, args, _ = gpt
    auto = js.parallelize(step, devices=8, mode="auto", search="recursive")
    plan = auto.plan(*args)
    plan.save(tmp_path / "plan.json")
    loaded = js.Plan.load(tmp_path / "plan.json")
    again = js.parallelize(step, devices=8, mode="auto", plan=loaded)
    assert {op.origin for op in again.plan(*args).ops} == {"searched"}
    assert again.lower(*args).as_text() == auto.lower(*args).as_text()


def test_impossible_budget_says_what_is_missing_and_which_tensors(wide_mlp):
    step, args, _ = wide_mlp
    auto = js.parallelize(step, devices=8, mode="auto", search=js.Search(memory_budget="64KiB"))
    with pytest.raises(js.ShardingError, match=r"memory_budget=64 KiB per device cannot be met on 8 devices") as e:
        auto.plan(*args)
    text = str(e.value)
    assert "missing" in text and "args[0]['w0'] float32[256,1024] (128 KiB per device at best)" in text
    assert "Raise memory_budget" in text


def test_shard_calls_stay_as_constraints_in_auto_mode():
    def f(x, w1, w2):
        h = js.shard(jnp.matmul, ((1, 1), (1, 8)))(x, w1)
        return jnp.tanh(h) @ w2

    rng = np.random.default_rng(0)
    args = [jnp.asarray(rng.normal(size=s), jnp.float32) for s in [(16, 32), (32, 64), (64, 8)]]
    auto = js.parallelize(f, devices=8, mode="auto", search="ilp")
    plan = auto.plan(*args)
    dot = plan.ops[0]
    assert dot.origin == "user" and dot.in_strategy == ((1, 1), (1, 8))
    assert {op.origin for op in plan.ops[1:]} == {"searched"}
    x, w1, w2 = args  # sums of 32 then 64 terms, tanh between; the second's terms cancel: scale by their size
    assert_close(auto(*args), f(*args), terms=32 + 4 + 64, scale=float(jnp.max(jnp.abs(jnp.tanh(x @ w1)) @ jnp.abs(w2))))


def test_abstract_mesh_plans_for_more_devices_than_present():
    cfg = models.GPTConfig(vocab=64, seq_len=16, d_model=64, n_heads=8, n_layers=4, d_ff=256, scan=True)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = jax.eval_shape(lambda: models.init_gpt(cfg, jax.random.key(0)))
    batch = tuple(jax.ShapeDtypeStruct((64, 16), t) for t in (np.int32, np.int32, np.float32))
    auto = js.parallelize(step, devices=64, mode="auto")
    args = (params, jax.eval_shape(optimizer.init, params), batch)
    plan = auto.plan(*args)
    assert plan.device_count == 64 and plan.search.mesh == "2·2·2·2·2·2"
    assert plan.search.peak_bytes > 0 and {op.origin for op in plan.ops} == {"searched"}
    with pytest.raises(js.DeviceCountError):
        auto.lower(*args)


def test_search_options_are_checked():
    f = lambda x: x * 2
    with pytest.raises(js.ShardingError, match=r"search='bfs' is not one of \('recursive', 'ilp', 'propagation'\)"):
        js.parallelize(f, devices=8, mode="auto", search="bfs")
    with pytest.raises(js.ShardingError, match=r"Search\(memory_budget=\.\.\.\) applies to the strategy search, mode='auto'"):
        js.parallelize(f, devices=8, mode="semi_auto", search=js.Search(memory_budget="1GiB"))
    with pytest.raises(js.ShardingError, match=r"search='propagation' cuts the batch and propagates"):
        js.parallelize(f, devices=8, mode="auto", search=js.Search("propagation", memory_budget="1GiB"))


def _tanh_mlp_step(ws, x):
    """An SGD step of a tanh MLP, summed: the loss's and each layer's weight gradient are
    independent all-reduces when the batch is cut."""
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return jnp.sum(h)

    value, grads = jax.value_and_grad(loss)(ws)
    return [w - 0.1 * g for w, g in zip(ws, grads)], value


def test_combined_pricing_pays_one_latency_per_set_of_independent_gradient_all_reduces():
    """Data parallel, the loss and three layers' weight gradients are independent all-reduces over
    the batch's axes: XLA's combiner merges them into one, and the search graph predicts and prices one."""
    from jshard.cost import CostModel
    from jshard.graph import flatten
    from jshard.search._graph import SearchGraph
    from jshard.search._seeded import propagated

    step = _tanh_mlp_step

    ws = [jnp.asarray(np.random.default_rng(n).normal(size=(16, 16)), jnp.float32) for n in range(3)]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(64, 16)), jnp.float32)
    closed = jax.make_jaxpr(step)(ws, x)
    args, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    axes = ("d0", "d1", "d2")
    fixed = {**{v: ((), ()) for v in args[:3]}, args[3]: (axes, ())}
    g = SearchGraph(flatten(closed.jaxpr), args, outvars, fixed, dict.fromkeys(axes, 2), CostModel(flops=float("inf")))
    choice = propagated(g, args, outvars, fixed, None).choice
    gradients = [k for k in range(len(g.units)) if g.partial_sums(k, choice[k])]
    assert len(gradients) == 4 and set(gradients) <= g.combinable  # the loss's, then each gradient's
    assert g.combined_sets(choice) == {(-1, axes, "add"): 1}
    latency = g.cost.group_latency(axes)
    bandwidth = [2 * 7 / 8 * n * 4 / g.cost.bandwidth for n in (1, 256, 256, 256)]  # f32[], f32[16,16] over 8
    assert [g.unit_seconds(k, choice[k]) for k in gradients] == pytest.approx(bandwidth)
    assert g.combined_latency(choice) == pytest.approx(latency)
    edges = sum(g.edge_seconds(e, g.spec(*e.src, choice[e.src[0]]), g.spec(*e.dst, choice[e.dst[0]])) for e in g.edges)
    assert g.seconds(choice) == pytest.approx(edges + sum(bandwidth) + latency)

    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 2, 2), axes)
    whole, rows = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*s)) for s in ((), (axes,)))
    compiled = jax.jit(step, in_shardings=([whole] * 3, rows), out_shardings=([whole] * 3, whole)).lower(ws, x).compile()
    assert js.audit(compiled).count("all-reduce") == g.all_reduces(choice) == 1
    for got, want in zip(jax.tree.leaves(compiled(ws, x)), jax.tree.leaves(jax.jit(step)(ws, x))):
        assert_close(got, want, terms=64)


@pytest.mark.parametrize("flops", [100e12, 1e9], ids=["latency-bound", "compute-bound"])
def test_recursive_search_weighs_the_latency_of_the_gradient_all_reduces_it_opens(flops):
    """The loss's and three layers' weight gradients are independent all-reduces: cutting the batch
    pays one combined latency for them all. On a fast device the compute a cut saves (more than the
    gradients' bandwidth) is worth less than that latency and the plan replicates; on a slow one the
    batch is cut and the latency paid once. The
    recursive search's levels price the pairwise energy without that latency, so it must weigh the
    sets it opens with it (`_Recursive._closed`) to find the ILP's plan; both run as on one device."""
    from jshard.cost import CostModel

    step = _tanh_mlp_step

    ws = [jnp.asarray(np.random.default_rng(n).normal(size=(16, 16)) / 4, jnp.float32) for n in range(3)]
    x = jnp.asarray(np.random.default_rng(3).normal(size=(16384, 16)), jnp.float32)
    cost = CostModel(flops=flops)
    plans = {how: js.parallelize(step, devices=8, mode="auto", search=how, cost_model=cost) for how in ("recursive", "ilp")}
    found = {how: auto.plan(ws, x).search for how, auto in plans.items()}
    assert found["ilp"].status == "optimal"
    eps = np.finfo(np.float64).eps  # the searches sum seconds in float64, one term per unit and edge
    assert found["recursive"].seconds == pytest.approx(found["ilp"].seconds, rel=eps * found["recursive"].units ** 2)
    want = jax.jit(step)(ws, x)
    for got, ref in zip(jax.tree.leaves(plans["recursive"](ws, x)), jax.tree.leaves(want)):
        assert_close(got, ref, terms=x.size)


def test_recursive_search_closes_the_combined_sets_the_gradients_move_onto(monkeypatch):
    """The tanh MLP on a 4x2 mesh, its batch cut 4 ways (data) and each row a sequence of 8: the
    weight gradients sum over the batch and the sequence. The model axis's level cuts the batch
    further, so the gradients open a second set (data·model) beside the loss's (data). Closing it
    moves the gradients onto the sequence (their all-reduces over model: a new set, the same two
    latencies), which alone helps nothing; closed too, they keep the model axis off their sums and
    one set (data) is left: the ILP's plan. Closing one set at a time misses it."""
    from jshard.cost import CostModel
    from jshard.graph import flatten
    from jshard.search import _ilp, _recursive
    from jshard.search._graph import SearchGraph

    ws = [jax.ShapeDtypeStruct((64, 64), jnp.float32)] * 2
    x = jax.ShapeDtypeStruct((64, 8, 64), jnp.float32)
    closed = jax.make_jaxpr(_tanh_mlp_step)(ws, x)
    args, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    g = SearchGraph(flatten(closed.jaxpr), args, outvars, {args[2]: (("data",), (), ())}, {"data": 4, "model": 2},
                    CostModel(flops=100e12))
    axes = [("data",), ("model",)]
    optimum = _ilp.solve(g, axes, None, 60.0)
    assert optimum.status == "optimal" and g.combined_sets(optimum.choice) == {(-1, ("data",), "add"): 1}
    eps = np.finfo(np.float64).eps * len(g.units) ** 2  # float64 sums, one term per unit and edge
    assert g.seconds(_recursive.solve(g, axes, None).choice) == pytest.approx(g.seconds(optimum.choice), rel=eps)

    def first_step(search, level, picks, sets, toll, best):
        yield next(closing(search, level, picks, sets, toll, best))

    closing = _recursive._Recursive._closing
    monkeypatch.setattr(_recursive._Recursive, "_closing", first_step)
    assert g.seconds(_recursive.solve(g, axes, None).choice) > (1 + eps) * g.seconds(optimum.choice)
