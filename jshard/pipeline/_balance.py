"""Stages balanced by the cost model: where an untagged step is cut, and what each stage costs.

A step passed with `stages=S` and no `pipeline_stage` tags is cut into S runs of its
forward loss's operators in program order (a value then only flows to later stages). `balance`
picks the S - 1 cuts:

1. compute first: each operator's FLOPs (the rules' `Factors.flops`; a call with no rule, such as
   a recompute region, its body's; any other operator with no rule, its results' elements), the
   slowest stage's as small as cuts anywhere make it;
2. narrow places: among the places where cutting keeps the slowest stage within 10% of that
   best, only those where the fewest bytes cross, the narrowest width that still allows it
   (between two layers, their activation; not inside a layer, where more is live);
3. among those, the cuts minimising (the slowest stage's FLOPs, ties within 1%; the widest
   boundary's bytes; the largest stage's parameter bytes), by dynamic programming.

Each stage's predicted time per micro-batch (`StageBalance.seconds`) is its forward compute × 3 (the
forward, and a backward of twice its work; each operator's FLOPs at `CostModel.compute_seconds`'s
rate, dots at the matmul rate; its memory traffic is not priced here), plus its boundaries' sends both ways
(the activation forward, its gradient back) at the cost model's α–β. The latency of a send is the
same wherever the cut falls, so it is reported, not weighed. A tagged step keeps its stages
(MindSpore's semantics); its `StageBalance` reports the same figures, so an unequal split shows
(`imbalance`).
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import numpy as np
from jax.extend import core as jcore

from jshard._format import human_bytes
from jshard.cost import CostModel
from jshard.rules import MATMUL, RULES

BACKWARD_FACTOR = 3.0
"""A stage's forward and backward work against its forward's: the backward takes about twice."""
_TIE = 1e-2


@dataclasses.dataclass(frozen=True)
class StageBalance:
    """Where a step was cut into stages, and each stage's predicted cost per micro-batch.

    Attributes:
      tagged: True where the user's `pipeline_stage` tags set the stages (kept as given), False
        where the cost model cut an untagged step.
      cuts: per boundary `k -> k+1`, the last operator of stage `k` (primitive and source line).
      flops: per stage, its forward FLOPs on one micro-batch (one device holding everything).
      seconds: per stage, its predicted forward + backward time per micro-batch: compute at the
        cost model's rate plus its boundaries' sends.
      param_bytes: per stage, the bytes of the parameter leaves it reads.
      boundary_bytes: per boundary, the bytes crossing it per micro-batch (each way).

    Examples:
      >>> b = StageBalance(False, ("dot_general at x.py:3",), (2e6, 1e6), (6e-8, 3e-8), (64, 32), (16,))
      >>> round(b.imbalance, 3), b.slowest
      (1.333, 0)
    """

    tagged: bool
    cuts: tuple[str, ...]
    flops: tuple[float, ...]
    seconds: tuple[float, ...]
    param_bytes: tuple[int, ...]
    boundary_bytes: tuple[int, ...]

    @property
    def slowest(self) -> int:
        """The stage with the most compute (it bounds the pipeline's tick)."""
        return int(np.argmax(self.flops))

    @property
    def imbalance(self) -> float:
        """The slowest stage's compute over the mean stage's (1.0: perfectly even)."""
        return float(max(self.flops) / max(np.mean(self.flops), 1e-30))

    def summary(self) -> str:
        """One line per stage: its predicted time, FLOPs, parameters, and where it ends."""
        how = "as tagged (pipeline_stage)" if self.tagged else "cut by the cost model (no tags)"
        lines = [f"stages {how}: slowest stage {self.slowest}, {self.imbalance:.2f}x the mean stage's compute"]
        for k, (s, f, p) in enumerate(zip(self.seconds, self.flops, self.param_bytes)):
            end = (f"ends after {self.cuts[k]}, sends {human_bytes(self.boundary_bytes[k])}"
                   if k < len(self.cuts) else "ends with the loss")
            lines.append(f"  stage {k}: {s * 1e6:9.3f} us predicted, {f:.3g} forward FLOPs, "
                         f"{human_bytes(p)} parameters; {end}")
        return "\n".join(lines)


class _Costs:
    """Per-operator FLOPs, per-position crossing bytes and parameter reads of one flattened loss."""

    def __init__(self, ops: Sequence[Any], param_vars: Sequence[Any], loss, cost: CostModel):
        self.n, self.cost = len(ops), cost
        work = [_flops(op.eqn) for op in ops]
        self.prefix = np.concatenate([[0.0], np.cumsum(work)])
        self.compute = np.concatenate([[0.0], np.cumsum([cost.compute_seconds(f, matmul=op.eqn.primitive.name in MATMUL)
                                                          for f, op in zip(work, ops)])])
        self.crossing = _crossing_bytes(ops, loss)
        index = {v: i for i, v in enumerate(param_vars)}
        self.param_size = [_nbytes(v.aval) for v in param_vars]
        reads: dict[int, list[int]] = {}
        for pos, op in enumerate(ops):
            for v in op.inputs:
                if isinstance(v, jcore.Var) and v in index:
                    reads.setdefault(index[v], []).append(pos)
        self.reads = reads

    def flops(self, lo: int, hi: int) -> float:
        return float(self.prefix[hi] - self.prefix[lo])

    def send(self, pos: int) -> float:
        """Seconds to send what crosses a cut before operator `pos`, one way."""
        return self.cost.latency + self.crossing[pos] / self.cost.bandwidth

    def seconds(self, lo: int, hi: int) -> float:
        """Stage `[lo, hi)`'s forward + backward time: compute, and each boundary both ways."""
        comm = sum(2 * self.send(p) for p in (lo, hi) if 0 < p < self.n)
        return BACKWARD_FACTOR * self.compute_seconds(lo, hi) + comm

    def compute_seconds(self, lo: int, hi: int) -> float:
        """Operators `[lo, hi)`'s forward compute (`CostModel.compute_seconds`, dots at the matmul rate)."""
        return float(self.compute[hi] - self.compute[lo])

    def param_bytes(self, lo: int, hi: int) -> int:
        """Bytes of the parameter leaves operators `[lo, hi)` read."""
        firsts, sizes = self._first_reads(lo)
        return int(sizes[int(np.searchsorted(firsts, hi, side="left"))])

    @functools.cache
    def _first_reads(self, lo: int) -> tuple[np.ndarray, np.ndarray]:
        """Each leaf's first read at or after `lo`, sorted, and the running sum of their bytes
        (`sizes[i]`: the leaves first read before `firsts[i]`)."""
        found = []
        for j, pos in self.reads.items():
            i = bisect.bisect_left(pos, lo)
            if i < len(pos):
                found.append((pos[i], self.param_size[j]))
        found.sort()
        firsts = np.asarray([f for f, _ in found], dtype=np.int64)
        return firsts, np.concatenate([[0], np.cumsum([b for _, b in found], dtype=np.int64)])

    def narrowest(self, stages: int) -> list[int]:
        """The places to cut before (step 2 of the module docstring), or [] where fewer than
        `stages - 1` places exist."""
        if self.n < stages:
            return []
        best = _least_slowest(self.prefix, range(1, self.n), stages)
        widths = sorted(set(self.crossing[1:self.n].tolist()))
        lo, hi = 0, len(widths) - 1  # the least width whose places balance within 10% of `best`
        while lo < hi:
            mid = (lo + hi) // 2
            places = [p for p in range(1, self.n) if self.crossing[p] <= widths[mid]]
            if len(places) >= stages - 1 and _least_slowest(self.prefix, places, stages) <= 1.1 * best:
                hi = mid
            else:
                lo = mid + 1
        return [p for p in range(1, self.n) if self.crossing[p] <= widths[lo]]


def balance(ops: Sequence[Any], stages: int, param_vars: Sequence[Any], loss, cost: CostModel) -> list[int] | None:
    """The stage of each of `ops` (an untagged loss's operators in program order, each with `eqn`,
    `inputs` and `outputs`) cut into `stages` (see the module docstring), or None where the loss
    has fewer than `stages` operators."""
    c = _Costs(ops, param_vars, loss, cost)
    places = c.narrowest(stages)
    if len(places) < stages - 1:
        return None
    cuts = _best_cuts(c, [0, *places, c.n], stages)
    stage, k = [], 0
    for pos in range(c.n):
        while k < len(cuts) and pos >= cuts[k]:
            k += 1
        stage.append(k)
    return stage


def _least_slowest(prefix: np.ndarray, places: Sequence[int], stages: int) -> float:
    """The least FLOPs of the slowest stage over cuts at `places` (at most `stages` stages), by
    bisection on the bound with a greedy fill."""
    points = np.asarray([0, *places, len(prefix) - 1])
    lo, hi = float(np.max(np.diff(prefix[points]), initial=0.0)), float(prefix[-1])
    for _ in range(60):
        if hi - lo <= 1e-9 * max(hi, 1.0):
            break
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if _fits(prefix, points, stages, mid) else (mid, hi)
    return hi


def _fits(prefix: np.ndarray, points: np.ndarray, stages: int, bound: float) -> bool:
    """Whether `stages` runs between `points`, each of at most `bound` FLOPs, cover everything."""
    at, used = 0, 0
    while at < len(points) - 1:
        reach = int(np.searchsorted(prefix[points], prefix[points[at]] + bound, side="right")) - 1
        if reach <= at:
            return False
        at, used = reach, used + 1
    return used <= stages


def report(ops: Sequence[Any], stage_of: Sequence[int], stages: int, param_vars: Sequence[Any], loss,
           cost: CostModel, tagged: bool, where) -> StageBalance:
    """The `StageBalance` of `ops` assigned `stage_of` (contiguous or not: a tagged step's stages are
    priced by the operators they run); `where(op)` names an operator."""
    c = _Costs(ops, param_vars, loss, cost)
    flops, compute = [0.0] * stages, [0.0] * stages
    for i, k in enumerate(stage_of):
        flops[k] += c.flops(i, i + 1)
        compute[k] += c.compute_seconds(i, i + 1)
    last = [max(i for i, k in enumerate(stage_of) if k == s) for s in range(stages)]
    sends = [c.send(last[k] + 1) if last[k] + 1 < c.n else 0.0 for k in range(stages - 1)]
    seconds = [BACKWARD_FACTOR * t + 2 * (sends[k] if k < stages - 1 else 0.0)
               + 2 * (sends[k - 1] if k else 0.0) for k, t in enumerate(compute)]
    params = [sum(c.param_size[j] for j, pos in c.reads.items() if any(stage_of[p] == k for p in pos))
              for k in range(stages)]
    return StageBalance(tagged, tuple(where(ops[last[k]]) for k in range(stages - 1)), tuple(flops),
                        tuple(seconds), tuple(params),
                        tuple(int(c.crossing[last[k] + 1]) if last[k] + 1 < c.n else 0 for k in range(stages - 1)))


def _best_cuts(c: _Costs, points: list[int], stages: int) -> list[int]:
    """The `stages - 1` inner `points` minimising (slowest stage's FLOPs, widest boundary's bytes,
    largest stage's parameter bytes), by dynamic programming over the points."""
    m = len(points)

    @functools.cache
    def best(i: int, left: int) -> tuple[float, float, int, tuple[int, ...]]:
        """The best split of `points[i]..end` into `left` stages: (FLOPs, bytes, params, cuts)."""
        if left == 1:
            lo = points[i]
            return c.flops(lo, c.n), 0.0, c.param_bytes(lo, c.n), ()
        found = None
        for j in range(i + 1, m - left + 1):
            f, w, b, rest = best(j, left - 1)
            lo, hi = points[i], points[j]
            cand = (max(f, c.flops(lo, hi)), max(w, float(c.crossing[hi])), max(b, c.param_bytes(lo, hi)), (hi, *rest))
            if found is None or _better(cand, found):
                found = cand
        return found

    return list(best(0, stages)[3])


def _better(a, b) -> bool:
    if a[0] < b[0] * (1 - _TIE):
        return True
    return a[0] <= b[0] * (1 + _TIE) and a[1:3] < b[1:3]


def _crossing_bytes(ops: Sequence[Any], loss) -> np.ndarray:
    """Per position `p`, the bytes of values made before operator `p` and read at or after it."""
    made = {v: i for i, op in enumerate(ops) for v in op.outputs}
    last: dict = {}
    for i, op in enumerate(ops):
        for v in op.inputs:
            if isinstance(v, jcore.Var) and v in made:
                last[v] = i
    if loss in made:
        last[loss] = len(ops)
    delta = np.zeros(len(ops) + 2)
    for v, j in last.items():
        delta[made[v] + 1] += _nbytes(v.aval)
        delta[j + 1] -= _nbytes(v.aval)
    return np.cumsum(delta)[: len(ops) + 1]


def _flops(eqn) -> float:
    """`eqn`'s FLOPs: its rule's; a call with no rule (a recompute region, a custom derivative),
    its body's; else its results' elements."""
    fn = RULES.get(eqn.primitive.name)
    if fn is not None:
        return float(fn(eqn).flops)
    bodies = [sub.jaxpr if isinstance(sub, jcore.ClosedJaxpr) else sub
              for sub in (eqn.params.get(k) for k in ("jaxpr", "call_jaxpr", "fun_jaxpr")) if sub is not None]
    if bodies:
        return sum(_flops(e) for body in bodies for e in body.eqns)
    return float(sum(np.prod(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")))


def _nbytes(aval) -> int:
    return int(np.prod(aval.shape)) * np.dtype(aval.dtype).itemsize if hasattr(aval, "shape") else 0
