"""The search prices recompute and memory: `jshard.recompute(policy="auto")` regions chosen under a
budget (numerics against one device), `parallelize(recompute=)` as the regions' default, the
device's memory as the default budget, and a budget nothing meets."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models
from jshard.cost import CostModel

MiB = 2**20

WHOLE = js.Search(time_limit=3600.0)
"""`Search(time_limit=...)` for the tests of what the weighings weigh: the time limit bounds the whole of
planning, which on a loaded 2-core machine can pass before every candidate is weighed."""


@pytest.fixture(scope="module")
def scan_gpt():
    """A scanned GPT whose activations (seq 32, batch 32) dwarf its weights, its block marked
    `recompute="auto"`; the train step and its single-device result."""
    cfg = models.GPTConfig(n_layers=2, scan=True, recompute="auto", seq_len=32, d_model=32, n_heads=4, d_ff=64)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    args = (params, optimizer.init(params), models.copy_task_batch(np.random.default_rng(0), cfg, 32))
    return step, args, jax.jit(step)(*args)


def test_loose_budget_weighs_every_policy_and_keeps_the_fastest(scan_gpt):
    step, args, _ = scan_gpt
    h100 = CostModel.for_device("H100")  # the roofline: every operator memory-bound at this toy size
    free = js.parallelize(step, devices=8, mode="auto", cost_model=h100, search=WHOLE).plan(*args).search
    weighed = {w.policy: w for w in free.recompute}
    assert [w.policy for w in free.recompute] == ["none", "selective", "full"]
    assert weighed["none"].chosen  # 80 GiB binds nothing: the fastest policy
    assert weighed["full"].peak_bytes < weighed["selective"].peak_bytes < weighed["none"].peak_bytes
    assert weighed["none"].seconds < weighed["full"].seconds  # recompute costs compute
    assert "budget 80 GiB (the memory of one H100, no memory_budget given)" in free.line()
    cpu = js.parallelize(step, devices=8, mode="auto").plan(*args).search
    assert cpu.budget is None and "no memory budget" in cpu.line()  # CPU stand-ins: no budget


def test_tight_budget_chooses_full_recompute_and_equals_one_device(scan_gpt):
    step, args, (ref_params, ref_state, ref_loss) = scan_gpt
    budget = 4 * MiB  # below what keeping every activation needs (about 9.5 MiB unbudgeted)
    auto = js.parallelize(step, devices=8, mode="auto", cost_model=CostModel(memory=budget, device="4 MiB device"),
                          search=WHOLE)
    report = auto.plan(*args).search
    chosen = [w for w in report.recompute if w.chosen]
    assert [w.policy for w in chosen] == ["full"], report.line()
    # recompute binds the budget, so the search weighed the state in host memory too: streaming costs more here
    assert [(w.policy, w.chosen) for w in report.offload] == [
        ("none", True), ("optimizer", False), ("optimizer+parameters", False)], report.line()
    assert all(w.host_seconds > 0 and w.seconds > report.seconds for w in report.offload[1:])
    assert report.peak_bytes <= budget and report.budget == budget
    assert "(the memory of one 4 MiB device, no memory_budget given)" in report.line()
    params, state, loss = auto(*args)
    terms = step_terms(args[0], args[2])
    assert_close(loss, ref_loss, terms=step_terms(args[0], args[2], backward=False))
    assert_close(params, ref_params, terms=terms)
    assert_close(state, ref_state, terms=terms)


def test_unfittable_budget_names_the_smallest_peak_and_what_to_try(scan_gpt):
    step, args, _ = scan_gpt
    auto = js.parallelize(step, devices=8, mode="auto", cost_model=CostModel(memory=64 * 2**10))
    with pytest.raises(js.MemoryBudgetError, match=(
            r"jshard.parallelize\(train_step\): a budget of the memory of one device, no memory_budget given: 64 KiB "
            r"per device cannot be met on 8 devices with any recompute policy of the "
            r"jshard.recompute\(policy='auto'\) regions \(none: no plan fits \(least peak .*\); selective: .*; full: "
            r".*\)\. The smallest peak the search estimated is .* per device, with recompute 'full'\. Raise "
            r"memory_budget to at least that, use more devices, shrink the batch")) as e:
        auto.plan(*args)
    assert e.value.least_bytes > 64 * 2**10


def test_default_budget_of_an_abstract_mesh_is_its_device_kind():
    cfg = models.MLPConfig(64, 256, 64, 2)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(models.mlp_loss, optimizer)
    params = jax.eval_shape(lambda k: models.init_mlp(cfg, k), jax.random.key(0))
    args = (params, jax.eval_shape(optimizer.init, params), models.mlp_batch(np.random.default_rng(0), cfg, 64))
    h100 = js.parallelize(step, devices=64, mode="auto", cost_model=CostModel.for_device("H100")).plan(*args).search
    assert h100.budget == 80 * 2**30 and "(the memory of one H100, no memory_budget given)" in h100.line()
    unknown = js.parallelize(step, devices=64, mode="auto").plan(*args).search
    assert unknown.budget is None  # an abstract mesh of no named device: no memory to hold the plan to
    tiny = js.parallelize(step, devices=64, mode="auto", cost_model=CostModel(memory=1024.0, device="tiny"))
    with pytest.raises(js.MemoryBudgetError, match=r"memory_budget=1 KiB per device cannot be met on 64 devices"):
        tiny.plan(*args)


def test_unknown_device_kind_names_the_known_ones():
    with pytest.raises(js.ShardingError, match=r"CostModel.for_device\('Z80'\): no such device kind; the known "
                                               r"kinds are H100, H200, A100, GH200\."):
        CostModel.for_device("Z80")


def _two_layers(ws, x):
    layer = js.recompute(lambda w, h: jnp.tanh(h @ w))  # no policy: parallelize's recompute=
    for w in ws:
        x = layer(w, x)
    return x.sum()


@pytest.mark.parametrize("recompute, barriers", [(None, 2), ("full", 2), ("none", 0)], ids=["default", "full", "none"])
def test_parallelize_recompute_is_the_default_of_regions_naming_none(recompute, barriers):
    ws = [jnp.eye(16) / (k + 2) for k in range(2)]
    x = jnp.linspace(-1, 1, 8 * 16).reshape(8, 16)
    step = js.parallelize(jax.grad(_two_layers), devices=8, recompute=recompute)
    assert step.lower(ws, x).as_text().count("optimization_barrier") == barriers
    assert_close(step(ws, x), jax.jit(jax.grad(_two_layers))(ws, x), terms=2 * 16 + 8)


def test_parallelize_recompute_bad_policy():
    with pytest.raises(js.ShardingError, match=r"jshard.parallelize\(_two_layers\): recompute='dots' is no recompute "
                                               r"policy. Use one of 'full', 'selective', 'none', 'auto'"):
        js.parallelize(_two_layers, devices=8, recompute="dots")(([jnp.eye(2)], jnp.ones((8, 2))))


def test_a_result_is_held_from_the_start_unless_it_takes_over_a_donated_argument():
    """XLA gives each result its own buffer for the whole program (`memory_analysis` counts the
    results beside the temporaries), so the memory model holds a result from the program's start,
    even where it is made last; one written into a donated argument's buffer from where it is made.
    At the outer product's point the model holds both arguments, the undonated result and the
    product: at least what XLA counts for the arguments and results."""
    from jshard.cost import live_ranges, value_bytes
    from jshard.graph import flatten

    def f(x, y):
        big = jnp.outer(x, x)  # the largest temporary, before either result is made
        return x + jnp.sum(jnp.tanh(big), axis=0), y * 2.0

    x, y = jnp.ones(256, jnp.float32), jnp.ones(1024, jnp.float32)
    closed = jax.make_jaxpr(f)(x, y)
    args, (kept, written) = closed.jaxpr.invars, closed.jaxpr.outvars
    nodes = flatten(closed.jaxpr)
    ranges = live_ranges(nodes, args, closed.jaxpr.outvars, donated=frozenset({args[1]}))
    made = {v: i for i, node in enumerate(nodes) for v in node.outputs}
    assert ranges.first[kept] == 0 < made[kept] and ranges.last[kept] == ranges.end
    assert ranges.first[written] == made[written] > 0
    live = ranges.live_bytes({v: value_bytes(v) for v in ranges.first})
    outer = next(i for i, node in enumerate(nodes) if node.primitive in ("dot_general", "mul") and len(node.outputs[0].aval.shape) == 2)
    assert live[outer] >= value_bytes(kept) + sum(value_bytes(v) for v in args) + 256 * 256 * 4
    m = jax.jit(f, donate_argnums=1).lower(x, y).compile().memory_analysis()
    assert live.max() >= m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes



ROWS, WIDTH, HIDDEN, DEPTH = 2048, 32, 1024, 2
HIDDEN_BYTES = ROWS * HIDDEN * 4
"""A scanned feed-forward layer whose hidden activations `[ROWS, HIDDEN]` (8 MiB in float32) dwarf
what the scan carries (`[ROWS, WIDTH]`, 1/32 of that) and each layer's weights."""


def _layer(x, w):
    return x + jnp.maximum(x @ w[0], 0.0) @ w[1], None


def _forward(ws, x):
    return jax.lax.scan(_layer, x, ws)[0]


def _train_step(ws, x):
    """The layer recomputed in the backward pass: its backward body makes the hidden activations
    again beside their gradients."""
    loss = lambda ws: jnp.mean(jax.lax.scan(jax.checkpoint(_layer), x, ws)[0] ** 2)  # noqa: E731
    return jax.tree.map(lambda w, g: w - 1e-3 * g, ws, jax.grad(loss)(ws))


@pytest.mark.parametrize("step", [_forward, _train_step], ids=["forward", "train_step"])
def test_a_loop_bodys_own_peak_is_counted_at_the_loop(step):
    """The memory model adds at a loop's point what its body holds at once of the values it makes
    (once, whatever the trip count). Against XLA's peak on one device: the top-level points alone
    fall short by at least one hidden buffer (the forward body holds one, the backward's three);
    counted, the model is within half of one, so no hidden-sized buffer is missed or counted twice
    (everything else, a few `[ROWS, WIDTH]` and `[WIDTH, HIDDEN]` arrays, is less than half of one).
    The same holds on 8 devices for a searched plan's estimate and a propagated one's against the
    compiled plans, at their per-device hidden buffer."""
    from jshard.cost import LiveRanges, live_ranges, value_bytes
    from jshard.graph import flatten
    from jshard.rules import FUSION

    rng = np.random.default_rng(0)
    ws = (jnp.asarray(rng.standard_normal((DEPTH, WIDTH, HIDDEN)) / 8, jnp.float32),
          jnp.asarray(rng.standard_normal((DEPTH, HIDDEN, WIDTH)) / 32, jnp.float32))
    x = jnp.asarray(rng.standard_normal((ROWS, WIDTH)), jnp.float32)
    closed = jax.make_jaxpr(step)(ws, x)
    ranges = live_ranges(flatten(closed.jaxpr), closed.jaxpr.invars, closed.jaxpr.outvars, fusion=FUSION)
    held = {v: value_bytes(v) for v in ranges.values()}
    top_level = LiveRanges(ranges.first, ranges.last, ranges.end).live_bytes(held).max()
    one_device = js.audit(jax.jit(step).lower(ws, x).compile()).memory.peak_bytes
    assert top_level <= one_device - HIDDEN_BYTES
    assert abs(ranges.live_bytes(held).max() - one_device) < HIDDEN_BYTES / 2

    for mode in ("auto", "semi_auto"):  # searched, and propagated (`Plan.work.peak_bytes`: the same model)
        fn = js.parallelize(step, devices=8, mode=mode)
        plan = fn.plan(ws, x)
        assert mode != "auto" or plan.work.peak_bytes == plan.search.peak_bytes
        hidden = next(op for op in plan.ops if op.primitive == "dot_general" and op.out_shapes[0].endswith(f"[{ROWS},{HIDDEN}]"))
        cut = math.prod(hidden.out_strategy[0])
        compiled = js.audit(fn.lower(ws, x).compile()).memory.peak_bytes
        assert abs(plan.work.peak_bytes - compiled) < HIDDEN_BYTES / cut / 2, mode


def test_a_loop_bodys_dead_operators_hold_no_memory():
    """The scanned GPT's blocks recomputed (`recompute="full"`): the backward's recomputed forward makes
    the causal fill `jnp.where(causal, scores, -1e9)` broadcasts to the scores' shape, which nothing
    in the backward reads. XLA removes such operators, so the memory model counts none of their bytes
    in the body's peak; counted, the fill alone at 1024 devices outweighed every plan's peak (GPT-3
    175B: 2,323 GiB per device, no plan under 80 GiB)."""
    from jax.extend import core as jcore

    from jshard.cost import live_ranges
    from jshard.graph import flatten
    from jshard.rules import FUSION

    cfg = models.GPTConfig(n_layers=2, seq_len=32, d_model=32, n_heads=4, scan=True, recompute="full")
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 4)
    closed = jax.make_jaxpr(jax.grad(lambda p, b: models.gpt_loss(p, b, cfg)))(params, batch)
    nodes = flatten(closed.jaxpr)
    ranges = live_ranges(nodes, closed.jaxpr.invars, closed.jaxpr.outvars, fusion=FUSION)
    read = {v for node in nodes for v in node.inputs if not isinstance(v, jcore.Literal)}
    dead = [v for node in nodes if node.inside and not node.bodies
            for v in node.outputs if node.primitive == "broadcast_in_dim" and v not in read and v.aval.shape]
    assert dead, "the recomputed forward no longer leaves a dead broadcast in the backward's body"
    assert {v.aval.shape for v in dead} == {(4, cfg.n_heads, cfg.seq_len, cfg.seq_len)}  # the scores' shape
    counted = set(ranges.values())
    assert not any(v in counted for v in dead)
