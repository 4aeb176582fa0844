"""`python -m benchmarks._pipeline_tagged`: a step cut at `pipeline_stage` tags (issue 17, items 1-3).

The reference GPT of `benchmarks._pipeline` (8 blocks, d_model 64, batch 64), unrolled and tagged
(`models.gpt_staged_loss`: the embedding with blocks 0-1 on stage 0, ..., blocks 6-7 with the head
on stage 3), on 8 simulated CPU devices as 4 stages × 2-way data parallel, 16 micro-batches. Per
schedule: compiled temp memory and argument bytes per device (the packed parameters: one stage's
share, against the whole model's), collective-permute and all-reduce bytes per device from the
audit (loops weighted by their trip counts), against what must cross stages (M activations forward
and M gradients back per boundary); and the loss against the one-device step. Deterministic
figures from compiled programs; not part of `python -m benchmarks` (BENCHMARKS.md).
"""

from __future__ import annotations

import jshard as js


def main() -> None:
    js.simulate_devices(8)
    import jax
    import numpy as np

    from jshard import models

    cfg = models.GPTConfig(n_layers=8)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 64)
    loss = models.gpt_staged_loss(cfg, 4)
    whole = sum(a.nbytes for a in jax.tree.leaves(params))
    ref_loss = float(jax.jit(loss)(params, batch))
    print(f"parameters {whole / 2**10:.0f} KiB in all; one-device loss {ref_loss:.6f}")
    print("schedule  stage shares KiB        args KiB/device  temp KiB  permute KiB  must cross KiB  all-reduce KiB*  loss")
    temps = {}
    for name in ("gpipe", "1f1b"):
        step = js.parallelize(loss, devices=8, pipeline_stages=4, micro_batches=16, schedule=name)
        compiled = step.compile(params, batch)
        memory, report = compiled.memory_analysis(), js.audit(compiled).by_kind()
        program = step.program(params, batch)
        temps[name] = memory.temp_size_in_bytes
        act = program.cut.boundary[0][0]
        per_device = int(np.prod(act.shape)) * act.dtype.itemsize  # one micro-batch's rows on one device
        must = 2 * 16 * per_device  # M activations forward and M gradients back, per boundary device
        shares = "/".join(f"{b / 2**10:.0f}" for b in program.stage_bytes())
        value = float(step(params, batch)[0])
        print(f"{name:9} {shares:22}  {memory.argument_size_in_bytes / 2**10:8.0f}         {temps[name] / 2**10:8.0f}  "
              f"{report['collective-permute'][1] / 2**10:8.0f}     {must / 2**10:8.0f}        "
              f"{report['all-reduce'][1] / 2**10:8.0f}      {value:.6f}")
    print(f"1F1B / GPipe temp memory: {temps['1f1b'] / temps['gpipe']:.2f}")
    print("* the audit counts every branch of a conditional, so all-reduce bytes are an upper bound")


if __name__ == "__main__":
    main()
