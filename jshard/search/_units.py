"""What a `SearchGraph` (`_graph.py`) is made of: its units (`Unit`, one decision each), its edges
(`Edge`, a value from the unit that makes it to one that uses it), and how an operator's factors
split into units (`unit_components`, which `jshard.compile`'s least step bound reads too)."""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

from jshard.rules import Factors

Assignment = dict  # factor id -> mesh axes (major to minor)
Group = tuple[str, ...]  # mesh axes that a search step hands out together


@dataclasses.dataclass(slots=True)
class Unit:
    """One decision of the search.

    Attributes:
      node: the operator's node index, or -1 for an argument.
      var: the argument (node -1), else None.
      factors: the operator's `Factors` (an argument's: one factor per dim, as an output).
      own: the factor ids this unit decides.
      operands: operand positions (into the operator's inputs + outputs) this unit lays out.
      weight: how often it runs per call.
      flops: its floating-point work on one device holding everything, per run.
      fixed: for a constraint or a fixed argument, its one layout per operand position.
      traffic: the device-memory bytes it moves per run once fused (`OpTable.traffic`), on one
        device holding everything.
      matmul: whether it runs on the matrix units (`CostModel.matmul_flops`).
      region: a manual region's (`shard_map`) own collectives' seconds per run, its body's as
        written (`jshard.propagate.manual_comms`); 0 for any other unit.
    """

    node: int
    var: object
    factors: Factors
    own: tuple[int, ...]
    operands: tuple[int, ...]
    weight: int
    flops: float
    fixed: dict | None = None
    traffic: float = 0.0
    matmul: bool = False
    region: float = 0.0

    @property
    def free(self) -> bool:
        return self.fixed is None and bool(self.own)


class Edge(NamedTuple):
    """A value from `(producer unit, operand position)` to `(consumer unit, operand position)` (a
    tuple: a program has one per use of a value, made by the hundred thousand)."""

    var: object
    src: tuple[int, int]
    dst: tuple[int, int]
    weight: int


@functools.lru_cache(maxsize=1 << 14)
def unit_components(f: Factors) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """The search's units of an operator with factors `f`: `(factors of more than one element,
    operand positions)` per group of factors its operands share (`f.joined` joins them), the
    operands with no factor in the first group; `()` where no operand has a factor. The first unit
    does the operator's work (`SearchGraph`'s `_add_node`); `jshard.compile`'s least step bound
    reads the same grouping. Found once per `Factors` (the same operator of identical layers)."""
    parent = list(range(len(f.sizes)))

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for joined in f.joined:
        facs = sorted(joined)
        for g in facs[1:]:
            parent[find(g)] = find(facs[0])
    groups: dict[int, tuple[set, list]] = {}
    loose = []
    for pos, dims in enumerate(f.operands):
        facs = [g for d in dims for g in d]
        if not facs:
            loose.append(pos)
            continue
        root = find(facs[0])
        groups.setdefault(root, (set(), []))
        groups[root][0].update(facs)
        groups[root][1].append(pos)
    out = [(tuple(sorted(g for g in facs if f.sizes[g] > 1)), tuple(pos)) for facs, pos in groups.values()]
    if not out:
        return ()
    first_facs, first_pos = out[0]
    out[0] = (first_facs, tuple(sorted(first_pos + tuple(loose))))
    return tuple(out)
