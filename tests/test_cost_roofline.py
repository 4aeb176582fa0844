"""The cost model's compute term and overlap: each operator's roofline (`CostModel.compute_seconds`)
on the memory traffic left after XLA's fusion (`OpTable.traffic`), and collectives overlapping the
compute that does not depend on them (`CostModel.overlap`) in `Plan.work` and the search."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import jshard as js
from jshard.cost import CostModel
from jshard.graph import flatten
from jshard.rules import OpTable

F32 = jnp.float32


def _traffic(fn, *args) -> tuple[float, dict]:
    closed = jax.make_jaxpr(fn)(*args)
    nodes = flatten(closed.jaxpr)
    moved = OpTable(nodes).traffic(closed.jaxpr.outvars)
    return sum(moved.values()), {nodes[i].primitive: b for i, b in moved.items()}


def test_the_roofline_takes_the_slower_of_the_units_and_the_memory():
    m = CostModel(flops=100e12, matmul_flops=50e12, memory_bandwidth=1e12)
    assert m.compute_seconds(1e12, 1e9, matmul=True) == pytest.approx(1e12 / 50e12)
    assert m.compute_seconds(1e9, 1e9) == pytest.approx(1e9 / 1e12)  # memory-bound
    assert m.compute_seconds(1e12) == pytest.approx(1e12 / 100e12)


def test_the_default_cost_model_prices_flops_at_its_rate_and_overlaps_nothing():
    m = CostModel()
    assert m.compute_seconds(1e12, 1e15, matmul=True) == 1e12 / m.flops  # no memory bandwidth: traffic unpriced
    assert not m.overlap


def test_a_device_kind_brings_its_measured_ceilings():
    m = CostModel.for_device("H100")
    assert (m.matmul_flops, m.memory_bandwidth, m.overlap) == (711e12, 2504e9, True)
    assert CostModel.for_device("H100", overlap=False).overlap is False


def test_an_elementwise_chain_moves_its_ends_only():
    x, w = jax.ShapeDtypeStruct((64, 128), F32), jax.ShapeDtypeStruct((128, 256), F32)
    total, _ = _traffic(lambda x, w: (jnp.tanh((x @ w) * 2.0 + 1.0)).sum(), x, w)
    out = 64 * 256 * 4
    # the dot reads x and w and writes its product; the chain reads the product once and the sum
    # takes the chain into its kernel, writing one scalar
    assert total == 64 * 128 * 4 + 128 * 256 * 4 + 2 * out + 4


def test_a_softmax_reads_its_rows_once_and_writes_them_once():
    x = jax.ShapeDtypeStruct((32, 512), F32)
    total, _ = _traffic(lambda x: jax.nn.softmax(x, axis=-1), x)
    assert total == 2 * 32 * 512 * 4


def test_a_value_read_by_two_kernels_is_written_once_and_read_by_each():
    x = jax.ShapeDtypeStruct((32, 512), F32)
    w = jax.ShapeDtypeStruct((512, 512), F32)

    def f(x, w):
        h = jnp.exp(x)  # read by a dot and by a reduction over the batch dim (not a row): two kernels
        return h @ w, h.sum(axis=0)

    total, by = _traffic(f, x, w)
    h = 32 * 512 * 4
    assert by["exp"] == 2 * h  # reads x, writes h
    assert by["reduce_sum"] == h + 512 * 4


def _step(ws, x):
    def loss(ws):
        h = x
        for w in ws:
            h = jnp.tanh(h @ w)
        return (h * h).mean()

    return jax.grad(loss)(ws)


@pytest.mark.parametrize("overlap", [False, True], ids=["apart", "beside"])
def test_the_search_compares_plans_by_their_schedule_where_collectives_overlap(overlap):
    from jshard.search._graph import SearchGraph
    from jshard.search._seeded import propagated

    ws = [jax.ShapeDtypeStruct((512, 512), F32)] * 3
    x = jax.ShapeDtypeStruct((4096, 512), F32)
    closed = jax.make_jaxpr(_step)(ws, x)
    args, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    fixed = {**{v: ((), ()) for v in args[:3]}, args[3]: (("data",), ())}
    cost = CostModel.for_device("H100", overlap=overlap)
    g = SearchGraph(flatten(closed.jaxpr), args, outvars, fixed, {"data": 8}, cost)
    choice = propagated(g, args, outvars, fixed, None).choice
    summed = g.summed(choice)
    compute = sum(g.unit_parts(k, choice[k])[1] for k in range(len(g.units)))
    assert 0 < compute < summed  # the gradients' all-reduces cost something
    if not overlap:
        assert g.seconds(choice) == summed
    else:  # the first layers' gradients are summed while the last layers' backward runs
        assert compute <= g.seconds(choice) < summed


def test_collectives_overlap_independent_compute_where_the_device_kind_says_so():
    ws = [jax.ShapeDtypeStruct((512, 512), F32)] * 3
    x = jax.ShapeDtypeStruct((4096, 512), F32)
    h100 = CostModel.for_device("H100")
    apart = js.parallelize(_step, devices=8, mode="data", cost_model=dataclasses.replace(h100, overlap=False)).plan(ws, x)
    plan = js.parallelize(_step, devices=8, mode="data", cost_model=h100).plan(ws, x)
    a, b = apart.work, plan.work
    assert a.hidden_seconds == 0.0 and a.seconds == a.comm_seconds + a.compute_seconds and not a.hidden_ops
    # the same plan and prices; the first layers' gradients are summed while the last layers' backward runs
    assert (b.comm_seconds, b.compute_seconds) == (a.comm_seconds, a.compute_seconds)
    assert 0.0 < b.hidden_seconds <= b.comm_seconds
    assert max(b.compute_seconds, b.comm_seconds) <= b.seconds < a.seconds
    assert sum(s for _, s in b.hidden_ops) == pytest.approx(b.hidden_seconds)
    assert hash(b) is not None  # a record: hashable
    hidden = [plan.ops[k] for k, _ in b.hidden_ops]
    # the gradients' partial sums (the loss itself is dead under jax.grad: XLA drops its all-reduce, and the plan prices none)
    assert {op.primitive for op in hidden} == {"dot_general"}
    op = next(op for op in hidden if op.primitive == "dot_general")
    assert "all-reduce" in plan.explain(op)
    assert f"of which {b.hidden(op.index) * 1e6:.4g} us run beside compute" in plan.explain(op)
    assert "run beside compute" not in apart.explain(op.index)


def test_a_loop_body_reads_its_carry_and_writes_it_each_trip():
    x = jax.ShapeDtypeStruct((256, 256), F32)

    def f(x):
        return jax.lax.scan(lambda c, _: (c * 2.0 + 1.0, None), x, None, length=4)[0]

    closed = jax.make_jaxpr(f)(x)
    nodes = flatten(closed.jaxpr)
    moved = OpTable(nodes).traffic(closed.jaxpr.outvars)
    assert sum(nodes[i].weight * b for i, b in moved.items()) == 4 * 2 * 256 * 256 * 4


def test_recompute_prices_its_rerun_on_the_roofline():
    """A region's recompute costs what the search prices every operator at (`compute_seconds`): its
    rerun operators' FLOPs or their memory traffic, whichever takes longer, not its FLOPs at the peak rate."""
    from jshard.search import region_costs

    def loss(w, x):
        with jax.named_scope("jshard_recompute_auto0_full"):
            h = jax.checkpoint(lambda x: jnp.tanh(jnp.tanh(x @ w) * 2.0))(x)
        return (h * h).sum()

    w, x = jax.ShapeDtypeStruct((64, 64), F32), jax.ShapeDtypeStruct((256, 64), F32)
    closed = jax.make_jaxpr(jax.grad(loss))(w, x)
    nodes, args, outs = flatten(closed.jaxpr), closed.jaxpr.invars, closed.jaxpr.outvars
    flops_only = CostModel(flops=1e12)
    [peak] = region_costs(nodes, None, {}, args, outs, cost=flops_only).values()
    assert peak.rerun_flops > 0 and peak.rerun_seconds == pytest.approx(peak.rerun_flops / 1e12)
    bound = CostModel(flops=1e12, memory_bandwidth=1e9)  # every rerun operator memory-bound
    [roof] = region_costs(nodes, None, {}, args, outs, cost=bound).values()
    assert roof.rerun_flops == peak.rerun_flops
    assert roof.rerun_seconds > 10 * peak.rerun_seconds
