"""Tables 3 and 4: jshard against plain `jax.jit` of the same shardings, in one pass per model.

First trace + plan + compile time (pairs, caches cleared, order alternating), then step time
(rounds of single steps, order rotating) of four calls: the `Parallelized` step and the `jax.jit`
one as a user calls them, and the two `Compiled` programs of the last compile pair called directly,
which tells the programs' own speed from jshard's per-call work.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence

import jax

import jshard as js
from benchmarks._compiled import loss_check
from benchmarks._models import Workload
from benchmarks._plans import parallelized, same_shardings
from benchmarks._settings import Settings
from benchmarks._table import Table, seconds, size, verdict
from benchmarks._timing import interleaved

COMPILE_TARGET = 1.3
"""jshard's trace + plan + compile time over plain `jax.jit`'s trace + compile time, at most."""
STEP_TARGET = 1.02
"""jshard's step time over the hand-written program's, at most (median of paired ratios)."""
WARMUP = 5


@dataclasses.dataclass(frozen=True)
class Timings:
    """One model's measurements, per round: compiles `(jshard, jax.jit)` in seconds; steps
    `(jshard call, jax.jit call, jshard's compiled program, jax.jit's compiled program)` in seconds."""

    model: str
    compiles: list[tuple[float, ...]]
    steps: list[tuple[float, ...]]
    bytes: tuple[float, float]
    losses: tuple[float, float]


def measure(w: Workload, devices: int, s: Settings) -> Timings:
    args = w.args()
    plan = parallelized(w, devices).plan(*args)
    # Each compile builds its own `Parallelized` / `jax.jit` object: nothing is cached.
    compiles, (ours_compiled, plain_compiled) = interleaved(
        (lambda: parallelized(w, devices).lower(*args).compile(), lambda: same_shardings(w, plan, devices).lower(*args).compile()),
        s.compile_pairs, s.compile_budget, setup=jax.clear_caches,
    )
    ours, plain = parallelized(w, devices), same_shardings(w, plan, devices)
    placed = jax.device_put(args, plan.in_shardings)
    calls = [lambda f=f: jax.block_until_ready(f(*placed)) for f in (ours, plain, ours_compiled, plain_compiled)]
    for _ in range(WARMUP):
        losses = [float(call()[2]) for call in calls]
    steps, _ = interleaved(calls, s.step_rounds, s.step_budget)
    collective_bytes = js.audit(ours_compiled).bytes(), js.audit(plain_compiled).bytes()
    return Timings(w.name, compiles, steps, collective_bytes, (losses[0], losses[1]))


def compile_table(timings: Sequence[Timings], devices: int) -> Table:
    cells = []
    for t in timings:
        ratio = _median_ratio(t.compiles, 0, 1)
        cells.append((t.model, seconds(_column(t.compiles, 0)), seconds(_column(t.compiles, 1)), f"{ratio:.2f}",
                      verdict(ratio <= COMPILE_TARGET)))
    return Table(
        f"3. Trace + plan + compile time against plain jax.jit, {devices} devices",
        f"jshard / jit <= {COMPILE_TARGET:g}",
        ("model", "jshard: parallelize + lower + compile", "jax.jit: jit + lower + compile", "median ratio", "target"),
        tuple(cells),
        (
            "jshard: a fresh `jshard.parallelize(step, ...)`, `.lower(*args).compile()`: traces the step, plans it, "
            "traces the planned program and compiles it. jax.jit: a fresh `jax.jit(step, in_shardings=..., "
            "out_shardings=...)` with the shardings jshard's plan gives `jax.jit`, `.lower(*args).compile()`.",
            "`jax.clear_caches()` before every measurement (untimed); the two alternate which goes first; "
            "ratio: median over the pairs of jshard's time over jit's.",
        ),
    )


def step_table(timings: Sequence[Timings], devices: int) -> Table:
    cells = []
    for t in timings:
        ours, plain = statistics.median(_column(t.steps, 0)), statistics.median(_column(t.steps, 1))
        ratio = _median_ratio(t.steps, 0, 1)
        cells.append((
            t.model, f"{ours * 1e3:.2f} ms", f"{plain * 1e3:.2f} ms", f"{(ours - plain) * 1e6:+.0f} us", f"{ratio:.3f}",
            verdict(ratio <= STEP_TARGET), f"{_median_ratio(t.steps, 2, 3):.3f}", " / ".join(map(size, t.bytes)),
            str(len(t.steps)), loss_check(*t.losses),
        ))
    return Table(
        f"4. Step time against the hand-written program, {devices} devices",
        f"jshard / hand-written <= {STEP_TARGET:g} (median of paired ratios)",
        ("model", "jshard step", "jax.jit step", "difference", "median ratio", "target", "programs alone: ratio",
         "collective bytes/step, jshard / jit", "rounds", "loss, jshard vs jit"),
        tuple(cells),
        (
            "jshard step: calling the `Parallelized` train step, its per-call work included (the signature lookup "
            "and `device_put` of the already placed arguments). jax.jit step: calling `jax.jit` of the same step "
            "with the shardings jshard's plan gives `jax.jit`. The same placed arguments, no donation.",
            "programs alone: the two `Compiled` programs (from table 3's last pair) called directly, the same way, "
            "so that only the programs differ: jshard's over jit's, median of the per-round ratios.",
            "collective bytes: what each compiled program moves (`jshard.audit`). jshard's program carries its "
            "planned sharding constraints, jit's only the argument and result shardings, so XLA may partition "
            "the two differently.",
            f"{WARMUP} warm-up calls each, then rounds of one step of each of the four (until "
            "`block_until_ready`), the order rotated every round; medians per column, ratios: median of the "
            "per-round ratios. loss: the two calls' losses, relative difference.",
        ),
    )


def _column(rounds: Sequence[tuple[float, ...]], i: int) -> list[float]:
    return [r[i] for r in rounds]


def _median_ratio(rounds: Sequence[tuple[float, ...]], i: int, j: int) -> float:
    return statistics.median(r[i] / r[j] for r in rounds)
