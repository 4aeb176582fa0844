"""Train steps for the reference models, plain and parallelized with a preset."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import optax

from jshard._parallelize import Parallelized, parallelize
from jshard.models._presets import Preset


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array], optimizer: optax.GradientTransformation):
    """`step(params, opt_state, batch) -> (params, opt_state, loss)`: one optimizer step."""

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def state_strategies(param_strategies, params, opt_state):
    """Lays out optimizer state like the parameter it tracks (same path suffix and shape).

    Leaves that track no parameter (step counters) are left to the default (replicated).
    """
    by_path = {
        tuple(path): (leaf.shape, strategy)
        for (path, leaf), strategy in zip(
            jax.tree_util.tree_flatten_with_path(params)[0], jax.tree_util.tree_leaves(param_strategies)
        )
    }

    def one(path, leaf):
        for n in range(len(path)):
            hit = by_path.get(tuple(path[n:]))
            if hit is not None and hit[0] == leaf.shape:
                return hit[1]
        return None

    return jax.tree_util.tree_map_with_path(one, opt_state)


def parallel_train_step(
    loss_fn: Callable[[Any, Any, Preset | None], jax.Array],
    optimizer: optax.GradientTransformation,
    params: Any,
    opt_state: Any,
    batch: tuple,
    preset: Preset,
    rules: Mapping[str, str],
) -> Parallelized:
    """The train step under `preset`: its matmuls sharded, parameters and optimizer state laid out
    to match them, the batch cut `dp` ways; inputs and outputs keep the same layouts."""
    step = make_train_step(lambda p, b: loss_fn(p, b, preset), optimizer)
    p_strats = preset.parameters(params, rules)
    o_strats = state_strategies(p_strats, params, opt_state)
    b_strats = tuple(preset.batch(x.ndim) for x in batch)
    return parallelize(
        step,
        devices=preset.dp * preset.mp,
        in_strategy=(p_strats, o_strats, b_strats),
        out_strategy=(p_strats, o_strats, None),
    )
