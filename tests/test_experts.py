"""Expert parallel (issue 34 item 1): the reference MoE's capacity form (GShard's top-k dispatch as
MaxText and Flax write it) with its experts cut over a mesh axis, tokens dispatched by all-to-all:
the routing against a loop, numerics against one device, the compiled all-to-alls against the
plan's, and the search choosing expert parallel where it is cheaper than the expert plans."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models
from jshard._examples import moe_shapes
from jshard.models import _moe

CFG = models.MoEConfig(vocab=32, seq_len=8, d_model=32, d_ff=64, n_experts=8, dispatch="capacity", top_k=2, capacity_factor=1.0)
BUFFER_BYTES = 8 * 8 * CFG.capacity * CFG.d_model * 4  # the experts' buffers [e, g, c, d], float32, batch 8


def _routed_by_loop(logits: np.ndarray, top_k: int, capacity: int) -> np.ndarray:
    """GShard's priority, one token at a time: every token's first choice, then every second choice."""
    g, s, e = logits.shape
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    combine = np.zeros((g, s, e, capacity))
    for group in range(g):
        taken = np.zeros(e, int)
        order = np.argsort(-probs[group], axis=-1, kind="stable")
        for k in range(top_k):
            for t in range(s):
                expert = order[t, k]
                if taken[expert] < capacity:
                    combine[group, t, expert, taken[expert]] = probs[group, t, expert]
                taken[expert] += 1
    return combine


def test_capacity_dispatch_is_gshards_priority_and_drops_over_capacity():
    logits = np.random.default_rng(0).normal(size=(4, 8, 8)).astype(np.float32)
    dispatch, combine = _moe.capacity_dispatch(jnp.asarray(logits), CFG.top_k, CFG.capacity)
    want = _routed_by_loop(logits, CFG.top_k, CFG.capacity)
    assert_close(combine, want.astype(np.float32), terms=2)  # softmax: exp, sum, divide
    np.testing.assert_array_equal(dispatch, (want > 0).astype(np.float32))
    assert 0 < int(dispatch.sum()) < 4 * 8 * CFG.top_k  # capacity 2 of 8 experts: some choices dropped


def _step(cfg):
    opt = optax.sgd(0.1)
    params = models.init_moe(cfg, jax.random.key(0))
    step = models.make_train_step(lambda p, b: models.moe_loss(p, b, cfg), opt)
    return step, (params, opt.init(params), models.moe_batch(np.random.default_rng(0), cfg, 8))


def _experts_cut(params, cut):
    """`cut` on the stacked expert weights (`w_in`, `w_out`), nothing on the rest."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: cut if jax.tree_util.keystr(path).endswith(("'w_in']", "'w_out']")) else None, params)


DP_EP = js.Layout((2, 4), ("dp", "ep"))
LAYOUTS = {
    # tuples: the experts over all 8 devices, which also hold the batch's 8 rows (ep borrows dp)
    "ep8-tuples": ((8, 1, 1), (8, 1)),
    # a Layout: the batch over dp x ep, the experts over ep only (4 ways), replicated over dp
    "dp2-ep4-layout": (DP_EP("ep", "None", "None"), DP_EP(("dp", "ep"), "None")),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_equals_one_device_and_moves_what_the_plan_predicts(name):
    experts, rows = LAYOUTS[name]
    step, args = _step(CFG)
    par = js.parallelize(step, devices=8, in_strategy=(_experts_cut(args[0], experts), None, (rows, rows)))
    plan = par.plan(*args)
    compiled = par.lower(*args).compile()
    report = js.audit(compiled)
    # four all-to-alls: the dispatch and the combine, forward and backward; no expert weight moves
    ep = 8 if name.startswith("ep8") else 4
    assert report.by_kind()["all-to-all"] == (4.0, 4 * BUFFER_BYTES / 8)  # each device's slice, as the audit counts
    assert plan.predicted_bytes("all-to-all") == report.bytes("all-to-all")
    assert plan.predicted_bytes() == report.bytes(), plan.compare(report)
    searched = [op for op in plan.ops if op.primitive == "dot_general" and op.in_strategy
                and len(op.in_strategy[1]) == 3 and op.in_strategy[1][0] == ep]
    assert searched, "no expert matmul cut by expert"
    got = compiled(*jax.device_put(args, plan.in_shardings))
    assert_close(got, jax.jit(step)(*args), terms=step_terms(args[0], args[2]))


def _abstract(cfg: models.MoEConfig, rows: int):
    """The MoE train step's arguments as shapes only: planned, never run."""
    params, opt = moe_shapes(cfg), optax.sgd(0.1)
    step = models.make_train_step(lambda p, b: models.moe_loss(p, b, cfg), opt)
    tokens = jax.ShapeDtypeStruct((rows, cfg.seq_len), jnp.int32)
    return step, (params, jax.eval_shape(opt.init, params), (tokens, tokens))


BIG = models.MoEConfig(vocab=1024, seq_len=512, d_model=1024, d_ff=4096, n_experts=8, dispatch="capacity", top_k=2)


def test_search_chooses_expert_parallel_where_it_is_cheaper_than_the_expert_plans():
    """A MoE layer of 8 experts 1024 -> 4096 and 16k tokens, the batch cut over the 8 devices (as a
    data loader gives it): replicating the experts all-reduces their 256 MiB of gradients, cutting
    them FSDP- or Megatron-style moves them or the activations; cutting them by expert moves only
    the dispatched tokens. The search cuts them by expert, dispatching by all-to-all, and predicts
    less than each expert plan priced by the same cost model."""
    step, args = _abstract(BIG, 32)
    x = js.Layout((8,), ("x",))
    rows = (x("x", "None"),) * 2
    auto = js.parallelize(step, devices=8, mode="auto", in_strategy=(None, None, rows)).plan(*args)
    layer = auto.in_shardings[0]["layers"][0]
    assert layer["w_in"].spec == layer["w_out"].spec == jax.sharding.PartitionSpec(auto.fine.names)
    assert auto.predicted_bytes("all-to-all") > 0
    megatron = {"w_in": x("None", "None", "x"), "w_out": x("None", "x", "None")}  # column, then row
    hand = {
        "replicated": _experts_cut(args[0], x("None", "None", "None")),
        "fsdp": _experts_cut(args[0], x("None", "x", "None")),  # gathered before use
        "megatron": jax.tree_util.tree_map_with_path(lambda path, _: megatron.get(path[-1].key), args[0]),
    }
    seconds = {name: js.parallelize(step, devices=8, in_strategy=(params, None, rows)).plan(*args).work.seconds
               for name, params in hand.items()}
    assert all(auto.work.seconds < s for s in seconds.values()), (auto.work.seconds, seconds)
    expert_matmul = next(i for i, op in enumerate(auto.ops) if op.primitive == "dot_general"
                         and op.in_strategy[1:] == ((8, 1, 1),) and "(_experts), forward" in auto.explain(i))
    assert "chosen by the strategy search" in auto.explain(expert_matmul)


def test_under_a_budget_replicated_experts_miss_and_the_search_cuts_them_by_expert():
    """The same layer under 800 MiB per device: its experts replicated hold more (read from the
    compiled program); the search's plan cuts them by expert, dispatches by all-to-all, and its
    compiled program fits."""
    step, args = _abstract(BIG, 32)
    x = js.Layout((8,), ("x",))
    rows = (x("x", "None"),) * 2
    budget = 800 * 2**20
    replicated = js.parallelize(step, devices=8, in_strategy=(_experts_cut(args[0], x("None", "None", "None")), None, rows))
    assert replicated.plan(*args).audit().memory.peak_bytes > budget
    auto = js.parallelize(step, devices=8, mode="auto", search=js.Search(memory_budget=budget), in_strategy=(None, None, rows))
    plan = auto.plan(*args)
    layer = plan.in_shardings[0]["layers"][0]
    assert layer["w_in"].spec == layer["w_out"].spec == jax.sharding.PartitionSpec(plan.fine.names)
    assert plan.predicted_bytes("all-to-all") > 0
    assert plan.search.compiled_peak_bytes <= budget, plan.search.line()


def test_the_three_dispatch_forms_agree_where_none_drops():
    """Top-1: the dense form, the dropless one (sorted, `ragged_dot`) and the capacity form with room
    for every token compute the same layer."""
    base = models.MoEConfig(vocab=32, seq_len=8, d_model=32, d_ff=64, n_experts=8)
    params = models.init_moe(base, jax.random.key(0))
    tokens = models.moe_batch(np.random.default_rng(0), base, 4)[0]
    dense = models.moe_apply(params, tokens, base)
    for form in (dataclasses.replace(base, dispatch="dropless"),
                 dataclasses.replace(base, dispatch="capacity", capacity_factor=base.n_experts)):
        assert_close(models.moe_apply(params, tokens, form), dense, terms=2 * (32 + 64) + 8, err_msg=form.dispatch)


def test_dropless_form_equals_one_device_and_its_gathers_are_priced():
    """The dropless form on 8 devices, the batch cut 8 ways: the sort and the grouped matmuls take
    the tokens whole (their groups' bounds are data), so the plan gathers them, priced to the byte."""
    cfg = models.MoEConfig(vocab=32, seq_len=8, d_model=32, d_ff=64, n_experts=8, dispatch="dropless", top_k=2)
    step, args = _step(cfg)
    par = js.parallelize(step, devices=8, in_strategy=(None, None, ((8, 1), (8, 1))))
    plan = par.plan(*args)
    (grouped, *_) = [op for op in plan.ops if op.primitive == "ragged_dot_general"]
    assert grouped.ruled and grouped.origin == "propagated"
    compiled = par.lower(*args).compile()
    report = js.audit(compiled)
    assert plan.predicted_bytes() == report.bytes(), plan.compare(report)
    got = compiled(*jax.device_put(args, plan.in_shardings))
    assert_close(got, jax.jit(step)(*args), terms=step_terms(args[0], args[2]))


def test_moe_config_and_preset_errors_name_the_fix():
    with pytest.raises(ValueError, match=r"dispatch='sparse'; the forms are \('dense', 'capacity', 'dropless'\)"):
        models.MoEConfig(dispatch="sparse")
    with pytest.raises(ValueError, match=r"top_k=2 needs dispatch='capacity' or 'dropless'"):
        models.MoEConfig(top_k=2)
    cfg = models.MoEConfig(n_experts=8, dispatch="dropless")
    params = models.init_moe(cfg, jax.random.key(0))
    with pytest.raises(js.ShardingError, match=r"preset '2d' cuts the expert dim .* \(jax.lax.ragged_dot\) .* Use "
                                               r"dispatch='capacity' for expert parallel"):
        models.moe_apply(params, jnp.zeros((2, cfg.seq_len), jnp.int32), cfg, models.preset("2d", 8))


@pytest.mark.parametrize("rows", ["dp", "dp-mp"])
def test_capacity_form_under_the_preset_shard_call(rows):
    """The preset's `shard` call on the experts cuts them and their buffers by expert `mp` ways (the
    groups `dp` ways). Tokens cut `dp` ways only are whole over mp: each device makes its experts'
    buffers from the tokens it holds, nothing moves to them. Tokens cut over dp x mp (expert
    parallel borrowing the data-parallel devices) reach them by all-to-all over the mp axes."""
    preset, opt = models.preset("2d", 8), optax.sgd(0.1)
    params = models.init_moe(CFG, jax.random.key(0))
    args = (params, opt.init(params), models.moe_batch(np.random.default_rng(0), CFG, 8))
    step = models.make_train_step(lambda p, b: models.moe_loss(p, b, CFG, preset), opt)
    cut = preset.batch(2) if rows == "dp" else preset.layout(("dp", "mp"), "None")
    par = js.parallelize(step, devices=8, in_strategy=(None, None, (cut, cut)))
    plan = par.plan(*args)
    compiled = par.lower(*args).compile()
    report = js.audit(compiled)
    buffers = [c for op in plan.ops for c in op.comms if c.kind == "all-to-all" and c.bytes == BUFFER_BYTES / 8]
    assert len(buffers) == (0 if rows == "dp" else 4)  # (dp-mp: the column-parallel head's logits move too)
    assert plan.predicted_bytes() == report.bytes(), plan.compare(report)
    plain = models.make_train_step(lambda p, b: models.moe_loss(p, b, CFG), opt)
    got = compiled(*jax.device_put(args, plan.in_shardings))
    assert_close(got, jax.jit(plain)(*args), terms=step_terms(args[0], args[2]))


def _scanned_top_k(xs):
    return jax.lax.scan(lambda c, x: (c, jax.lax.top_k(-x, 2)), 0.0, xs)[1]


@pytest.mark.parametrize("fn, shape, cut", [(lambda x: jax.lax.top_k(-x, 2), (64, 16), (8, 1)),
                                            (_scanned_top_k, (3, 64, 16), (1, 8, 1))], ids=["top-level", "in-scan"])
def test_top_k_runs_on_each_devices_rows_without_a_collective(fn, shape, cut):
    """XLA's partitioner gathers a TopK's whole input whatever its batch cut; the plan runs it per
    device instead, in a loop body too, as its rule prices it (nothing moves)."""
    x = jnp.asarray(np.random.default_rng(0).normal(size=shape), jnp.float32)
    top = js.parallelize(fn, devices=8, in_strategy=(cut,))
    assert js.audit(top.lower(x).compile()).by_kind() == {}
    for got, want in zip(top(x), jax.jit(fn)(x)):
        np.testing.assert_array_equal(got, want)  # the same elements and indices: chosen, not computed
