"""Pipeline parallel: stages, micro-batches, GPipe / 1F1B / interleaved / zero-bubble (ZB-H1) schedules.

`Pipeline` describes a model as first / layer stack / last; `pipeline_stage` tags per-stage
functions; `jshard.parallelize(pipe, pipeline_stages=S, micro_batches=M, schedule=...)` returns a
`Pipelined` step (one `jax.jit` program per step, see `_engine.py` for why); its `plan` is a
`PipelinePlan` with the `Schedule` table and picture, bubble, memory and boundary bytes.
"""

from jshard.pipeline._model import Pipeline as Pipeline
from jshard.pipeline._model import StageFunction as StageFunction
from jshard.pipeline._model import pipeline_stage as pipeline_stage
from jshard.pipeline._parallel import Pipelined as Pipelined
from jshard.pipeline._parallel import pipelined as pipelined
from jshard.pipeline._plan import PipelinePlan as PipelinePlan
from jshard.pipeline._plan import StageInfo as StageInfo
from jshard.pipeline._schedule import SCHEDULES as SCHEDULES
from jshard.pipeline._schedule import Schedule as Schedule
from jshard.pipeline._schedule import build_schedule as build_schedule
