"""Stages cut from any function: an unrolled GPT whose embedding, layers and head are tagged with
`js.pipeline_stage(fn, k)` inside a plain train step, pipelined by `parallelize(step,
pipeline=js.Pipelining(S, M, schedule=...))`. Loss and gradients equal the unpipelined step
(non-uniform stages, a tied embedding read by the first and the last stage), each stage's devices
hold that stage's parameters only, and bad tags are errors naming the fix."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, step_terms
from jax.sharding import PartitionSpec as P

import jshard as js

D, VOCAB, SEQ, ROWS = 32, 16, 8, 16


def _init(tied: bool, layers: int) -> dict:
    keys = iter(jax.random.split(jax.random.key(0), 3 + 4 * layers))
    dense = lambda a, b: jax.random.normal(next(keys), (a, b)) / np.sqrt(a)
    params = {
        "embed": jax.random.normal(next(keys), (VOCAB, D)) * 0.3,
        "pos": jax.random.normal(next(keys), (SEQ, D)) * 0.1,
        "layers": [{"qkv": dense(D, 3 * D), "out": dense(D, D), "up": dense(D, 2 * D), "down": dense(2 * D, D)}
                   for _ in range(layers)],
    }
    return params if tied else {**params, "head": dense(D, VOCAB)}


def _norm(x):
    return (x - x.mean(-1, keepdims=True)) * jax.lax.rsqrt(x.var(-1, keepdims=True) + 1e-5)


def _block(p, x):
    q, k, v = jnp.split(_norm(x) @ p["qkv"], 3, axis=-1)
    scores = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), jnp.einsum("btd,bsd->bts", q, k) / np.sqrt(D), -1e9)
    x = x + jnp.einsum("bts,bsd->btd", jax.nn.softmax(scores, axis=-1), v) @ p["out"]
    return x + jax.nn.gelu(_norm(x) @ p["up"]) @ p["down"]


def _gpt_loss(stage_of_layer, last: int, tied: bool):
    """The unrolled GPT's loss as a user writes it, each part tagged with its stage."""

    def loss(params, batch):
        tokens, targets = batch
        x = js.pipeline_stage(lambda p, t: p["embed"][t] + p["pos"][None], 0)(params, tokens)
        for i, lp in enumerate(params["layers"]):
            x = js.pipeline_stage(_block, stage_of_layer[i])(lp, x)
        w_out = params["embed"].T if tied else params["head"]  # untagged: runs where the head reads it
        logits = js.pipeline_stage(lambda w, h: _norm(h) @ w, last)(w_out, x)
        logp = jax.nn.log_softmax(logits, axis=-1)  # untagged: joins the head's stage
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()

    return loss


@functools.cache
def _case(stages: int, tied: bool):
    """One layer a stage (the fewest each stage compiles): the embedding joins stage 0's, the head the
    last stage's."""
    params = _init(tied, stages)
    tokens = np.random.default_rng(1).integers(0, VOCAB, (ROWS, SEQ))
    batch = (tokens, np.roll(tokens, -1, axis=1))
    loss = _gpt_loss(list(range(stages)), stages - 1, tied)
    return params, batch, loss, jax.jit(jax.value_and_grad(loss))(params, batch)


CASES = [("gpipe", 2, 4, False), ("1f1b", 2, 4, False), ("zb-h1", 2, 4, True)]
"""S=4 (one layer a stage, the tied embedding on stages 0 and 3) runs at M=16: `_wide`, below."""


@functools.cache
def _step(schedule: str, stages: int, micro: int, tied: bool):
    _, _, loss, _ = _case(stages, tied)
    if tied:  # a plain loss function: the pipeline returns (loss, grads) for it
        return js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=stages, micro_batches=micro, schedule=schedule))
    step = lambda params, batch: jax.value_and_grad(loss)(params, batch)  # an ordinary train step
    return js.parallelize(step, devices=8, pipeline=js.Pipelining(stages=stages, micro_batches=micro, schedule=schedule))


@pytest.mark.parametrize("schedule,stages,micro,tied", CASES,
                         ids=[f"{s}-S{n}-M{m}{'-tied' if t else ''}" for s, n, m, t in CASES])
def test_tagged_gpt_equals_the_unpipelined_step(schedule, stages, micro, tied):
    params, batch, _, (ref_loss, ref_grads) = _case(stages, tied)
    loss, grads = _step(schedule, stages, micro, tied)(params, batch)
    # S=2: stage 0 = embedding + layer 0, stage 1 = layer 1 + head; tied: the embedding is the
    # head too, read by the first and the last stage, its gradient the sum of both (under zero
    # bubble: of the two stages' `W`s)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))
    moved, must = _permuted(_step(schedule, stages, micro, tied), params, batch)
    assert moved == must if stages > 2 else 2 * moved == must, (moved, must)  # see the test below


def _permuted(step, params, batch) -> tuple[float, int]:
    """The bytes the busiest device sends in the compiled step's collective-permutes (`js.audit`),
    and what must cross per step: M activations forward and M gradients back per boundary."""
    boundary = step.program(params, batch).cut.boundary  # one micro-batch's rows on one device
    assert len({tuple(b) for b in boundary}) == 1  # every boundary alike: one activation [rows, SEQ, D]
    one = sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in boundary[0])
    moved = js.audit(step.compile(params, batch)).by_kind()["collective-permute"][1]
    return moved, 2 * step.program(params, batch).schedule.micro_batches * one


MUST_CROSS = [(sched, 4, 16) for sched in ("gpipe", "1f1b")]  # S=2 (half of what must cross) at M=4: above


@functools.cache
def _wide_case():
    """The tied S=4 case on a 64-row batch (two rows per device per micro-batch at S=4, M=16): its
    parameters, batch, loss, and the unpipelined loss and gradients."""
    params, _, loss, _ = _case(4, True)
    tokens = np.random.default_rng(2).integers(0, VOCAB, (64, SEQ))
    batch = (tokens, np.roll(tokens, -1, axis=1))
    return params, batch, loss, jax.jit(jax.value_and_grad(loss))(params, batch)


@functools.cache
def _wide(schedule: str, stages: int, micro: int):
    """The 64-row batch and the step for it: every S=4 test shares these programs (one compile each)."""
    _, batch, loss, _ = _wide_case()
    step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=stages, micro_batches=micro, schedule=schedule))
    return batch, step


@pytest.mark.parametrize("schedule,stages,micro", MUST_CROSS, ids=[f"{a}-S{s}-M{m}" for a, s, m in MUST_CROSS])
def test_permutes_move_only_what_must_cross(schedule, stages, micro):
    """Each boundary carries M activations forward and M gradients back per step, so an inner stage
    must send 2M activations, an end stage M. Each permute carries only the pairs whose source sends
    at that tick (a stage idle in the fill or drain leaves them), so the busiest device sends
    (`js.audit`: loops weighted by trip count) exactly that: 1.0x what must cross at S=4, where
    it sends both ways, half of it at S=2 (each stage sends one way); the cells at M=4 are checked
    with the steps above, and S=2 there alone. The step still equals the unpipelined one (the
    embedding tied: read by the first and the last stage, its gradient the sum of both)."""
    params, batch, _, ref = _wide_case()
    step = _wide(schedule, stages, micro)[1]
    assert_close(step(params, batch), ref, terms=step_terms(params, batch))
    moved, must = _permuted(step, params, batch)
    assert moved <= 1.1 * must, (moved, must)
    assert moved == must if stages > 2 else 2 * moved == must, (moved, must)


def test_1f1b_holds_under_half_the_temporary_memory_of_gpipe():
    """At S=4, M=16 GPipe keeps 16 micro-batches' residuals per stage, 1F1B at most 4 (theory S/M);
    the programs compiled above."""
    params = _wide_case()[0]
    temp = {}
    for name in ("gpipe", "1f1b"):
        batch, step = _wide(name, 4, 16)
        temp[name] = step.compile(params, batch).memory_analysis().temp_size_in_bytes
    assert temp["1f1b"] <= 0.5 * temp["gpipe"], temp


BUBBLES = [(s, m) for s in (2, 4) for m in (4, 16)]


@pytest.mark.parametrize("stages,micro", BUBBLES, ids=[f"S{s}-M{m}" for s, m in BUBBLES])
def test_zero_bubble_idles_less_than_1f1b(stages, micro):
    """ZB-H1's `W`s fill 1F1B's bubble: the idle share of the tick table (every operation one tick,
    the backward two under zero bubble) is below 1F1B's, and at its theory (S-1)/(3M+S-1)."""
    zb = js.pipeline.build_schedule("zb-h1", stages=stages, micro_batches=micro)
    one = js.pipeline.build_schedule("1f1b", stages=stages, micro_batches=micro)
    assert zb.bubble_fraction < one.bubble_fraction
    assert zb.bubble_fraction == pytest.approx(zb.theoretical_bubble)


def test_the_zero_bubble_step_runs_its_table_and_splits_without_recomputing():
    """The zb-h1 step compiled above runs the ZB-H1 table; its stage's backward split into `B` and
    `W` (`SplitBackward`) computes what the whole pullback does, no more (compiled FLOPs): running
    the whole pullback at both ticks, XLA dropping the unused half, would repeat the chain of input
    gradients inside the stage."""
    from jshard.pipeline._split import SplitBackward  # noqa: PLC0415

    params, batch, _, _ = _case(2, True)
    program = _step("zb-h1", 2, 4, True).program(params, batch)
    assert program.schedule.name == "zb-h1" and program.schedule.split_backward
    c, leaves = program.cut, jax.tree.leaves(params)
    k = 1  # a layer and the head: the input gradient chains through them
    p_k, mb = [leaves[j] for j in c.params[k]], [a[: c.boundary[0][0].shape[0]] for a in jax.tree.leaves(batch)]  # one device's micro-batch
    x = [jnp.ones(a.shape, a.dtype) for a in c.boundary[k - 1]]
    cot = [jnp.ones(c.loss_aval.shape, c.loss_aval.dtype)]

    def bwd(p, x, cot):
        return jax.vjp(lambda p, x: c.run(k, p, mb, x), p, x)[1](cot)

    split = SplitBackward.of(bwd, [p_k, x, cot], n_params=len(p_k))
    args = [p_k, x, cot]
    g_x, handoff = split.input_grad(args)
    ref_p, ref_x = jax.jit(bwd)(*args)
    assert_close((split.weight_grad(args, handoff), g_x), (ref_p, ref_x), terms=step_terms(params, batch))
    flops = lambda f, *a: jax.jit(f).lower(*a).compile().cost_analysis()["flops"]
    whole = flops(bwd, *args)
    split_flops = flops(split.input_grad, args) + flops(split.weight_grad, args, handoff)
    assert split_flops <= whole, (split_flops, whole)


def _nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


def test_each_stage_holds_its_own_parameters_only():
    params, batch, _, _ = _case(2, False)
    step = _step("1f1b", 2, 4, False)
    layers = params["layers"]
    shares = (_nbytes([params["embed"], params["pos"], layers[:1]]), _nbytes([layers[1:], params["head"]]))
    assert step.program(params, batch).stage_bytes() == shares
    packed_sharding = step.compile(params, batch).input_shardings[0][0]  # the packed parameters
    per_device = {name: s.shard_shape((2, max(shares) // 4)) for name, s in packed_sharding.items()}
    assert {name: s.spec for name, s in packed_sharding.items()} == {"float32": P("stage")}
    assert per_device == {"float32": (1, max(shares) // 4)}  # one stage's row: the larger share, not the whole model
    assert max(shares) < _nbytes(params)
    # stage 1's four devices hold its layer and the head, packed in leaf order, and nothing of stage 0's
    packed = step.pack(params, batch)["float32"]
    mine = np.concatenate([np.ravel(a) for a in jax.tree.leaves({"head": params["head"], "layers": layers[1:]})])
    for shard in packed.addressable_shards:
        if shard.index[0] == slice(1, 2, None):
            np.testing.assert_array_equal(np.asarray(shard.data)[0, : mine.size], mine)


def test_tied_copies_get_the_summed_gradient_in_the_packed_step():
    params, batch, _, (_, ref_grads) = _wide_case()
    step = _wide("1f1b", 4, 16)[1]
    program = step.program(params, batch)
    _, packed_grads = step.train(step.pack(params, batch), batch)
    rows = np.asarray(packed_grads["float32"])
    flats = program.param_flats
    embed = 0  # the index of params["embed"] among the leaves: its key sorts first
    copies = [np.asarray(f.unpack({"float32": jnp.asarray(rows[k])})[idx.index(embed)])
              for k, (f, idx) in enumerate(zip(flats, program.cut.params)) if embed in idx]
    assert len(copies) == 2  # the first and the last stage
    for copy in copies:  # both copies hold the whole gradient, so an optimizer keeps them equal
        assert_close(copy, ref_grads["embed"], terms=step_terms(params, batch))


def test_a_packed_training_loop_keeps_state_where_it_is_used_and_trains_like_one_device():
    """SGD with momentum on the packed buffers (an update linear in the gradients, so the two runs'
    rounding differences stay of their size): each stage's parameters and optimizer state stay on its devices,
    the tied embedding's two copies stay equal, and the losses follow the one-device run."""
    params, batch, loss, _ = _wide_case()
    step = _wide("1f1b", 4, 16)[1]
    opt = optax.sgd(0.1, momentum=0.9)
    update = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*opt.update(g, s, p)))
    ref = jax.jit(jax.value_and_grad(loss))
    packed, p = step.pack(params, batch), params
    state, ref_state = opt.init(packed), opt.init(params)
    got, want = [], []
    for _ in range(3):
        value, grads = step.train(packed, batch)
        packed, state = update(packed, state, grads)
        ref_value, ref_grads = ref(p, batch)
        p, ref_state = update(p, ref_state, ref_grads)
        got.append(float(value))
        want.append(float(ref_value))
    assert_close(got, want, dtype=np.float32, terms=3 * step_terms(params, batch))
    assert want[-1] < want[0]
    assert {x.sharding.spec for x in jax.tree.leaves((packed, state)) if x.ndim == 2} == {P("stage")}
    program = step.program(params, batch)
    rows = [np.asarray(f.unpack({"float32": packed["float32"][k]})[idx.index(0)])
            for k, (f, idx) in enumerate(zip(program.param_flats, program.cut.params)) if 0 in idx]
    np.testing.assert_array_equal(rows[0], rows[1])  # the embedding (leaf 0) in stage 0's row and stage 3's
    assert_close(step.unpack(packed, params, batch), p, terms=3 * step_terms(params, batch))


def _tagged_loss(stage_of_layer, last):
    return _gpt_loss(stage_of_layer, last, tied=False)


@pytest.mark.parametrize("loss,message", [
    (_tagged_loss([0, 1], 2),
     r"is tagged jshard\.pipeline_stage\(fn, 2\), but stages=2 has stages 0\.\.1\. Tag it with a stage "
     r"below 2, or pass stages=3"),
    (_tagged_loss([1, 0], 1),
     r"is tagged jshard\.pipeline_stage\(fn, 0\), but it reads a value made on stage 1: stages must not decrease "
     r"along the data flow"),
    (_tagged_loss([0, 0], 0),
     r"stages=2, but stage\(s\) \[1\] run no operator of the loss"),
    (lambda p, b: p["head"].sum(),  # untagged, and one operator: nothing for the cost model to cut
     r"stages=2, but no operator of the loss is tagged with a stage\. Cut by the cost model, its 1 "
     r"operator\(s\) hold fewer narrow places .* than the 1 cut\(s\) 2 stages need\. Wrap the parts of the "
     r"model in jshard\.pipeline_stage\(fn, k\)"),
], ids=["stage-out-of-range", "not-monotone", "empty-stage", "no-tags"])
def test_bad_tags_are_errors_naming_the_fix(loss, message):
    params, batch, _, _ = _case(2, False)
    step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    with pytest.raises(js.ShardingError, match=message):
        step(params, batch)


def test_a_step_returning_more_than_the_loss_is_an_error():
    params, batch, loss, _ = _case(2, False)
    step = js.parallelize(lambda p, b: (loss(p, b), 2 * loss(p, b)), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    with pytest.raises(js.ShardingError, match=r"returns a scalar loss, or \(loss, grads\) as jax\.value_and_grad"):
        step(params, batch)


def test_interleaved_runs_tagged_stage_k_on_device_group_k_mod_S():
    """Four tagged stages (the embedding tied to the head: stages 0 and 3) on two device groups with
    two chunks each: stage k on group k mod 2, as its chunk k // 2. The step equals the unpipelined
    one, idles less than 1F1B at the same S, M, sends at most 1.1x what must cross, and each group
    holds its two stages' parameters."""
    params, batch, loss, ref = _case(4, True)
    step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="interleaved", virtual_stages=2))
    assert_close(step(params, batch), ref, terms=step_terms(params, batch))
    program = step.program(params, batch)
    one = js.pipeline.build_schedule("1f1b", stages=2, micro_batches=4)
    assert program.schedule.bubble_fraction < one.bubble_fraction
    assert [program.row(k) for k in range(4)] == [0, 2, 1, 3]  # group 0: stages 0, 2; group 1: stages 1, 3
    moved, must = _permuted(step, params, batch)  # a group sends from its v = 2 chunks: 2vM activations
    assert moved <= 1.1 * 2 * must, (moved, must, program.schedule.segments())
    packed = step.pack(params, batch)["float32"]
    rows = {k: program.param_flats[k].pack([jax.tree.leaves(params)[j] for j in program.cut.params[k]],
                                           program.param_widths)["float32"] for k in range(4)}
    for shard in packed.addressable_shards:
        group = shard.index[0].start // 2
        np.testing.assert_array_equal(np.asarray(shard.data), np.stack([rows[group], rows[group + 2]]))
    too_few = js.parallelize(_case(2, False)[2], devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="interleaved", virtual_stages=2))
    with pytest.raises(js.ShardingError, match=r"stage\(s\) \[2, 3\] run no operator of the loss.*"
                                               r"the tags number stages × virtual_stages = 2 × 2 = 4 stages"):
        too_few(*_case(2, False)[:2])


def test_in_strategy_and_integer_parameters_are_refused_for_a_cut_step():
    loss = _case(2, False)[2]
    with pytest.raises(js.ShardingError, match=r"in_strategy= sets strategies inside the stages of a jshard\.Pipeline"):
        js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), in_strategy=((2, 1),))
    params, batch, _, _ = _case(2, False)
    step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    with pytest.raises(js.ShardingError, match=r"params\['step'\] \(int32\[\]\) is not a float array; a pipelined step "
                                               r"differentiates every parameter\. Pass integer state in the batch"):
        step({**params, "step": jnp.zeros((), jnp.int32)}, batch)


def test_the_cut_inlines_jit_and_remat_regions_and_chains_back_to_the_loss():
    """Calls inside a tag (a jitted block, a recomputed one) take its stage; untagged operators join
    their latest tagged producer's stage; the stages run one after another give the loss."""
    from jshard.pipeline import cut  # noqa: PLC0415

    params, batch, _, _ = _case(2, False)
    block = js.pipeline_stage(jax.jit(_block), 0)
    remat = js.pipeline_stage(js.recompute(_block), 1)

    def loss(p, b):
        x = js.pipeline_stage(lambda p, t: p["embed"][t] + p["pos"][None], 0)(p, b[0])
        x = remat(p["layers"][1], block(p["layers"][0], x))
        logp = jax.nn.log_softmax(_norm(x) @ p["head"], axis=-1)  # untagged: stage 1
        return -jnp.take_along_axis(logp, b[1][..., None], axis=-1).mean()

    c = cut(loss, params, batch, 2, "test")
    leaves = jax.tree.leaves(params)
    names = [re.match(r"\['\w+'\](\[\d\])?", jax.tree_util.keystr(k)).group()
             for k, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert [sorted({names[j] for j in idx}) for idx in c.params] == [
        ["['embed']", "['layers'][0]", "['pos']"], ["['head']", "['layers'][1]"]]
    assert [[a.shape for a in b] for b in c.boundary] == [[(ROWS, SEQ, D)]]

    @jax.jit
    def chained(leaves, flat_batch):
        x = c.run(0, [leaves[j] for j in c.params[0]], flat_batch, [])
        return c.run(1, [leaves[j] for j in c.params[1]], flat_batch, x)[0]

    got = chained(leaves, jax.tree.leaves(batch))
    assert_close(got, jax.jit(loss)(params, batch), terms=step_terms(params, batch, backward=False))


@jax.custom_vjp
def _clipped(x):
    return x


_clipped.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))


def _small_loss(p, x):
    """Stage 0: a loop inside one tag and a custom derivative rule; stage 1: the head."""
    def layers(w, x):
        return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=2)[0]

    h = js.pipeline_stage(lambda w, x: _clipped(layers(w, x)), 0)(p["a"], x)
    return js.pipeline_stage(lambda w, h: (h @ w).mean(), 1)(p["b"], h)


def test_a_custom_derivative_keeps_its_rule_and_a_loop_inside_one_tag_is_one_operator():
    from jshard.pipeline import cut  # noqa: PLC0415

    p, x = {"a": jnp.eye(4) / 2, "b": jnp.ones((4, 2))}, jnp.ones((2, 4))
    c = cut(_small_loss, p, x, 2, "test")
    assert [[op.eqn.primitive.name for op in ops] for ops in c.ops] == [
        ["scan", "custom_vjp_call"], ["dot_general", "reduce_sum", "div"]]

    def chained(a, b):
        return c.run(1, [b], [x], c.run(0, [a], [x], []))[0]

    ref = jax.grad(_small_loss)(p, x)
    assert_close(jax.grad(chained, argnums=(0, 1))(p["a"], p["b"]), (ref["a"], ref["b"]), terms=16)
    assert float(jnp.abs(ref["a"]).max()) <= 0.01 * 4  # the clipped rule, not the identity's gradient


def test_a_tag_inside_a_loop_body_is_an_error():
    def loss(p, x):
        body = lambda h, w: (js.pipeline_stage(lambda w, h: jnp.tanh(h @ w), 1)(w, h), None)
        return jax.lax.scan(body, x, p)[0].mean()

    step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=2))
    with pytest.raises(js.ShardingError, match=r"scan at .* holds operators tagged jshard\.pipeline_stage\(fn, k\) for "
                                               r"k in \[1\] inside its body; a scan runs on one stage and cannot be cut"):
        step(jnp.ones((2, 4, 4)), jnp.ones((16, 4)))


def test_zero_bubble_splits_a_backward_holding_a_loop_and_runs_full_batch():
    """A stage whose backward holds a loop (the transposed `scan`: one equation, run in `B`, its
    weight-gradient outputs handed to the `W`), on full-batch stages (every device all rows)."""
    def loss(p, x):
        def layers(w, x):
            return jax.lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=2)[0]

        h = js.pipeline_stage(layers, 0)(p["a"], x)
        return js.pipeline_stage(lambda w, h: jnp.tanh(h @ w).mean(), 1)(p["b"], h)

    p, x = {"a": jnp.eye(4) / 2 + 0.1, "b": jnp.ones((4, 2))}, jnp.arange(32.0).reshape(8, 4) / 32
    step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=2, schedule="zb-h1"), dataset_strategy="full_batch")
    assert_close(step(p, x), jax.value_and_grad(loss)(p, x), terms=4 * 2 * 4 + x.size)
