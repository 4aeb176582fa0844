"""`RecomputeReport`: what the program recomputes (`jax.checkpoint`, `jshard.recompute`), and the
memory model's peak with it and without it."""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence

from jshard._format import human_bytes
from jshard.cost import LiveRanges, live_ranges, slice_counter, value_bytes
from jshard.graph import Node
from jshard.plan._records import recompute_regions
from jshard.rules import FUSION


@dataclasses.dataclass(frozen=True, slots=True)
class RecomputeReport:
    """The recompute regions of a planned program.

    Attributes:
      regions: per region kind (`OpRecord.recompute`: `jshard.recompute(policy='full')`,
        `jax.checkpoint(policy=full)`, ...), how many operators belong to it and how many of them
        the backward pass runs again. A region keeping its collectives' results
        (`jshard.recompute(policy='full', mp_comm_recompute=False)`) counts its operators as
        traced: emission then gives its backward run the forward pass's gathered and reduced
        values, so the operators making only those are not run again, and the peaks here leave
        those kept values out.
      peak_bytes: the memory model's peak per device (`cost.live_ranges`: the values live at once
        between top-level operators, and at a loop's point what its body holds at once, each at its
        planned layout) of the program as planned: a
        value a region recomputes is held from its run in the backward pass to its last use.
      kept_peak_bytes: the same with each recomputed value held instead from its forward run (the
        latest forward operator of the same source line and primitive not matched yet, as the
        backward pass runs the regions in reverse) to its last use: the regions' values kept, as
        without recompute. Both leave out what XLA adds (temporaries inside fusions, buffers its
        scheduler keeps longer); the compiled program's own figure is `memory_analysis()`.
    """

    regions: tuple[tuple[str, int, int], ...]
    peak_bytes: float
    kept_peak_bytes: float

    def line(self) -> str:
        """One line for `Plan.summary`."""
        kinds = ", ".join(f"{name}: {n} operators, {again} run again" for name, n, again in self.regions)
        return (f"recompute: {kinds}; predicted peak {human_bytes(self.peak_bytes)} per device "
                f"({human_bytes(self.kept_peak_bytes)} with the recomputed values kept instead)")


def recompute_report(nodes: Sequence[Node], values: Mapping, axis_size: Mapping[str, int], args: Sequence,
                     outvars: Sequence, donated: frozenset = frozenset()) -> RecomputeReport | None:
    """The `RecomputeReport` of a flattened program, or None where it has no recompute region.

    Args:
      nodes: the program's nodes.
      values: value -> its planned `Spec` (absent: held whole).
      axis_size: the mesh's axis sizes.
      args / outvars / donated: as `cost.live_ranges` takes them.
    """
    regions, rerun = recompute_regions(nodes)
    if not regions:
        return None
    ranges, held = _planned(nodes, values, axis_size, args, outvars, donated)
    first = dict(ranges.first)
    forward: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for i, node in enumerate(nodes):
        if not node.backward and not node.inside and not node.remat:
            forward[node.source, node.primitive].append(i)
    for i in rerun:  # the backward pass runs the last region first: match the latest forward run left
        runs = forward[nodes[i].source, nodes[i].primitive]
        if runs:
            t = runs.pop()
            for v in nodes[i].outputs:
                if v in first:
                    first[v] = min(first[v], t)
    counts = collections.Counter(regions.values())
    again = collections.Counter(regions[i] for i in rerun if i in regions)
    return RecomputeReport(tuple((name, counts[name], again[name]) for name in sorted(counts)),
                           _peak(ranges, held), _peak(dataclasses.replace(ranges, first=first), held))


def planned_peak(nodes: Sequence[Node], values: Mapping, axis_size: Mapping[str, int], args: Sequence,
                 outvars: Sequence, donated: frozenset = frozenset(), ranges: LiveRanges | None = None) -> float:
    """The memory model's peak per device (`cost.live_ranges`, a loop's body's own peak at its point)
    of a flattened program as planned; its arguments as `recompute_report` takes them (`ranges`: their
    `cost.live_ranges` with `rules.FUSION`, where made already)."""
    return _peak(*_planned(nodes, values, axis_size, args, outvars, donated, ranges))


def _planned(nodes: Sequence[Node], values: Mapping, axis_size: Mapping[str, int], args: Sequence,
             outvars: Sequence, donated: frozenset, ranges: LiveRanges | None = None) -> tuple[LiveRanges, dict]:
    """The program's live ranges and the bytes per device of each value under its planned `Spec`."""
    ranges = ranges or live_ranges(nodes, args, outvars, donated, fusion=FUSION)
    slices = slice_counter(axis_size)
    held = {v: value_bytes(v) / slices(values.get(v, ())) for v in ranges.values()}
    return ranges, held


def _peak(ranges: LiveRanges, held: Mapping) -> float:
    live = ranges.live_bytes(held)
    return float(live.max()) if len(live) else 0.0
