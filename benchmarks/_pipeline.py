"""Table: the stacked pipeline (`jshard.Pipeline`) on the reference GPT (issues 5 and 17).

The GPT (8 blocks, d_model 64, 8 heads, d_ff 256, seq 16, vocab 32, `scan=True`, batch 64) on 8
simulated CPU devices as S stages × 8/S-way data parallel, M micro-batches, under GPipe and 1F1B at
S ∈ {2, 4}, M ∈ {4, 16}, and zero bubble (ZB-H1) and interleaved (v = 2) at S = 4, M = 16. Per
case: the bubble fraction against the theory, compiled temp and argument memory per
device (`memory_analysis()`), collective-permute bytes per device from the audit (loops weighted by their
trip counts) against what must cross per device (M activations forward and M gradients back, per
boundary) and against the floor of a program that permutes tick by tick (`Schedule.tick_permutes`),
and the loss against the one-device step. Deterministic figures from compiled programs.
`python -m benchmarks --only pipeline` writes it into BENCHMARKS.md; `python -m benchmarks._pipeline`
prints it.
"""

from __future__ import annotations

import jax
import numpy as np

import jshard as js
from benchmarks._compiled import loss_check
from benchmarks._table import Table, size
from jshard import models

CASES = tuple((name, s, m, 1) for name in ("gpipe", "1f1b") for s in (2, 4) for m in (4, 16)) + (
    ("zb-h1", 4, 16, 1), ("interleaved", 4, 16, 2))
ROWS = 64


def pipeline_table(devices: int) -> Table:
    """The table, measured on `devices` devices."""
    cfg = models.GPTConfig(n_layers=8, scan=True)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, ROWS)
    pipe = models.gpt_pipeline(cfg)
    reference = float(jax.jit(lambda p, b: models.gpt_loss(p, b, cfg))(params, batch))
    rows, temps = [], {}
    whole = sum(a.nbytes for a in jax.tree.leaves(params))
    for name, s, m, v in CASES:
        step = js.parallelize(pipe, devices=devices, pipeline=js.Pipelining(stages=s, micro_batches=m, schedule=name, virtual_stages=v))
        compiled = step.compile(params, batch)
        plan = step.plan(params, batch)
        memory = compiled.memory_analysis()
        temps[name, s, m] = temp = memory.temp_size_in_bytes
        moved = js.audit(compiled).by_kind()["collective-permute"][1]
        must = 2 * m * plan.activation_bytes * (v if v > 1 else 1)  # an interleaved device has v boundaries
        floor = int(plan.schedule.sends(plan.schedule.tick_permutes()).max()) * plan.activation_bytes
        loss = float(step(params, batch)[0])
        if (name, s) == ("gpipe", 4):
            shares = step.stage_bytes(params, batch)
        label = name + (f" (v={v})" if v > 1 else "")
        rows.append((label, f"{s} × {m}", f"{plan.bubble_fraction:.4f} ({plan.schedule.theoretical_bubble:.4f})",
                     size(temp), size(memory.argument_size_in_bytes), size(moved), size(must), f"{moved / must:.3f}", f"{floor / must:.3f}",
                     loss_check(loss, reference)))
    ratio = temps["1f1b", 4, 16] / temps["gpipe", 4, 16]
    return Table(
        f"17. Pipeline parallel: the stacked reference GPT (8 blocks, batch {ROWS}), {devices} devices", "",
        ("schedule", "S × M", "bubble (theory)", "temp / device", "arguments / device", "permute bytes / device (audit)",
         "must cross / device", "permute / must", "tick-by-tick floor / must", "loss vs one device"),
        tuple(rows),
        (f"1F1B / GPipe temp memory at S = 4, M = 16: {ratio:.2f} (1F1B holds S micro-batches' residuals, "
         f"GPipe M).",
         f"Parameters outside the stack are held where they are used (the embedding on stage 0, the head on the "
         f"last stage; tied ones on both): the model's {size(whole)} of parameters, at S = 4 a stage holds "
         f"{' / '.join(size(b) for b in shares)} (stages 0 to 3); the arguments add the device's rows.",
         "Must cross: per boundary, M activations forward and M gradients back; per device, a middle stage's "
         "2·M activations (an interleaved device, v boundaries). The floor: permutes at every tick where "
         "something crosses and none elsewhere, each with only the pairs whose source sends at that tick, "
         "what the busiest device then sends (an end stage sends one way, hence 0.5 at S = 2).",
         "Audit convention: a collective-permute counts its operand bytes on the devices that are sources in "
         "its source-target pairs (0 elsewhere); the bytes per device are the busiest device's.",
         "Interleaved: the compiled program takes its stack in stage order (each stage's chunks side by side, "
         "`step.pack`), so no parameter moves in the step; `step(params, batch)` converts on the way in and out."),
    )


def main() -> None:
    js.simulate_devices(8)
    print(pipeline_table(8).markdown())


if __name__ == "__main__":
    main()
