"""Table: host and device together. One MLP train step (Adam, data parallel over the devices)
with nothing offloaded, the optimizer state offloaded, optimizer state and parameters offloaded,
and the activations offloaded (`recompute(policy="offload")`): per device, the bytes the device
holds between steps, the bytes in host memory, the bytes moved per step, the step time and its
ratio to nothing offloaded, and whether the losses equal one device's.

On CPU the device's and the host's memory are one RAM, and XLA:CPU compiles a move between them to
nothing, so the device bytes are read from the compiled program's argument shardings (their memory
kinds) and the plan, not from a memory counter; the step times measure jshard's program, not a
transfer.
"""

from __future__ import annotations

import math
import statistics

import jax
import numpy as np
import optax

import jshard as js
from benchmarks._compiled import loss_check
from benchmarks._table import Table, size
from benchmarks._timing import interleaved
from jshard import models
from jshard.graph import flatten

CASES = ("nothing offloaded", "optimizer offloaded", "optimizer + parameters", "activations")
OFFLOAD = {"optimizer offloaded": ("optimizer",), "optimizer + parameters": ("optimizer", "parameters")}
CFG = models.MLPConfig(d_in=128, d_hidden=512, d_out=64, n_layers=2)
BATCH, STEPS = 64, 3
OPT = optax.adam(1e-3)


def hetero_table(devices: int, rounds: int = 10, budget: float = 20.0) -> Table:
    """The table, measured on `devices` devices (`rounds` rounds of one step per case, rotating)."""
    params = models.init_mlp(CFG, jax.random.key(0))
    state = OPT.init(params)
    rng = np.random.default_rng(1)
    batches = [models.mlp_batch(rng, CFG, BATCH) for _ in range(STEPS)]
    reference = _losses(jax.jit(_step(False)), params, state, batches)
    steps = {case: js.parallelize(_step(case == "activations"), devices=devices, mode="data",
                                  offload=OFFLOAD.get(case, ())) for case in CASES}
    losses = {case: _losses(step, params, state, batches) for case, step in steps.items()}
    placed = {case: step(params, state, batches[0])[:2] for case, step in steps.items()}  # state as the loop holds it
    times, _ = interleaved([lambda s=s, c=c: jax.block_until_ready(s(*placed[c], batches[0])) for c, s in steps.items()],
                           rounds, budget)
    base = statistics.median(t[0] for t in times)
    rows = []
    for k, (case, step) in enumerate(steps.items()):
        device, host, moved = _placement(step, params, state, batches[0], devices, case == "activations")
        median = statistics.median(t[k] for t in times)
        worst = max(zip(losses[case], reference), key=lambda p: abs(p[0] - p[1]))
        rows.append((case, size(device), size(host), size(moved), f"{median * 1e3:.2f} ms (n={len(times)})",
                     f"{median / base:.2f}", loss_check(*worst)))
    return Table(
        f"13. Host and device: an MLP train step ({devices} devices, data parallel, Adam)", "",
        ("case", "device bytes / device between steps", "host bytes / device", "moved host<->device / step",
         "step time", "ratio", f"loss vs one device ({STEPS} steps)"),
        tuple(rows),
        (f"MLP {CFG.d_in}-{CFG.d_hidden}-{CFG.d_in}-{CFG.d_out}, batch {BATCH}; device bytes: the parameter and "
         "optimizer-state arguments the compiled program takes in device memory (memory kind `device`), host "
         "bytes: those in `pinned_host` (`plan.offload`); activations: the residuals the offload policy moves to "
         "host in the forward (device_put to host in the step's jaxpr, per device: cut by the batch), moved both ways.",
         "Step time on CPU, where host and device share one RAM and the moves compile to nothing: the ratio is "
         "jshard's overhead for the offloaded program, not the cost of a transfer (on a GPU, the moved bytes "
         "over the host<->device bandwidth).",
         f"Loss: of the {STEPS} steps, the one that differs most from one device's, as a relative difference."),
    )


def _step(offload_activations: bool):
    apply = js.recompute(models.mlp_apply, policy="offload") if offload_activations else models.mlp_apply

    def loss(params, batch):
        x, y = batch
        return ((apply(params, x) - y) ** 2).mean()

    return models.make_train_step(loss, OPT)


def _losses(step, params, state, batches) -> list[float]:
    out = []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        out.append(float(loss))
    return out


def _placement(step, params, state, batch, devices: int, activations: bool) -> tuple[float, float, float]:
    """Per device: state bytes in device memory and in host memory between steps, bytes moved per step."""
    shardings = jax.tree.leaves(step.lower(params, state, batch).compile().input_shardings[0][:2])
    leaves = jax.tree.leaves((params, state))
    held = {kind: sum(_bytes(x) / _ways(sh, x) for x, sh in zip(leaves, shardings) if sh.memory_kind == kind)
            for kind in ("device", "pinned_host")}
    report = step.plan(params, state, batch).offload
    moved = report.moved_bytes if report is not None else 0.0
    if activations:
        offloaded = _offloaded_residuals(step.fn, params, state, batch) / devices  # the batch is cut `devices` ways
        return held["device"], offloaded, 2 * offloaded
    return held["device"], held["pinned_host"], moved


def _offloaded_residuals(fn, params, state, batch) -> float:
    """Bytes the step's jaxpr moves to host memory (the offload policy's residuals)."""
    jaxpr = jax.make_jaxpr(fn)(params, state, batch).jaxpr
    return float(sum(_bytes(v.aval) for node in flatten(jaxpr) if node.primitive == "device_put"
                     for v in node.eqn.outvars if v.aval.memory_space == jax.memory.Space.Host))


def _bytes(x) -> float:
    return float(math.prod(x.shape) * np.dtype(x.dtype).itemsize)


def _ways(sharding, x) -> int:
    return math.prod(np.shape(x)) // math.prod(sharding.shard_shape(np.shape(x))) if np.ndim(x) else 1
