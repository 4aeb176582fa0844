"""7b. Planning an unrolled GPT-3-shaped step at depth: the recursive search with and without the
replay of repeated layers (`parallelize(search=js.Search(replay=...))`), on an abstract mesh of 1024 devices."""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from typing import NamedTuple

import jax

import jshard as js
from benchmarks._search import Shape
from benchmarks._table import Table
from jshard import models

DEPTHS = (12, 48, 96)
DEVICES = 1024
TARGET = 5.0  # seconds for the 96-layer step (issue 15 item 4), and at most 2x the 12-layer time
REPEATS = 3  # each case planned this many times; the run of least CPU kept


def _shape(layers: int) -> Shape:
    return Shape("GPT-3-shaped, unrolled", models.GPTConfig(vocab=50257, seq_len=2048, d_model=12288, n_heads=96,
                                                             n_layers=layers, d_ff=49152, scan=False), 1536)


class _Measured(NamedTuple):
    """One plan's timings, in seconds.

    Attributes:
      wall / cpu: `Parallelized.plan(...)`, wall clock and this process's CPU time.
      read_wall / read_cpu: the same call and then the first read of `Plan.ops` (the operator
        records every reader of the plan pays for: `summary()`, `jshard plan`).
      trace / trace_cpu: JAX's own trace of the same step (`jax.make_jaxpr`), timed after, with
        Python's garbage collector paused as `plan` traces (once: JAX caches a trace).
      search: the search's own wall time.
      plan: the plan.
    """

    wall: float
    cpu: float
    read_wall: float
    read_cpu: float
    trace: float
    trace_cpu: float
    search: float
    plan: js.Plan


def _measure(layers: int, replay: bool) -> _Measured:
    shape = _shape(layers)
    step = js.parallelize(shape.step(), devices=DEVICES, mode="auto", search=js.Search(replay=replay))
    args = shape.args()
    start, cpu = time.perf_counter(), time.process_time()
    plan = step.plan(*args)
    took, took_cpu = time.perf_counter() - start, time.process_time() - cpu
    plan.ops  # made on this first read
    read, read_cpu = time.perf_counter() - start, time.process_time() - cpu
    enabled = gc.isenabled()
    gc.disable()
    try:
        start, trace_cpu = time.perf_counter(), time.process_time()
        jax.make_jaxpr(step.fn)(*args)
        trace, trace_cpu = time.perf_counter() - start, time.process_time() - trace_cpu
    finally:
        if enabled:
            gc.enable()
    return _Measured(took, took_cpu, read, read_cpu, trace, trace_cpu, plan.search.planning_seconds, plan)


def _least(layers: int, replay: bool, repeats: int) -> _Measured:
    """Of `repeats` plans of the same case (each traced afresh), the one whose read took the least CPU
    less JAX's trace: what the code costs, with the least a shared machine adds to it."""
    return min((_measure(layers, replay) for _ in range(repeats)), key=lambda m: m.read_cpu - m.trace_cpu)


def replay_table(depths: Sequence[int] = DEPTHS, repeats: int = REPEATS) -> Table:
    measured = {(layers, replay): _least(layers, replay, repeats) for layers in depths for replay in (False, True)}
    rows = []
    for (layers, replay), m in measured.items():
        first = measured[(depths[0], replay)]
        full = measured[(layers, False)].plan.search.seconds
        s = m.plan.search
        rows.append((str(layers), "on" if replay else "off", f"{m.wall:.2f} s", f"{m.cpu:.2f} s",
                     f"{m.read_wall:.2f} s", f"{m.read_cpu:.2f} s", f"{m.trace:.2f} s", f"{m.cpu - m.trace_cpu:.2f} s",
                     f"{m.read_cpu - m.trace_cpu:.2f} s", f"{m.search:.2f} s", f"{m.cpu / first.cpu:.2f}",
                     f"{(m.cpu - m.trace_cpu) / (first.cpu - first.trace_cpu):.2f}",
                     f"{(m.read_cpu - m.trace_cpu) / (first.read_cpu - first.trace_cpu):.2f}", f"{s.units:,}",
                     f"{s.seconds:.5g} s", f"{s.seconds / full:.4f}"))
    return Table(
        "7b. Planning an unrolled GPT-3-shaped step at depth: replay of repeated layers",
        f"the {depths[-1]}-layer step on {DEVICES} devices planned and read (read plan CPU less JAX trace) in at "
        f"most {TARGET:g} s, at most 2x the {depths[0]}-layer time (issue 15 item 4; a 2-core machine shared with "
        "other work).",
        ("layers", "replay", "plan", "plan CPU", "read plan", "read plan CPU", "JAX trace", "plan CPU less JAX trace",
         "read plan CPU less JAX trace", "search alone", f"CPU vs {depths[0]} layers",
         f"less trace vs {depths[0]} layers", f"read less trace vs {depths[0]} layers", "decisions",
         "predicted per step", "predicted vs replay off"),
        tuple(rows),
        (
            "`Parallelized.plan(...)` of the Adam train step of the GPT-3-shaped model (d_model 12288, 96 heads, "
            "d_ff 49152, seq 2048, vocab 50257, batch 1536), its layers an unrolled Python loop, no annotations "
            f"(`mode='auto'`, recursive search, no memory budget), on shapes only, an abstract mesh of {DEVICES} "
            "devices; `Search(replay=True)` (the default) or False. plan: trace + search, wall clock; plan CPU: this "
            "process's CPU time over the same call; read plan (wall and CPU): the same call, then the first read of "
            "`Plan.ops`, the plan's operator records, made when first read (the collector paused, as `plan` "
            "pauses it): what a user reading the plan (`plan.ops`, `plan.summary()`, `jshard plan`) pays, the "
            "figure the target is judged on; JAX trace: "
            "`jax.make_jaxpr` of the same step, timed after, wall clock, with Python's garbage collector paused as "
            "`plan` traces (`compile.build` pauses it; plain `jax.jit` pays this trace too); ... less JAX trace: "
            "jshard's own CPU time, that CPU time less the trace's CPU time; search alone: the search's own wall "
            f"time; vs 12 layers: the ratio to the 12-layer row's figure with the same replay. Each case is planned "
            f"{repeats} times, each traced afresh, and the run whose read plan took the least CPU less JAX trace is "
            "shown (on a shared machine one run can take half as long again as the next: the least is what the "
            "code costs).",
            "replay: the interior layers of each repeated run of units (the forward blocks, the backward blocks, "
            "the optimizer's update of each layer's parameters) are decided as one at each level of the search, the "
            "first and last layer of each run on their own, then the replayed choice is checked by single and "
            "pairwise moves with every unit on its own but the middle layers of long runs (those move as one; where "
            "the layers beside them change, the middle takes their choice and is checked again); the records of "
            "operators alike (the same operator of identical layers) are made once. predicted vs replay "
            "off: the plan's predicted seconds per step over those of the plan made without replay (below 1: the "
            "replayed plan is cheaper).",
        ),
    )
