"""MindSpore's `recompute(mp_comm_recompute=False)`: a `jshard.recompute` region that recomputes its
computation in the backward pass but keeps the results of its collectives (the all-reduced,
all-gathered tensors) from the forward pass, read from the compiled program of a Megatron block on
a 2 x 4 device matrix, and equal to one device.

XLA:CPU's buffer assignment barely shrinks when a program recomputes (see `test_recompute.py`), so
the kept values' memory is checked against the program a user would write by hand for the same
thing (`checkpoint_name` on the reduced value, `save_only_these_names`): the same temp memory and
the same collectives."""

import jax
import jax.numpy as jnp
import pytest
from _tolerance import assert_close, step_terms
from jax.ad_checkpoint import checkpoint_name

import jshard as js
from benchmarks._comm_recompute import megatron_block, stacked_grad

LAYERS, ROWS, D, F = 2, 64, 32, 64
block = megatron_block()  # table 14's block, on fewer and smaller layers
by_hand = megatron_block(lambda y: checkpoint_name(y, "reduced"))


def _grad(layer):
    return stacked_grad(layer, LAYERS)


WRAPS = {
    "none": lambda: block,
    "recomputed": lambda: js.recompute(block),
    "kept": lambda: js.recompute(block, mp_comm_recompute=False),
    "by-hand": lambda: jax.checkpoint(by_hand, policy=jax.checkpoint_policies.save_only_these_names("reduced")),
}


def _args():
    keys = jax.random.split(jax.random.key(0), 3)
    return (jax.random.normal(keys[0], (D, F)) / D**0.5, jax.random.normal(keys[1], (F, D)) / F**0.5,
            jax.random.normal(keys[2], (ROWS, D)))


@pytest.fixture(scope="module")
def compiled():
    """Per wrap: the parallel step, its audit and its compiled temp memory."""
    found = {}
    for name, wrap in WRAPS.items():
        step = js.parallelize(_grad(wrap()), devices=8, mode="semi_auto")
        program = step.lower(*_args()).compile()
        found[name] = step, js.audit(program), program.memory_analysis().temp_size_in_bytes
    return found


def test_the_backward_pass_reduces_again_only_when_the_region_recomputes_its_communication(compiled):
    reduced = {name: audit.bytes("all-reduce") for name, (_, audit, _) in compiled.items()}
    # each layer all-reduces its (64 x 32 f32, rows cut 2 ways: 4 KiB) output once forward
    assert reduced["recomputed"] == reduced["none"] + LAYERS * ROWS * D * 4 // 2
    assert reduced["kept"] == reduced["none"] < reduced["recomputed"]


def test_keeping_the_communication_is_the_program_written_by_hand(compiled):
    _, kept, kept_temp = compiled["kept"]
    _, hand, hand_temp = compiled["by-hand"]
    assert kept_temp == hand_temp
    assert {k: (kept.count(k), kept.bytes(k)) for k in ("all-reduce", "all-gather")} == {
        k: (hand.count(k), hand.bytes(k)) for k in ("all-reduce", "all-gather")}


@pytest.mark.parametrize("wrap", ["recomputed", "kept"])
def test_values_equal_one_device(compiled, wrap):
    step = compiled[wrap][0]
    args = _args()
    want = jax.jit(_grad(block))(*args)  # one device: the arguments are on device 0
    assert_close(step(*args), want, terms=LAYERS * step_terms({"w1": args[0], "w2": args[1]}, args[2]))


def test_the_plan_names_the_region_and_explain_says_it_keeps_the_collectives(compiled):
    plan = compiled["kept"][0].plan(*_args())
    region = "jshard.recompute(policy='full', mp_comm_recompute=False)"
    assert {op.recompute for op in plan.ops} == {"", region}
    again = next(op for op in plan.ops if op.recomputed)
    assert plan.explain(again).splitlines()[-1] == (
        f"  recomputed: the backward pass runs this forward operator again instead of keeping its result ({region}, "
        f"the user's jshard.recompute call; the results of its collectives are kept from the forward pass, not "
        f"communicated again)")


def _two_layers(wrap, name=lambda h: h):
    def layer(w, x):
        h = jnp.tanh(js.shard(jnp.matmul, ((8, 1), (1, 1)))(x, w))  # rows cut 8 ways
        return js.shard(jnp.matmul, ((1, 1), (1, 8)))(name(h), w * 1.0)  # rows whole: h all-gathered

    f = wrap(layer)
    step = js.parallelize(jax.grad(lambda w, x: f(w, f(w, x)).sum()), devices=8)
    return js.audit(step.lower(jnp.ones((64, 64)), jnp.ones((64, 64))).compile())


def test_a_region_keeps_its_gathered_values_as_written_by_hand():
    kept = _two_layers(lambda f: js.recompute(f, mp_comm_recompute=False))
    again = _two_layers(js.recompute)
    hand = _two_layers(lambda f: jax.checkpoint(f, policy=jax.checkpoint_policies.save_only_these_names("h")),
                       lambda h: checkpoint_name(h, "h"))
    # recomputed, the backward pass gathers each layer's h (64 x 64 f32, 16 KiB) again; kept, it does
    # not (XLA still gathers the cut w * 1.0 for the backward matmul, as in the program by hand)
    assert kept.bytes("all-gather") == again.bytes("all-gather") - 16 * 2**10
    assert (kept.count("all-gather"), kept.bytes("all-gather")) == (hand.count("all-gather"), hand.bytes("all-gather"))


def test_bad_mp_comm_recompute_and_no_constraints_to_keep_raise():
    with pytest.raises(TypeError, match=r"jshard.recompute\(block\): mp_comm_recompute must be True .* or False "
                                        r".*, not 'no'"):
        js.recompute(block, mp_comm_recompute="no")
    step = js.parallelize(_grad(js.recompute(block, mp_comm_recompute=False)), devices=8, propagation="xla")
    with pytest.raises(js.ShardingError, match=r"jshard.parallelize\(loss\): jshard.recompute\(\.\.\., mp_comm_recompute=False\) at "
                                               r".*_comm_recompute.py:\d+:\d+ \(megatron_block\.<locals>\.block\) keeps "
                                               r"the results of the collectives jshard's constraints make, but with "
                                               r"propagation='xla' jshard places none .* or mp_comm_recompute=True"):
        step.lower(*_args())


def test_a_scan_over_layers_cannot_keep_and_says_so():
    def loss(w1, w2, x):
        layer = js.recompute(block, mp_comm_recompute=False)
        x, _ = jax.lax.scan(lambda c, _: (layer(w1, w2, c), None), x, None, length=LAYERS)
        return (x**2).sum()

    step = js.parallelize(jax.grad(loss, argnums=(0, 1)), devices=8, mode="semi_auto")
    with pytest.raises(js.ShardingError, match=r"mp_comm_recompute=False\): the backward pass runs the region at "
                                               r".*_comm_recompute.py:\d+:\d+ \(megatron_block\.<locals>\.block\) again where its forward "
                                               r"pass's values are out of reach .* Call the layers in a Python loop, "
                                               r"or use mp_comm_recompute=True"):
        step.lower(*_args())
