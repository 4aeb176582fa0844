"""Pipeline parallel on 8 simulated devices: loss and gradients equal the non-pipelined step for every
schedule, stage count and micro-batch count; with data and tensor parallel inside stages; tied
embeddings; GPT training; inference; the plan's schedule, bubble, memory and bytes; bad input."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close, fan_in, step_terms
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard import models
from jshard.audit import Collective
from jshard.pipeline import Pipeline, build_schedule

D, LAYERS, ROWS = 16, 8, 512


def _mlp_pipe():
    first = lambda p, b: jnp.tanh(b[0] @ p["w_in"])
    layer = lambda lp, x: jnp.tanh(x @ lp["w"] + lp["b"][None, :]) + x
    last = lambda p, x, b: ((x @ p["w_out"] - b[1]) ** 2).mean()
    return Pipeline(first=first, layer=layer, last=last, head=lambda p, x: x @ p["w_out"])


@functools.cache
def _mlp():
    k = jax.random.split(jax.random.key(0), 5)
    params = {
        "w_in": jax.random.normal(k[0], (8, D)) / 3,
        "layers": {"w": jax.random.normal(k[1], (LAYERS, D, D)) / 4, "b": jax.random.normal(k[2], (LAYERS, D)) / 4},
        "w_out": jax.random.normal(k[3], (D, 4)) / 4,
    }
    batch = (jax.random.normal(k[4], (ROWS, 8)), jnp.ones((ROWS, 4)))
    pipe = _mlp_pipe()
    loss, grads = jax.jit(jax.value_and_grad(pipe.loss))(params, batch)
    return pipe, params, batch, (loss, grads)


@functools.cache
def _mlp_step(schedule, stages, micro, broadcast=False):
    virtual = 2 if schedule == "interleaved" else 1
    return js.parallelize(_mlp()[0], devices=8, pipeline=js.Pipelining(stages=stages, micro_batches=micro, schedule=schedule, virtual_stages=virtual, result_broadcast=broadcast))


GRID = [(sched, s, m) for sched in ("gpipe", "1f1b", "interleaved") for s in (2, 4) for m in (s, 4 * s)]
"""M = S (no steady state) and M = 4S (a steady-state loop of many repeats; the programs the permute and
memory tests below read); an M = 2S cell repeated the 4S one's check on a program of its own."""


@pytest.mark.parametrize("schedule,stages,micro", GRID, ids=[f"{a}-S{s}-M{m}" for a, s, m in GRID])
def test_loss_and_grads_equal_the_unpipelined_step(schedule, stages, micro):
    _, params, batch, (ref_loss, ref_grads) = _mlp()
    loss, grads = _mlp_step(schedule, stages, micro)(params, batch)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))
    # the stack lives cut over the stage axis; each stage's rows are cut over its own 8/S devices
    assert grads["layers"]["w"].sharding.spec == P("stage")


def test_interleaved_holds_its_stack_in_stage_order():
    """Interleaved stage s runs chunks s, S + s, ...: its train program takes the stack in that order
    (`pack`), so the step moves no parameter between stages (a stack in layer order was re-laid every
    step: 2.6x what must cross). Its permutes carry activations only, at most 1.1x what must cross
    (2vM per device). `train` on held parameters gives the gradients held alike, `unpack` the
    call's, in layer order; inference still takes the layer order."""
    _, params, batch, (ref_loss, ref_grads) = _mlp()
    step = _mlp_step("interleaved", 4, 16)  # compiled by the grid above
    plan = step.plan(params, batch)
    moved = plan.audit().by_kind()["collective-permute"][1]
    assert moved == plan.permute_bytes <= 1.1 * 2 * 2 * 16 * plan.activation_bytes, plan.schedule.segments()
    ends, stack = step.pack(params, batch)
    w = params["layers"]["w"]  # 8 layers: stage s holds layers s and 4 + s (one layer a chunk)
    assert [int(np.argmin(np.abs(w - x[None]).sum(axis=(1, 2)))) for x in stack["w"]] == [0, 4, 1, 5, 2, 6, 3, 7]
    loss, grads = step.train((ends, stack), batch)
    assert_close((loss, step.unpack(grads, params, batch)), (ref_loss, ref_grads), terms=step_terms(params, batch))
    pipe = _mlp()[0]  # inference takes the layer order: its stack moves into stage order inside the program
    assert_close(step.forward(params, batch)[-1], pipe.apply(params, batch), terms=fan_in(params))
    with pytest.raises(js.ShardingError, match=r"\.train: no pipeline was built for held parameters .* and a batch "
                                               r"of shapes \['f32\[64,8\]'.*\.pack\(params, batch\)"):
        step.train((ends, stack), tuple(b[:64] for b in batch))


GPT = models.GPTConfig(vocab=16, seq_len=8, d_model=32, n_heads=4, n_layers=4, d_ff=64, scan=True)


@functools.cache
def _gpt(rows=16):
    params = models.init_gpt(GPT, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(1), GPT, rows)
    return params, batch


def test_pipeline_with_tensor_parallel_inside_stages_equals_one_device():
    column = js.shard(jnp.matmul, ((1, 1), (1, 4)))  # Megatron over each stage's 4 devices
    row = js.shard(jnp.matmul, ((1, 4), (4, 1)))
    layer = lambda lp, x: x + row(jax.nn.gelu(column(x, lp["up"])), lp["down"])
    base, params, batch, _ = _mlp()
    pipe = Pipeline(first=base.first, layer=layer, last=base.last)
    k = jax.random.split(jax.random.key(5), 2)
    params = {**params, "layers": {"up": jax.random.normal(k[0], (4, D, 32)) / 4,
                                   "down": jax.random.normal(k[1], (4, 32, D)) / 6}}
    strategies = {"w_in": None, "w_out": None, "layers": {"up": (1, 1, 4), "down": (1, 4, 1)}}
    step = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="gpipe"), in_strategy=(strategies, None), dataset_strategy="full_batch")
    loss, grads = step(params, batch)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(pipe.loss))(params, batch)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))
    up = grads["layers"]["up"]  # [4 layers, 16, 32]: layers cut over 2 stages, columns over 4 devices
    assert up.sharding.spec == P("stage", None, ("d0", "d1"))
    assert {s.data.shape for s in up.addressable_shards} == {(2, D, 8)}
    assert js.audit(step.compile(params, batch)).count("all-reduce") > 0  # the row matmul's partial sums

    # without in_strategy the shard calls still apply (rows cut over the stage, weights left to XLA)
    plain = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="gpipe"))
    loss, grads = plain(params, batch)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))
    ticks = plain.plan(params, batch).schedule.ticks
    report = js.audit(plain.compile(params, batch))
    assert report.count("all-reduce") > ticks  # per tick, not once per step
    # Megatron's traffic only: the rows stay whole over the axes the tuples cut the model over and
    # the weights are held cut as the shard calls cut them, so no activation (nor weight gradient)
    # is gathered, and each all-reduce sums one micro-batch's activation (or the loss)
    activation = ROWS // 4 * D * 4  # [rows / M, D] float32
    assert report.by_kind().get("all-gather", (0, 0))[1] < activation
    assert all(c.bytes <= c.count * activation for c in report.collectives if c.kind == "all-reduce")


def _tied_pipe():
    first = lambda p, b: p["embed"][b[0]]
    layer = lambda lp, x: x + jnp.tanh(x @ lp)
    def last(p, x, b):
        logp = jax.nn.log_softmax(x @ p["embed"].T, axis=-1)  # the output projection is the embedding
        return -jnp.take_along_axis(logp, b[1][..., None], axis=-1).mean()
    return Pipeline(first=first, layer=layer, last=last)


def test_tied_embedding_gradients_combine_first_and_last_stage():
    pipe = _tied_pipe()
    k = jax.random.split(jax.random.key(3), 3)
    params = {"embed": jax.random.normal(k[0], (16, 8)), "layers": jax.random.normal(k[1], (4, 8, 8)) / 3}
    tokens = jax.random.randint(k[2], (16, 4), 0, 16)
    batch = (tokens, jnp.roll(tokens, 1, axis=1))
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(pipe.loss))(params, batch)
    loss, grads = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=4, micro_batches=4))(params, batch)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))


def test_parameters_outside_the_stack_live_on_the_stages_that_use_them():
    """`first`'s parameters (w_in) are held on stage 0 only, `last`'s and `head`'s (w_out) on the
    last stage only: each stage holds its layers and its own share, and the compiled program's
    arguments per device are that, one packed row as wide as the larger share, and the device's
    rows (not every stage all of w_in and w_out, as before)."""
    _, params, batch, _ = _mlp()
    step = _mlp_step("gpipe", 4, 4)  # compiled by the grid above
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    layers, w_in, w_out = nbytes(params["layers"]) // 4, nbytes(params["w_in"]), nbytes(params["w_out"])
    assert step.stage_bytes(params, batch) == (layers + w_in, layers, layers, layers + w_out)
    rows = nbytes(batch) // 2  # each stage's 2 devices hold half the rows
    assert step.compile(params, batch).memory_analysis().argument_size_in_bytes == layers + max(w_in, w_out) + rows


def test_parameters_outside_the_stack_cut_inside_stages_stay_on_every_stage():
    """Where `in_strategy` cuts a parameter outside the stack inside the stages (w_in's columns
    over each stage's 4 devices), a packed row would lose the cut: those parameters stay on every
    stage, cut as asked, and the step still equals the unpipelined one."""
    pipe, params, batch, (ref_loss, ref_grads) = _mlp()
    step = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="1f1b"), in_strategy=({"w_in": (1, 4), "w_out": None, "layers": None}, None),
                          dataset_strategy="full_batch")
    loss, grads = step(params, batch)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    ends = nbytes(params["w_in"]) + nbytes(params["w_out"])
    assert step.stage_bytes(params, batch) == (nbytes(params["layers"]) // 2 + ends,) * 2
    assert {s.data.shape for s in grads["w_in"].addressable_shards} == {(8, D // 4)}


@functools.cache
def _gpt_1f1b_s4_m16():
    """The GPT under 1F1B, 4 stages × 2-way data parallel, 16 micro-batches of 2 rows (1 per device)."""
    pipe = models.gpt_pipeline(GPT)
    return js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=4, micro_batches=16, schedule="1f1b"))


def test_gpt_under_pipeline_and_data_parallel_trains_like_one_device():
    params, _ = _gpt()
    rng = np.random.default_rng(7)
    batches = [models.copy_task_batch(rng, GPT, 32) for _ in range(5)]
    ref_value_and_grad = jax.jit(jax.value_and_grad(lambda p, b: models.gpt_loss(p, b, GPT)))
    ref_loss, ref_grads = ref_value_and_grad(params, batches[0])
    step = _gpt_1f1b_s4_m16()
    loss, grads = step(params, batches[0])
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batches[0]))
    plan = step.plan(params, batches[0])
    assert plan.activation_bytes == 1 * 8 * 32 * 4  # one row of [8, 32] per device
    # the embedding on stage 0, ln_f and the head on stage 3, each stage's layers on its own
    nbytes = lambda *keys: sum(a.nbytes for k in keys for a in jax.tree.leaves(params[k]))
    stage_layers = nbytes("layers") // 4
    shares = (nbytes("embed", "pos"), 0, 0, nbytes("ln_f", "head"))
    assert step.stage_bytes(params, batches[0]) == tuple(stage_layers + share for share in shares)
    # gradients are summed once per step, not per micro-batch: one all-reduce over each stage's 2
    # devices of its layers and its packed row of the embedding / head (the wider share), and the
    # loss over all 8
    report = js.audit(step.compile(params, batches[0]))
    assert [c for c in report.collectives if c.kind == "all-reduce"] == [
        Collective("all-reduce", 1.0, stage_layers + max(shares), 2), Collective("all-reduce", 1.0, 4, 8)]
    # one activation per permute a device is a source of, only where something crosses (neighbour
    # pairs swap in the steady state); the busiest device's bytes
    permutes = sum(len(p) for p in plan.schedule.permutes())
    busiest = int(plan.schedule.sends().max())
    assert report.by_kind()["collective-permute"] == (permutes, busiest * plan.activation_bytes) == (
        permutes, plan.permute_bytes)

    opt = optax.adam(3e-3)
    update = jax.jit(lambda p, s, g: (lambda u, s: (optax.apply_updates(p, u), s))(*opt.update(g, s, p)))
    p, s, rp, rs = params, opt.init(params), params, opt.init(params)
    got, want = [], []
    for b in batches:
        loss, grads = step(p, b)
        p, s = update(p, s, grads)
        ref_loss, ref_grads = ref_value_and_grad(rp, b)
        rp, rs = update(rp, rs, ref_grads)
        got.append(float(loss))
        want.append(float(ref_loss))
    assert_close(got, want, dtype=np.float32, terms=len(batches) * step_terms(params, batches[0]))  # each step adds its own
    assert want[-1] < want[0]


def test_data_parallel_tuples_inside_stacked_stages_reduce_gradients_once_per_step():
    """`jshard.shard` tuples cutting the rows 4 ways inside each stage's layer run those axes manual,
    as the tagged form does: each device accumulates its own rows' gradients over the schedule's
    loop, and one all-reduce per step sums them (before, XLA reduced them at every micro-batch's
    backward). The figure is the parameters': each stage's 4 devices sum its layers and its packed
    row of w_in / w_out (the wider share) in one all-reduce, the loss over all 8. Equal to one
    device. Where the tuple no longer divides one device's rows, a warning says the gradients stay
    reduced per micro-batch."""
    base, params, batch, _ = _mlp()
    rows = js.shard(jnp.matmul, ((4, 1), (1, 1)))  # data parallel over a stage's 4 devices, as a tuple
    pipe = Pipeline(first=base.first, layer=lambda lp, x: jnp.tanh(rows(x, lp["w"]) + lp["b"][None, :]) + x,
                    last=base.last)
    step = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="1f1b"))
    ref = jax.jit(jax.value_and_grad(pipe.loss))(params, batch)
    assert_close(step(params, batch), ref, terms=step_terms(params, batch))
    nbytes = lambda tree: sum(a.nbytes for a in jax.tree.leaves(tree))
    once = nbytes(params["layers"]) // 2 + max(nbytes(params["w_in"]), nbytes(params["w_out"]))
    assert [c for c in js.audit(step.compile(params, batch)).collectives if c.kind == "all-reduce"] == [
        Collective("all-reduce", 1.0, once, 4), Collective("all-reduce", 1.0, 4, 8)]
    with pytest.warns(UserWarning, match=r"cut the micro-batch's rows over d0, d1, but the step does not trace on "
                                         r"one device's rows .* reduces the gradients at every micro-batch's backward"):
        step.stage_bytes(params, tuple(b[:32] for b in batch))  # a device's 2 rows of a micro-batch: not 4 ways


def test_tagged_stage_functions_run_on_their_stages():
    pipe0, params, batch, _ = _mlp()
    scan = pipe0.stage_runner(0)
    tagged = [js.pipeline_stage(scan, 0), js.pipeline_stage(lambda ch, x: 0.5 * scan(ch, x), 1)]
    pipe = Pipeline(first=pipe0.first, layer=tagged, last=pipe0.last)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(pipe.loss))(params, batch)
    loss, grads = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))(params, batch)
    assert_close((loss, grads), (ref_loss, ref_grads), terms=step_terms(params, batch))


@pytest.mark.parametrize("broadcast", [True, False], ids=["broadcast", "last-stage"])
def test_inference_runs_forward_only(broadcast):
    pipe, params, batch, _ = _mlp()
    out = _mlp_step("1f1b", 4, 4, broadcast).forward(params, batch)
    want = pipe.apply(params, batch)
    if broadcast:
        assert_close(out, want, terms=fan_in(params))  # forward only
        assert out.sharding.spec == P("d0")  # every stage holds all rows, cut over its own 2 devices
    else:
        assert_close(out[-1], want, terms=fan_in(params))
        assert float(jnp.abs(out[0]).max()) == 0.0  # only the last stage holds the result


def test_plan_shows_stages_schedule_bubble_memory_and_bytes():
    _, params, batch, _ = _mlp()
    plan = _mlp_step("1f1b", 4, 8).plan(params, batch)  # compiled once, for the M = 8 figures below
    s = plan.schedule
    assert s.ticks == 2 * (8 + 4 - 1)
    assert_close(plan.bubble_fraction, 3 / 11, terms=2, scale=1.0)  # 1 - busy / all, in float64: two roundings
    assert [st.ranks for st in plan.stages] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert [st.layers for st in plan.stages] == [((0, 1),), ((2, 3),), ((4, 5),), ((6, 7),)]
    assert [st.peak_in_flight for st in plan.stages] == [4, 3, 2, 1]
    rows = ROWS // 8  # per micro-batch, cut over the stage's 2 devices; f32
    assert plan.activation_bytes == rows // 2 * D * 4
    assert plan.boundary_bytes == 2 * 8 * 3 * rows * D * 4  # forward + backward, 8 micro-batches, 3 boundaries
    assert "stage 3 |...FBFBFBFBFBFBFBFB...|" in plan.summary()
    # what XLA emitted: one activation per permute a device sends in, only at ticks where it sends
    permutes = plan.audit().by_kind()["collective-permute"]
    assert permutes == (sum(len(p) for p in s.permutes()), plan.permute_bytes)
    assert plan.permute_bytes == 2 * 8 * plan.activation_bytes  # an inner stage: 8 forward, 8 back


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4),
                                              ("zb-h1", 1)])
def test_bubble_fraction_is_the_theory(schedule, virtual):
    for stages, micro in ((2, 4), (4, 8), (4, 16)):
        s = build_schedule(schedule, stages=stages, micro_batches=micro, virtual=virtual)
        work = 3 if schedule == "zb-h1" else virtual  # zero bubble: forward, B and W a tick each
        assert_close(s.bubble_fraction, (stages - 1) / (work * micro + stages - 1), terms=2, scale=1.0)
        assert_close(s.theoretical_bubble, s.bubble_fraction, terms=2, scale=1.0)


PERMUTE_CELLS = [(sched, s, m) for sched in ("gpipe", "1f1b") for s, m in ((2, 8), (4, 4), (4, 16))]
"""The grid's programs: both stage counts, M = S and steady-state loops (the cells S=2 at M=4 and 16 and
S=4 at M=32 repeated these checks on programs of their own)."""


@pytest.mark.parametrize("schedule,stages,micro", PERMUTE_CELLS, ids=[f"{a}-S{s}-M{m}" for a, s, m in PERMUTE_CELLS])
def test_permutes_move_only_what_must_cross(schedule, stages, micro):
    """Each boundary carries M activations forward and M gradients back per step, so an inner
    stage must send 2M activations, an end stage M. Each permute carries only the pairs whose source
    sends at that tick (fill and drain ticks have fewer), so in the compiled program
    (`jshard.audit`: bytes the busiest device sends, loops weighted by trip count) the busiest
    device sends exactly that: at most 1.1x what must cross, the plan's figure and the tick-by-tick
    floor. The step still equals the unpipelined one."""
    _, params, batch, (ref_loss, ref_grads) = _mlp()
    step = _mlp_step(schedule, stages, micro)
    assert_close(step(params, batch), (ref_loss, ref_grads), terms=step_terms(params, batch))
    plan = step.plan(params, batch)
    moved = plan.audit().by_kind()["collective-permute"][1]
    must_cross = 2 * micro * plan.activation_bytes
    floor = int(plan.schedule.sends(plan.schedule.tick_permutes()).max()) * plan.activation_bytes
    assert moved == plan.permute_bytes == floor, (moved, plan.permute_bytes, floor, plan.schedule.segments())
    assert moved <= 1.1 * must_cross, (moved, must_cross, plan.schedule.segments())
    assert moved == (micro if stages == 2 else 2 * micro) * plan.activation_bytes  # exactly what must cross


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 4), (4, 16), (8, 8)])
def test_gpipe_permutes_fill_and_drain_only(stages, micro):
    """GPipe sends forward at M + S - 2 ticks and back at as many (the first and last S - 2 of
    each with some stages idle); the program permutes at those ticks and no others, and only from
    the stages that send: M values from an end stage, 2M from an inner one."""
    s = build_schedule("gpipe", stages=stages, micro_batches=micro)
    assert sum(len(p) for p in s.permutes()) == sum(len(p) for p in s.tick_permutes()) == 2 * (micro + stages - 2)
    assert s.sends().tolist() == [micro] + [2 * micro] * (stages - 2) + [micro]


@pytest.mark.parametrize("schedule,virtual", [("gpipe", 1), ("1f1b", 1), ("zb-h1", 1), ("interleaved", 2)])
def test_each_permute_carries_only_the_stages_that_send(schedule, virtual):
    """Every permute's sources send at that tick in every repeat of its loop: the loops permute as a
    program permuting tick by tick would, and a stage sends M values per direction it sends in
    (an inner stage 2M, an end stage M). Interleaved trades a few sends for fewer loops (its ticks
    seldom repeat): no device sends more than 1.1x what must cross (2vM), in the fewest loops that
    allows (exact pairs take up to 49)."""
    for stages, micro in ((2, 4), (2, 16), (4, 4), (4, 16)):
        s = build_schedule(schedule, stages=stages, micro_batches=micro, virtual=virtual)
        sends = s.sends()
        if virtual == 1:
            assert s.permutes() == s.tick_permutes()
            assert sends.tolist() == [micro] + [2 * micro] * (stages - 2) + [micro]
            assert len(s.segments()) <= 14
        else:
            assert sends.max() <= 1.1 * 2 * virtual * micro, sends
            assert len(s.segments()) <= (3 if stages == 2 else 11), s.segments()
        for tick, names in zip(s.ops, s.tick_permutes()):
            senders = {a for name in names for a, _ in s.pairs(name)}
            assert senders == {k for k, op in enumerate(tick) if op is not None and op.kind in "FB"
                               and op.vstage != ((stages * virtual - 1) if op.kind == "F" else 0)}


@pytest.mark.parametrize("stages,micro", [(2, 4), (4, 8)], ids=["S2-M4", "S4-M8"])
def test_zero_bubble_equals_1f1b_with_a_smaller_bubble(stages, micro):
    """ZB-H1 splits each backward into B (input gradient) and W (parameter gradient) and runs the
    W's in what would be 1F1B's bubble: the same gradients, the same micro-batches in flight."""
    _, params, batch, (ref_loss, ref_grads) = _mlp()
    step = _mlp_step("zb-h1", stages, micro)
    assert_close(step(params, batch), (ref_loss, ref_grads), terms=step_terms(params, batch))
    zb, one = step.plan(params, batch), build_schedule("1f1b", stages=stages, micro_batches=micro)
    assert zb.bubble_fraction < one.bubble_fraction
    assert [st.peak_in_flight for st in zb.stages] == [stages] * stages  # 1F1B's peak, stage 0's, on every stage
    assert zb.schedule.slots("residuals") == one.slots("residuals")
    assert {op.kind for row in zb.schedule.ops for op in row if op} == {"F", "B", "W"}
    assert "W" in zb.schedule.picture()


def test_1f1b_holds_under_half_the_temporary_memory_of_gpipe():
    """At S=4, M=16 GPipe keeps 16 micro-batches' residuals per stage, 1F1B at most 4 (the grid's
    compiled programs; the reference GPT's figure is in notebooks/pipeline.ipynb and
    benchmarks/_pipeline.py)."""
    _, params, batch, _ = _mlp()
    temp = {name: _mlp_step(name, 4, 16).compile(params, batch).memory_analysis().temp_size_in_bytes
            for name in ("gpipe", "1f1b")}
    assert temp["1f1b"] <= 0.5 * temp["gpipe"], temp
    plans = {name: _mlp_step(name, 4, 16).plan(params, batch) for name in ("gpipe", "1f1b")}
    assert [st.peak_in_flight for st in plans["gpipe"].stages] == [16] * 4
    assert [st.peak_in_flight for st in plans["1f1b"].stages] == [4, 3, 2, 1]


# --- bad input ---------------------------------------------------------------------------------


def test_fewer_micro_batches_than_stages_is_an_error():
    with pytest.raises(js.ShardingError, match=r"micro_batches=2 with stages=4: .* at least 4\. Pass micro_batches=8"):
        js.parallelize(_mlp_pipe(), devices=8, pipeline=js.Pipelining(stages=4, micro_batches=2))


def test_batch_not_divisible_by_micro_batches_is_an_error():
    pipe, params, _, _ = _mlp()
    batch = (jnp.ones((30, 8)), jnp.ones((30, 4)))
    step = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    with pytest.raises(js.ShardingError, match=r"micro_batches=4 must divide the batch's rows, but batch\[0\] "
                                               r"\(shape \[30, 8\]\) has 30 rows\. Use a batch size that is a multiple of 4"):
        step(params, batch)


def test_a_scalar_in_the_batch_is_an_error():
    pipe, params, batch, _ = _mlp()
    step = js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    with pytest.raises(js.ShardingError, match=r"batch\[1\] \(shape \[\]\) is a scalar; every batch array needs a leading row dim"):
        step(params, (batch[0], jnp.float32(1.0)))


def test_devices_not_divisible_by_stages_is_an_error():
    with pytest.raises(js.ShardingError, match=r"devices=6 is not divisible by stages=4; .* Use stages in \[2, 3, 6\]"):
        js.parallelize(_mlp_pipe(), devices=6, pipeline=js.Pipelining(stages=4, micro_batches=4))


@pytest.mark.parametrize("ids,message", [
    ((0, 2, 3), r"stage ids \(0, 2, 3\) with stages=4: stage\(s\) \[1\] have no function"),
    ((1, 0, 2, 3), r"stage ids \(1, 0, 2, 3\) are out of order\. List the per-stage functions in stage order"),
], ids=["missing", "out-of-order"])
def test_stage_ids_missing_or_out_of_order_is_an_error(ids, message):
    fns = [js.pipeline_stage(lambda ch, x: x, i) for i in ids]
    pipe = Pipeline(first=lambda p, b: b, layer=fns, last=lambda p, x, b: x.mean())
    with pytest.raises(js.ShardingError, match=message):
        js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=4, micro_batches=4))


def test_pipeline_options_without_stages_are_an_error():
    with pytest.raises(js.ShardingError, match=r"micro_batches=, schedule= and virtual_stages= configure a pipeline, but stages= is missing"):
        js.parallelize(lambda x: x, devices=8, pipeline=js.Pipelining(micro_batches=4))


def test_only_a_pipeline_or_a_function_can_be_pipelined():
    with pytest.raises(TypeError, match=r"pipeline= needs a jshard.Pipeline or a function whose parts are tagged"):
        js.parallelize(3, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=2))


def test_a_long_schedule_is_drawn_in_blocks_no_wider_than_asked():
    sched = build_schedule("1f1b", stages=4, micro_batches=64)
    whole, blocked = sched.picture(), sched.picture(width=120)
    assert max(len(line) for line in whole.splitlines()) > 120
    assert max(len(line) for line in blocked.splitlines()) <= 120
    rows = {s: "" for s in range(4)}  # the blocks, read back, are the whole picture
    for line in blocked.splitlines():
        if line.startswith("stage "):
            s, marks = line.split(" |")
            rows[int(s.split()[1])] += marks.rstrip("|")
    assert [f"stage {s} |{m}|" for s, m in rows.items()] == whole.splitlines()
