"""`propagation="best"` (issue 32, item 1): jshard's propagated plan and Shardy's from the same
anchors both compiled, the one moving fewer collective bytes kept and run, the plan saying which
won and by how much. Each case compiles each plan once: the weighing's compile of the kept plan is
the one its first call reuses; `propagation="jshard"` (the default) compiles once."""

import jax
import jax.numpy as jnp
import pytest
from _compiles import compiles
from _programs import Program, Step
from _tolerance import assert_close, step_terms
from clients import loop_gpt, one_device

import jshard as js

SHARDY_CHEAPER = Program(shape=(2, 16), steps=(Step(kind="scan", param="dot", extras=(((16, 16), False),),
                                                    strategy=None),),
                         mode="semi_auto", dataset="data_parallel", in_strategy=((1, 2), (1, 4)))
"""A scanned matmul whose carry and weight the user cuts apart (found by tests/_programs.py's random
programs): Shardy's plan moves 96 B per device, jshard's 128 B."""


def test_shardy_cheaper_is_kept_and_equals_one_device():
    args = [jnp.asarray(a) for a in SHARDY_CHEAPER.arguments()]
    step = js.parallelize(SHARDY_CHEAPER.fn, devices=8, dataset_strategy="data_parallel",
                          in_strategy=SHARDY_CHEAPER.in_strategy, propagation="best")
    with compiles() as seen:
        plan = step.plan(*args)
    args = jax.device_put(args, list(plan.in_shardings))  # placed outside the count (its own small compiles)
    with compiles() as called:
        out = step(*args)
    assert (len(seen), len(called)) == (2, 0), "jshard's and Shardy's programs compiled once each, the kept one run"
    peer = plan.peer
    assert peer is not None and peer.kept == "xla" and plan.propagation == "xla"
    assert peer.shardy_bytes < peer.jshard_bytes
    assert js.audit(step.lower(*args).compile()).bytes() == peer.shardy_bytes  # the program run is Shardy's
    assert "Shardy's plan kept: jshard's moved" in plan.summary()
    terms, scale = SHARDY_CHEAPER.bound(args)
    assert_close(out, jax.jit(SHARDY_CHEAPER.fn)(*args), terms=terms, scale=scale)


def test_jshard_cheaper_is_kept_and_equals_one_device():
    params, tokens = loop_gpt.create(layers=1, d=16, ff=32, vocab=64, length=8)
    step = js.parallelize(loop_gpt.train_step, devices=8, propagation="best")
    plan = step.plan(params, tokens)
    peer = plan.peer
    assert peer is not None and peer.kept == "jshard" and plan.propagation == "jshard"
    assert peer.jshard_bytes < peer.shardy_bytes
    assert f"propagation: jshard's plan kept, {peer.ratio:.3f}x Shardy's bytes" in plan.summary()
    assert plan.predicted_bytes() == peer.jshard_bytes  # predicted = compiled, to the byte
    assert_close(step(params, tokens), one_device(loop_gpt.train_step, params, tokens),
                 terms=step_terms(params, tokens))


@pytest.mark.parametrize("propagation", ["jshard", None], ids=["jshard", "default"])
def test_off_compiles_once(propagation):
    args = [jnp.asarray(a) for a in SHARDY_CHEAPER.arguments()]
    given = {} if propagation is None else {"propagation": propagation}
    step = js.parallelize(SHARDY_CHEAPER.fn, devices=8, in_strategy=SHARDY_CHEAPER.in_strategy, **given)
    with compiles() as seen:
        plan = step.plan(*args)
    args = jax.device_put(args, list(plan.in_shardings))
    with compiles() as called:
        step(*args)
    assert (len(seen), len(called)) == (0, 1)
    assert plan.peer is None and plan.propagation == "jshard"


def test_not_weighed_without_devices():
    """On an abstract mesh nothing compiles: jshard's plan, no `peer`."""
    step = js.parallelize(SHARDY_CHEAPER.fn, devices=64, in_strategy=SHARDY_CHEAPER.in_strategy,
                          dataset_strategy="full_batch", propagation="best")
    plan = step.plan(*[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in SHARDY_CHEAPER.arguments()])
    assert plan.peer is None and plan.propagation == "jshard"


REFINED = Program(shape=(2,), steps=(Step(kind="dot", param=8, extras=(((2, 8), False),), strategy=((2,), (2, 1))),
                                     Step(kind="binary", param="max", extras=(((8,), False),), strategy=None)),
                  mode="semi_auto", dataset="data_parallel", in_strategy=None)
"""A `shard` call's whole result (its partial sums reduced) meeting the batch cut 8 ways: the
operator after it takes the result cut as the batch is (each device slices what it holds) rather
than gathering the batch, as Shardy does (was 64 B against Shardy's 32 B)."""


def test_a_shard_results_user_cuts_it_finer_where_nothing_moves():
    args = [jnp.asarray(a) for a in REFINED.arguments()]
    step = js.parallelize(REFINED.fn, devices=8, propagation="best")
    plan = step.plan(*args)
    assert plan.ops[-1].in_strategy == ((8,), (8,))
    assert plan.peer is not None and plan.peer.kept == "jshard" and plan.peer.jshard_bytes == plan.peer.shardy_bytes == 32
    assert plan.predicted_bytes() == 32
    terms, scale = REFINED.bound(args)
    assert_close(step(*args), jax.jit(REFINED.fn)(*args), terms=terms, scale=scale)
