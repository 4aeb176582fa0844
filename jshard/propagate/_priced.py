"""`priced`: the work and the predicted time per call of a planned program, per device."""

from __future__ import annotations

import collections
import math
from collections.abc import Collection, Mapping, Sequence
from typing import NamedTuple

from jax.extend import core as jcore

from jshard.cost import CostModel, Timeline
from jshard.graph import Node
from jshard.propagate._manual import MANUAL, manual_flops
from jshard.propagate._result import Decision, Result
from jshard.rules import OpTable

_AFTER = frozenset({"all-reduce"})
"""Collectives an operator issues after it computes (its partial sums); the others move its inputs."""


class Priced(NamedTuple):
    """What one device does per call under a plan, as the cost model prices it.

    Attributes:
      flops: the program's floating-point work on one device holding everything (loops weighted
        by their trip counts).
      device_flops: the work of one device under the plan: each operator's divided by the devices
        its strategy cuts it over (the mesh axes its operands' layouts use).
      comm_seconds: the plan's collectives' α–β time.
      compute_seconds: each operator's roofline (`CostModel.compute_seconds`: its FLOPs per device
        at its units' rate, or its fused memory traffic at the memory bandwidth), summed.
      step_seconds: the predicted time per call: the makespan of `schedule`, compute and each
        collective kind on their own resource where the cost model overlaps them (else their sum).
      hidden: per operator (node index) whose collectives run beside compute, the seconds of them
        the compute resource is busy with other work (`schedule`); empty where nothing overlaps.
    """

    flops: float
    device_flops: float
    comm_seconds: float
    compute_seconds: float
    step_seconds: float
    hidden: Mapping[int, float] = {}

    @property
    def seconds(self) -> float:
        """The predicted time per call (`step_seconds`)."""
        return self.step_seconds

    @property
    def hidden_seconds(self) -> float:
        """The collectives' time that runs beside compute: `comm_seconds` the step does not wait for."""
        return max(self.comm_seconds + self.compute_seconds - self.step_seconds, 0.0)


def priced(nodes: Sequence[Node], result: Result, axis_size: Mapping[str, int], cost: CostModel,
           table: OpTable | None = None, outputs: Collection = ()) -> Priced:
    """The `Priced` work of `nodes` laid out as `result` decided (an operator it left undecided,
    or has no rule for, runs whole on every device); `table`: the nodes' `OpTable`, where one is
    at hand; `outputs`: the program's results (written to memory, `OpTable.traffic`)."""
    table = table or OpTable(nodes)
    moved = table.traffic(outputs) if cost.memory_bandwidth else {}
    flops = device = comm = compute = 0.0
    seconds: dict[int, float] = {}
    over: dict[int, int] = {}  # `devices_over` by the decision's id (operators alike share one; `result` holds them)
    for i, node in enumerate(nodes):
        decision = result.decisions.get(i)
        if decision is not None:
            comm += decision.seconds
        if node.primitive == MANUAL:  # its body's products, at one device's shapes
            work = node.weight * manual_flops(node.eqn)
            flops, device = flops + work * math.prod(axis_size.values()), device + work
            seconds[i] = node.weight * cost.compute_seconds(work / node.weight, matmul=True) if work else 0.0
            compute += seconds[i]
            continue
        f = table.factors.get(i)
        if f is None or i in result.unruled or not (f.flops or i in moved):
            continue
        n = over.get(id(decision))
        if n is None:
            n = over[id(decision)] = devices_over(decision, axis_size)
        work = node.weight * f.flops
        flops += work
        device += work / n
        seconds[i] = node.weight * cost.compute_seconds(f.flops / n, moved.get(i, 0.0) / n, i in table.matmul)
        compute += seconds[i]
    if not (cost.overlap and comm):
        return Priced(flops, device, comm, compute, comm + compute)
    step, hidden = schedule(nodes, result, seconds, table, axis_size, cost)
    return Priced(flops, device, comm, compute, step, hidden)


def schedule(nodes: Sequence[Node], result: Result, compute: Mapping[int, float], table: OpTable,
             axis_size: Mapping[str, int], cost: CostModel) -> tuple[float, dict[int, float]]:
    """The makespan of the program's operators, compute on one resource and each collective kind
    on its own (`Timeline`s: each piece of work in program order, as early as its inputs allow):
    an operator's input collectives start once the values they move are made, its compute once
    they have arrived, its partial sums' all-reduces once it has computed. A collective so
    overlaps the compute that does not depend on it, as the asynchronous collectives of XLA's
    latency-hiding scheduler do on GPU. `compute`: seconds per operator. Also, per operator with
    collectives, the seconds of them the compute resource works through (`Priced.hidden`)."""
    ready: dict = {}
    lines: dict[str, Timeline] = collections.defaultdict(Timeline)
    spans: dict[int, list[tuple[float, float]]] = collections.defaultdict(list)
    for i, _ in enumerate(nodes):
        ins, outs = table.vars[i]
        start = max((ready.get(v, 0.0) for v in ins if isinstance(v, jcore.Var)), default=0.0)
        decision = result.decisions.get(i)
        after: list[tuple[str, float]] = []
        if decision is not None and decision.seconds:
            times = [cost.time(c, axis_size) for c in decision.comms]
            scale = decision.seconds / sum(times) if sum(times) else 0.0
            for c, t in zip(decision.comms, times):
                if c.kind in _AFTER:
                    after.append((c.kind, t * scale))
                else:
                    start = lines[c.kind].place(start, t * scale)
                    spans[i].append((start - t * scale, start))
        done = lines["compute"].place(start, compute.get(i, 0.0))
        for kind, t in after:
            done = lines[kind].place(done, t)
            spans[i].append((done - t, done))
        for v in outs:
            ready[v] = done
    work = lines["compute"]
    hidden = {i: sum(work.busy(a, b) for a, b in found) for i, found in spans.items()}
    return max((line.tail for line in lines.values()), default=0.0), {i: s for i, s in hidden.items() if s > 0}


def devices_over(decision: Decision | None, axis_size: Mapping[str, int]) -> int:
    """How many devices an operator's work is divided over: the mesh axes its operands use."""
    if decision is None:
        return 1
    axes = {a for spec in (*decision.in_specs, *decision.out_specs) if spec for dim in spec
            for a in dim}
    return math.prod(axis_size[a] for a in axes)
