"""Table 14: model-parallel communication recompute (`jshard.recompute(..., mp_comm_recompute=...)`)
on a stack of Megatron blocks, from the compiled programs (`memory_analysis()`, the audit's
collectives): deterministic figures, and the gradients against one device."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import jshard as js
from benchmarks._table import Table, size

LAYERS, ROWS, D, F = 4, 2048, 64, 256
"""Blocks, batch rows, model width and hidden width: activations outweigh the weights."""


def megatron_block(name=lambda y: y):
    """A Megatron block `tanh(gelu(x @ w1) @ w2) + x` on a 2 x 4 device matrix: w1's columns over
    mp = 4 and x's rows over dp = 2, w2's rows (partial sums, all-reduced); `name` wraps the reduced
    value (e.g. `checkpoint_name`). tanh's backward needs that reduced value."""
    col = js.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)))
    row = js.shard(jnp.matmul, in_strategy=((2, 4), (4, 1)))

    def block(w1, w2, x):
        return jnp.tanh(name(row(jax.nn.gelu(col(x, w1)), w2))) + x

    return block


def stacked_grad(layer, layers: int = LAYERS):
    """The gradient in (w1, w2) of the mean square of `layers` applications of `layer(w1, w2, x)`."""
    def loss(w1, w2, x):
        for _ in range(layers):
            x = layer(w1, w2, x)
        return (x**2).mean()

    return jax.grad(loss, argnums=(0, 1))


WRAPS = (
    ("none (no recompute)", lambda: megatron_block()),
    ("jshard.recompute(block) (mp_comm_recompute=True)", lambda: js.recompute(megatron_block())),
    ("jshard.recompute(block, mp_comm_recompute=False)", lambda: js.recompute(megatron_block(), mp_comm_recompute=False)),
    ("by hand: checkpoint_name + save_only_these_names", lambda: jax.checkpoint(
        megatron_block(lambda y: checkpoint_name(y, "reduced")),
        policy=jax.checkpoint_policies.save_only_these_names("reduced"))),
)


def comm_recompute_table(devices: int = 8) -> Table:
    """No recompute, recompute with and without its collectives, and the same written by hand."""
    keys = jax.random.split(jax.random.key(0), 3)
    args = (jax.random.normal(keys[0], (D, F)) / D**0.5, jax.random.normal(keys[1], (F, D)) / F**0.5,
            jax.random.normal(keys[2], (ROWS, D)))
    want = jax.jit(stacked_grad(megatron_block()))(*args)
    rows = []
    for name, wrap in WRAPS:
        step = js.parallelize(stacked_grad(wrap()), devices=devices, mode="semi_auto")
        compiled = step.lower(*args).compile()
        audit = js.audit(compiled)
        diff = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(step(*args), want))
        rows.append((name, size(compiled.memory_analysis().temp_size_in_bytes), f"{audit.count('all-reduce'):.0f}",
                     size(audit.bytes("all-reduce")), size(audit.bytes("all-gather")), f"{diff:.2g}"))
    return Table(
        "14. Model-parallel communication recompute: a recompute region keeps its all-reduced values",
        "mp_comm_recompute=False: the all-reduce bytes of no recompute, the program written by hand",
        ("region", "temp", "all-reduces", "all-reduce bytes", "all-gather bytes", "max |grad - one device|"),
        tuple(rows),
        (
            f"{LAYERS} Megatron blocks tanh(gelu(x @ w1) @ w2) + x (w1 columns, w2 rows cut 4 ways, rows of x 2 "
            f"ways: a 2 x 4 device matrix), {ROWS} x {D} inputs, hidden {F}, on {devices} simulated CPU devices; "
            f"the gradients of a mean square; figures from the compiled programs.",
            "XLA:CPU's buffer assignment gains nothing from recompute here (the recomputed program holds more "
            "temp memory than the one without); keeping the reduced values sits between the two, equal to the "
            "program written by hand. XLA combines all-reduces, so their count moves less than their bytes.",
        ),
    )
