"""jit's options on `parallelize`: `static_argnums`, `static_argnames`, `donate_argnames` and keyword
arguments, each equal to `jax.jit` on one device, and each rule's error."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close
from clients import linen_dropout, nnx_dropout, one_device
from jax.sharding import PartitionSpec as P

import jshard as js

MODES = ["data", "semi_auto", "auto"]


def parts(*texts: str) -> str:
    """A regex matching `texts` literally, in order, anything between them."""
    return "(?s)" + ".*".join(map(re.escape, texts))


def layers(w, x, n, *, scale=1.0, act="tanh"):
    """`n` layers of `act` (Python control flow on static arguments), scaled by `scale`."""
    y = x @ w * scale
    for _ in range(n):
        y = jnp.tanh(y) if act == "tanh" else jax.nn.relu(y)
    return y.sum(axis=1)


W, X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 4)), jnp.float32), jnp.ones((8, 16))
TERMS = 16 + 4 + 3 * 4
"""What `layers` sums (tests/_tolerance.py): `x @ w` 16 terms, the row sum 4, and up to 3 layers of
tanh at a few ulps each."""


class Counted:
    """`fn`, counting how often it is traced (each trace is one Python call)."""

    def __init__(self, fn):
        self.fn, self.traces, self.__name__ = fn, 0, fn.__name__

    def __call__(self, *args, **kwargs):
        self.traces += 1
        return self.fn(*args, **kwargs)


# --- static_argnums / static_argnames ---------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_static_argnums_equal_jax_jit(mode):
    step = js.parallelize(layers, devices=8, mode=mode, static_argnums=2)
    for n in (1, 3):
        assert_close(step(W, X, n), one_device(layers, W, X, n, jit_options={"static_argnums": 2}), terms=TERMS)
    if mode != "auto":  # (the search lays out the batch too)
        assert step.plan(W, X, 3).in_specs[1] == P(("d0", "d1", "d2"))  # the batch: X, the last argument not static


@pytest.mark.parametrize("mode", MODES)
def test_static_argnames_equal_jax_jit_by_keyword_and_by_position(mode):
    step = js.parallelize(layers, devices=8, mode=mode, static_argnames=("n", "act"))
    want = one_device(layers, W, X, 2, act="relu", jit_options={"static_argnames": ("n", "act")})
    assert_close(step(W, X, 2, act="relu"), want, terms=TERMS)
    assert_close(step(W, X, n=2, act="relu"), want, terms=TERMS)  # n numbered from its name through the signature


def test_static_values_key_the_programs_as_jax_jit_does():
    fn = Counted(layers)
    step = js.parallelize(fn, devices=8, static_argnums=2, static_argnames="act")
    step(W, X, 2)
    step(W, X, 2)
    assert fn.traces == 1
    step(W, X, 3)
    step(W, X, 3, act="relu")
    assert fn.traces == 3
    step(W, X, 2)
    assert fn.traces == 3


def test_a_static_argument_leaves_none_in_its_place():
    step = js.parallelize(layers, devices=8, static_argnums=2, in_strategy=((1, 2), (8, 1), None))
    plan = step.plan(W, X, 2)
    assert plan.in_specs == (P(None, "d0"), P(("d0", "d1", "d2")))
    assert step.lower(W, X, 2).compile().input_shardings[0][2] is None


def test_nnx_graphdef_as_a_static_argument():
    graphdef, state, batch = nnx_dropout.create_state()
    key = jax.random.key(1)
    step = js.parallelize(nnx_dropout.train_step, devices=8, static_argnums=0)
    want = one_device(nnx_dropout.train_step, graphdef, state, key, batch, jit_options={"static_argnums": 0})
    assert_close(step(graphdef, state, key, batch), want, terms=nnx_dropout.terms())


# --- keyword arguments ------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_keyword_arguments_are_traced_as_jax_jit_traces_them(mode):
    step = js.parallelize(layers, devices=8, mode=mode, static_argnums=2)
    for scale in (0.5, 2.0):  # one program: a traced keyword argument is no cache key
        got = step(W, X, 2, scale=jnp.float32(scale))
        assert_close(got, one_device(layers, W, X, 2, scale=jnp.float32(scale), jit_options={"static_argnums": 2}),
                     terms=TERMS)


def test_keyword_arguments_are_never_the_batch():
    def loss(w, x, *, bias):
        return ((x @ w + bias) ** 2).mean()

    bias = jnp.ones((8, 4))
    plan = js.parallelize(loss, devices=8, mode="data").plan(W, X, bias=bias)
    assert plan.in_specs == (P(), P(("d0", "d1", "d2")), P())  # x cut as the batch, bias replicated
    got = js.parallelize(loss, devices=8)(W, X, bias=bias)
    assert_close(got, one_device(loss, W, X, bias=bias), terms=16 + 32)  # x @ w, then the mean of 32


@pytest.mark.parametrize("mode", MODES)
def test_linen_step_with_its_dropout_key_by_keyword(mode):
    """LM1B's `train_step(state, batch, ..., dropout_rng=None)`: the batch stays the last positional argument."""
    state, batch = linen_dropout.create_state()
    rng = jax.random.key(1)
    got = js.parallelize(linen_dropout.train_step, devices=8, mode=mode)(state, batch, dropout_rng=rng)
    assert_close(got, one_device(linen_dropout.train_step, state, batch, dropout_rng=rng), terms=linen_dropout.terms())


def test_in_strategy_counts_positional_arguments_only():
    step = js.parallelize(layers, devices=8, static_argnums=2, in_strategy=(None, (8, 1), None))
    assert_close(step(W, X, 2, scale=jnp.float32(3.0)), one_device(layers, W, X, 2, scale=jnp.float32(3.0),
                                                                       jit_options={"static_argnums": 2}), terms=TERMS)
    with pytest.raises(js.ShardingError, match=parts(
        "jshard.parallelize(layers): in_strategy has 4 entries but the function was called with 3 positional arguments",
    )):
        js.parallelize(layers, devices=8, static_argnums=2, in_strategy=(None, (8, 1), None, None)).plan(
            W, X, 2, scale=jnp.float32(3.0))


# --- donate_argnames --------------------------------------------------------------------------


def test_donate_argnames_donates_positional_and_keyword_arguments():
    def update(params, x, *, grads):
        return jax.tree.map(lambda p, g: p - 0.1 * g, params, grads), jax.tree.map(jnp.zeros_like, grads), x.sum()

    params, grads = {"w": jnp.ones((16, 4))}, {"w": jnp.full((16, 4), 2.0)}
    want = one_device(update, params, X, grads=grads)
    params, grads = jax.tree.map(jnp.copy, (params, grads))
    step = js.parallelize(update, devices=8, donate_argnames=("params", "grads"))
    got = step(params, X, grads=grads)
    assert_close(got, want, terms=16 * 8)  # x.sum(): 128 terms
    assert params["w"].is_deleted() and grads["w"].is_deleted() and not X.is_deleted()


# --- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "options, error, message",
    [
        ({"static_argnums": 3}, js.ShardingError,
         ("jshard.parallelize(layers): static_argnums=(3,) numbers argument 3, but layers(w, x, n, *, scale=1.0, "
          "act='tanh') takes 3 positional argument(s). Number them 0 to 2 (or -1 to -3).",)),
        ({"static_argnames": "depth"}, js.ShardingError,
         ("jshard.parallelize(layers): static_argnames=('depth',) names 'depth', which is not a parameter of "
          "layers(w, x, n, *, scale=1.0, act='tanh'). Name one of ['w', 'x', 'n', 'scale', 'act'].",)),
        ({"donate_argnames": "weights"}, js.ShardingError, ("donate_argnames=('weights',) names 'weights'",)),
        ({"static_argnums": 2, "donate_argnums": 2}, js.ShardingError,
         ("argument 2 is in both static_argnums=(2,) and donate_argnums=(2,); a static argument is no buffer to "
          "donate. Drop it from one of them.",)),
        ({"static_argnames": "n", "donate_argnames": "n"}, js.ShardingError,
         ("'n' is in both static_argnames=('n',) and donate_argnames=('n',)",)),
        ({"static_argnums": 1, "batch_argnums": 1}, js.ShardingError,
         ("argument 1 is in both static_argnums=(1,) and batch_argnums=(1,); a static argument is not traced",)),
        ({"static_argnums": -1, "in_strategy": (None, (8, 1), (2,))}, js.ShardingError,
         ("in_strategy[2]=(2,) lays out argument 2, which is static (static_argnums=(-1,)); a static argument is "
          "not traced, so it has no layout. Give None there.",)),
        ({"static_argnums": "n"}, TypeError, ("static_argnums takes ints (or one int), got 'n'",)),
        ({"static_argnames": 2}, TypeError, ("static_argnames takes strs (or one str), got 2",)),
    ],
    ids=["num-out-of-range", "unknown-name", "unknown-donate-name", "static-and-donated", "static-and-donated-names",
         "static-batch", "static-in-strategy", "num-not-int", "name-not-str"],
)
def test_option_errors_name_the_call_and_the_fix(options, error, message):
    with pytest.raises(error, match=parts(*message)):
        js.parallelize(layers, devices=8, **options)


def test_a_positional_only_parameter_cannot_be_static_by_name():
    def f(x, n, /):
        return x * n

    with pytest.raises(js.ShardingError, match=parts(
        "static_argnames=('n',) names 'n', a positional-only parameter of f(x, n, /); number it in static_argnums",
    )):
        js.parallelize(f, static_argnames="n")


def test_an_unhashable_static_argument_is_a_type_error():
    step = js.parallelize(layers, devices=8, static_argnums=2, static_argnames="act")
    with pytest.raises(TypeError, match=parts(
        "jshard.parallelize(layers): static argument 2 is a list, which cannot be hashed",
        "Pass a hashable value (a tuple for a list, a frozen dataclass)",
    )):
        step(W, X, [2])
    with pytest.raises(TypeError, match=parts("static keyword argument 'act' is a dict")):
        step(W, X, 2, act={"kind": "relu"})


def test_a_pipeline_takes_no_jit_argument_options():
    pipe = js.Pipeline(first=lambda p, b: b, layer=lambda lp, x: x, last=lambda p, x, b: x.mean())
    with pytest.raises(js.ShardingError, match=parts(
        "a pipeline step takes (params, batch), both traced; static_argnums= applies to parallelize's own program",
    )):
        js.parallelize(pipe, pipeline=js.Pipelining(stages=2, micro_batches=2), static_argnums=0)


def test_lower_places_an_argument_committed_elsewhere_as_a_call_does():
    """An argument committed replicated on the devices, where the plan cuts it: `lower` takes it on
    the plan's sharding as a call does (`jax.jit` would refuse the mismatch), and the compiled
    program equals one device."""

    def matmul(x, w):
        return js.shard(lambda a, b: a @ b, in_strategy=((2, 1), (1, 4)))(x, w).sum()

    step = js.parallelize(matmul, devices=8, mode="semi_auto")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:8]), ("all",))
    w = jax.device_put(W, jax.sharding.NamedSharding(mesh, P()))
    assert step.plan(X, w).in_shardings[1].spec != P()  # the plan cuts what was placed whole
    compiled = step.lower(X, w).compile()
    got = compiled(*jax.device_put((X, w), compiled.input_shardings[0]))
    assert_close(got, matmul(X, W), terms=16 * 4)
