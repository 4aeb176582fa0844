"""Table 18: the round trip a training loop pays between calls, beside the step's own collectives.

A step that takes its parameters or optimizer state in one layout and returns them in another
makes the next call move them (`jax.device_put` to the program's input shardings) before it runs:
bytes no audit of one compiled program sees. Each row runs three calls of an Adam train step on
loop_gpt (2 layers, d 256, ff 1024, vocab 2048; `tests/clients/loop_gpt.py`), searched
(`mode="auto"`) under a memory budget, feeding each call's parameters and state to the next, and
counts what placing them moves before each call (`jshard.audit.moved_bytes`, the busiest device's
bytes received) beside the compiled step's collective bytes (`jshard.audit`, its payload
convention). A result that updates an argument is laid out as the plan makes it, not as the argument
is taken (moving it back inside the program was tried and reverted: XLA made the move by a full
rematerialization the plan did not price), so where the two differ the loop moves it.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

import jax
import optax

import jshard as js
from benchmarks._table import Table, size
from jshard.audit import moved_bytes

BUDGETS_MIB = (12.0, 8.0)
"""The budgets per device: both make the search cut state (at 20 MiB and above the data-parallel plan
fits, and its state is whole in and out). Each row searches for minutes on 2 cores."""
CALLS = 3
OPT = optax.adam(1e-3)


def _loop_gpt():
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from clients import loop_gpt

    return loop_gpt


def _step(loss_fn):
    def adam_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = OPT.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return adam_step


def round_trip_row(budget_mib: float, devices: int = 8) -> tuple[str, ...]:
    """One budget: the step's collective bytes and peak, the plan's round trip (`Plan.round_trip`), and
    what each of `CALLS` calls moved first."""
    loop_gpt = _loop_gpt()
    params, tokens = loop_gpt.create(layers=2, d=256, ff=1024, vocab=2048)
    state = OPT.init(params)
    step = js.parallelize(_step(loop_gpt.loss_fn), devices=devices, mode="auto", search=js.Search(memory_budget=budget_mib * 2**20))
    plan = step.plan(params, state, tokens)
    compiled = step.lower(params, state, tokens).compile()
    shardings = compiled.input_shardings[0]
    args = jax.device_put((params, state, tokens), shardings)
    moved = []
    for _ in range(CALLS):
        moved.append(moved_bytes(args, shardings))
        new_params, new_state, _ = step(*args)
        args = (new_params, new_state, args[2])
    audit = js.audit(compiled)
    return (f"{budget_mib:g} MiB", size(audit.bytes()), size(audit.memory.peak_bytes), size(plan.round_trip or 0),
            " / ".join(size(b) for b in moved[1:]))


def round_trip_table(budgets: Sequence[float] = BUDGETS_MIB) -> Table:
    return Table(
        "18. Round trip between calls: a loop of three Adam steps, 8 devices",
        "the loop moves nothing between calls: every move is in the step's own bytes, or the plan prices it",
        ("budget per device", "step collectives", "peak", "plan's round trip", "moved before calls 2 / 3"),
        tuple(round_trip_row(b) for b in budgets),
        ("loop_gpt (2 layers, d 256) with optax Adam, `mode='auto'` (recursive search) under `memory_budget`; "
         "moved: `jshard.audit.moved_bytes` of the fed-back parameters and state against the compiled program's "
         "input shardings (bytes the busiest device receives); call 1's placement of the caller's arrays is not "
         "counted. The plan's round trip: `Plan.round_trip`, what the plan says the loop moves before each call.",),
    )
