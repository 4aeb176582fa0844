"""`PipelinePlan`: what a pipelined step will do, before (and, on request, after) compiling it."""

from __future__ import annotations

import dataclasses
import math
import textwrap
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from jshard._format import human_bytes
from jshard.audit import Audit, audit
from jshard.compile import abstract
from jshard.layouts import slices
from jshard.pipeline._schedule import Schedule

_THEORY = {False: "(S-1)/(v·M+S-1)", True: "(S-1)/(3M+S-1)"}


@dataclasses.dataclass(frozen=True, slots=True)
class StageInfo:
    """One pipeline stage.

    Attributes:
      stage: its id.
      ranks: the device ranks that run it (`devices / stages` of them, its data / tensor group).
      layers: the stack's layer indices it runs, per chunk (one chunk unless interleaved).
      peak_in_flight: the most micro-batch inputs it holds at once, waiting for their backward.
    """

    stage: int
    ranks: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    peak_in_flight: int


@dataclasses.dataclass(frozen=True)
class PipelinePlan:
    """The plan of a pipelined step.

    Attributes:
      schedule: the `Schedule` (`table()`, `picture()`, ticks, `bubble_fraction`).
      stages: one `StageInfo` per stage.
      mesh_shape: the mesh, `{"stage": S, ...the stage's own axes}`.
      activation_bytes: bytes per device of one activation passed between stages (one micro-batch).
      buffer_bytes: bytes per device of the slot buffers every stage holds: received activations
        and gradients, chunk outputs, and the residuals forwards keep for their backwards.
      boundary_bytes: bytes that must cross stage boundaries per step (activations forward and
        gradients backward, all micro-batches, whole tensors).
      permute_bytes: bytes the busiest device sends in the program's `collective-permute`s per
        step (`jshard.audit`'s convention): one activation per permute it is a source of, only at
        ticks where it sends (`Schedule.permutes`, `Schedule.sends`).
    """

    schedule: Schedule
    stages: tuple[StageInfo, ...]
    mesh_shape: dict
    activation_bytes: int
    buffer_bytes: int
    boundary_bytes: int
    permute_bytes: int
    _compile: Callable[[], Any] | None = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def bubble_fraction(self) -> float:
        return self.schedule.bubble_fraction

    def audit(self) -> Audit:
        """Compiles the step and reads its collectives and memory (`jshard.audit`)."""
        return audit(self._compile())

    def summary(self, width: int = 120) -> str:
        """Stages, the schedule picture, bubble, memory and boundary traffic, as text no wider than
        `width` columns (long lines wrapped, a long schedule drawn in blocks of ticks)."""
        s = self.schedule
        lines = [
            f"pipeline: schedule={s.name}, stages={s.stages}, micro_batches={s.micro_batches}, "
            f"virtual_stages={s.virtual}, mesh {self.mesh_shape}",
            f"bubble fraction {s.bubble_fraction:.4f} (theory {_THEORY[s.split_backward]} = {s.theoretical_bubble:.4f}), "
            f"{s.ticks} ticks",
        ]
        for st in self.stages:
            lines.append(f"  stage {st.stage}: ranks {list(st.ranks)}, layers {[list(c) for c in st.layers]}, "
                         f"micro-batches in flight (peak) {st.peak_in_flight}")
        lines += [
            f"activation per micro-batch {human_bytes(self.activation_bytes)} per device; slot buffers "
            f"{human_bytes(self.buffer_bytes)} per device",
            f"must cross stages per step: {human_bytes(self.boundary_bytes)}; the program's collective-permutes "
            f"move {human_bytes(self.permute_bytes)} per device",
        ]
        wrapped = [w for line in lines for w in textwrap.wrap(line, width, subsequent_indent="    ")]
        return "\n".join([*wrapped, s.picture(width)])


def plan_of(program, mesh, layers: int, params, batch, compile_) -> PipelinePlan:
    """The `PipelinePlan` of a built pipeline `program` for these arguments."""
    sched: Schedule = program.schedule
    s, v = sched.stages, sched.virtual
    rest, _ = program.pipe.split(params)
    first_mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // sched.micro_batches, *a.shape[1:]), a.dtype),
                            abstract(batch))
    act = jax.eval_shape(program.pipe.first, abstract(rest), first_mb)
    whole = int(np.prod(act.shape)) * act.dtype.itemsize
    cut = math.prod(slices(program.specs.act, len(program.specs.act), dict(mesh.shape)))
    per_device = whole // cut
    slots = sched.slots("activations") + (0 if sched.forward_only else sched.slots("gradients") + sched.slots("residuals"))
    residual_bytes = 0
    if not sched.forward_only:
        sizes = dict(mesh.shape)
        residual_bytes = sched.slots("residuals") * sum(
            int(np.prod(r.shape)) * r.dtype.itemsize // math.prod(slices(p, len(p), sizes))
            for r, p in zip(program.residual_shapes(params, batch), program.specs.residuals))
    k = layers // (s * v)
    per_stage = mesh.devices.size // s
    stages = tuple(
        StageInfo(st, tuple(range(st * per_stage, (st + 1) * per_stage)),
                  tuple(tuple(range((c * s + st) * k, (c * s + st + 1) * k)) for c in range(v)),
                  _peak_in_flight(sched, st))
        for st in range(s)
    )
    crossings = sched.micro_batches * (s * v - 1) * (1 if sched.forward_only else 2)
    permutes = int(sched.sends().max())
    return PipelinePlan(sched, stages, dict(mesh.shape), per_device, v * (slots * per_device + residual_bytes),
                        crossings * whole, permutes * per_device, compile_)


def _peak_in_flight(sched: Schedule, stage: int) -> int:
    """The most forwards this stage has run whose backward (with a split backward: `W`) it has
    not run yet."""
    live = peak = 0
    ends = "W" if sched.split_backward else "B"
    for row in sched.ops:
        op = row[stage]
        if op is not None:
            live += 1 if op.kind == "F" else -1 if op.kind == ends else 0
            peak = max(peak, live)
    return peak

