"""`priced`: the work and the predicted time per call of a planned program, per device."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jshard.cost import CostModel
from jshard.graph import Node
from jshard.propagate._engine import Decision, Result
from jshard.rules import OpTable


class Priced(NamedTuple):
    """What one device does per call under a plan, as the cost model prices it.

    Attributes:
      flops: the program's floating-point work on one device holding everything (loops weighted
        by their trip counts).
      device_flops: the work of one device under the plan: each operator's divided by the devices
        its strategy cuts it over (the mesh axes its operands' layouts use).
      comm_seconds: the plan's collectives' α–β time.
      compute_seconds: `device_flops` at the cost model's rate.
    """

    flops: float
    device_flops: float
    comm_seconds: float
    compute_seconds: float

    @property
    def seconds(self) -> float:
        """The predicted time per call: collectives and compute."""
        return self.comm_seconds + self.compute_seconds


def priced(nodes: Sequence[Node], result: Result, axis_size: Mapping[str, int], cost: CostModel,
           table: OpTable | None = None) -> Priced:
    """The `Priced` work of `nodes` laid out as `result` decided (an operator it left undecided,
    or has no rule for, runs whole on every device); `table`: the nodes' `OpTable`, where one is
    at hand."""
    table = table or OpTable(nodes)
    flops = device = comm = 0.0
    over: dict[int, int] = {}  # `devices_over` by the decision's id (operators alike share one; `result` holds them)
    for i, node in enumerate(nodes):
        decision = result.decisions.get(i)
        if decision is not None:
            comm += decision.seconds
        f = table.factors.get(i)
        if f is None or not f.flops or i in result.unruled:
            continue
        work = node.weight * f.flops
        flops += work
        n = over.get(id(decision))
        if n is None:
            n = over[id(decision)] = devices_over(decision, axis_size)
        device += work / n
    return Priced(flops, device, comm, device / cost.flops)


def devices_over(decision: Decision | None, axis_size: Mapping[str, int]) -> int:
    """How many devices an operator's work is divided over: the mesh axes its operands use."""
    if decision is None:
        return 1
    axes = {a for spec in (*decision.in_specs, *decision.out_specs) if spec for dim in spec
            for a in dim}
    return math.prod(axis_size[a] for a in axes)
