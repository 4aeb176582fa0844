"""Strategies, balance and search inside the stages of a step cut by `pipeline_stage` tags (or by
the cost model where it has none): `jshard.shard` strategies hold on each stage's own devices, an
untagged step is cut where the predicted per-stage times are most even, and `mode="auto"` searches
each stage's strategy over its devices. Every result equals the unpipelined single-device step."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close, step_terms
from jax.sharding import PartitionSpec as P

import jshard as js

D, VOCAB, SEQ, LAYERS, ROWS = 32, 16, 8, 4, 16

col = js.shard(jnp.matmul, in_strategy=((1, 1, 1), (1, 4)))  # Megatron: the up projection's columns over 4
row = js.shard(jnp.matmul, in_strategy=((1, 1, 4), (4, 1)))  # the down projection's rows: a partial sum


@functools.cache
def _params() -> dict:
    keys = iter(jax.random.split(jax.random.key(0), 2 + 2 * LAYERS))
    dense = lambda a, b: jax.random.normal(next(keys), (a, b)) / np.sqrt(a)
    return {"embed": jax.random.normal(next(keys), (VOCAB, D)) * 0.3, "head": dense(D, VOCAB),
            "layers": [{"up": dense(D, 4 * D), "down": dense(4 * D, D)} for _ in range(LAYERS)]}


@functools.cache
def _batch() -> tuple:
    tokens = np.random.default_rng(1).integers(0, VOCAB, (ROWS, SEQ))
    return tokens, np.roll(tokens, -1, axis=1)


def _megatron(p, x):
    return x + row(jax.nn.gelu(col(x, p["up"])), p["down"])


def _loss(block, stage_of_layer=None):
    """A tiny GPT-like loss; each part tagged with its stage where `stage_of_layer` is given."""
    tag = (lambda fn, k: fn) if stage_of_layer is None else js.pipeline_stage
    last = 0 if stage_of_layer is None else max(stage_of_layer)

    def loss(params, batch):
        tokens, targets = batch
        x = tag(lambda e, t: e[t], 0)(params["embed"], tokens)
        for i, lp in enumerate(params["layers"]):
            x = tag(block, 0 if stage_of_layer is None else stage_of_layer[i])(lp, x)
        logits = tag(lambda w, h: h @ w, last)(params["head"], x)
        return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], axis=-1).mean()

    return loss


@functools.cache
def _reference(block):
    return jax.jit(jax.value_and_grad(_loss(block)))(_params(), _batch())


def _groups(hlo: str, op: str) -> set[frozenset[int]]:
    """The device groups of every `op` in compiled HLO text (explicit or iota replica groups)."""
    out = set()
    for m in re.finditer(rf"{op}\([^\n]*?replica_groups=(\{{[\d,{{}}]*\}}|\[[\d,]+\]<=\[\d+\])", hlo):
        g = m.group(1)
        if g.startswith("{"):
            out |= {frozenset(map(int, x.split(","))) for x in re.findall(r"\{([\d,]+)\}", g)}
        else:
            shape, n = re.match(r"\[([\d,]+)\]<=\[(\d+)\]", g).groups()
            rows = np.arange(int(n)).reshape([int(s) for s in shape.split(",")])
            out |= {frozenset(r.tolist()) for r in rows.reshape(-1, rows.shape[-1])}
    return out


def test_megatron_strategies_hold_inside_tagged_stages():
    """8 devices, S=2 under 1F1B: each stage's 4 devices run its blocks Megatron-style; loss and
    gradients equal the unpipelined single-device step, the compiled program all-reduces the
    row-parallel partial sums over each stage's own 4 devices, and a device holds a quarter of its
    stage's cut weights (the embedding and head, which no strategy cuts, whole). The residuals
    stay in the layout the strategies give them (the ff hidden values cut over the stage's 4
    devices, the residual stream whole, as it crosses), so no forward gathers what it stores: the
    step all-gathers less than one micro-batch's ff hidden value."""
    step = js.parallelize(_loss(_megatron, [0, 0, 1, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="1f1b"))
    params, batch = _params(), _batch()
    assert_close(step(params, batch), _reference(_megatron), terms=step_terms(params, batch))
    compiled = step.compile(params, batch)
    groups = _groups(compiled.as_text(), "all-reduce")
    assert {frozenset(range(4)), frozenset(range(4, 8))} <= groups, groups
    layouts = step.program(params, batch).layouts
    assert layouts.boundary == ((None,),)  # the residual stream: whole after the row cut's all-reduce
    hidden = (ROWS // 4, SEQ, 4 * D)  # one micro-batch's ff hidden value, cut over the stage's 4 devices
    assert P(None, None, ("d0", "d1")) in [spec for spec, shape in zip(layouts.residuals[0], layouts.residual_shapes[0])
                                           if shape == hidden]
    assert js.audit(compiled).bytes("all-gather") < np.prod(hidden) * 4
    layers, whole = params["layers"], params["embed"].nbytes  # embed and head: one of them per stage
    program = step.program(params, batch)
    assert program.stage_bytes() == (whole + _nbytes(layers[:2]), whole + _nbytes(layers[2:]))
    assert program.device_bytes() == whole + _nbytes(layers[:2]) // 4
    shardings = compiled.input_shardings[0][0]  # the packed parameters: one whole buffer, one cut over d0·d1
    packed = jax.eval_shape(program.pack, jax.tree.leaves(params))
    per_device = sum(np.prod(shardings[k].shard_shape(a.shape)) * a.dtype.itemsize for k, a in packed.items())
    assert {k: s.spec for k, s in shardings.items()} == {"float32": P("stage"), "float32@d0.d1": P("stage", ("d0", "d1"))}
    assert per_device == program.device_bytes()


def _nbytes(tree) -> int:
    return sum(a.nbytes for a in jax.tree.leaves(tree))


dp = js.shard(jnp.matmul, in_strategy=((2, 1, 1), (1, 1)))  # the rows over 2 of a stage's 4 devices


def _data_parallel(p, x):
    return x + dp(jax.nn.gelu(dp(x, p["up"])), p["down"])


def test_data_parallel_strategies_inside_stages_reduce_gradients_once():
    """Data parallel written as strategies inside the stages (the rows cut over `d0`, two of a
    stage's four devices): each device runs its own rows of each micro-batch, and the gradients
    are all-reduced once per step (one all-reduce of the packed gradients, one of the loss), not
    once per micro-batch; loss and gradients equal the unpipelined single-device step."""
    step = js.parallelize(_loss(_data_parallel, [0, 0, 1, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="1f1b"))
    params, batch = _params(), _batch()
    assert_close(step(params, batch), _reference(_plain), terms=step_terms(params, batch))
    program = step.program(params, batch)
    assert program.data_axes == ("d0",)
    reduced = js.audit(step.compile(params, batch))
    assert reduced.count("all-reduce") == 2, reduced.summary()
    assert reduced.bytes("all-reduce") == program.device_bytes() + 4  # the packed gradients, and the loss


def _plain(p, x):
    return x + jax.nn.gelu(x @ p["up"]) @ p["down"]


def test_an_untagged_step_is_cut_where_the_stages_balance():
    """No tags, S=4: the cost model cuts between the blocks (each stage one block's parameters, the
    embedding with the first, the head with the last), the stages' compute within 10% of each
    other, and loss and gradients equal the unpipelined step."""
    params, batch = _params(), _batch()
    step = js.parallelize(_loss(_plain), devices=8, pipeline=js.Pipelining(stages=4, micro_batches=4))
    assert_close(step(params, batch), _reference(_plain), terms=step_terms(params, batch))
    c = step.program(params, batch).cut
    leaves = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
    assert [sorted(leaves[j] for j in idx) for idx in c.params] == [
        ["['embed']", "['layers'][0]['down']", "['layers'][0]['up']"],
        ["['layers'][1]['down']", "['layers'][1]['up']"], ["['layers'][2]['down']", "['layers'][2]['up']"],
        ["['head']", "['layers'][3]['down']", "['layers'][3]['up']"]]
    b = c.balance
    assert not b.tagged and len(b.cuts) == 3 and b.imbalance < 1.1, b.summary()
    assert all("(_plain)" in where for where in b.cuts), b.cuts  # each stage ends with a block's last add
    one = ROWS // (4 * 2) * SEQ * D * 4  # one device's micro-batch (M=4, 2 devices a stage): what crosses
    assert b.boundary_bytes == (one, one, one)
    assert "cut by the cost model (no tags)" in b.summary()


def test_unequal_tags_are_kept_and_their_imbalance_reported():
    """Three blocks on stage 0, one and the head on stage 1: MindSpore's tags are kept as given,
    and the balance report names stage 0 the slowest, with the compute ratio."""
    params, batch = _params(), _batch()
    step = js.parallelize(_loss(_plain, [0, 0, 0, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    b = step.program(params, batch).cut.balance
    assert b.tagged and b.slowest == 0
    assert b.flops[0] > 2.5 * b.flops[1] and b.imbalance > 1.4, b.summary()
    assert re.search(r"stages as tagged \(pipeline_stage\): slowest stage 0, 1\.\d\dx the mean stage's compute",
                     b.summary())


def test_auto_searches_each_stage_over_its_devices():
    """mode="auto", no tags, S=2 on 8 devices under a 480 KiB budget per device, of which the
    pipeline's in-flight residuals and boundary slots take 420.5 KiB and the gradient sums, laid
    out as the search cuts the parameters, as many bytes as the packed parameters a device holds
    (18 KiB): each stage's strategy is searched over its 4 devices under the 41.5 KiB left (each
    stage's `Plan`: every operator `searched`, the budget), the step runs those strategies, and it
    equals the unpipelined step."""
    params, batch = _params(), _batch()
    step = js.parallelize(_loss(_plain), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), search=js.Search(memory_budget="480KiB"), mode="auto")
    assert_close(step(params, batch), _reference(_plain), terms=step_terms(params, batch))
    c, program = step.program(params, batch).cut, step.program(params, batch)
    assert not c.balance.tagged and len(c.plans) == 2
    for plan in c.plans:
        assert plan.mode == "auto" and dict(plan.mesh.shape) == {"d0": 2, "d1": 2}
        assert {op.origin for op in plan.ops} == {"searched"}
        # 1F1B at S=2: 2 residual slots, 1 slot each way; the gradient sums as the packed parameters
        assert c.pipeline_bytes == 2 * 211200 + 2 * 4096 + program.device_bytes()
        assert plan.search.budget == 480 * 1024 - c.pipeline_bytes and plan.search.peak_bytes <= plan.search.budget
        assert re.search(r"search=recursive over mesh 2·2: .*budget\s+41\.5\s+KiB", plan.summary(), re.S), plan.summary()
    cut_ops = [op for plan in c.plans for op in plan.ops
               if any(d > 1 for s in (op.in_strategy or ()) if s for d in s)]
    assert cut_ops  # the search cut something inside a stage (the budget binds: 66 KiB of parameters a stage)
    # the packed parameters cut as the search cut them
    assert program.classes and program.device_bytes() < max(program.stage_bytes())


@pytest.mark.parametrize("make,message", [
    (lambda: js.parallelize(_loss(_megatron, [0, 0, 1, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), mode="auto"),
     r"mode='auto' with pipeline= searches every stage's strategy, but the step calls jshard\.shard \(\d+ "
     r"call\(s\), the first matmul at .*\) inside its stages\. Use mode='semi_auto'"),
    (lambda: js.parallelize(_loss(_plain, [0, 0, 1, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), mode="data"),
     r"stage-internal strategies as in semi_auto \(or searched, mode='auto'\); mode='data' cannot be combined"),
    (lambda: js.parallelize(lambda p, b: p["head"].sum(), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4)),
     r"no operator of the loss is tagged with a stage\. Cut by the cost model, its 1 operator\(s\) hold fewer "
     r"narrow places"),
    (lambda: js.parallelize(_loss(_plain), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), search=js.Search(memory_budget="441KiB"), mode="auto"),
     r"jshard\.parallelize\(loss\) \(stage 0; memory_budget less the pipeline's 437 KiB outside it\): "
     r"memory_budget=4 KiB per device cannot be met on 4 devices .* Raise memory_budget"),
    (lambda: js.parallelize(_loss(_plain), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), search=js.Search(memory_budget="4KiB"), mode="auto"),
     r"memory_budget=4 KiB per device, but the pipeline alone holds 420\.5 KiB per device outside its stages' "
     r"programs \(the residuals of the micro-batches in flight and the boundary slots under schedule='1f1b', S=2, "
     r"M=4\) and at least 16\.5 KiB of gradient sums \(the largest stage's parameters cut over its 4 devices\), "
     r"leaving the search nothing\. Raise memory_budget above 437 KiB"),
], ids=["auto-with-shard-calls", "mode-data", "untagged-too-small", "stage-over-budget", "pipeline-over-budget"])
def test_what_a_searched_or_balanced_pipeline_cannot_do_is_an_error(make, message):
    with pytest.raises(js.ShardingError, match=message):
        make()(_params(), _batch())


def test_auto_refuses_a_stacked_pipeline():
    pipe = js.Pipeline(first=lambda p, b: b @ p["w_in"], layer=lambda w, x: jnp.tanh(x @ w), last=lambda p, x, b: (x ** 2).mean())
    with pytest.raises(js.ShardingError, match=r"mode='auto' searches the strategies inside the stages of a step cut "
                                               r"into stages .* Use mode='semi_auto' with the Pipeline"):
        js.parallelize(pipe, devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4), mode="auto")


def test_recompute_regions_hold_inside_stages():
    """A `jshard.recompute` block inside a stage stays one region of the cut, so the stage's backward
    recomputes it: under GPipe (M micro-batches' residuals held) the compiled temporary memory is
    under half the plain blocks', and the step still equals the unpipelined one."""
    params, batch = _params(), _batch()
    temp = {}
    for name, block in (("plain", _plain), ("recompute", js.recompute(_plain))):
        step = js.parallelize(_loss(block, [0, 0, 1, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule="gpipe"))
        temp[name] = step.compile(params, batch).memory_analysis().temp_size_in_bytes
    assert_close(step(params, batch), _reference(_plain), terms=step_terms(params, batch))  # the recomputed one
    assert temp["recompute"] < 0.5 * temp["plain"], temp


def test_train_on_buffers_pack_never_made_names_their_shapes_and_the_fix():
    """`Staged.train` before `pack` built a pipeline for these shapes: an error naming the packed
    buffers' shapes, the batch's and `pack` (nothing is traced or compiled)."""
    step = js.parallelize(_loss(_plain, [0, 0, 1, 1]), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4))
    with pytest.raises(js.ShardingError, match=r"\.train: no pipeline was built for packed parameters "
                                               r"\{'float32': 'f32\[2,16\]'\} and a batch of shapes \[.*\]\. Pack them "
                                               r"with .*\.pack\(params, batch\)"):
        step.train({"float32": jnp.zeros((2, 16))}, _batch())
