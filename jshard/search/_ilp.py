"""`search="ilp"`: one exact choice per unit, solved with HiGHS (through SciPy's `milp`).

Variables: a binary `x[u, c]` per unit and candidate (exactly one per unit), and for each edge
whose two ends can each lay the value out more than one way, a continuous `y[e, p, q] >= 0` per
pair of (produced layout, wanted layout), tied to the ends by `sum_q y[e, p, q] = sum of x[u, c]
giving p` and `sum_p y[e, p, q] = sum of x[w, d] wanting q`. With the `x` integral, exactly one `y`
of an edge is 1, so the edge variables need not be integers (Alpa's formulation needs |C_u|·|C_w|
binaries per edge). An edge with one layout on either end folds its cost into the other end's `x`.

Objective: the units' own seconds (partial sums, compute) plus the edges' redistribution seconds,
plus one latency per set of all-reduces XLA combines (a continuous `z[s] >= x[u, c]` for each
candidate whose all-reduce joins set `s`), in microseconds. Memory: per device at a program point,
the values live there at their local size must fit the budget; the point of the replicated peak is
constrained first, and a point the solution overflows is added and the problem solved again (a few
rounds at most).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence

import numpy as np

from jshard.cost import value_bytes
from jshard.search._graph import TIE, Assignment, Group, Infeasible, SearchGraph, Solved

_ROUNDS = 4


def solve(g: SearchGraph, groups: Sequence[Group], budget: float | None, time_limit: float) -> Solved:  # noqa: C901  (the MILP's variables and constraints, built in one place)
    """The least-cost choice over `groups` (mesh-axis groups, each given to one factor or none)."""
    from scipy.optimize import Bounds, LinearConstraint, milp  # noqa: PLC0415  (SciPy loads on demand)
    from scipy.sparse import coo_array  # noqa: PLC0415

    start = time.perf_counter()
    cands = [g.candidates(k, groups) for k in range(len(g.units))]
    offset = np.cumsum([0] + [len(c) for c in cands])
    n_x = int(offset[-1])
    cost = [g.unit_seconds(k, a) * 1e6 for k, cs in enumerate(cands) for a in cs]
    rows, cols, vals, lo, hi = [], [], [], [], []

    def row(entries, low, high):
        r = len(lo)
        for c, v in entries:
            rows.append(r)
            cols.append(c)
            vals.append(v)
        lo.append(low)
        hi.append(high)

    for k, cs in enumerate(cands):
        row([(int(offset[k]) + j, 1.0) for j in range(len(cs))], 1.0, 1.0)
    constant = 0.0
    for e in g.edges:
        (u, pu), (w, pw) = e.src, e.dst
        made = _by_spec(g, u, pu, cands[u])
        want = _by_spec(g, w, pw, cands[w])
        if len(made) == 1 and len(want) == 1:
            (p,), (q,) = made, want
            constant += g.edge_seconds(e, p, q) * 1e6
        elif len(made) == 1:
            (p,) = made
            for q, js in want.items():
                for j in js:
                    cost[int(offset[w]) + j] += g.edge_seconds(e, p, q) * 1e6
        elif len(want) == 1:
            (q,) = want
            for p, js in made.items():
                for j in js:
                    cost[int(offset[u]) + j] += g.edge_seconds(e, p, q) * 1e6
        else:
            first = len(cost)
            ps, qs = list(made), list(want)
            cost += [g.edge_seconds(e, p, q) * 1e6 for p in ps for q in qs]
            for a, p in enumerate(ps):
                row([(first + a * len(qs) + b, 1.0) for b in range(len(qs))]
                    + [(int(offset[u]) + j, -1.0) for j in made[p]], 0.0, 0.0)
            for b, q in enumerate(qs):
                row([(first + a * len(qs) + b, 1.0) for a in range(len(ps))]
                    + [(int(offset[w]) + j, -1.0) for j in want[q]], 0.0, 0.0)
    for v, makers in g.producers.items():  # one variable made at several call sites: one layout
        if len(makers) < 2:
            continue
        _, u, pu = makers[0]
        first = _by_spec(g, u, pu, cands[u])
        for _, w, pw in makers[1:]:
            other = _by_spec(g, w, pw, cands[w])
            for p in set(first) | set(other):
                row([(int(offset[u]) + j, 1.0) for j in first.get(p, ())]
                    + [(int(offset[w]) + j, -1.0) for j in other.get(p, ())], 0.0, 0.0)
    _combined(g, cands, offset, cost, row)
    peak_at = int(np.argmax(g.live_bytes({v: value_bytes(v) for v in g.memory_values})))
    for c, b in _memory_row(g, peak_at, cands, offset):  # between plans of equal cost, the one that holds less
        cost[c] += TIE * b * 1e6
    n = len(cost)
    integrality = np.zeros(n)
    integrality[:n_x] = 1
    points = [] if budget is None else [int(np.argmax(g.live_bytes({v: value_bytes(v) for v in g.memory_values})))]
    status, result = "", None
    for _ in range(_ROUNDS):
        m_rows, m_cols, m_vals, m_hi = list(rows), list(cols), list(vals), list(hi)
        m_lo = list(lo)
        for t in points:
            r = len(m_lo)
            for c, v in _memory_row(g, t, cands, offset):
                m_rows.append(r)
                m_cols.append(c)
                m_vals.append(v / budget)
            m_lo.append(-np.inf)
            m_hi.append(1.0)
        a = coo_array((m_vals, (m_rows, m_cols)), shape=(len(m_lo), n)).tocsr()
        left = max(min(1.0, time_limit), time_limit - (time.perf_counter() - start))  # each round some time
        result = milp(np.asarray(cost), integrality=integrality, bounds=Bounds(0, 1),
                      constraints=LinearConstraint(a, m_lo, m_hi),
                      options={"time_limit": left, "disp": False, "mip_rel_gap": 1e-6})
        if result.x is None:  # infeasible under the budget, or no solution found within the time limit
            raise Infeasible(f"HiGHS: {result.message}")
        choice = [cs[int(np.argmax(result.x[offset[k]:offset[k + 1]]))] for k, cs in enumerate(cands)]
        peak, t = g.peak(choice)
        if budget is None or peak <= budget * (1 + 1e-9) or t in points:
            break
        points.append(t)
    if result.status == 0:
        status = "optimal"
    else:
        gap = getattr(result, "mip_gap", None)
        status = f"time limit ({time_limit:g} s): best solution found" + (
            f", within {gap:.1%} of optimal" if gap is not None and math.isfinite(gap) else "")
    seconds = (float(result.fun) + constant) / 1e6
    return Solved(choice, seconds, peak, status)


def _combined(g: SearchGraph, cands, offset, cost: list, row) -> None:
    """One variable per set of combinable all-reduces (`SearchGraph.combined_sets`), at least
    every candidate's that joins it, priced at the set's latency: the objective pays it once."""
    sets: dict[tuple, int] = {}
    for k in sorted(g.combinable):
        for j, a in enumerate(cands[k]):
            for axes in g.partial_sums(k, a):
                key = g.combined_set(k, axes)
                if key not in sets:
                    sets[key] = len(cost)
                    cost.append(g.units[k].weight * g.cost.group_latency(axes) * 1e6)
                row([(sets[key], 1.0), (int(offset[k]) + j, -1.0)], 0.0, np.inf)


def _by_spec(g: SearchGraph, k: int, pos: int, cands: Sequence[Assignment]) -> dict:
    """Layout of operand `pos` -> the candidates of unit `k` that give it."""
    out: dict = {}
    for j, a in enumerate(cands):
        out.setdefault(g.spec(k, pos, a), []).append(j)
    return out


def _memory_row(g: SearchGraph, t: int, cands, offset):
    coef: dict[int, float] = {}
    for v in g.live_at(t):
        k, pos = g.makers[v]
        size = value_bytes(v)
        for j, a in enumerate(cands[k]):
            spec = g.spec(k, pos, a)
            cut = math.prod(g.axis_size[x] for axes in spec for x in axes)
            c = int(offset[k]) + j
            coef[c] = coef.get(c, 0.0) + size / cut
    return list(coef.items())
