"""Whole-chain moves of a free argument's layout after the search (`jshard.search._chains`, issue 32):
where the searched plan stores a parameter (and its Adam moments, their update) otherwise than a
seed does, and the seed's layout of that whole chain predicts less on the schedule, it is moved at
once; the plan predicts fewer seconds, fits the budget and equals one device."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _tolerance import assert_close

import jshard as js
from benchmarks import _llama
from jshard.cost import CostModel
from jshard.graph import flatten
from jshard.search import _chains
from jshard.search._graph import SearchGraph

# a two-layer Llama-shaped step (scanned layers) whose searched plan, on the H100's cost model (its
# 80 GiB the default budget, so the seeds are made), stores the embedding table otherwise than the
# seeds: 27.3 us per call without the chain moves, 24.2 us with them
CFG = _llama.Decoder("tiny", vocab=512, seq_len=64, d_model=64, n_heads=4, n_kv_heads=2, d_ff=256, n_layers=2)
ROWS = 8


def _step(train_step):
    return js.parallelize(train_step, devices=8, mode="auto", cost_model=CostModel.for_device("H100"))


@pytest.fixture(scope="module")
def args():
    params = _llama.init_params(CFG)
    tokens = jax.random.randint(jax.random.key(0), (ROWS, CFG.seq_len), 0, CFG.vocab, jnp.int32)
    return params, optax.adam(1e-4).init(params), (tokens, jnp.roll(tokens, -1, axis=1))


def test_a_chain_moved_whole_predicts_less_and_equals_one_device(args, monkeypatch):
    train_step = _llama.train_step(CFG, None)
    with monkeypatch.context() as m:  # the search's plan as it was before the chain moves
        m.setattr(_chains, "moved", lambda g, solved, *_: solved)
        before = _step(train_step).plan(*args).search
    step = _step(train_step)
    after = step.plan(*args).search
    assert after.seconds < before.seconds * (1 - 1e-6), (after.line(), before.line())
    assert after.peak_bytes <= after.budget, after.line()
    assert "argument chain move" in after.line(), after.line()
    want, got = jax.jit(train_step)(*args), step(*args)
    # within bfloat16's rounding of each value (the step computes in it, `_llama.COMPUTE`: the weights,
    # activations and gradients each rounded a few times; 3.4 of its eps of a leaf's largest value here)
    widen = int(jnp.finfo(jnp.bfloat16).eps / jnp.finfo(jnp.float32).eps)  # np.finfo knows no bfloat16
    assert_close(got, want, dtype=np.float32, terms=8 * widen)


def test_chains_hold_each_parameter_with_its_moments(args):
    """Each chain starts at a free argument and holds the arguments of its shape its update reads:
    a parameter's chain its two Adam moments, a batch array's itself alone."""
    closed = jax.make_jaxpr(_llama.train_step(CFG, None))(*args)
    invars, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
    g = SearchGraph(flatten(closed.jaxpr), invars, outvars, {}, dict.fromkeys(("d0", "d1", "d2"), 2))
    held = sorted(sum(g.units[k].node < 0 for k in chain) for chain in _chains.chains(g))
    assert held == [1] * len(args[2]) + [3] * len(jax.tree.leaves(args[0])), held
