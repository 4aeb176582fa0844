"""How much a run measures: the model size, the depths, and how many repetitions within what time."""

from __future__ import annotations

import dataclasses

DEVICES = 8
"""Simulated CPU devices every compiled figure is measured on."""


@dataclasses.dataclass(frozen=True, slots=True)
class Settings:
    """Attributes:
      size: the models' size (`quick` or `full`; see `benchmarks._models`).
      depths: GPT layers at which planning time is measured.
      plan_runs / plan_budget: planning runs per depth, and seconds after which no new run starts.
      compile_pairs / compile_budget: jshard-vs-jit compile pairs per model, and their seconds.
      step_rounds / step_budget: rounds of jshard-vs-jit steps per model, and their seconds.
    """

    size: str
    depths: tuple[int, ...]
    plan_runs: int
    plan_budget: float
    compile_pairs: int
    compile_budget: float
    step_rounds: int
    step_budget: float


FULL = Settings("full", (12, 48, 96), 3, 30.0, 3, 30.0, 300, 12.0)
QUICK = Settings("quick", (2, 4), 1, 5.0, 1, 5.0, 10, 2.0)
