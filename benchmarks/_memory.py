"""Tables 8-10: making big models fit. The GPT-3 175B plan under an 80 GiB budget (recompute chosen
by the search) against the compute bound; optimizer parallel levels x recompute policies on the
reference GPT, compiled; `jax.checkpoint` per layer under jshard against `jax.jit` of the same
shardings, compiled temporary memory.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

import jax
import numpy as np
import optax

import jshard as js
from benchmarks._compiled import loss_check
from benchmarks._table import Table, size
from benchmarks._timing import interleaved, timed
from jshard import models
from jshard.cost import CostModel

GPT3 = models.GPTConfig(vocab=50257, seq_len=2048, d_model=12288, n_heads=96, n_layers=96, d_ff=49152, scan=True,
                        recompute="auto")
GPT3_BATCH, GPT3_DEVICES, GPT3_BUDGET, GPT3_DEVICE = 1536, 1024, 80 * 2**30, "H100"
MEGATRON_FRACTION = 0.52
"""Megatron-LM's GPT-3 175B on 1024 A100s (Narayanan et al., SC '21, table 1): 163 TFLOP/s per GPU
of a 312 TFLOP/s peak, with full activation recompute."""
CHECKPOINT_TARGET = 1.05
"""jshard's compiled temporary memory over `jax.jit`'s with the same shardings, at most."""

SMALL_GPT = models.GPTConfig(vocab=64, seq_len=128, d_model=128, n_heads=4, n_layers=2, d_ff=512, scan=True)
SMALL_BATCH = 32
LEVELS = (None, 1, 2, 3)
POLICIES = ("none", "selective", "full")


def model_flops(cfg: models.GPTConfig, batch: int) -> float:
    """A GPT train step's FLOPs without recompute: 3x the forward's matmuls (the backward does two
    per forward one): per layer the projections `2·B·S·(4·D² + 2·D·F)` and attention `4·B·S²·D`, and
    the logits `2·B·S·D·V`."""
    b, s, d, f = batch, cfg.seq_len, cfg.d_model, cfg.d_ff
    forward = cfg.n_layers * (2 * b * s * (4 * d * d + 2 * d * f) + 4 * b * s * s * d) + 2 * b * s * d * cfg.vocab
    return 3.0 * forward


def gpt3_table() -> Table:
    """Plans the GPT-3 175B-shaped scanned train step (its block `recompute="auto"`) for 1024 H100s
    under an 80 GiB budget on an abstract mesh, as `jshard plan gpt-scan ... --memory-budget 80GiB`."""
    cfg, cost = GPT3, CostModel.for_device(GPT3_DEVICE)
    optimizer = optax.adam(1e-3)
    params = jax.eval_shape(lambda key: models.init_gpt(cfg, key), jax.random.key(0))
    tokens = jax.ShapeDtypeStruct((GPT3_BATCH, cfg.seq_len), np.int32)
    args = (params, jax.eval_shape(optimizer.init, params),
            (tokens, tokens, jax.ShapeDtypeStruct((GPT3_BATCH, cfg.seq_len), np.float32)))
    step = js.parallelize(models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer),
                          devices=GPT3_DEVICES, mode="auto", search=js.Search(memory_budget=GPT3_BUDGET), cost_model=cost,
                          donate_argnums=(0, 1))
    took, plan = timed(lambda: step.plan(*args))
    report = plan.search
    bound = model_flops(cfg, GPT3_BATCH) / (GPT3_DEVICES * cost.flops)
    rows = []
    for w in report.recompute:
        if w.seconds is None:
            rows.append((w.policy, "no plan fits", f"{size(w.peak_bytes)} at least", "-", "-", ""))
            continue
        rows.append((w.policy, f"{w.seconds:.2f} s", size(w.peak_bytes), f"{bound:.2f} s", f"{bound / w.seconds:.1%}",
                     "chosen" if w.chosen else ""))
    fits = report.peak_bytes <= GPT3_BUDGET
    return Table(
        f"8. GPT-3 175B on {GPT3_DEVICES} {GPT3_DEVICE}s under an 80 GiB budget: recompute chosen by the search",
        "a plan whose estimated peak is <= 80 GiB per device, planned in under a minute",
        ("recompute", "predicted step", "estimated peak / device", "compute bound", "compute bound / predicted", ""),
        tuple(rows),
        (
            f"`jshard plan gpt-scan --layers 96 --d-model 12288 --heads 96 --seq-len 2048 --batch 1536 --vocab 50257 "
            f"--d-ff 49152 --devices 1024 --memory-budget 80GiB --device H100`, in process: planned in {took:.1f} s "
            f"on an abstract mesh ({'fits' if fits else 'OVER BUDGET'}: {size(report.peak_bytes)} per device); "
            f"{report.search} search over mesh {report.mesh}, {report.status}.",
            "The scanned GPT marks its block `jshard.recompute(policy='auto')`: the search traced the step once per "
            "policy, searched each under the budget, and kept the fastest that fits. A policy whose least possible "
            "peak (every tensor cut as finely as its dims allow) exceeds the budget is dropped before searching.",
            f"compute bound: model FLOPs (3x the forward's matmuls, no recompute: {model_flops(cfg, GPT3_BATCH):.3g}) "
            f"/ ({GPT3_DEVICES} x {cost.flops / 1e12:g} TFLOP/s, the H100's dense bf16 peak). predicted step: the "
            "cost model's (alpha-beta collectives at the H100's NVLink rate on every mesh axis, compute at peak, the "
            "recomputed forward included): a model, not a measurement, and the model is float32.",
            f"Megatron-LM reached about {MEGATRON_FRACTION:.0%} of peak on this model with 1024 A100s (Narayanan et "
            "al. 2021, measured, with pipeline parallelism and an interconnect slower across nodes). jshard's "
            "predicted fraction above is an upper estimate: its cost model has one bandwidth for all axes, no "
            "pipeline bubble, no kernel inefficiency, and estimates memory only at top-level program points (a "
            "scanned layer's own temporaries, about one layer's recomputed activations, come on top).",
        ),
    )


@dataclasses.dataclass(frozen=True)
class _Case:
    level: int | None
    policy: str
    compiled: object
    args: tuple
    loss: float


def _gpt_step(policy: str | None):
    cfg = dataclasses.replace(SMALL_GPT, recompute=None if policy == "none" else policy)
    optimizer = optax.adam(1e-3)
    step = models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optimizer)
    params = models.init_gpt(cfg, jax.random.key(0))
    args = (params, optimizer.init(params), models.copy_task_batch(np.random.default_rng(0), cfg, SMALL_BATCH))
    return step, args


def optimizer_recompute_table(devices: int, rounds: int, budget: float) -> Table:
    """Optimizer parallel levels 0-3 x recompute none/selective/full, data parallel on `devices`."""
    step, args = _gpt_step("none")
    reference = float(jax.jit(step)(*args)[2])
    cases = []
    for level in LEVELS:
        for policy in POLICIES:
            step, args = _gpt_step(policy)
            parallel = js.parallelize(step, devices=devices, mode="data", optimizer=level)
            compiled = parallel.lower(*args).compile()
            placed = jax.device_put(args, parallel.plan(*args).in_shardings)
            cases.append(_Case(level, policy, compiled, placed, float(compiled(*placed)[2])))
    calls: list[Callable] = [lambda c=c: jax.block_until_ready(c.compiled(*c.args)) for c in cases]
    for call in calls:
        call()
    steps, _ = interleaved(calls, rounds, budget)
    base = cases[0]
    rows = []
    for i, c in enumerate(cases):
        a, b = js.audit(c.compiled), js.audit(base.compiled)
        ratio = statistics.median(r[i] / r[0] for r in steps)
        rows.append((str(c.level or 0), c.policy, size(a.memory.peak_bytes), f"{a.memory.peak_bytes / b.memory.peak_bytes:.2f}",
                     size(a.bytes()), f"{statistics.median(r[i] for r in steps) * 1e3:.2f} ms", f"{ratio:.2f}",
                     loss_check(c.loss, reference)))
    cfg = SMALL_GPT
    return Table(
        f"9. Optimizer parallel x recompute: the reference GPT, Adam, data parallel, {devices} devices, compiled",
        "",
        ("optimizer parallel", "recompute", "peak / device", "peak vs 0/none", "collective bytes/step", "step",
         "step vs 0/none", "loss vs one device"),
        tuple(rows),
        (
            f"GPT (jshard.models) with {cfg.n_layers} layers under `lax.scan`, d_model {cfg.d_model}, d_ff {cfg.d_ff}, "
            f"seq_len {cfg.seq_len}, vocab {cfg.vocab}, batch {SMALL_BATCH}; `jshard.parallelize(step, "
            f"devices={devices}, mode='data', optimizer=level)` (0: off), each block "
            "`jshard.recompute(block, policy=...)` (`GPTConfig.recompute`; none: not wrapped). No donation.",
            "Scanned, because XLA:CPU undoes recompute in an unrolled program: it drops the optimization barriers "
            "`jax.checkpoint` leaves and merges the recomputed forward with the first (common-subexpression "
            "elimination); the same unrolled GPT compiles to the same temporary memory with and without "
            "`jax.checkpoint`, under plain `jax.jit` on one device too. A loop body's recompute cannot be merged.",
            "peak: the compiled program's argument + output + temp - alias bytes per device (`jshard.audit`); "
            "collective bytes: what it moves per step (HLO, loops weighted by trip count).",
            f"step: the compiled programs called directly on placed arguments, {len(steps)} rounds of one step "
            "each in rotating order; medians, and the median of per-round ratios to level 0 / none. On 8 CPU "
            "stand-in devices of 2 cores the step time is mostly the host's, so only large ratios mean much; "
            "here recompute ran faster than keeping the activations (smaller buffers for a memory-bound host), "
            "which a GPU, bound by compute, would not show.",
        ),
    )


def checkpoint_table(devices: int) -> Table:
    """A GPT with `jax.checkpoint` per layer: compiled temporary memory under jshard against
    `jax.jit` of the same step with the shardings jshard's plan gives it, in three modes."""
    step, args = _gpt_step("full")
    reference = float(jax.jit(step)(*args)[2])
    rows = []
    for mode in ("data", "semi_auto", "auto"):
        parallel = js.parallelize(step, devices=devices, mode=mode)
        plan = parallel.plan(*args)
        ours = parallel.lower(*args).compile()
        plain = jax.jit(step, in_shardings=plan.in_shardings, out_shardings=plan.out_shardings).lower(*args).compile()
        a, b = js.audit(ours).memory, js.audit(plain).memory
        ratio = a.temp_bytes / b.temp_bytes
        rows.append((mode, size(a.temp_bytes), size(b.temp_bytes), f"{ratio:.3f}",
                     "meets" if ratio <= CHECKPOINT_TARGET else "misses",
                     loss_check(float(ours(*jax.device_put(args, plan.in_shardings))[2]), reference)))
    return Table(
        f"10. jax.checkpoint per layer: compiled temporary memory, jshard against jax.jit, {devices} devices",
        f"jshard / jax.jit <= {CHECKPOINT_TARGET:g}",
        ("mode", "jshard temp / device", "jax.jit temp / device", "ratio", "target", "loss vs one device"),
        tuple(rows),
        (
            "The table-9 GPT (scanned) with each block under `jax.checkpoint` (`jshard.recompute(block, policy='full')`). "
            "jax.jit: the same train step under `jax.jit(step, in_shardings=plan.in_shardings, "
            "out_shardings=plan.out_shardings)`, so the two differ only by jshard's constraints inside (the remat "
            "regions rebuilt around them). temp: XLA's temporary buffers per device (`memory_analysis`).",
            "auto: its plan is not the one `jax.jit` propagates from the same arguments' shardings. On this "
            "microsecond step the search (the alpha-beta model, no budget) cuts the batch 2 ways inside the "
            "layers and computes each half on 4 devices, fewer collectives; `jax.jit`'s propagation cuts it 8 "
            "ways from the arguments. The extra temporaries are that choice's activations (the scores' mask "
            "and fill, 16 rows per device where `jax.jit` holds 4), not the constraints.",
        ),
    )


def memory_tables(devices: int, rounds: int, budget: float) -> list[Table]:
    """Tables 8-10."""
    return [gpt3_table(), optimizer_recompute_table(devices, rounds, budget), checkpoint_table(devices)]
