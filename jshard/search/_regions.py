"""Recompute per region: the search's choice of a policy for each `jshard.recompute(policy="auto")`
region.

Each region is priced from the step traced once per policy (`AUTO_POLICIES`, the same for every
region): by memory, the bytes per device it holds from the forward pass into the backward pass
(the memory model's live ranges, each value at its planned layout), and by compute, the seconds
per device the backward pass runs again (its operators' FLOPs and memory traffic over their cut,
each priced on the cost model's roofline, `CostModel.compute_seconds`, as the search prices all
compute). `upgrades` orders the moves from no recompute towards full recompute, each the move
that lowers the estimated peak (`estimate`: the backward pass runs the regions last to first) the
most per second of recompute; the search takes the shortest prefix whose estimate fits the budget,
so identical layers share a policy only where the budget needs it.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping, Sequence

from jshard._format import human_bytes
from jshard.cost import CostModel, live_ranges, value_bytes
from jshard.graph import AUTO_LABEL, RECOMPUTE_SCOPE, Node
from jshard.rules import MATMUL, OpTable

POLICIES = ("none", "selective", "full")
"""The policies a region can get, from the least recompute to the most."""

_REGION = re.compile(RECOMPUTE_SCOPE + AUTO_LABEL + r"(\d+)_")
_RERUN = "rematted_computation"


@dataclasses.dataclass(frozen=True)
class RegionCost:
    """One region under one policy, as priced from a trace that gives it that policy.

    Attributes:
      kept_bytes: bytes per device it holds from the forward pass into the backward pass.
      rerun_flops: FLOPs per device the backward pass runs again.
      source: where the region's first operator is (`file:line`).
      rerun_seconds: the seconds per device the backward pass runs again (each rerun operator's
        roofline, `CostModel.compute_seconds`).
    """

    kept_bytes: float
    rerun_flops: float
    source: str = ""
    rerun_seconds: float = 0.0


@dataclasses.dataclass(frozen=True)
class RegionChoice:
    """The policy the search gave one `jshard.recompute(policy="auto")` region, and why.

    Attributes:
      region: its number, in the order the trace meets the regions.
      source: where its first operator is.
      policy: `"none"`, `"selective"` or `"full"`.
      saved_bytes: bytes per device the policy saves against no recompute (the memory model).
      seconds: the predicted recompute time per call (its rerun operators' rooflines).
      step: the greedy move that gave it this policy (1 the first; `upgrades`), or 0 where none did
        (no recompute, or a policy the search gave every region at once).
    """

    region: int
    source: str
    policy: str
    saved_bytes: float
    seconds: float
    step: int = 0

    def text(self) -> str:
        if self.policy == "none":
            return f"region {self.region} ({self.source}): none"
        move = f" (move {self.step})" if self.step else ""
        return (f"region {self.region} ({self.source}): {self.policy}, saves {human_bytes(self.saved_bytes)} for "
                f"{self.seconds * 1e6:.3g} us of recompute{move}")


def region_costs(nodes: Sequence[Node], values: Mapping | None, axis_size: Mapping[str, int], args: Sequence,
                 outvars: Sequence, donated: frozenset = frozenset(), cost: CostModel | None = None) -> dict[int, RegionCost]:
    """Region number -> its `RegionCost` in the flattened program `nodes`, laid out as `values`
    says (value -> `Spec`; absent: whole; `values` None: each value cut as finely as its dims
    allow, the least the search estimates, where no plan was made), its rerun priced on `cost`'s
    roofline (the default `CostModel` where None).

    A value made at top level in the forward pass and live where the backward pass begins is the
    region's that made it (a loop's results: shared evenly among the regions inside the loop).
    """
    ranges = live_ranges(nodes, args, outvars, donated)
    start = next((i for i, n in enumerate(nodes) if n.backward and not n.inside), ranges.end)
    regions = [_region(n) for n in nodes]
    kept: dict[int, float] = {k: 0.0 for k in regions if k is not None}
    flops = dict.fromkeys(kept, 0.0)
    source: dict[int, str] = {}
    for i, node in enumerate(nodes):
        k = regions[i]
        if k is not None:
            source.setdefault(k, os.path.basename(node.source))
        if i >= start or node.inside:
            continue
        owners = _owners(nodes, regions, i)
        for v in node.outputs:
            if owners and ranges.first.get(v) == i and ranges.last[v] >= start:
                for owner in owners:
                    kept[owner] += _held(v, values, axis_size) / len(owners)
    cost = cost or CostModel()
    seconds = dict.fromkeys(kept, 0.0)
    table, moved = None, {}
    for i, node in enumerate(nodes):
        k = regions[i]
        if k is None or not node.remat or _RERUN not in node.scope or not node.outputs:
            continue
        if table is None:
            table = OpTable(nodes)
            moved = table.traffic(outvars) if cost.memory_bandwidth else {}
        f = table.factors.get(i)
        work = 0.0 if f is None else f.flops
        if work or moved.get(i):
            cut = _cut(node.outputs[0], values, axis_size)
            flops[k] += node.weight * work / cut
            seconds[k] += node.weight * cost.compute_seconds(work / cut, moved.get(i, 0.0) / cut,
                                                             matmul=node.primitive in MATMUL)
    return {k: RegionCost(kept[k], flops[k], source.get(k, ""), seconds[k]) for k in sorted(kept)}


def upgrades(costs: Mapping[str, Mapping[int, RegionCost]], peak: float) -> list[tuple[int, str, float, float]]:
    """The greedy moves from no recompute anywhere towards full recompute: `(region, policy,
    estimated peak after it, recompute seconds it adds)`, each the move (a region to any policy
    after its own) that lowers the estimated peak (`estimate`; `peak` the plan's with no recompute)
    the most per second of recompute; ties go to the first region. Stops where no move lowers it."""
    choice = dict.fromkeys(costs["none"], "none")
    now, moves = peak, []
    while True:
        best = None
        for k in choice:
            for policy in POLICIES[POLICIES.index(choice[k]) + 1:]:
                after = estimate(costs, {**choice, k: policy}, peak)
                seconds = max(costs[policy][k].rerun_seconds - costs[choice[k]][k].rerun_seconds, 0.0)
                gain = (now - after) / max(seconds, 1e-15)
                if now - after > 0 and (best is None or gain > best[0]):
                    best = (gain, k, policy, after, seconds)
        if best is None:
            return moves
        _, k, policy, now, seconds = best
        choice[k] = policy
        moves.append((k, policy, now, seconds))


def estimate(costs: Mapping[str, Mapping[int, RegionCost]], choice: Mapping[int, str], peak: float) -> float:
    """The estimated peak per device with the regions recomputed as `choice` says, `peak` the
    plan's with none recomputed. The backward pass runs the regions last to first: while it runs
    region k, the regions before it hold what their policies keep, region k all it held without
    recompute (kept, or run again), and the regions after it are done."""
    none = costs["none"]
    base = peak - sum(c.kept_bytes for c in none.values())
    held, worst = 0.0, 0.0
    for k in sorted(none):
        worst = max(worst, held + none[k].kept_bytes)
        held += costs[choice[k]][k].kept_bytes
    return base + worst


def assignment(regions: Sequence[int], moves: Sequence[tuple[int, str, float, float]]) -> tuple[str, ...]:
    """Each region's policy after `moves` (`upgrades`' prefix), in region order."""
    choice = dict.fromkeys(regions, "none")
    for k, policy, _, _ in moves:
        choice[k] = policy
    return tuple(choice[k] for k in sorted(choice))


def choices(costs: Mapping[str, Mapping[int, RegionCost]], policies: Sequence[str],
            moves: Sequence[tuple[int, str, float, float]]) -> tuple[RegionChoice, ...]:
    """The `RegionChoice`s of the regions given `policies` (in region order), `moves` the greedy
    order they were weighed in (`upgrades`)."""
    none = costs["none"]
    step = {(k, p): n + 1 for n, (k, p, _, _) in enumerate(moves)}
    return tuple(RegionChoice(k, none[k].source, p, none[k].kept_bytes - costs[p][k].kept_bytes,
                              costs[p][k].rerun_seconds, step.get((k, p), 0))
                 for k, p in zip(sorted(none), policies))


def _region(node: Node) -> int | None:
    found = _REGION.search(node.scope)
    return None if found is None else int(found.group(1))


def _owners(nodes: Sequence[Node], regions: Sequence[int | None], i: int) -> list[int]:
    """The regions a top-level node's results belong to: its own, or for a loop those inside it."""
    if regions[i] is not None:
        return [regions[i]]
    if not nodes[i].bodies:
        return []
    inside = set()
    for j in range(i + 1, len(nodes)):
        if not nodes[j].inside:
            break
        if regions[j] is not None:
            inside.add(regions[j])
    return sorted(inside)


def _cut(v, values: Mapping | None, axis_size: Mapping[str, int]) -> int:
    if values is None:
        return finest_cut(v.aval.shape, axis_size)
    return math.prod(axis_size[a] for axes in values.get(v, ()) for a in axes)


def _held(v, values: Mapping | None, axis_size: Mapping[str, int]) -> float:
    if values is None:
        return value_bytes(v) / finest_cut(v.aval.shape, axis_size)
    return value_bytes(v) / _cut(v, values, axis_size)


def finest_cut(shape, axis_size: Mapping[str, int]) -> int:
    """The most devices a tensor of `shape` can be cut over, each mesh axis on a dim it divides."""
    left = list(shape)
    cut = 1
    for n in sorted((n for n in axis_size.values() if n > 1), reverse=True):
        for d, m in enumerate(left):
            if m % n == 0:
                left[d] = m // n
                cut *= n
                break
    return cut
