"""The round trip a training loop pays between calls (issue 30, item 5): `jshard.audit.moved_bytes`
measures what feeding a step's results back as its arguments moves (an audit of the loop, not of
one program); `out_strategy` lays a result out as it says, and the loop pays the move back."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.audit import moved_bytes

N, ROWS = 64, 16
TX = optax.sgd(0.1, momentum=0.9)  # with state; Adam would amplify rounding where a gradient is near 0


def _step(params, opt_state, x):
    """SGD with momentum on a linear least-squares loss whose update a strategy cuts by rows: the new parameters
    and moments are made cut 8 ways, where the step takes them whole."""
    loss, grads = jax.value_and_grad(lambda w, x: jnp.mean((x @ w["w"]) ** 2))(params, x)
    updates, opt_state = TX.update(grads, opt_state, params)
    new = js.shard(jnp.add, in_strategy=((8, 1), (8, 1)))(params["w"], updates["w"])
    return {"w": new}, opt_state, loss


@functools.cache
def _args():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(N, N)) / N, jnp.float32)}
    return params, TX.init(params), jnp.asarray(rng.normal(size=(ROWS, N)), jnp.float32)


def _whole(tree):
    """A strategy per array leaf that leaves it whole (a scalar's left to the plan)."""
    return jax.tree.map(lambda a: (1,) * np.ndim(a) if np.ndim(a) else None, tree)


def _taken_whole(**options):
    """The step with its parameters and state taken whole (and the batch's rows cut)."""
    params, state, _ = _args()
    whole = _whole(params), _whole(state)
    return js.parallelize(_step, devices=8, in_strategy=(*whole, (8, 1)), **options)


def _loop(step, calls: int = 3):
    """`calls` steps, each result fed back: the bytes moved before each call (after the first,
    which places the caller's arrays), and the final results."""
    params, state, x = _args()
    shardings = step.lower(params, state, x).compile().input_shardings[0]
    args, moved = jax.device_put((params, state, x), shardings), []
    for _ in range(calls):
        moved.append(moved_bytes(args, shardings))
        params, state, loss = step(*args)
        args = (params, state, args[2])
    return moved, (params, state, loss)


def test_out_strategy_keeps_its_layout_and_the_loop_pays_the_move():
    params, state, x = _args()
    out = ({"w": (8, 1)}, _whole(state), None)
    step = _taken_whole(out_strategy=out)
    moved, _ = _loop(step)
    assert moved[0] == 0.0 and moved[1] == moved[2] == pytest.approx(N * N * 4 * 7 / 8)
    plan = step.plan(params, state, x)
    assert plan.round_trip == moved[1]  # the plan prices what the loop moves
    assert "round trip: results that update arguments come back in other layouts than taken; a loop moves 14 KiB " \
           "per device before each next call" in " ".join(plan.summary().split())


def test_the_plan_prices_the_round_trip_of_the_parameters_it_returns_cut():
    """Without out_strategy the plan returns the updated parameters as the strategy cuts them (8 ways
    on rows), where it takes them whole: the plan says what the loop then moves, and the loop moves
    exactly that; with the results laid out as taken, nothing."""
    params, state, x = _args()
    step = _taken_whole()
    moved, _ = _loop(step)
    assert step.plan(params, state, x).round_trip == moved[1] == moved[2] == pytest.approx(N * N * 4 * 7 / 8)
    kept = _taken_whole(out_strategy=(_whole(params), _whole(state), None))
    moved, _ = _loop(kept)
    assert kept.plan(params, state, x).round_trip == moved[1] == moved[2] == 0.0


def test_moved_bytes_counts_what_each_device_lacks():
    mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(2, 4), ("a", "b"))
    x = jax.device_put(jnp.zeros((8, 8)), jax.sharding.NamedSharding(mesh, P("a", "b")))
    named = lambda *spec: jax.sharding.NamedSharding(mesh, P(*spec))
    assert moved_bytes(x, named("a", "b")) == 0.0
    assert moved_bytes(x, named("a")) == 4 * 8 * 4 - 4 * 2 * 4  # a row block, less the columns held
    assert moved_bytes(x, named()) == 8 * 8 * 4 - 4 * 2 * 4
    assert moved_bytes(np.zeros((8, 8), np.float32), named("a")) == 4 * 8 * 4  # from the host: all of it
