"""Sharding propagation: MindSpore's documented cases, numerics against one device, explain,
prediction against the compiled program, save/load."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms

import jshard as js
from jshard import models


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).normal(size=shape), jnp.float32)


def _ffn(x, w1, b1, w2):
    h = js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w1)
    h = jax.nn.relu(h + b1[None, :])
    return h @ w2


@pytest.fixture(scope="module")
def ffn():
    args = (_rand((8, 16)), _rand((16, 32), 1), _rand((32,), 2), _rand((32, 8), 3))
    step = js.parallelize(_ffn, devices=8, batch_argnums=0)
    return step, args, step.plan(*args)


def test_ffn_first_matmul_configured_propagates_to_bias_relu_and_second_matmul(ffn):
    """MindSpore's sharding_propagation example: only the first MatMul is configured."""
    step, args, plan = ffn
    dot1, bias, add, relu, dot2 = plan.ops
    assert [op.primitive for op in plan.ops] == ["dot_general", "broadcast_in_dim", "add", "max", "dot_general"]
    assert dot1.origin == "user" and dot1.out_strategy == ((2, 4),)
    assert add.in_strategy == ((2, 4), (1, 4)) and add.out_strategy == ((2, 4),) and add.origin == "propagated"
    assert relu.out_strategy == ((2, 4),) and relu.origin == "propagated"
    assert bias.in_strategy == ((4,),)  # the bias is stored cut like the columns it is added to
    # The second matmul contracts over the 4-way cut: W2 rows cut 4 ways, partial sums all-reduced after it.
    assert dot2.in_strategy == ((2, 4), (4, 1)) and dot2.out_strategy == ((2, 1),)
    assert [c[0] for op in plan.ops[:4] for c in op.comms] == []
    assert [(k, axes) for k, _, axes in dot2.comms] == [("all-reduce", ("d1", "d2"))]
    report = plan.audit()
    assert report.by_kind() == {"all-reduce": (1.0, 128.0)}  # none between the two matmuls
    assert_close(step(*args), jax.jit(_ffn)(*args), terms=16 + 1 + 32)  # (x @ w1 + b1) @ w2


def test_two_matmuls_with_different_cuts_all_gather_between():
    def f(x, w1, w2):
        h = js.shard(jnp.matmul, ((4, 1), (1, 1)))(x, w1)
        return js.shard(jnp.matmul, ((1, 1), (1, 4)))(h, w2)

    args = (_rand((8, 16)), _rand((16, 16), 1), _rand((16, 8), 2))
    step = js.parallelize(f, devices=4, batch_argnums=0)
    report = js.audit(step.lower(*args).compile())
    assert set(report.by_kind()) == {"all-gather"}
    assert report.bytes("all-gather") == 8 * 16 * 4  # the whole [8, 16] activation, gathered
    assert_close(step(*args), jax.jit(f)(*args), terms=16 + 16)


def test_explain_names_anchor_chain_cost_and_rejected(ffn):
    _, _, plan = ffn
    text = plan.explain(4)
    assert text.startswith("op #4 dot_general (")
    assert "strategy: in ((2, 4), (4, 1)) -> out ((2, 1),); origin propagated" in text
    assert "came from: #0 dot_general [matmul] (user," in text
    assert "through: #0 dot_general -> #2 add -> #3 max -> #4 dot_general" in text
    assert "cost paid: all-reduce of 128 B over d1×d2 (5.00192 us predicted)" in text
    # Gathering the contracted cut instead: 512 B all-gathered, dearer by a hair at these sizes.
    assert "best rejected alternative: ((2, 1), (1, 1)) -> ((2, 1),) at 5.00384 us" in text
    assert "set by the user: jshard.shard(matmul)" in plan.explain(plan.ops[0])


def test_summary_groups_by_source_line(ffn):
    _, _, plan = ffn
    text = plan.summary()
    assert "5 operators: 1 user, 4 propagated; coverage 100.0%" in text
    assert re.search(r"test_propagation\.py:\d+:\d+\s+fwd\s+add\s+add \(\(2, 4\), \(1, 4\)\) -> \(\(2, 4\),\)\s+1 propagated", text)
    assert "dot_general ((2, 4), (4, 1)) -> ((2, 1),)" in text


def _gpt_step(cfg, preset=None):
    opt = optax.sgd(0.1)  # Adam's first step is ±lr wherever a gradient is ~0: rounding would decide its sign
    params = models.init_gpt(cfg, jax.random.key(0))
    state = opt.init(params)
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 16)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg, preset), opt)
    plain = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), opt)
    return step, plain, (params, state, batch)


TIED = js.Layout((2, 4), ("mp", "dp"))


def _tied_embedding_step(table, tokens):
    def loss(table, tokens):  # a lookup and an output layer sharing one table: two gradient parts
        return jax.nn.logsumexp(jnp.tanh(table[tokens]) @ table.T, axis=-1).mean()

    return table - 0.1 * jax.grad(loss)(table, tokens)


def test_partial_sums_are_summed_in_the_layout_their_users_take():
    """The lookup's scatter-add decides from the tokens (cut over dp) before its user, the sum with
    the output layer's gradient, takes the table cut over mp: it then sums its partial sums into
    that cut, all-reducing its own rows (1 KiB) instead of the whole table, the whole table rejected."""
    table, tokens = _rand((32, 16)), jnp.asarray(np.random.default_rng(1).integers(0, 32, (8, 4)), jnp.int32)
    step = js.parallelize(_tied_embedding_step, devices=8, in_strategy=(TIED("mp", "None"), TIED("dp", "None")))
    plan = step.plan(table, tokens)
    (scatter,) = [op for op in plan.ops if op.primitive == "scatter-add"]
    assert scatter.out_specs == (jax.sharding.PartitionSpec("mp"),)
    assert [(k, b, axes) for k, b, axes in scatter.comms] == [("all-reduce", 32 // 2 * 16 * 4, ("dp_0", "dp_1"))]
    assert "best rejected alternative: ((1, 1), (4, 1, 1), (4, 1, 1)) -> ((1, 1),)" in plan.explain(scatter)
    # the output layer's dot (16 terms), logsumexp over 32, the mean over 32 tokens; the gradient's
    # sums over 32 tokens (the scatter-add's and the dot's) and a few for tanh, exp and log
    assert_close(step(table, tokens), jax.jit(_tied_embedding_step)(table, tokens), terms=16 + 32 + 32 + 32 + 32 + 8)


def _scaled(x, y, scale):
    return x + y * jnp.broadcast_to(scale, y.shape)


def test_a_broadcast_vector_is_gathered_where_its_users_take_the_activations_layout():
    """A per-channel vector cut over the channels (as a sharded batch-norm scale is), broadcast
    to meet activations cut over the batch: the broadcast decides from the vector alone, the
    product follows it and moves its activation operand in (an all-to-all of 1 KiB per device),
    and the sum moves the product back (another). Walking back from the users, the product is
    made in the layout its user takes and the broadcast in the product's: the vector (128 B) is
    gathered, nothing else moves; equal to one device."""
    x, y, scale = _rand((64, 32)), _rand((64, 32), 1), _rand((32,), 2)
    step = js.parallelize(_scaled, devices=8, in_strategy=((8, 1), (8, 1), (8,)))
    found = js.audit(step.lower(x, y, scale).compile())
    assert [(c.kind, c.bytes) for c in found.collectives] == [("all-gather", 32 * 4)], found
    assert_close(step(x, y, scale), jax.jit(_scaled)(x, y, scale), terms=2)


@pytest.fixture(scope="module")
def gpt_2d():
    """The GPT train step with the 2-D preset's matmul strategies and the batch as the only anchors:
    parameters and optimizer state are laid out by propagation."""
    preset = models.preset("2d", 8)
    step, plain, args = _gpt_step(models.GPTConfig(n_layers=1), preset)
    batch_strategy = tuple(preset.batch(x.ndim) for x in args[2])
    par = js.parallelize(step, devices=8, in_strategy=(None, None, batch_strategy))
    return par, plain, args, par.plan(*args)


def test_gpt_propagated_equals_one_device(gpt_2d):
    par, plain, args, plan = gpt_2d
    got, want = par(*args), jax.jit(plain)(*args)
    assert_close(got, want, terms=step_terms(args[0], args[2]))  # new parameters, state and loss
    # Weights are stored where the Megatron matmuls use them: w_up cut on its columns 4 ways.
    w_up = plan.in_shardings[0]["layers"][0]["w_up"]
    assert w_up.spec == jax.sharding.PartitionSpec(None, ("mp_0", "mp_1"))  # the preset Layout's mp, over 2 mesh axes


def test_gpt_prediction_matches_compiled_bytes(gpt_2d):
    _, _, _, plan = gpt_2d
    report = plan.audit()
    assert report.bytes() > 0
    assert abs(plan.predicted_bytes() / report.bytes() - 1) <= 0.10, plan.compare(report)


def test_save_load_rebuilds_the_same_program(gpt_2d, tmp_path):
    par, _, args, plan = gpt_2d
    path = tmp_path / "plan.json"
    plan.save(str(path))
    loaded = js.Plan.load(str(path))
    assert loaded.ops == plan.ops
    assert path.stat().st_size < 300 * len(plan.ops)  # format 2: ~230 bytes an operator (format 1: ~890)
    again = js.parallelize(par.fn, devices=8, in_strategy=par.options.in_strategy, plan=loaded)
    replan = again.plan(*args)
    assert [op.layout for op in replan.ops] == [op.layout for op in plan.ops]
    assert jax.tree.leaves(replan.in_shardings) == jax.tree.leaves(plan.in_shardings)
    assert js.audit(again.lower(*args).compile()).by_kind() == plan.audit().by_kind()


def test_loaded_plan_that_does_not_match_names_first_mismatch(gpt_2d, tmp_path):
    _, _, args, plan = gpt_2d
    path = tmp_path / "plan.json"
    plan.save(str(path))
    params, state, batch = args

    def other(params, state, batch):  # same arguments, another graph
        return jax.tree.map(jnp.tanh, params), state, batch[0].sum()

    step = js.parallelize(other, devices=8, plan=js.Plan.load(str(path)))
    with pytest.raises(js.ShardingError, match=r"the loaded plan does not match this function at operator #0: "
                                               r"the plan has \w+ .* the function tanh f32\[32,64\]"):
        step.plan(*args)
    with pytest.raises(js.ShardingError, match="the loaded plan is for a mesh"):
        js.parallelize(other, devices=4, plan=js.Plan.load(str(path))).plan(*args)


def test_xla_propagation_is_the_baseline(gpt_2d):
    par, plain, args, _ = gpt_2d
    base = js.parallelize(par.fn, devices=8, in_strategy=par.options.in_strategy, propagation="xla")
    plan = base.plan(*args)
    assert plan.propagation == "xla" and all(op.origin in ("user", "default") for op in plan.ops)
    assert_close(base(*args)[2], jax.jit(plain)(*args)[2], terms=step_terms(args[0], args[2], backward=False))


def test_propagation_value_is_checked():
    with pytest.raises(js.ShardingError, match=r"propagation='shardy' is not one of \('jshard', 'xla', 'best'\)"):
        js.parallelize(lambda x: x, propagation="shardy")


def test_plan_for_more_devices_than_present_on_an_abstract_mesh():
    """Planning for 64 devices from 8: the plan is made; running it is a DeviceCountError."""
    x, w1, b1, w2 = (jax.ShapeDtypeStruct(s, jnp.float32) for s in ((64, 16), (16, 32), (32,), (32, 8)))
    step = js.parallelize(_ffn, devices=64, batch_argnums=0)
    plan = step.plan(x, w1, b1, w2)
    assert plan.fine.sizes == (2,) * 6 and isinstance(plan.mesh, jax.sharding.AbstractMesh)
    # ((2, 1), (1, 4)) on 64 devices repeats the calculation 8 ways; the rest follows as on 8.
    assert plan.ops[2].out_strategy == ((2, 4),) and plan.ops[4].in_strategy == ((2, 4), (4, 1))
    with pytest.raises(js.DeviceCountError, match="such a plan can be made"):
        step.lower(x, w1, b1, w2)


def test_scanned_gpt_plans_the_body_once_and_matches_one_device():
    preset = models.preset("2d", 8)
    sizes = []
    for layers in (2, 4):
        step, plain, args = _gpt_step(models.GPTConfig(n_layers=layers, scan=True), preset)
        par = js.parallelize(step, devices=8, in_strategy=(None, None, tuple(preset.batch(x.ndim) for x in args[2])))
        plan = par.plan(*args)
        sizes.append(len(plan.ops))
    assert sizes[0] == sizes[1]  # one body, whatever the depth
    body = [op for op in plan.ops if op.inside == "scan"]
    assert body and all(op.origin in ("user", "propagated") for op in body)
    got, want = par(*args), jax.jit(plain)(*args)
    assert_close(got, want, terms=step_terms(args[0], args[2]))  # new parameters, state and loss
    report = js.audit(par.lower(*args).compile())
    assert abs(plan.predicted_bytes() / report.bytes() - 1) <= 0.10, plan.compare(report)


@pytest.mark.parametrize("name", ["mlp", "resnet", "moe"])
def test_reference_model_under_propagation_equals_one_device_and_prediction_holds(name):
    """Only the preset's shard calls and the batch layout are given; propagation lays out the rest."""
    rng = np.random.default_rng(0)
    cfg, init, loss, batch = {
        "mlp": (models.MLPConfig(), models.init_mlp, lambda p, b, cfg, preset=None: models.mlp_loss(p, b, preset),
                models.mlp_batch),
        "resnet": (models.ResNetConfig(), models.init_resnet, models.resnet_loss, models.resnet_batch),
        "moe": (models.MoEConfig(), models.init_moe, models.moe_loss, models.moe_batch),
    }[name]
    preset, opt = models.preset("2d", 8), optax.sgd(0.1)
    params = init(cfg, jax.random.key(0))
    args = (params, opt.init(params), batch(rng, cfg, 16))
    step = models.make_train_step(lambda p, b: loss(p, b, cfg, preset), opt)
    par = js.parallelize(step, devices=8, in_strategy=(None, None, tuple(preset.batch(np.ndim(x)) for x in args[2])))
    plan = par.plan(*args)
    assert plan.coverage >= 0.98
    compiled = par.lower(*args).compile()
    report = js.audit(compiled)
    assert abs(plan.predicted_bytes() / report.bytes() - 1) <= 0.10, plan.compare(report)
    got = compiled(*jax.device_put(args, plan.in_shardings))
    want = jax.jit(models.make_train_step(lambda p, b: loss(p, b, cfg), opt))(*args)
    assert_close(got, want, terms=step_terms(args[0], args[2]))  # new parameters, state and loss


def test_plan_argument_is_checked(ffn, tmp_path):
    _, _, plan = ffn
    with pytest.raises(js.ShardingError, match=r"plan= rebuilds a plan jshard propagated or searched; it cannot be used with "
                                               r"propagation='xla'"):
        js.parallelize(_ffn, propagation="xla", plan=plan)
    with pytest.raises(TypeError, match=r"plan= takes a jshard.Plan \(from Plan.load\), got str"):
        js.parallelize(_ffn, plan="plan.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "other"}')
    with pytest.raises(js.ShardingError, match=r"not a jshard plan file: format 'other', expected one of \('jshard.plan/1', 'jshard.plan/2'\)"):
        js.Plan.load(str(bad))


def _classifier_loss(params, batch):
    """Wide inputs through a small free layer, then a column-parallel head: the labels meet the
    logits, cut over the tensor-parallel axes, only in the loss."""
    x, labels = batch
    h = jax.nn.relu(x @ params["w1"])
    logp = jax.nn.log_softmax(js.shard(jnp.matmul, ((2, 1), (1, 4)))(h, params["w2"]))
    return -jnp.take_along_axis(logp, labels[:, None], axis=-1).mean()


def _classifier_step(params, batch):
    loss, grads = jax.value_and_grad(_classifier_loss)(params, batch)
    return loss, jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)


def test_default_cut_labels_move_alone_where_the_inputs_are_best_left_where_they_arrive():
    """The batch left to the default cut (8 ways): moving the wide inputs to the head's 2-way batch
    costs more than it saves, moving the labels saves the loss three all-to-alls of the logits.
    Each batch array is weighed moved alone too, and the gain is judged on what changes, not on
    the whole program's time (which its gradient all-reduce holds): Shardy's bytes or fewer."""
    rng = np.random.default_rng(0)
    params = {"w1": _rand((1024, 8)), "w2": _rand((8, 8), 1)}
    batch = (_rand((32, 1024), 2), jnp.asarray(rng.integers(0, 8, 32), jnp.int32))
    step = js.parallelize(_classifier_step, devices=8)
    plan = step.plan(params, batch)
    weighed = {text.split(":")[0]: text for op in plan.ops for text in op.weighed.split("; ") if op.weighed}
    assert re.search(r"\(2,\) moved once at the start [\d.]+ us \(chosen\)", weighed["i32[32]"]), weighed
    assert re.search(r"\(8, 1\) as it arrives [\d.]+ us \(chosen\)", weighed["f32[32,1024]"]), weighed
    ours = step.lower(params, batch).compile()
    shardy = js.parallelize(_classifier_step, devices=8, propagation="xla").lower(params, batch).compile()
    assert "all-to-all" not in js.audit(ours).by_kind()
    assert js.audit(ours).bytes() <= js.audit(shardy).bytes()
    got = ours(*jax.device_put((params, batch), ours.input_shardings[0]))
    assert_close(got, jax.jit(_classifier_step)(params, batch), terms=step_terms(params, batch))


MEGATRON = js.Layout((2, 4), ("dp", "mp"))


def _rotary_step(wk, x):
    def loss(wk, x):  # a key of 2 heads of 4, cut over its head dim, and its halves swapped (rotary)
        k = (x @ wk).reshape(x.shape[0], 2, 4)
        rotated = jnp.concatenate([-k[..., 2:], k[..., :2]], axis=-1)
        return jnp.tanh(k * 0.5 + rotated * 0.25).sum()

    return wk - 0.1 * jax.grad(loss)(wk, x)


def test_a_slice_of_a_dim_it_needs_whole_gathers_that_dim_alone():
    """The key's columns cut over mp (4) lay its 2 heads over mp_0 and its head dim over mp_1; the
    rotary half-slices need the head dim whole. The layout they cannot take as it is still says how
    to cut the rest: only the head dim is gathered (128 B over mp_1), the batch and head cuts kept,
    not the whole key gathered over every axis; equal to one device."""
    wk, x = _rand((16, 8), 3), _rand((16, 16), 4)
    step = js.parallelize(_rotary_step, devices=8, in_strategy=(MEGATRON("None", "mp"), MEGATRON("dp", "None")))
    slices = [op for op in step.plan(wk, x).ops if op.primitive == "slice"]
    assert {op.in_specs for op in slices} == {(jax.sharding.PartitionSpec("dp", "mp_0"),)}
    assert [(k, b, axes) for op in slices for k, b, axes in op.comms] == [("all-gather", 128, ("mp_1",))]
    assert_close(step(wk, x), jax.jit(_rotary_step)(wk, x), terms=16 + 8)


def _residual_loss(params, x):
    for w1, w2 in params:
        x = x + jnp.tanh(x @ w1) @ w2
    return jnp.tanh(x).sum()


def _residual_step(params, x):
    return jax.tree.map(lambda p, g: p - 0.1 * g, params, jax.grad(_residual_loss)(params, x))


def test_default_cut_batch_moves_to_the_axes_the_parameters_leave_free():
    """Megatron layouts on the parameters (over mp), the batch left to the default cut over every
    device: the model-parallel products and the residual stream want it over dp alone, the axis no
    anchor uses, which the anchors alone do not propagate to it (they leave it whole). Weighed moved
    once at the start into that cut, it is chosen: the bytes of the batch given over dp plus the
    one move, a lower peak than whole, equal to one device."""
    params = [(_rand((16, 64), 2 * k), _rand((64, 16), 2 * k + 1)) for k in range(2)]
    x = _rand((32, 16), 4)
    rules = [(MEGATRON("None", "mp"), MEGATRON("mp", "None"))] * 2
    step = js.parallelize(_residual_step, devices=8, in_strategy=(rules, None))
    weighed = {text.split(":")[0]: text for op in step.plan(params, x).ops for text in op.weighed.split("; ")
               if op.weighed}
    assert re.search(r"\(2, 1\) moved once at the start, cut over the axes the anchors leave free [\d.]+ us \(chosen\)",
                     weighed["f32[32,16]"]), weighed
    ours = step.lower(params, x).compile()
    given = js.parallelize(_residual_step, devices=8, in_strategy=(rules, MEGATRON("dp", "None"))).lower(params, x).compile()
    moved = 32 * 16 * 4 // 2  # the batch gathered over mp once: [16, 16] per device
    assert js.audit(ours).bytes() <= js.audit(given).bytes() + moved
    assert js.audit(ours).memory.peak_bytes <= js.audit(given).memory.peak_bytes
    got = ours(*jax.device_put((params, x), ours.input_shardings[0]))
    assert_close(got, jax.jit(_residual_step)(params, x), terms=step_terms(params, x))
