"""`python -m benchmarks._pipeline_stacked_inner`: strategies inside the stages of a stacked `jshard.Pipeline` (issue 17 item 3).

The reference GPT of table 17 (8 blocks, d_model 64, `scan=True`, batch 64) as
`models.gpt_pipeline(cfg, preset)`, S = 2 stages of 4 simulated CPU devices, M = 4: its matmuls
written with `jshard.shard` tuples over a stage's 4 devices, the rows cut 4 ways (data parallel as
tuples), Megatron's column / row cut at mp = 4, or both at 2 × 2. Per case: the all-reduces and
all-gathers the audit reads per step (loops weighted by their trip counts), what one reduction
per step sums (a stage's layers and its packed row of the embedding or head, the wider), compiled
temp memory per device, and loss and gradients against the one-device step. Deterministic figures
from compiled programs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jshard as js
from benchmarks._table import Table, size
from jshard import models

ROWS = 64
CASES = (("dp = 4 (rows cut by tuples)", models.Preset("data", 4, 1), "gpipe"),
         ("dp = 4 (rows cut by tuples)", models.Preset("data", 4, 1), "1f1b"),
         ("mp = 4 (Megatron tuples)", models.Preset("tensor", 1, 4), "1f1b"),
         ("dp 2 × mp 2", models.Preset("2d", 2, 2), "1f1b"))


def stacked_inner_table() -> Table:
    """The cases (see the module docstring), on 8 devices."""
    cfg = models.GPTConfig(n_layers=8, scan=True)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, ROWS)
    ref = jax.jit(jax.value_and_grad(lambda p, b: models.gpt_loss(p, b, cfg)))(params, batch)
    nbytes = lambda *keys: sum(a.nbytes for k in keys for a in jax.tree.leaves(params[k]))
    once = nbytes("layers") // 2 + max(nbytes("embed", "pos"), nbytes("ln_f", "head"))
    out = []
    for name, preset, schedule in CASES:
        step = js.parallelize(models.gpt_pipeline(cfg, preset), devices=8, pipeline=js.Pipelining(stages=2, micro_batches=4, schedule=schedule))
        got = step(params, batch)
        compiled = step.compile(params, batch)
        kinds = js.audit(compiled).by_kind()
        err = max(float(jnp.abs(a - b).max() / jnp.abs(b).max()) for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(ref)))
        count = lambda kind: "{:.0f} ({})".format(kinds.get(kind, (0, 0))[0], size(kinds.get(kind, (0, 0))[1]))
        out.append((name, schedule, count("all-reduce"), count("all-gather"),
                    size(compiled.memory_analysis().temp_size_in_bytes), f"{err:.1e}"))
    return Table(
        "Strategies inside a stacked pipeline's stages: data-parallel tuples reduced once per step",
        f"dp: one all-reduce of {size(once)} per step (a stage's layers and its wider end row) and the loss's; "
        f"equal to one device",
        ("inside each stage", "schedule", "all-reduces (bytes)", "all-gathers (bytes)", "temp / device",
         "max |x - 1 device| / max |x|"),
        tuple(out),
        (f"GPT of 8 blocks (d_model {cfg.d_model}, d_ff {cfg.d_ff}), batch {ROWS}; S = 2, M = 4, 8 devices (4 a stage).",
         "dp: the rows' axes run manual (found as for a step cut by tags); each device sums its own rows' "
         "gradients over the schedule's loop, and one all-reduce per step sums them (the other is the loss's). "
         "mp: the stage's axes cut parameters and stay automatic, so XLA reduces what they leave partial per "
         "micro-batch (Megatron's row-cut sums); the rows are whole over the mp axes, the stack held as the tuples "
         "cut it, so no activation is gathered; 2 × 2: the dp axis runs manual, the mp axis stays automatic. "
         "The audit counts every branch of a tick's switch (forward and backward) at every tick."),
    )


if __name__ == "__main__":
    js.simulate_devices(8)
    print(stacked_inner_table().markdown())
