"""Tables 8 and 9: gradient accumulation (`accumulation_steps`, `accumulation_shard`) and
communication recompute (`optimizer_comm_recompute`) on the reference GPT with Adam, from the
compiled programs (`memory_analysis()`, the audit's collectives): deterministic figures."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
import optax

import jshard as js
from benchmarks._table import Table, size
from jshard import models

STEPS = 3
"""Train steps each row runs, for its losses."""
ROWS = 64
"""Batch rows: k = 8 leaves micro-batches of 8 rows, one per device."""
OPT = optax.adam(1e-3)


def _problem(cfg: models.GPTConfig):
    params = models.init_gpt(cfg, jax.random.key(0))
    rng = np.random.default_rng(1)
    return params, OPT.init(params), [models.copy_task_batch(rng, cfg, ROWS) for _ in range(STEPS)]


def _accumulating_step(cfg: models.GPTConfig):
    def step(params, state, batch):
        loss, grads = js.accumulate(jax.value_and_grad(lambda p, b: models.gpt_loss(p, b, cfg)))(params, batch)
        updates, state = OPT.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    return step


def _figures(step, params, state, batches) -> tuple[tuple[str, ...], list[float]]:
    """The compiled program's temp, argument and collective bytes, and the losses of `STEPS` steps."""
    compiled = step.lower(params, state, batches[0]).compile()
    memory, audit = compiled.memory_analysis(), js.audit(compiled)
    kinds = ", ".join(f"{k} {size(b)}" for k, (_, b) in sorted(audit.by_kind().items())) or "-"
    losses = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return (size(memory.temp_size_in_bytes), size(memory.argument_size_in_bytes), size(audit.bytes()), kinds), losses


def accumulation_table(cfg: models.GPTConfig = models.GPTConfig(n_layers=2), ks: Sequence[int] = (1, 2, 4, 8),
                       devices: int = 8) -> Table:
    """k micro-batches per step, data parallel on `devices`: the accumulator laid out as the
    gradients (without and with `optimizer=1`), and cut (`Accumulation(shard=True)`)."""
    params, state, batches = _problem(cfg)
    cut = dict(optimizer=js.OptimizerParallel(1, threshold="16KiB"))
    configs = (("as the gradients", {}, False), ("as the gradients, optimizer=1", cut, False),
               ("cut, optimizer=1", cut, True))
    rows, reference = [], None
    for how, extra, shard in configs:
        for k in ks:
            if k == 1 and shard:  # no accumulator: the row above
                continue
            step = js.parallelize(_accumulating_step(cfg), devices=devices, mode="data", accumulation=js.Accumulation(k, shard=shard),
                                  **extra)
            cells, losses = _figures(step, params, state, batches)
            reference = reference or losses
            diff = max(abs(a - b) for a, b in zip(losses, reference))
            rows.append((str(k), str(ROWS // k), how if k > 1 else how.replace("as the gradients", "none (full batch)"),
                         *cells, f"{diff:.2g}"))
    return Table(
        "11. Gradient accumulation: k micro-batches per step",
        "the losses of k micro-batches equal the full batch's (f32 rounding); temp memory falls with k; the "
        "gradients reduced once per step",
        ("k", "micro-batch rows", "accumulator", "temp", "arguments", "collectives", "by kind", "max |loss - k=1 loss|"),
        tuple(rows),
        (
            f"GPT ({cfg.n_layers} layers, d_model {cfg.d_model}, seq {cfg.seq_len}) with Adam, {ROWS} rows, data "
            f"parallel on {devices} simulated CPU devices, {STEPS} steps; the step calls "
            f"`js.accumulate(jax.value_and_grad(loss))` under `parallelize(..., accumulation=k)`.",
            "Collective bytes per step from the compiled HLO (loops weighted by their trip count). Accumulator "
            "as the gradients: each device sums its own micro-batches (the loop in a shard_map manual over the "
            "batch's axes) and one all-reduce after the loop reduces them, so the all-reduce bytes are those of "
            "k = 1. Cut: each micro-batch's gradients above the threshold are reduce-scattered into the cut carry "
            "(k reduce-scatters), the small ones all-reduced once.",
            "Accumulation(shard=True) (last rows) cuts the scan's accumulated gradients over the data-parallel "
            "axes, as optimizer_parallel cuts the state they update (MindSpore's gradient_accumulation_shard "
            "asks for its parallel optimizer too); compare with the rows of the same k and optimizer=1.",
        ),
    )


def comm_recompute_table(cfg: models.GPTConfig = models.GPTConfig(n_layers=2), devices: int = 8) -> Table:
    """Optimizer parallel level 3 with and without `optimizer_comm_recompute`."""
    params, state, batches = _problem(cfg)
    train = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), OPT)
    rows, reference = [], None
    for again in (False, True):
        step = js.parallelize(train, devices=devices, mode="data", optimizer=js.OptimizerParallel(3, threshold="16KiB", comm_recompute=again))
        compiled = step.lower(params, state, batches[0]).compile()
        gathers = js.audit(compiled).by_kind().get("all-gather", (0, 0.0))
        cells, losses = _figures(step, params, state, batches)
        reference = reference or losses
        rows.append(("on" if again else "off", cells[0], f"{gathers[0]:.0f}", size(gathers[1]), cells[2],
                     f"{max(abs(a - b) for a, b in zip(losses, reference)):.2g}"))
    return Table(
        "12. Communication recompute: optimizer parallel level 3 gathers parameters again in the backward pass",
        "more all-gather bytes for less temp memory; the same losses",
        ("optimizer_comm_recompute", "temp", "all-gathers", "all-gather bytes", "collectives", "max |loss - off loss|"),
        tuple(rows),
        (
            f"GPT ({cfg.n_layers} layers) with Adam, {ROWS} rows, `optimizer=3` (threshold 16 KiB) on "
            f"{devices} simulated CPU devices, {STEPS} steps; figures from the compiled programs.",
        ),
    )
