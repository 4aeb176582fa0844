"""What the propagation engine decides: per operator a `Decision` (its layouts, the collectives it
pays, the alternative it did not take, `Rejected`), and the `Result` of a run, also what the search
assembles (`search/_assemble.py`) and what global propagation weighs (`WeighedLayout`)."""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

from jshard.cost import Comm
from jshard.layouts import Spec


class Rejected(NamedTuple):
    """The best alternative an operator did not take: its operands' layouts and its predicted seconds."""

    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    seconds: float


class WeighedLayout(NamedTuple):
    """One layout global propagation weighed for an argument (`propagate_globally`): the layout, the
    whole program's predicted seconds with it, how it came (`"propagated"`, `"weighed"`, `"as it
    arrives"`, `"moved once at the start"`) and whether the plan took it."""

    spec: Spec
    seconds: float
    how: str
    chosen: bool


@dataclasses.dataclass(frozen=True, slots=True)
class Decision:
    """What the engine chose for one operator.

    Attributes:
      in_specs / out_specs: the layout of each operand the operator works on (loop bodies' results
        and parameters follow the outer operands).
      comms: the collectives it costs (redistributing its inputs, its partial sums), per run.
      seconds: their α–β time, weighted by how often the operator runs.
      via: the operator index (or `arg<k>`) whose layout it took, or `""`.
      rejected: the best alternative it did not take, or None.
      implied: whether XLA infers its output layouts from its inputs alone (no constraint needed).
    """

    in_specs: tuple[Spec, ...]
    out_specs: tuple[Spec, ...]
    comms: tuple[Comm, ...]
    seconds: float
    via: str
    rejected: Rejected | None
    implied: bool


@dataclasses.dataclass
class Result:
    """Every decision, the layout of every value, which nodes had no rule, and the layouts global
    propagation weighed for the arguments (argument -> `WeighedLayout` alternatives)."""

    decisions: dict[int, Decision]
    values: dict
    unruled: set[int]
    weighed: dict = dataclasses.field(default_factory=dict)
