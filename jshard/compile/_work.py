"""The work stage: how much of the single-device work each device does under the built plan, the
memory model's peak per device of it and, where it is nearly all of the work, the data-parallel plan
of the same traced program priced beside it (`WorkReport`). The data-parallel plan reuses the trace
and the operator table: one propagation from its anchors, nothing compiled."""

from __future__ import annotations

import dataclasses

from jshard._errors import ShardingError
from jshard.compile._boundary import argument_leaves, dataset_anchors, in_shardings
from jshard.compile._options import Options
from jshard.compile._planners import Problem
from jshard.compile._program import Program
from jshard.plan import WorkReport, numbered, planned_peak
from jshard.propagate import Engine, priced
from jshard.rules import OpTable


def with_work(program: Program, args: tuple, batch: set[int], slots, c: Options, call: str) -> Program:
    """`program` with its plan's `WorkReport` (`batch`: the batch argument leaves; `slots`: the
    `in_strategy` slots), unchanged where XLA propagates or the program does no floating-point work."""
    traced, result = program.traced, program.result
    if traced is None or result is None:
        return program
    table = traced.table
    cost = c.costs
    here = priced(traced.nodes, result, traced.axis_size, cost, table, traced.outvars)
    if not here.flops:
        return program
    number = numbered(traced.nodes) if here.hidden else {}
    donated = frozenset(traced.invars[i] for i in argument_leaves(args, c.donate_argnums))
    report = WorkReport(traced.fine.device_count, here.flops, here.device_flops, here.comm_seconds,
                        here.compute_seconds, c.mode, hidden_seconds=here.hidden_seconds,
                        hidden_ops=tuple((number[i], s) for i, s in here.hidden.items() if i in number),
                        peak_bytes=planned_peak(traced.nodes, result.values, traced.axis_size, traced.invars,
                                                traced.outvars, donated, traced.live_ranges(traced.invars, donated)))
    if report.replicated and c.mode != "data":
        report = _data_parallel(report, traced, table, args, batch, slots, c, call)
    return dataclasses.replace(program, plan=program.plan.replace(work=report))


def _data_parallel(report: WorkReport, traced, table: OpTable, args: tuple, batch: set[int], slots, c: Options,
                   call: str) -> WorkReport:
    """`report` with the data-parallel plan's predicted time: the batch leaves' dim 0 cut over every
    device (`in_strategy` kept), the rest replicated, the engine propagating from there."""
    data = dataclasses.replace(c, mode="data", dataset_strategy="data_parallel")
    try:
        dataset = dataset_anchors(args, batch, data, traced.fine.device_count, call)
        fixed = Problem(traced, in_shardings(traced, slots, dataset, data, call), frozenset(), None).fixed
    except ShardingError as e:
        why = str(e).split(": ", 1)[-1]  # the call is the user's; its fix is for a plan they did not ask for
        return dataclasses.replace(report, data_missing=why.split(". ", 1)[0].rstrip(".") + ".")
    result = Engine(traced.nodes, traced.axis_size, c.costs, table).run({**traced.typed(), **fixed}, traced.outvars)
    there = priced(traced.nodes, result, traced.axis_size, c.costs, table, traced.outvars)
    return dataclasses.replace(report, data_comm_seconds=there.comm_seconds, data_compute_seconds=there.compute_seconds,
                               data_hidden_seconds=there.hidden_seconds)
