"""`parallelize(fn, pipeline=js.Pipelining(S, M, schedule=...))`: a pipelined step.

The front end of the pipeline package, on the compile core's pieces: the same validated `Options`
(with its `Pipelining`), the same per-signature cache, strategy canonicalizer and dataset
policy as `parallelize`. It refuses the options a pipeline does not take and returns a `Pipelined`
step for a `jshard.Pipeline` (`_pipelined.py`) or a `Staged` one for a plain function
(`_staged_step.py`); both check the pipeline's own rules (`_checks.py`) and build its mesh (a
leading `stage` axis of size S, then the stage's own fine mesh over `devices / S` devices).
"""

from __future__ import annotations

from typing import Any

from jshard._errors import ShardingError
from jshard.compile import Options
from jshard.pipeline._checks import name_of
from jshard.pipeline._model import Pipeline
from jshard.pipeline._pipelined import Pipelined
from jshard.pipeline._staged_step import Staged


def pipelined(fn: Any, options: Options) -> Pipelined | Any:
    """What `parallelize(..., pipeline=js.Pipelining(S, ...))` returns: a `Pipelined` (or a decorator making one).

    Of the `Options`, only `devices`, `in_strategy` (strategies over one stage's devices),
    `dataset_strategy` and `pipeline` apply; for a step cut into stages also `cost_model` (the
    balance of an untagged step), and with `mode="auto"` `search` and `memory_budget` (each stage's
    strategy searched over its devices).
    """
    call = f"jshard.parallelize({name_of(fn) if fn is not None else 'fn'})"
    assert options.pipeline is not None  # parallelize calls it with one
    if options.pipeline.stages is None:
        raise ShardingError(
            f"{call}: micro_batches=, schedule= and virtual_stages= configure a pipeline, but stages= "
            f"is missing. Pass js.Pipelining(stages=S, ...) (and a jshard.Pipeline), or drop them."
        )
    if options.mesh is not None or options.mode not in ("semi_auto", "auto"):
        what = "mesh=" if options.mesh is not None else f"mode={options.mode!r}"
        raise ShardingError(
            f"{call}: pipeline= builds its own mesh (a stage axis, then each stage's devices) with "
            f"stage-internal strategies as in semi_auto (or searched, mode='auto'); {what} cannot be combined with "
            f"it. Drop {what.split('=')[0]}=."
        )
    jit_options = [k for k in ("static_argnums", "static_argnames", "donate_argnames") if getattr(options, k)]
    if jit_options:
        raise ShardingError(
            f"{call}: a pipeline step takes (params, batch), both traced; {jit_options[0]}= applies to "
            f"parallelize's own program, not to a pipeline. Bind static values into the stage functions "
            f"(functools.partial), or drop pipeline=."
        )
    if options.optimizer is not None:
        raise ShardingError(
            f"{call}: optimizer= (optimizer parallel) cuts the optimizer state over the axes the strategies leave replicated, "
            f"in mode='data', 'semi_auto' or 'auto'; it cannot be used with a pipeline yet. Use mode='data', "
            f"'semi_auto' or 'auto', or drop optimizer=."
        )
    if options.accumulation is not None:
        raise ShardingError(
            f"{call}: accumulation= cuts a step's batch into micro-batches outside a pipeline; a pipeline "
            f"accumulates its own micro_batches. Use Pipelining(micro_batches=...), or drop accumulation=."
        )
    if options.offload:
        raise ShardingError(
            f"{call}: offload={options.offload} keeps state in host memory in the one-program "
            f"path; it cannot be used with a pipeline yet. Drop offload= or the pipeline."
        )
    if fn is None:
        return lambda f: _pipelined_step(f, options)
    return _pipelined_step(fn, options)


def _pipelined_step(fn: Any, options: Options) -> Pipelined | Staged:
    """A `Pipelined` step for a `jshard.Pipeline`, a `Staged` one for a function tagged with
    `jshard.pipeline_stage`."""
    if isinstance(fn, Pipeline):
        if options.mode == "auto":
            raise ShardingError(
                f"jshard.parallelize({name_of(fn)}): mode='auto' searches the strategies inside the stages of a step cut "
                f"into stages (pipeline_stage tags, or none: cut by the cost model); a jshard.Pipeline's stages take "
                f"in_strategy and jshard.shard calls. Use mode='semi_auto' with the Pipeline, or pass its loss as a "
                f"plain function with mode='auto'."
            )
        return Pipelined(fn, options)
    if not callable(fn):
        raise TypeError(
            f"jshard.parallelize({name_of(fn)}): pipeline= needs a jshard.Pipeline or a function whose parts "
            f"are tagged with jshard.pipeline_stage(fn, k), got {type(fn).__name__}."
        )
    return Staged(fn, options)
