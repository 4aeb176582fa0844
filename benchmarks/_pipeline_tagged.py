"""`python -m benchmarks --only pipeline`: a step cut at `pipeline_stage` tags (issue 17), every schedule.

The reference GPT (4 blocks, d_model 64, batch 64), unrolled and tagged (`models.gpt_staged_loss`:
the embedding with the first blocks on stage 0, the last blocks with the head on the last stage),
on 8 simulated CPU devices as S stages × 8/S-way data parallel, for GPipe, 1F1B and zero bubble
(ZB-H1) at S in {2, 4}, M in {4, 16}: the issue's matrix. Per cell: the tick table's bubble against
its theory, loss and gradients against the one-device step, compiled temp memory per device (and
against GPipe's at the same S, M), collective-permute bytes per device from the audit (loops
weighted by their trip counts) against what must cross (M activations forward and M gradients back
per boundary), and each stage's parameter bytes against the packed parameters a device holds.
Deterministic figures from compiled programs. `python -m benchmarks._pipeline_tagged` prints it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

import jshard as js
from benchmarks._table import Table, size
from jshard import models

SCHEDULES = ("gpipe", "1f1b", "zb-h1", "interleaved")
CELLS = tuple((name, s, m) for s in (2, 4) for m in (4, 16) for name in SCHEDULES if name != "interleaved" or s == 2)
"""(schedule, S, M); interleaved at S=2 with v=2 chunks each (4 tagged stages of the 4-block GPT)."""


def pipeline_table(cfg: models.GPTConfig = models.GPTConfig(n_layers=4), rows: int = 64,
                   cells: tuple[tuple[str, int, int], ...] = CELLS) -> Table:
    """The matrix of `cells` (default `CELLS`) on the tagged reference GPT (see the module docstring)."""
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, rows)
    out, gpipe_temp = [], {}
    for name, stages, micro in cells:
        v = 2 if name == "interleaved" else 1
        loss = models.gpt_staged_loss(cfg, stages * v)
        ref_loss, ref_grads = jax.jit(jax.value_and_grad(loss))(params, batch)
        step = js.parallelize(loss, devices=8, pipeline=js.Pipelining(stages=stages, micro_batches=micro, schedule=name, virtual_stages=v))
        got_loss, got_grads = step(params, batch)
        compiled = step.compile(params, batch)
        program = step.program(params, batch)
        temp = compiled.memory_analysis().temp_size_in_bytes
        gpipe_temp.setdefault((stages, micro), temp)
        act = program.cut.boundary[0]
        must = 2 * micro * v * sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in act)
        moved = js.audit(compiled).by_kind().get("collective-permute", (0, 0))[1]
        grad_err = max(float(jnp.abs(a - b).max() / jnp.abs(b).max())
                       for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(ref_grads)))
        held = v * max(program.stage_bytes())
        sch = program.schedule
        out.append((name if v == 1 else f"{name} v={v}", str(stages), str(micro), f"{sch.bubble_fraction:.3f} / {sch.theoretical_bubble:.3f}",
                    f"{abs(float(got_loss) - float(ref_loss)):.1e}", f"{grad_err:.1e}", size(temp),
                    f"{temp / gpipe_temp[(stages, micro)]:.2f}", f"{moved / must:.2f}",
                    " / ".join(size(b) for b in program.stage_bytes()),
                    f"{size(held)} of {size(sum(a.nbytes for a in jax.tree.leaves(params)))}"))
    return Table(
        "16. Pipeline stages cut from a tagged step: GPipe, 1F1B, zero bubble and interleaved, 8 devices",
        "loss and gradients equal one device (within 1e-5); 1F1B temp <= 0.5x GPipe's at S=4, M=16; zero "
        "bubble's bubble below 1F1B's; permute bytes <= 1.1x what must cross; a device holds its stage's "
        "parameters only",
        ("schedule", "S", "M", "bubble / theory", "|loss - 1 device|", "max |grad - 1 device| / max |grad|",
         "temp", "temp / GPipe's", "permute bytes / must cross", "stage parameter bytes", "packed per device"),
        tuple(out),
        (
            f"GPT ({cfg.n_layers} blocks, d_model {cfg.d_model}, seq {cfg.seq_len}, vocab {cfg.vocab}), {rows} rows, "
            "unrolled and tagged with `js.pipeline_stage` (`models.gpt_staged_loss`), run by "
            "`parallelize(loss, devices=8, pipeline=js.Pipelining(S, M, schedule=...))`; each stage's "
            "8/S devices cut the micro-batch rows (data parallel, gradients reduced once per step).",
            "Bubble: the idle share of the tick table, every operation one tick (zero bubble's backward is two: "
            "B, the input gradient, and W, the weight gradient). Theory (S-1)/(M+S-1); zero bubble (S-1)/(3M+S-1); "
            "interleaved (S-1)/(vM+S-1), its 4 tagged stages on 2 device groups (stage k on group k mod 2).",
            "Zero bubble splits each stage's backward at its equations (`pipeline/_split.py`): B stores for its W "
            "the values W reads that B made (mostly the gradients of the stage's matmul outputs), so every "
            "equation runs once; that store is the temp memory it adds over 1F1B.",
            "Must cross: M activations forward and M gradients back per boundary, per device (one micro-batch's "
            "rows on one device; interleaved: a device sends from each of its v chunks, so v times that); the collective-permute bytes per device are read from the compiled HLO by "
            "`js.audit`, loops weighted by their trip counts: the busiest device's sends (a permute counts on "
            "its sources only). Each permute carries only the pairs whose source sends at that tick.",
            "Stage parameter bytes: each (tagged) stage's own (`StagedProgram.stage_bytes`); a device holds the "
            "largest stage's share (its row of the packed `[S, width]` buffer; interleaved: its v rows), not the model.",
        ),
    )


def main() -> None:
    print(pipeline_table().markdown())


if __name__ == "__main__":
    js.simulate_devices(8)
    main()
