"""The tick loop both pipelined programs run (`_engine.py`'s stacked one, `_staged.py`'s cut one).

The schedule's ticks run as consecutive loops, one per repeating permute pattern
(`Schedule.segments`), each body position handed its row of the stage's tick table, its permutes
and what runs at it (`Running`), so that a position compiles only the operations some stage runs
there: a fill tick no backward, a drain tick no forward. Table and slot indices are never
negative, so they are read without the wrap-around arithmetic of `a[i]` (`take`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from jshard.pipeline._schedule import Schedule


def take(a: jax.Array, i: jax.Array, axis: int) -> jax.Array:
    """`a`'s entry `i` along `axis` (dim dropped), for an index the schedule's table makes (never
    negative): one `dynamic_slice`, without the wrap-around arithmetic that `a[i]` emits for every
    dim of every read (at S = 4 most of a pipelined step's program was that arithmetic)."""
    return jax.lax.dynamic_index_in_dim(a, i, axis, keepdims=False, allow_negative_indices=False)


@dataclasses.dataclass(frozen=True)
class Running:
    """What one position of a tick loop's body can be asked to run: `(code, vstage)` of the
    operations some stage runs at its ticks (`Schedule.running`). A tick compiles only those: a
    fill tick no backward, a drain tick no forward, a forward that runs on no end stage there
    neither `first` nor `last` (at S = 4 the fill and drain ticks, each a loop of its own, were
    most of a step's program, every one compiling every operation)."""

    ops: frozenset[tuple[int, int]]

    def vstages(self, code: int) -> list[int]:
        """The virtual stages that run operation `code` here."""
        return sorted(v for c, v in self.ops if c == code)

    def switch(self, code: jax.Array, branches: Sequence[Callable], *operands) -> Any:
        """`branches[code](*operands)`, compiling only the branches of the codes that run here."""
        return select(code, sorted({c for c, _ in self.ops}), branches, *operands)


def select(index: jax.Array, cases: Sequence[int], branches: Sequence[Callable] | Mapping[int, Callable],
           *operands) -> Any:
    """`branches[index](*operands)` where `index` is one of the static `cases` (sorted): a
    `lax.switch` over those branches only, or the one branch called where there is one case."""
    if len(cases) == 1:
        return branches[cases[0]](*operands)
    position = sum((index > k).astype(jnp.int32) for k in cases[:-1])  # where `index` is among `cases`
    return jax.lax.switch(position, [branches[k] for k in cases], *operands)


def scan_ticks(schedule: Schedule, table: jax.Array, carry: Any, tick: Callable) -> Any:
    """Runs `tick(carry, row, permutes, running)` over `schedule`'s ticks: one `fori_loop` per
    segment (`Schedule.segments`), whose body holds the segment's pattern of ticks, each handed its
    row of this stage's `[ticks, fields]` table, its permute patterns (`Schedule.permutes`) and
    what runs at it over the loop's repeats (`Running`). Rows are read in place (a sliced table is
    a copy), and the loops hand one carry on (no buffer copied)."""
    for start, repeats, pattern in schedule.segments():
        width = len(pattern)
        running = [Running(schedule.running(range(start + k, start + repeats * width, width))) for k in range(width)]

        def body(r, carry, start=start, pattern=pattern, running=running):
            for k, permutes in enumerate(pattern):
                row = take(table, start + r * len(pattern) + k, 0)
                carry = tick(carry, row, permutes, running[k])
            return carry

        carry = jax.lax.fori_loop(0, repeats, body, carry)
    return carry
