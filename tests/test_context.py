"""Context parallel (issue 34 item 2): causal grouped-query attention over a sequence cut over a
mesh axis by a `Layout`, in its three forms (all-gather of K/V, ring of K/V, Ulysses all-to-all),
each against one device, its compiled collectives against the plan's, the cost model's choice
among them, and the cuts it refuses."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close, step_terms

import jshard as js

B, T, D, H, KV, HD = 2, 32, 16, 8, 4, 4
LAY = js.Layout((2, 4), ("dp", "sp"))
SEQUENCE = LAY("dp", "sp", "None", "None")  # q [batch, length, heads, head_dim]: batch over dp, length over sp
SP = 4


def _step(form: str, zigzag: bool = False, strategy=SEQUENCE, block=None):
    def loss(p, x):
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[w]) for w in ("wq", "wk", "wv"))
        o = js.attention(q, k, v, causal=True, strategy=strategy, form=form, zigzag=zigzag, block=block)
        return jnp.mean(jnp.einsum("bthe,hed->btd", o, p["wo"]) ** 2)

    def step(p, x):
        value, grads = jax.value_and_grad(loss)(p, x)
        return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value

    return step


@pytest.fixture(scope="module")
def args():
    rng = np.random.default_rng(0)
    shapes = {"wq": (D, H, HD), "wk": (D, KV, HD), "wv": (D, KV, HD), "wo": (H, HD, D)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    return p, jnp.asarray(rng.normal(size=(B, T, D)), jnp.float32)


@pytest.fixture(scope="module")
def one_device(args):
    return jax.jit(_step("auto"))(*args)  # outside parallelize: plain attention


# per form: the collective kind its body runs, and its bytes per device per step (forward and
# backward), from the sizes: one device's K or V block is [B/2, T/4, KV, HD] float32
BLOCK = B // 2 * T // SP * KV * HD * 4
Q_BLOCK = BLOCK * H // KV
FORMS = {
    # K, V all-gathered forward (result bytes), their gradients reduce-scattered backward
    "gather": {"all-gather": 2 * SP * BLOCK, "reduce-scatter": 2 * SP * BLOCK},
    # SP - 1 passes of K and V forward; backward the same again beside their gradients, which
    # take one pass more, home (each device keeps its own blocks only)
    "ring": {"collective-permute": ((2 + 2 + 2) * (SP - 1) + 2) * BLOCK},
    # q, k, v and the output traded forward, their cotangents backward
    "ulysses": {"all-to-all": 2 * (2 * Q_BLOCK + 2 * BLOCK)},
}


@pytest.mark.parametrize(("form", "zigzag"), [("gather", False), ("ring", True), ("ulysses", False)])
def test_each_form_equals_one_device_and_moves_what_the_plan_predicts(args, one_device, form, zigzag):
    p, x = args
    parts = js.zigzag(x, SP) if zigzag else x  # the tokens in zig-zag order: each device's causal work alike
    par = js.parallelize(_step(form, zigzag), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    plan = par.plan(p, parts)
    compiled = par.lower(p, parts).compile()
    report = js.audit(compiled)
    for kind, moved in FORMS[form].items():
        assert plan.predicted_bytes(kind) == report.bytes(kind) == moved, plan.compare(report)
    assert plan.predicted_bytes() == report.bytes(), plan.compare(report)
    got = compiled(*jax.device_put((p, parts), plan.in_shardings))
    # the loss is a mean over tokens: the updated weights do not depend on their order
    assert_close(got, one_device, terms=step_terms(p, x) + 3 * T)  # + the softmax's sums, exp and divide


def test_a_ring_over_the_sequence_beside_tensor_parallel_heads_equals_one_device(args, one_device):
    """The heads cut 2 ways (tensor parallel, a divisor of the 4 key/value heads) and the sequence
    4 ways: each ring runs over its heads' devices."""
    p, x = args
    lay = js.Layout((2, 4), ("tp", "sp"))
    step = _step("ring", strategy=lay("None", "sp", "tp", "None"))
    par = js.parallelize(step, devices=8, in_strategy=(None, lay("None", "sp", "None")))
    plan = par.plan(p, x)
    compiled = par.lower(p, x).compile()
    report = js.audit(compiled)
    assert plan.predicted_bytes() == report.bytes() and report.bytes("collective-permute") > 0, plan.compare(report)
    got = compiled(*jax.device_put((p, x), plan.in_shardings))
    assert_close(got, one_device, terms=step_terms(p, x) + 3 * T)


def test_the_zigzag_ring_in_bfloat16_equals_one_device_within_bfloat16s_tolerance(args):
    """bfloat16 weights and tokens: the ring accumulates its softmax in float32 as the one-device
    attention does, and the step equals one device's within bfloat16's rounding of the step. (Its
    bytes are not compared: XLA:CPU widens bfloat16 collectives to float32, twice the plan's.)"""
    p, x = jax.tree.map(lambda a: a.astype(jnp.bfloat16), args)
    par = js.parallelize(_step("ring", True), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    got, want = (
        jax.tree.map(lambda a: a.astype(jnp.float32), r)
        for r in (par(p, js.zigzag(x, SP)), jax.jit(_step("auto"))(p, x))
    )
    widen = int(jnp.finfo(jnp.bfloat16).eps / jnp.finfo(jnp.float32).eps)  # np.finfo knows no bfloat16
    assert_close(got, want, dtype=np.float32, terms=(step_terms(p, x) + 3 * T) * widen)


def test_auto_takes_the_cost_models_form_and_explain_says_why(args):
    p, x = args
    par = js.parallelize(_step("auto"), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    plan = par.plan(p, x)
    region = next(op for op in plan.ops if op.primitive == "shard_map" and not op.backward)
    assert "jshard.attention(form='auto'): gather: " in plan.explain(region.index)  # tiny blocks: fewest latencies


def test_the_choice_weighs_bytes_heads_and_memory():
    mha = js.context_choice((1, 32768, 32, 128), 32, {"sp": 8}, itemsize=2)
    assert mha.form == "ulysses"  # 4 blocks traded, against 2 x 7 blocks passed or gathered
    gqa = js.context_choice((1, 32768, 32, 128), 4, {"sp": 8}, itemsize=2)
    assert "ulysses" in gqa.refused and gqa.form == "gather"
    assert "4 key/value heads" in gqa.refused["ulysses"]
    tight = js.context_choice(
        (1, 32768, 32, 128), 4, {"sp": 8}, itemsize=2, cost=js.CostModel(memory=gqa.held["gather"] / 2)
    )
    assert tight.form == "ring" and "would hold more" in tight.why  # the gathered K/V do not fit
    h100 = js.CostModel.for_device("H100")  # collectives overlap compute: each ring pass hides behind a block
    long = js.context_choice((1, 131072, 32, 128), 8, {"sp": 8}, itemsize=2, cost=h100)
    short = js.context_choice((1, 8192, 32, 128), 8, {"sp": 8}, itemsize=2, cost=h100)
    assert (long.form, short.form) == ("ring", "ulysses")


def test_ulysses_beyond_the_kv_heads_is_refused(args):
    p, x = args
    lay = js.Layout((8,), ("sp",))
    par = js.parallelize(
        _step("ulysses", strategy=lay("None", "sp", "None", "None")),
        devices=8,
        in_strategy=(None, lay("None", "sp", "None")),
    )
    with pytest.raises(js.ShardingError, match=r"form='ulysses'.*8 does not divide the 4 key/value heads.*form='ring'"):
        par.plan(p, x)


def test_a_cut_head_dim_is_refused(args):
    p, x = args
    par = js.parallelize(_step("ring", strategy=(1, 2, 1, 4)), devices=8)
    with pytest.raises(js.ShardingError, match=r"jshard.attention: strategy .* cuts .*head_dim"):
        par.plan(p, x)


def _einsum_step(p, x):
    """One layer of grouped-query attention as users write it: einsums, a causal mask, softmax."""

    def loss(p, x):
        q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[w]) for w in ("wq", "wk", "wv"))
        b, t, h, d = q.shape
        kv = k.shape[2]
        s = jnp.einsum("blkgd,bmkd->bkglm", q.reshape(b, t, kv, h // kv, d), k) / np.sqrt(d)
        w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9), axis=-1)
        o = jnp.einsum("bkglm,bmkd->blkgd", w, v).reshape(b, t, h, d)
        return jnp.mean(jnp.einsum("bthe,hed->btd", o, p["wo"]) ** 2)

    value, grads = jax.value_and_grad(loss)(p, x)
    return jax.tree.map(lambda a, g: a - 0.1 * g, p, grads), value


def test_the_search_cuts_the_sequence_where_nothing_else_fits():
    """One sequence of 512 tokens, 2 query heads sharing 1 key/value head: the batch cannot be cut,
    the heads at most 2 ways, and the [512, 512] scores of each head dominate the memory. Under a
    budget of 30% of one device's compiled peak, the search cuts the queries' sequence 8 ways (the
    keys and values whole on every device: context parallel), fits, and equals one device."""
    rng = np.random.default_rng(0)
    shapes = {"wq": (16, 2, 16), "wk": (16, 1, 16), "wv": (16, 1, 16), "wo": (2, 16, 16)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(size=(1, 512, 16)), jnp.float32)
    one = jax.jit(_einsum_step).lower(p, x).compile()
    budget = int(0.3 * js.audit(one).memory.peak_bytes)
    par = js.parallelize(_einsum_step, devices=8, mode="auto", search=js.Search(memory_budget=budget))
    plan = par.plan(p, x)
    scores = next(op for op in plan.ops if op.primitive == "dot_general" and sorted(map(len, op.in_strategy)) == [4, 5])
    queries = next(s for s in scores.in_strategy if len(s) == 5)  # [batch, length, kv_heads, group, head_dim]
    assert queries[1] == 8 and scores.origin == "searched"  # the queries' sequence cut 8 ways
    compiled = par.lower(p, x).compile()
    report = js.audit(compiled)
    assert report.memory.peak_bytes <= budget
    assert plan.predicted_bytes() == report.bytes(), plan.compare(report)
    heads = js.Layout((2, 4), ("mp", "r"))  # the heads cut as far as they go: tensor parallel does not fit
    megatron = js.parallelize(
        _einsum_step,
        devices=8,
        in_strategy=(
            {"wq": heads("None", "mp", "None"), "wk": None, "wv": None, "wo": heads("mp", "None", "None")},
            heads("None", "None", "None"),
        ),
    )
    assert js.audit(megatron.lower(p, x).compile()).memory.peak_bytes > budget
    got = compiled(*jax.device_put((p, x), plan.in_shardings))
    assert_close(got, one(p, x), terms=step_terms(p, x) + 3 * 512)


def test_the_search_plans_around_a_ring_and_explain_names_the_region(args):
    """Under `mode="auto"` the attention's region keeps its specs; the search lays out the rest,
    and the ring's collective-permutes are priced as compiled."""
    p, x = args
    par = js.parallelize(_step("ring"), devices=8, mode="auto", in_strategy=(None, LAY("dp", "sp", "None")))
    plan = par.plan(p, x)
    region = next(op for op in plan.ops if op.primitive == "shard_map" and not op.backward)
    assert region.in_strategy == ((2, 4, 1, 1),) * 3
    why = plan.explain(region.index)
    assert "a manual region (jax.shard_map" in why and "set by the user: jshard.attention(form='ring')" in why
    report = js.audit(par.lower(p, x).compile())
    assert plan.predicted_bytes("collective-permute") == report.bytes("collective-permute") > 0


def test_the_reference_gpt_runs_its_attention_context_parallel():
    """`GPTConfig(kv_heads=2, context=...)`: the reference GPT's grouped-query attention through
    `jshard.attention`, its sequence cut 8 ways (ring); one train step equals one device (the
    einsum attention of `context=None`), and its collective-permutes are those predicted."""
    import optax

    from jshard import models

    cfg = models.GPTConfig(seq_len=16, d_model=32, n_heads=4, kv_heads=2, n_layers=1, d_ff=64)
    ring = dataclasses.replace(cfg, context=(1, 8, 1, 1), context_form="ring")
    opt = optax.sgd(0.1)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 2)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, ring), opt)
    par = js.parallelize(step, devices=8, in_strategy=(None, None, ((1, 8),) * 2 + ((1, 8),)))
    plan = par.plan(params, opt.init(params), batch)
    compiled = par.lower(params, opt.init(params), batch).compile()
    report = js.audit(compiled)
    assert plan.predicted_bytes("collective-permute") == report.bytes("collective-permute") > 0
    got = compiled(*jax.device_put((params, opt.init(params), batch), plan.in_shardings))
    want = jax.jit(models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), opt))(
        params, opt.init(params), batch
    )
    assert_close(got, want, terms=step_terms(params, batch) + 3 * cfg.seq_len)


def _einsums(q, k, v):
    b, t, h, d = q.shape
    s = jnp.einsum("blkgd,bmkd->bkglm", q.reshape(b, t, k.shape[2], -1, d), k) / np.sqrt(d)
    w = jax.nn.softmax(jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -1e9), axis=-1)
    return jnp.einsum("bkglm,bmkd->blkgd", w, v).reshape(b, t, h, d)


def _dot_product_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize("attention", [_einsums, _dot_product_attention], ids=["einsums", "dot_product_attention"])
def test_attention_as_users_write_it_under_a_sequence_cut_moves_what_the_plan_predicts(attention):
    """Grouped-query attention as einsums, or `jax.nn.dot_product_attention`, under a `shard`
    call that cuts q, k, v's sequence 8 ways: the engine gathers the queries and keeps the keys'
    cut (the scores cut by key), and predicts the compiled bytes; `reduce_max`'s derivative counts
    the maxima into a value `stop_gradient` drops, whose all-reduce XLA removes and the plan no
    longer counts."""
    rng = np.random.default_rng(0)
    shapes = {"wq": (32, 8, 8), "wk": (32, 2, 8), "wv": (32, 2, 8), "wo": (8, 8, 32)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(size=(2, 64, 32)), jnp.float32)

    def step(p, x):
        def loss(p, x):
            q, k, v = (jnp.einsum("btd,dhe->bthe", x, p[w]) for w in ("wq", "wk", "wv"))
            o = js.shard(attention, in_strategy=((1, 8, 1, 1),) * 3)(q, k, v)
            return jnp.mean(jnp.einsum("bthe,hed->btd", o, p["wo"]) ** 2)

        return jax.tree.map(lambda a, g: a - 0.1 * g, p, jax.grad(loss)(p, x))  # the loss itself unused

    par = js.parallelize(step, devices=8, in_strategy=(None, (1, 8, 1)))
    plan = par.plan(p, x)
    compiled = par.lower(p, x).compile()
    report = js.audit(compiled)
    assert plan.predicted() == {k: b for k, (_, b) in report.by_kind().items()}, plan.compare(report)
    got = compiled(*jax.device_put((p, x), plan.in_shardings))
    assert_close(got, jax.jit(step)(p, x), terms=step_terms(p, x) + 3 * 64)


def test_the_ring_holds_less_than_the_gather():
    """One sequence of 512 tokens over 8 devices: the gather holds every device's scores against the
    whole sequence; the ring one block at a time, forward and backward (compiled: 0.38 MiB against
    2.10 MiB)."""
    rng = np.random.default_rng(0)
    shapes = {"wq": (16, 4, 8), "wk": (16, 4, 8), "wv": (16, 4, 8), "wo": (4, 8, 16)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(size=(1, 512, 16)), jnp.float32)
    lay = js.Layout((8,), ("sp",))
    peaks = {}
    for form in ("gather", "ring"):
        step = _step(form, strategy=lay("None", "sp", "None", "None"))
        par = js.parallelize(step, devices=8, in_strategy=(None, lay("None", "sp", "None")))
        peaks[form] = js.audit(par.lower(p, x).compile()).memory.peak_bytes
    assert peaks["ring"] < peaks["gather"] / 2, peaks


@pytest.mark.parametrize("form", ["ring", "auto"])
def test_a_zigzag_order_the_sequence_cannot_hold_is_refused(args, form):
    p, _ = args
    x = jnp.zeros((B, 36, D), jnp.float32)  # 36 tokens over 4 devices: 9 each, no two equal chunks
    par = js.parallelize(_step(form, zigzag=True), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    with pytest.raises(
        js.ShardingError, match=r"zig-zag order cuts the sequence into 8 chunks, which do not divide 36"
    ):
        par.plan(p, x)


def test_an_unknown_form_is_named(args):
    p, x = args
    par = js.parallelize(_step("flash"), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    with pytest.raises(ValueError, match=r"form='flash'; pass 'auto', 'gather', 'ring' or 'ulysses'"):
        par.plan(p, x)


@pytest.mark.parametrize(("form", "zigzag"), [("none", False), ("gather", False), ("ring", True), ("ulysses", False)])
def test_tiled_attention_equals_one_device(args, one_device, form, zigzag):
    """`block=4`: the keys taken 4 at a time (the softmax online, the backward recomputing each
    tile), with no sequence cut (`strategy=None`, one device) and inside each form (the zig-zag
    ring's half-blocks of 4 keys in one tile): one train step equals one device's plain attention."""
    p, x = args
    if form == "none":
        got = jax.jit(_step("auto", strategy=None, block=4))(p, x)
    else:
        x_in = js.zigzag(x, SP) if zigzag else x
        par = js.parallelize(
            _step(form, zigzag, block=4), devices=8, mode="semi_auto", in_strategy=(None, LAY("dp", "sp", "None"))
        )
        got = par(p, x_in)
    assert_close(got, one_device, terms=step_terms(p, x) + 3 * T)


def test_tiled_attention_holds_one_tile_of_scores():
    """One sequence of 1024 tokens on one device: plain attention holds the [1024, 1024] scores of
    each head (forward, and their weights for the backward); tiles of 128 keys hold one tile's. The
    compiled train step's peak is under half the plain one's."""
    rng = np.random.default_rng(0)
    shapes = {"wq": (16, 2, 8), "wk": (16, 2, 8), "wv": (16, 2, 8), "wo": (2, 8, 16)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(size=(1, 1024, 16)), jnp.float32)
    peaks = {
        block: js.audit(jax.jit(_step("auto", strategy=None, block=block)).lower(p, x).compile()).memory.peak_bytes
        for block in (1024, 128)
    }
    assert peaks[128] < peaks[1024] / 2, peaks


def test_a_recomputed_scanned_layer_keeps_no_tile_masks():
    """Under `jshard.recompute` in a `lax.scan` (a model's layers), the tiles' causal masks are
    recomputed with their scores: the differentiated program keeps nothing of length^2 elements
    (made of positions alone, JAX's partial evaluation would hoist every tile's mask out of the loop
    as a residual)."""
    t = 256

    def loss(x):
        def layer(h, _):
            q = h.reshape(1, t, 2, 8)
            o = js.recompute(lambda q: js.attention(q, q[:, :, :1], q[:, :, :1], causal=True, block=32))(q)
            return o.reshape(h.shape), None

        return jnp.sum(jax.lax.scan(layer, x, None, length=2)[0] ** 2)

    jaxpr = jax.make_jaxpr(jax.grad(loss))(jnp.ones((1, t, 16), jnp.float32))
    sizes = [int(np.prod(v.aval.shape)) for e in jaxpr.eqns for v in e.outvars if hasattr(v.aval, "shape")]
    assert max(sizes) < t * t, max(sizes)


def test_a_block_that_does_not_divide_is_refused(args):
    p, x = args
    par = js.parallelize(_step("ring", block=3), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    with pytest.raises(js.ShardingError, match=r"block=3 .* each device attends 8 keys at once \(the ring's blocks"):
        par.plan(p, x)


def test_auto_weighs_no_ring_its_block_does_not_divide(args, one_device):
    """`form="auto"` with `block=16`: the ring's blocks of 8 keys (32 over 4 devices) cannot take
    tiles of 16, so the ring is not weighed (its refusal named in the region's why) and another
    form runs, equal to one device; `form="ring"` with the same block is refused (above)."""
    p, x = args
    par = js.parallelize(_step("auto", block=16), devices=8, mode="semi_auto", in_strategy=(None, LAY("dp", "sp", "None")))
    plan = par.plan(p, x)
    region = next(op for op in plan.ops if op.primitive == "shard_map" and not op.backward)
    assert "not ring: the ring's blocks of 8 keys do not divide into the call's tiles of block=16" in plan.explain(
        region.index)
    assert_close(par(p, x), one_device, terms=step_terms(p, x) + 3 * T)


def test_a_manual_regions_matmuls_are_priced(args):
    """The ring's region is priced by its body's matrix products per device (`Plan.work`): the
    plan's FLOPs are those of the same step with its attention laid out by the search, less the
    softmax's elementwise work the region's price leaves out (unpriced, the region counted none)."""
    p, x = args
    ring = js.parallelize(_step("ring"), devices=8, in_strategy=(None, LAY("dp", "sp", "None"))).plan(p, x)
    plain = js.parallelize(_step("auto", strategy=None), devices=8, in_strategy=(None, LAY("dp", "sp", "None")))
    want = plain.plan(p, x).work.flops
    assert 0.8 * want <= ring.work.flops <= want, (ring.work.flops, want)
    assert ring.work.device_flops < ring.work.flops / 4


def test_the_search_weighs_context_parallel_for_attention_without_a_strategy(tmp_path):
    """One sequence of 2048 tokens through `jshard.attention(form='ring')` with no strategy (tiled
    attention), heads of 64: under a budget of 8% of one device's compiled peak, no plan without a
    sequence cut fits (the search cuts the tiles' queries in its global view, but each device then
    holds all the keys and values and their gradients, and the memory model counts the tile loop's
    body), so the planning weighs the calls cut 8 ways (context parallel, the smallest cut that
    leaves no device idle beside one batch row, its ring passing blocks of keys and values),
    chooses it, and the compiled program fits and equals one device. The saved plan carries the
    cut: loaded, it rebuilds the same operators."""
    rng = np.random.default_rng(0)
    shapes = {"wq": (16, 2, 64), "wk": (16, 2, 64), "wv": (16, 2, 64), "wo": (2, 64, 16)}
    p = {k: jnp.asarray(rng.normal(size=s) / 4, jnp.float32) for k, s in shapes.items()}
    x = jnp.asarray(rng.normal(size=(1, 2048, 16)), jnp.float32)
    step = _step("ring", strategy=None)
    one = jax.jit(step).lower(p, x).compile()
    budget = int(0.08 * js.audit(one).memory.peak_bytes)
    par = js.parallelize(step, devices=8, mode="auto", search=js.Search(memory_budget=budget))
    plan = par.plan(p, x)
    assert plan.search.context_cut == 8 and plan.choices == (("context", 8),)
    assert [(w.policy, w.seconds is not None, w.chosen) for w in plan.search.context] == [
        ("sequence 1 (no cut)", False, False), ("sequence 8", True, True)]
    assert "context parallel weighed for jshard.attention without a strategy: sequence 1 (no cut): no plan fits" in (
        plan.summary())
    compiled = par.lower(p, x).compile()
    assert js.audit(compiled).memory.peak_bytes <= budget
    got = compiled(*jax.device_put((p, x), plan.in_shardings))
    assert_close(got, one(p, x), terms=step_terms(p, x) + 3 * 2048)
    plan.save(tmp_path / "plan.json")
    again = js.parallelize(step, devices=8, mode="auto", plan=js.Plan.load(tmp_path / "plan.json")).plan(p, x)
    assert again.choices == (("context", 8),)
    assert [op.layout for op in again.ops] == [op.layout for op in plan.ops]


def test_a_short_attention_without_a_strategy_weighs_no_cut(args):
    """Keys within one tile: the planning weighs no sequence cut and traces the step no more often
    than with the attention's layout given."""
    traces = []

    def counted(strategy):
        inner = _step("auto", strategy=strategy)

        def step(p, x):
            traces.append(strategy)
            return inner(p, x)

        return step

    plans = {s: js.parallelize(counted(s), devices=8, mode="auto").plan(*args) for s in (None, (2, 1, 1, 1))}
    assert plans[None].search.context == () and plans[None].search.context_cut is None
    assert plans[None].choices == ()
    assert traces.count(None) == traces.count((2, 1, 1, 1))
