"""`python -m benchmarks._pipeline`: the pipeline's figures on the reference GPT (issue 5).

The GPT (8 blocks, d_model 64, 8 heads, d_ff 256, seq 16, vocab 32, `scan=True`) on 8 simulated
CPU devices as 4 stages × 2-way data parallel, 16 micro-batches of 4 rows, under GPipe, 1F1B,
interleaved (v = 2) and zero bubble (ZB-H1). Per schedule: bubble fraction against the theory,
compiled temp memory (`memory_analysis()`), collective-permute bytes per device from the audit
against the plan's and against what must cross per device (2·M activations: M forward, M gradients
back), all-reduce bytes, compile and step time; and the one-device `value_and_grad` step for scale. Figures from compiled programs are deterministic; times are not
(a shared 2-core machine). Not part of `python -m benchmarks` (BENCHMARKS.md).
"""

from __future__ import annotations

import time

import jshard as js

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1))


def _timed(fn, reps=3):
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> None:
    js.simulate_devices(8)
    import jax
    import numpy as np

    from jshard import models

    cfg = models.GPTConfig(n_layers=8, scan=True)
    params = models.init_gpt(cfg, jax.random.key(0))
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 64)
    pipe = models.gpt_pipeline(cfg)
    print("schedule     bubble  theory  temp KiB  permute KiB (plan)  must cross KiB  permute/must  all-reduce KiB*  "
          "compile s  step s")
    temps = {}
    for name, v in SCHEDULES:
        step = js.parallelize(pipe, devices=8, pipeline_stages=4, micro_batches=16, schedule=name, virtual_stages=v)
        start = time.perf_counter()
        compiled = step.compile(params, batch)
        took = time.perf_counter() - start
        plan, report = step.plan(params, batch), js.audit(compiled).by_kind()
        temps[name] = compiled.memory_analysis().temp_size_in_bytes
        step_s = _timed(lambda: jax.block_until_ready(step(params, batch)))
        must = 2 * plan.schedule.micro_batches * plan.activation_bytes  # per device, both directions
        moved = report["collective-permute"][1]
        print(f"{name:12} {plan.bubble_fraction:.4f}  {plan.schedule.theoretical_bubble:.4f}  {temps[name] / 2**10:8.0f}  "
              f"{moved / 2**10:8.0f} ({plan.permute_bytes / 2**10:.0f})      {must / 2**10:8.0f}        "
              f"{moved / must:5.2f}         {report['all-reduce'][1] / 2**10:8.0f}      {took:6.1f}  {step_s:6.3f}")
    ref = jax.jit(jax.value_and_grad(lambda p, b: models.gpt_loss(p, b, cfg)))
    print(f"1F1B / GPipe temp memory: {temps['1f1b'] / temps['gpipe']:.2f}; ZB-H1 / 1F1B: {temps['zb-h1'] / temps['1f1b']:.2f}")
    print(f"one device value_and_grad step: {_timed(lambda: jax.block_until_ready(ref(params, batch))):.3f} s")
    print("* the audit counts every branch of a conditional, so all-reduce bytes are an upper bound")


if __name__ == "__main__":
    main()
