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
      search_models: the models the strategy search is compared with the experts on (table 5):
        reference models, and the zoo's (`loop_gpt`, `linen_lm`, `nnx_gqa`, `eqx_vit`, `linen_resnet`:
        models written by others, each against its own experts).
      search_time_limit: the ILP's time limit per search, seconds.
      search_depths / search_counts: the unrolled GPT's layers and the device counts of the search's
        planning-time curve (table 7).
      search_big: also plan the GPT-3, 12-layer GPT and Alpa GPT-39B shapes (table 7).
      memory_step_budget: seconds of table 9's rounds of steps (twelve programs side by side).
    """

    size: str
    depths: tuple[int, ...]
    plan_runs: int
    plan_budget: float
    compile_pairs: int
    compile_budget: float
    step_rounds: int
    step_budget: float
    search_models: tuple[str, ...] = ()
    search_time_limit: float = 30.0
    search_depths: tuple[int, ...] = ()
    search_counts: tuple[int, ...] = ()
    search_big: bool = False
    memory_step_budget: float = 60.0


FULL = Settings("full", (12, 48, 96), 3, 30.0, 3, 30.0, 300, 12.0, search_models=("MLP", "GPT", "GPT scan", "ResNet", "MoE", "loop_gpt", "linen_lm", "nnx_gqa", "eqx_vit", "linen_resnet"),
                search_time_limit=30.0, search_depths=(2, 4, 8), search_counts=(8, 64, 1024), search_big=True)
QUICK = Settings("quick", (2, 4), 1, 5.0, 1, 5.0, 10, 2.0, search_models=("MLP",), search_time_limit=5.0,
                 search_depths=(2,), search_counts=(8, 64), memory_step_budget=5.0)
