"""Pipeline parallel: stages, micro-batches, GPipe / 1F1B / interleaved / zero-bubble (ZB-H1) schedules.

`pipeline_stage(fn, k)` tags the parts of any step with their stage: `jshard.parallelize(step,
pipeline=js.Pipelining(S, M, schedule=...))` returns a `Staged` step, the step's forward loss
`cut` into per-stage functions (`Cut`; with no tags, where the cost model balances the stages,
reported in its `StageBalance`; with `mode="auto"` a `SearchedCut`, each stage's strategy searched
over its devices) run by a `StagedProgram` with each stage's parameters on its
own devices (a leaf a `jshard.shard` strategy cuts inside its stage packed by its layout class,
`CutClass`, cut as the strategy cuts it; its residuals and boundary values packed in the
layouts its strategies give them, `stage_layouts`: `StageLayouts`). `Pipeline` describes a model as first / layer stack / last (the fast path for identical
layers); for it `parallelize` returns a `Pipelined` step (one `jax.jit` program per step, see
`_engine.py` for why); its `plan` is a `PipelinePlan` with the `Schedule` table and picture,
bubble, memory and boundary bytes.
"""

from jshard.pipeline._balance import StageBalance as StageBalance
from jshard.pipeline._cut import Cut as Cut
from jshard.pipeline._cut import cut as cut
from jshard.pipeline._inner import CutClass as CutClass
from jshard.pipeline._inner import StageLayouts as StageLayouts
from jshard.pipeline._inner import stage_layouts as stage_layouts
from jshard.pipeline._model import Pipeline as Pipeline
from jshard.pipeline._model import StageFunction as StageFunction
from jshard.pipeline._model import pipeline_stage as pipeline_stage
from jshard.pipeline._parallel import pipelined as pipelined
from jshard.pipeline._pipelined import Pipelined as Pipelined
from jshard.pipeline._plan import PipelinePlan as PipelinePlan
from jshard.pipeline._plan import StageInfo as StageInfo
from jshard.pipeline._schedule import SCHEDULES as SCHEDULES
from jshard.pipeline._schedule import Schedule as Schedule
from jshard.pipeline._schedule import build_schedule as build_schedule
from jshard.pipeline._staged import StagedProgram as StagedProgram
from jshard.pipeline._staged_step import Staged as Staged
from jshard.pipeline._stagesearch import SearchedCut as SearchedCut
