"""Sharding rules of gather/scatter, convolution, windows and the rest: the factors each rule reads
off a tiny operator, each family run on 8 devices against one, and every operator of the reference
train steps ruled."""

import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close

import jshard as js
from jshard import models
from jshard.graph import flatten
from jshard.models._moe import MoEConfig, init_moe, moe_batch, moe_loss
from jshard.models._resnet import ResNetConfig, init_resnet, resnet_batch, resnet_loss
from jshard.rules import RULES, Factors

f32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)
i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)


def signature(f: Factors) -> str:
    """`f` as einsum-like text: a letter per factor (upper case: reduced), `.` a whole dim, `(ab)` a
    dim of several factors, operands joined by `,`, inputs `->` outputs."""
    names: dict[int, str] = {}

    def letter(x):
        names.setdefault(x, string.ascii_lowercase[len(names)])
        return names[x].upper() if x in f.reduced else names[x]

    def dim(d):
        s = "".join(map(letter, d))
        return "." if not d else s if len(d) == 1 else f"({s})"

    side = lambda operands: ",".join("".join(map(dim, op)) for op in operands)
    return f"{side(f.inputs)}->{side(f.outputs)}"


def ruled(fn, args, primitive, nth=0) -> str:
    """The signature of the rule of the `nth` `primitive` equation in `fn`'s jaxpr."""
    eqns = [n.eqn for n in flatten(jax.make_jaxpr(fn)(*args).jaxpr) if n.primitive == primitive]
    return signature(RULES[primitive](eqns[nth]))


def _conv(x, w, groups=1):
    return jax.lax.conv_general_dilated(
        x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups
    )


def _max_pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _take(logp, targets):
    return jnp.take_along_axis(logp, targets[..., None], axis=-1)


_grad_xw = lambda fn: jax.grad(lambda x, w: fn(x, w).sum(), argnums=(0, 1))
TABLE, TOKENS, LOGP, IMAGES, KERNEL = f32(32, 16), i32(4, 8), f32(4, 8, 32), f32(8, 6, 6, 4), f32(3, 3, 4, 16)

# (function, arguments, primitive, which one, signature); `.`: whole, upper case: reduced (a gather's
# looked-up dim may stay cut: masked lookups summed by an all-reduce; a scatter's written dim too,
# each device applying the updates in its own rows).
CASES = {
    "embedding": (lambda t, i: t[i], (TABLE, TOKENS), "gather", 0, "Ab,cd.->cdb"),
    "embedding-grad": (jax.grad(lambda t, i: t[i].sum()), (TABLE, TOKENS), "scatter-add", 0, "ab,CD.,CDb->ab"),
    "take_along_axis": (_take, (LOGP, TOKENS), "gather", 0, "abC,abd.->abd"),
    "take_along_axis-grad": (jax.grad(lambda l, t: _take(l, t).sum()), (LOGP, TOKENS), "scatter-add", 0,
                             "abc,abD.,abD->abc"),
    "x[:,idx]": (lambda x, i: x[:, i], (f32(8, 16), i32(4)), "gather", 0, "aB,c.->ac"),
    "x[:,idx]-grad": (jax.grad(lambda x, i: x[:, i].sum()), (f32(8, 16), i32(4)), "scatter-add", 0, "ab,C.,aC->ab"),
    "x[idx,2:5]": (lambda x, i: x[i, 2:5], (f32(8, 16), i32(4)), "gather", 0, "A.,b.->b."),
    "x.at[idx].set": (lambda x, i: x.at[i].set(1.0), (f32(8, 16), i32(4)), "scatter", 0, "ab,..,.b->ab"),
    "x.at[idx].mul": (lambda x, i: x.at[i].mul(2.0), (f32(8, 16), i32(4)), "scatter-mul", 0, "ab,C.,Cb->ab"),
    "x.at[idx].max": (lambda x, i: x.at[i].max(2.0), (f32(8, 16), i32(4)), "scatter-max", 0, "ab,C.,Cb->ab"),
    "conv": (_conv, (IMAGES, KERNEL), "conv_general_dilated", 0, "a..B,..Bc->a..c"),
    "conv-kernel-grad": (_grad_xw(_conv), (IMAGES, KERNEL), "conv_general_dilated", 1, "A..b,A..c->..bc"),
    "conv-input-grad": (_grad_xw(_conv), (IMAGES, KERNEL), "conv_general_dilated", 2, "a..B,..cB->a..c"),
    "grouped-conv": (lambda x, w: _conv(x, w, 2), (IMAGES, f32(3, 3, 2, 16)), "conv_general_dilated", 0,
                     "a..(bC),..C(bd)->a..(bd)"),
    "grouped-conv-kernel-grad": (_grad_xw(lambda x, w: _conv(x, w, 2)), (IMAGES, f32(3, 3, 2, 16)),
                                 "conv_general_dilated", 1, "A...,A..b->...b"),
    "max-pool": (_max_pool, (IMAGES,), "reduce_window_max", 0, "a..b->a..b"),
    "max-pool-grad": (jax.grad(lambda x: _max_pool(x).sum()), (IMAGES,), "select_and_scatter_add", 0,
                      "a..b,a..b->a..b"),
    "max-pool-jvp": (lambda x, t: jax.jvp(_max_pool, (x,), (t,)), (IMAGES, IMAGES), "select_and_gather_add", 0,
                     "a..b,a..b->a..b"),
    "avg-pool-same": (lambda x: jax.lax.reduce_window(x, 0.0, jax.lax.add, (1, 3, 3, 1), (1,) * 4, "SAME"),
                      (IMAGES,), "reduce_window_sum", 0, "a..b->a..b"),
    "reduce_window-mul": (lambda x: jax.lax.reduce_window(x, 1.0, jax.lax.mul, (2, 1, 1, 1), (2, 1, 1, 1), "VALID"),
                          (IMAGES,), "reduce_window", 0, ".abc,->.abc"),
    "sort": (lambda x: jnp.sort(x, axis=0), (f32(8, 16),), "sort", 0, ".a->.a"),
    "argsort": (lambda x: jnp.argsort(x, axis=1), (f32(8, 16),), "sort", 0, "a.,a.->a.,a."),
    "top_k": (lambda x: jax.lax.top_k(x, 3), (f32(8, 16),), "top_k", 0, "a.->a.,a."),
    "split": (lambda x: jnp.split(x, 2, axis=1), (f32(8, 16),), "split", 0, "a.->a.,a."),
    "stack": (lambda x: jnp.stack([x, x], axis=1), (f32(8, 16),), "stack", 0, "ab,ab->a.b"),
    "unstack": (lambda x: jnp.unstack(x, axis=1), (f32(8, 2),), "unstack", 0, "a.->a,a"),
    "tile": (lambda x: jnp.tile(x, (2, 1)), (f32(8, 16),), "tile", 0, ".a->.a"),
    "bitcast-narrower": (lambda x: jax.lax.bitcast_convert_type(x, jnp.uint8), (f32(8, 16),),
                         "bitcast_convert_type", 0, "ab->ab."),
    "bitcast-wider": (lambda x: jax.lax.bitcast_convert_type(x, jnp.int32), (jax.ShapeDtypeStruct((8, 4), jnp.uint8),),
                      "bitcast_convert_type", 0, "a.->a"),
    "rng_bit_generator": (lambda k: jax.lax.rng_bit_generator(k, (8, 16)), (jax.ShapeDtypeStruct((4,), jnp.uint32),),
                          "rng_bit_generator", 0, ".->.,ab"),
    "clamp-scalar-bounds": (lambda x: jax.lax.clamp(0.1, x, 0.5), (f32(8, 16),), "clamp", 0, ",ab,->ab"),
    "erf_inv": (jax.lax.erf_inv, (f32(8, 16),), "erf_inv", 0, "ab->ab"),
    "add_any": (jax.grad(lambda x: (x * x).sum()), (f32(8, 16),), "add_any", 0, "ab,ab->ab"),
}


@pytest.mark.parametrize("case", CASES)
def test_rule_factors(case):
    fn, args, primitive, nth, expected = CASES[case]
    assert ruled(fn, args, primitive, nth) == expected


def _lookup_loss(table, batch):
    tokens, targets = batch
    logp = jax.nn.log_softmax(table[tokens] @ table.T, axis=-1)
    return -_take(logp, targets).mean()


def _conv_loss(params, images):
    h = jax.nn.relu(_conv(images, params["w1"]))
    return (_conv(h, params["w2"]) ** 2).mean()


def _pool_loss(x, images):
    pooled = _max_pool(images * x[None, None, None, :])
    summed = jax.lax.reduce_window(images, 0.0, jax.lax.add, (1, 3, 3, 1), (1, 1, 1, 1), "SAME")
    return (pooled**2).mean() + (summed * x[None, None, None, :]).mean()


def _misc(x, batch):
    top, _ = jax.lax.top_k(batch * x[None, :], 3)
    left, right = jnp.split(jnp.sort(batch, axis=1), 2, axis=1)
    return top.sum(), left - right


_rng = np.random.default_rng(0)
_normal = lambda *shape: _rng.normal(size=shape).astype(np.float32)
_tokens = lambda: _rng.integers(0, 32, (8, 4), np.int32)
# (function, arguments: the batch last, the primitives it must rule, the terms its results sum: see
# tests/_tolerance.py)
FAMILIES = {
    # logits over 16 dims, log-softmax over 32 (and exp, log), the mean over 32 tokens; the gradient's
    # dlogits @ table (32), dlogits.T @ rows over 32 tokens and the scatter-add of 32 looked-up rows
    "gather": (jax.value_and_grad(_lookup_loss), (_normal(32, 16), (_tokens(), _tokens())), ("gather", "scatter-add"),
               16 + 32 + 4 + 32 + 32 + 32 + 32),
    # the loss: a 3x3x4 then a 3x3x8 convolution, the mean over 8x6x6x4; the gradients: the 3x3x4
    # convolution back, and the kernels' sums over 8x6x6 positions (fewer)
    "conv": (
        jax.value_and_grad(_conv_loss),
        ({"w1": _normal(3, 3, 4, 8), "w2": _normal(3, 3, 8, 4)}, _normal(8, 6, 6, 4)),
        ("conv_general_dilated",),
        36 + 72 + 8 * 6 * 6 * 4,
    ),
    # means over 8x3x3x4 pooled and 8x6x6x4 3x3-summed values; x's gradient sums over as many
    "window": (
        jax.value_and_grad(_pool_loss),
        (_normal(4), _normal(8, 6, 6, 4)),
        ("reduce_window_max", "select_and_scatter_add", "reduce_window_sum"),
        8 * 3 * 3 * 4 + 9 + 8 * 6 * 6 * 4,
    ),
    # the sum of 8x3 top values; sort and split move values, computing nothing
    "misc": (_misc, (_normal(16), _normal(8, 16)), ("top_k", "sort", "split"), 8 * 3),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_family_on_8_devices_equals_one(family):
    fn, args, primitives, terms = FAMILIES[family]
    parallel = js.parallelize(fn, devices=8)
    ops = [op for op in parallel.plan(*args).ops if op.primitive in primitives]
    assert {op.primitive for op in ops} == set(primitives)
    assert all(op.ruled and op.origin == "propagated" for op in ops), [(op.primitive, op.origin) for op in ops]
    assert_close(parallel(*args), jax.jit(fn)(*args), terms=terms)


@pytest.mark.parametrize("update", ["set", "add"])
def test_scatter_with_its_written_rows_cut_equals_one_device(update):
    """A scatter keeps its operand's rows cut over the whole mesh: each device writes the updates that
    land in its own rows and drops the rest (no all-gather of the table, no sum)."""
    fn = lambda x, u, i: getattr(x.at[i], update)(u) * 2.0
    args = (_normal(16, 4), _normal(5, 4), np.array([3, 9, 12, 15, 0], np.int32))
    parallel = js.parallelize(fn, devices=8, in_strategy=((8, 1), (1, 1), (1,)))
    (op,) = [op for op in parallel.plan(*args).ops if op.primitive.startswith("scatter")]
    assert op.in_specs[0] == op.out_specs[0] == jax.sharding.PartitionSpec(("d0", "d1", "d2"))
    assert_close(parallel(*args), jax.jit(fn)(*args), terms=2)


def coverage(plan) -> float:
    """The share of the plan's operators that jshard has a sharding rule for."""
    return sum(op.ruled for op in plan.ops) / len(plan.ops)


def _params(init, cfg):
    """The parameters, as shapes where `init` traces: planning needs no values, and a compiled random
    draw per shape costs seconds on CPU. An `init` that draws on the host is called."""
    try:
        return jax.eval_shape(lambda key: init(cfg, key), jax.random.key(0))
    except jax.errors.TracerArrayConversionError:
        return init(cfg, jax.random.key(0))


def _gpt():
    cfg = models.GPTConfig(n_layers=1)
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 8)
    return lambda p, b: models.gpt_loss(p, b, cfg), _params(models.init_gpt, cfg), batch


def _mlp():
    cfg = models.MLPConfig()
    return models.mlp_loss, _params(models.init_mlp, cfg), models.mlp_batch(np.random.default_rng(0), cfg, 8)


def _resnet():
    cfg = ResNetConfig()
    batch = resnet_batch(np.random.default_rng(0), cfg, 8)
    return lambda p, b: resnet_loss(p, b, cfg), _params(init_resnet, cfg), batch


def _moe():
    cfg = MoEConfig()
    batch = moe_batch(np.random.default_rng(0), cfg, 8)
    return lambda p, b: moe_loss(p, b, cfg), _params(init_moe, cfg), batch


@pytest.mark.parametrize("model", [_gpt, _mlp, _resnet, _moe], ids=["gpt", "mlp", "resnet", "moe"])
def test_train_step_fully_ruled(model):
    loss, params, batch = model()
    opt = optax.adam(1e-3)
    step = js.parallelize(models.make_train_step(loss, opt), devices=8)
    plan = step.plan(params, jax.eval_shape(opt.init, params), batch)
    assert coverage(plan) == 1.0, sorted({op.primitive for op in plan.ops if not op.ruled})
