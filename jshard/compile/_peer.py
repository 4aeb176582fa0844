"""The peer stage (`propagation="best"`): jshard's propagated plan and Shardy's from the same
anchors, both compiled and measured alike (`jshard.audit`'s collective bytes per device), the one
moving fewer bytes kept (jshard's where they tie), the plan saying which won and by how much
(`PeerReport`).

The two are compared on their compiled programs, not on the cost model: Shardy's plan is read back
from what XLA emitted, which the cost model, pricing operator by operator the layouts it chose
itself, cannot price. The program that runs is the one measured: its executable, compiled here, is
what calls run (`Program.compiled`), so the weighing costs one compile more, not two."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any, NamedTuple

from jshard.audit import audit, memory_figures
from jshard.compile._program import Program
from jshard.compile._signature import abstract
from jshard.plan import PeerReport


def weigh_peer(mine: Program, shardy: Callable[[], Program], args: tuple) -> Program:
    """Of jshard's program `mine` and Shardy's (built by `shardy` from the same anchors), the one
    whose compiled program moves fewer collective bytes per device, its plan's `peer` saying so."""
    ours = _measured(mine, args)
    theirs = _measured(shardy(), args)
    kept, other = (ours, theirs) if theirs.bytes >= ours.bytes else (theirs, ours)
    report = PeerReport(ours.bytes, theirs.bytes, ours.peak, theirs.peak, "jshard" if kept is ours else "xla",
                        other.seconds)
    program = kept.program
    return dataclasses.replace(program, plan=program.plan.replace(peer=report), compiled=kept.compiled)


class _Measured(NamedTuple):
    """One program compiled: its executable, collective bytes and peak per device, compile seconds."""

    program: Program
    compiled: Any
    bytes: float
    peak: float
    seconds: float


def _measured(program: Program, args: tuple) -> _Measured:
    start = time.perf_counter()
    compiled = program.jitted.lower(*abstract(args, program.in_shardings)).compile()
    seconds = time.perf_counter() - start
    return _Measured(program, compiled, audit(compiled).bytes(), float(memory_figures(compiled).peak_bytes), seconds)
