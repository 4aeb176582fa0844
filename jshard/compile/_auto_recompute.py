"""The last weighing of `mode="auto"` (`_weigh.py`): a recompute policy chosen per
`jshard.recompute(policy="auto")` region (`weigh_recompute`), from the step traced and planned once
per policy given to every region, the least recompute whose estimated peak fits the budget, and
the fastest that fits built."""

from __future__ import annotations

import dataclasses
from typing import cast

from jshard._errors import MemoryBudgetError
from jshard._format import human_bytes
from jshard._recompute import AUTO_POLICIES
from jshard.compile._boundary import argument_leaves
from jshard.compile._program import Program
from jshard.compile._stage import Signature, build_traced, fastest_that_fits, search_report
from jshard.compile._trace import Traced
from jshard.search import Weighed, assignment, choices, region_costs, upgrades


def weigh_recompute(s: Signature, traced: Traced, check: bool = True) -> Program:
    """Chooses a recompute policy per `policy="auto"` region and builds the step so.

    The step is traced and planned once per policy (`AUTO_POLICIES`) given to every region: each
    region priced under each policy from the fastest plans (`search.region_costs`); the least
    recompute per region whose estimated peak fits the budget (a prefix of `search.upgrades`)
    planned under the budget; and of it and the uniform plans that fit, the fastest built (with
    `memory_budget` and devices present, `check`: the fastest whose compiled program fits; else
    more recompute). Its `SearchReport` lists the policies weighed (`recompute`) and each region's
    (`regions`)."""
    c, budget = s.options, s.budget
    uniform: dict[str, tuple[Traced, Program | None, Program | MemoryBudgetError]] = {}
    weighed: list[Weighed] = []

    def weigh(policy: str) -> None:
        t = traced if policy == traced.ctx.recompute_choice else s.trace(traced.fine, policy)
        fastest, fits = _fitting(s, t, policy, traced.ctx.auto_regions > 1)
        weighed.append(
            Weighed(policy, None, fits.least_bytes)
            if isinstance(fits, MemoryBudgetError)
            else Weighed(policy, search_report(fits).seconds, search_report(fits).peak_bytes)
        )
        uniform[policy] = (t, fastest, fits)

    for policy in AUTO_POLICIES:
        s.planning.candidate(
            f"recompute {policy!r}",
            any(not isinstance(u[2], MemoryBudgetError) for u in uniform.values()),
            lambda: weigh(policy),
        )
    donated = argument_leaves(s.args, c.donate_argnums)
    costs = {
        p: region_costs(
            t.nodes,
            None if fastest is None else fastest.values,
            t.axis_size,
            t.invars,
            t.outvars,
            frozenset(t.invars[i] for i in donated),
            c.costs,
        )
        for p, (t, fastest, _) in uniform.items()
    }
    _, fastest, fits = uniform["none"]
    # no fastest plan: `_fitting` found none under the budget either, and says why
    peak = (
        search_report(fastest).peak_bytes
        if fastest is not None
        else cast(MemoryBudgetError, fits).least_bytes or float("inf")
    )
    moves = upgrades(costs, peak) if len(uniform) == len(AUTO_POLICIES) else []  # mixes need every policy
    regions = sorted(costs["none"])
    estimates = [peak] + [m[2] for m in moves]
    first = next((n for n, e in enumerate(estimates) if budget is None or e <= budget), len(moves))
    failed, tried = None, set()
    for n in range(first, len(moves) + 1):  # the estimate's prefix, then more recompute where XLA holds more
        choice = assignment(regions, moves[:n])
        candidates: dict[str | tuple[str, ...], tuple[Traced, Program]] = {
            p: (u[0], u[2]) for p, u in uniform.items() if not isinstance(u[2], MemoryBudgetError) and p not in tried
        }
        if len(set(choice)) > 1:
            mixed = s.planning.candidate("recompute per region", bool(candidates), lambda: _mixed(s, traced, choice))
            if isinstance(mixed, MemoryBudgetError):
                failed = mixed
            elif mixed is not None:
                candidates[choice] = mixed

        def held(key) -> Program:  # XLA's buffers held to the budget
            tried.add(key)
            t, program = candidates[key]
            return (
                build_traced(s, t, key) if check and c.memory_budget is not None and s.devices is not None else program
            )

        def refused(key, e: MemoryBudgetError) -> None:  # XLA holds more than estimated: weighed as not fitting
            nonlocal failed, weighed
            failed = e
            weighed = [
                dataclasses.replace(w, seconds=None, peak_bytes=e.least_bytes) if w.policy == key else w
                for w in weighed
            ]

        found = fastest_that_fits(candidates, lambda k: search_report(candidates[k][1]).seconds, held, refused)
        if found is not None:
            key, program = found
            assert program.plan.search is not None  # the search planned it
            policies = (key,) * len(regions) if isinstance(key, str) else key
            report = dataclasses.replace(
                program.plan.search,
                regions=choices(costs, policies, moves),
                recompute=tuple(dataclasses.replace(w, chosen=key == w.policy) for w in weighed),
            )
            return dataclasses.replace(program, plan=program.plan.replace(search=report))
    bound = all(isinstance(u[2], MemoryBudgetError) and u[2].bound for u in uniform.values())
    raise MemoryBudgetError(
        _recompute_error(s.call, cast(float, budget), s.budget_from, weighed, traced.fine.device_count),
        min((w.peak_bytes for w in weighed if w.peak_bytes is not None), default=None),
        bound,
    ) from failed


def _mixed(s: Signature, traced: Traced, choice: tuple) -> tuple[Traced, Program] | MemoryBudgetError:
    """The step traced with a policy per region (`choice`) and planned under the budget, or why
    nothing fits so."""
    t = s.trace(traced.fine, choice)
    _, fits = _fitting(s, t, choice, True)
    return fits if isinstance(fits, MemoryBudgetError) else (t, fits)


def _fitting(
    s: Signature, t: Traced, policy, fastest_first: bool
) -> tuple[Program | None, Program | MemoryBudgetError]:
    """The plan of `t` whose layouts price its regions (the fastest: planned without a budget), and
    its plan under `budget` (the fastest where it fits), or why none fits. Without `fastest_first`
    (one region: its policies are the uniform ones, and recomputing the last region lowers no
    estimate) planned under the budget only, the regions priced at its layouts, or (None) at the
    finest cuts."""
    budget = s.budget

    def plan(limit):
        return build_traced(dataclasses.replace(s, budget=limit), t, policy, False)

    fastest = plan(None) if fastest_first or budget is None else None
    if fastest is not None and (budget is None or fastest.plan.search.peak_bytes <= budget):
        return fastest, dataclasses.replace(
            fastest, plan=fastest.plan.replace(search=dataclasses.replace(fastest.plan.search, budget=budget))
        )
    try:
        fits = plan(budget)
    except MemoryBudgetError as e:
        return fastest, e
    return fastest or fits, fits


def _recompute_error(call: str, budget: float, budget_from: str, weighed, n: int) -> str:
    tried = "; ".join(w.text() for w in weighed)
    least = min(weighed, key=lambda w: w.peak_bytes if w.peak_bytes is not None else float("inf"))
    given = "memory_budget=" if budget_from == "memory_budget" else f"a budget of {budget_from}: "
    return (
        f"{call}: {given}{human_bytes(budget)} per device cannot be met on {n} devices with any recompute "
        f"policy of the jshard.recompute(policy='auto') regions ({tried}). The smallest peak the search "
        f"estimated is {human_bytes(least.peak_bytes or 0)} per device, with recompute {least.policy!r}. "
        f"Raise memory_budget to at least that, use more devices, shrink the batch, or recompute more of "
        f"the model (wrap more of it in jshard.recompute)."
    )
