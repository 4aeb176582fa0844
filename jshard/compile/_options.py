"""The options of one parallelized function, validated once for every front end.

`parallelize`, the pipeline front end and `jshard plan` build one `Options` (with a
`PipelineOptions` where a pipeline is asked for) and call `check`; each rule raises one
`ShardingError` naming the call, the value and the fix. A new feature adds a field and a rule
here, not another keyword check in a front end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from jax.sharding import Mesh

from jshard._errors import ShardingError
from jshard._recompute import check_policy
from jshard.cost import CostModel
from jshard.hetero import check_offload
from jshard.layouts import DatasetStrategy, check_dataset_strategy
from jshard.plan import Plan
from jshard.search import SEARCHES

MODES = ("data", "semi_auto", "auto", "manual")
"""`parallelize`'s modes (see its docstring)."""

PROPAGATIONS = ("jshard", "xla")
"""Who lays out the operators no strategy fixes: jshard's engine, or Shardy."""


@dataclasses.dataclass(frozen=True)
class PipelineOptions:
    """How to pipeline (`parallelize(..., pipeline_stages=S, micro_batches=M, schedule=...)`).

    Attributes:
      stages: S, the number of stages.
      micro_batches: M, micro-batches per step.
      schedule: `"1f1b"`, `"gpipe"`, `"interleaved"` or `"zb-h1"` (zero bubble).
      virtual_stages: v, model chunks per stage (interleaved).
      result_broadcast: inference outputs on every device (else on the last stage).
    """

    stages: int | None
    micro_batches: int | None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    result_broadcast: bool = False

    @property
    def asked(self) -> bool:
        """Whether any pipeline option differs from its default (a pipeline was asked for)."""
        return (self.stages is not None or self.micro_batches is not None or self.schedule != "1f1b"
                or self.virtual_stages != 1)


@dataclasses.dataclass(frozen=True)
class OptimizerParallel:
    """Optimizer parallel (`parallelize(..., optimizer_parallel=level, optimizer_parallel_threshold=...)`,
    MindSpore's `enable_parallel_optimizer` with `optimizer_level` and `parallel_optimizer_threshold`).

    Attributes:
      level: 1 cuts the optimizer state over the data-parallel devices, 2 also reduce-scatters the
        gradients, 3 also cuts the parameters (all-gathered before use: ZeRO-3 / FSDP).
      threshold: bytes (or a size such as `"64KiB"`, as given); smaller leaves stay whole.
      state_argnums: the optimizer-state arguments; None: every one but argument 0 (the
        parameters) and the batch.
    """

    level: Any
    threshold: Any = "64KiB"
    state_argnums: tuple[int, ...] | None = None

    @property
    def threshold_bytes(self) -> float:
        return parse_bytes(self.threshold)


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """Gradient accumulation (`parallelize(..., accumulation_steps=k, accumulation_shard=...)`,
    MindSpore's `gradient_accumulation` and `gradient_accumulation_shard`), run by the
    `jshard.accumulate` call inside the step.

    Attributes:
      steps: k, the micro-batches one step's batch is cut into.
      shard: whether the accumulated gradients are cut over the data-parallel axes the parameters'
        layout leaves free (ZeRO-style), rather than laid out as the gradients are.
    """

    steps: Any
    shard: Any = False


@dataclasses.dataclass(frozen=True)
class Options:
    """Every option of one `parallelize` call (see `jshard.parallelize` for each)."""

    devices: int | None = None
    mesh: Mesh | None = None
    mode: str = "semi_auto"
    in_strategy: Any = None
    out_strategy: Any = None
    donate_argnums: tuple[int, ...] = ()
    static_argnums: tuple[int, ...] = ()
    static_argnames: tuple[str, ...] = ()
    donate_argnames: tuple[str, ...] = ()
    dataset_strategy: DatasetStrategy = "data_parallel"
    batch_argnums: tuple[int, ...] | None = None
    propagation: str = "jshard"
    cost_model: CostModel | None = None
    enable_alltoall: bool = True
    plan: Plan | None = None
    search: str = "recursive"
    memory_budget: float | None = None
    search_time_limit: float = 60.0
    search_replay: bool = True
    pipeline: PipelineOptions | None = None
    optimizer: OptimizerParallel | None = None
    accumulation: Accumulation | None = None
    optimizer_comm_recompute: Any = False
    offload: tuple[str, ...] | None = None
    recompute: Any = None

    @classmethod
    def create(cls, *, donate_argnums: int | Sequence[int] = (), batch_argnums: int | Sequence[int] | None = None,
               static_argnums: int | Sequence[int] = (), static_argnames: str | Sequence[str] = (),
               donate_argnames: str | Sequence[str] = (), memory_budget: int | float | str | None = None,
               search_time_limit: float = 60.0,
               pipeline_stages: int | None = None, micro_batches: int | None = None, schedule: str = "1f1b",
               virtual_stages: int = 1, pipeline_result_broadcast: bool = False, optimizer_parallel: int | None = None,
               optimizer_parallel_threshold: int | float | str = "64KiB",
               optimizer_state_argnums: int | Sequence[int] | None = None, accumulation_steps: int | None = None,
               accumulation_shard: bool = False, offload: str | Sequence[str] | None = None, **fields: Any) -> Options:
        """Options from `parallelize`'s keywords, normalized (argnums and argnames as tuples, sizes as
        bytes, the pipeline's keywords as one `PipelineOptions`, or None where none differs from its
        default; the optimizer-parallel keywords as one `OptimizerParallel`, or None without a level;
        the accumulation keywords as one `Accumulation`, or None without `accumulation_steps`;
        `offload` as a tuple of names, None where not given: the search may choose)."""
        optimizer = None if optimizer_parallel is None else OptimizerParallel(
            optimizer_parallel, optimizer_parallel_threshold,
            None if optimizer_state_argnums is None else _as_tuple(optimizer_state_argnums))
        accumulation = None if accumulation_steps is None and accumulation_shard is False else Accumulation(
            accumulation_steps, accumulation_shard)
        pipeline = PipelineOptions(pipeline_stages, micro_batches, schedule, virtual_stages, pipeline_result_broadcast)
        return cls(donate_argnums=_as_tuple(donate_argnums), batch_argnums=None if batch_argnums is None else _as_tuple(batch_argnums),
                   static_argnums=_as_tuple(static_argnums), static_argnames=_as_tuple(static_argnames),
                   donate_argnames=_as_tuple(donate_argnames),
                   memory_budget=parse_bytes(memory_budget), search_time_limit=float(search_time_limit),
                   pipeline=pipeline if pipeline.asked else None, optimizer=optimizer,
                   accumulation=accumulation,
                   offload=None if offload is None else _as_tuple(offload), **fields)

    @property
    def costs(self) -> CostModel:
        """The cost model the planners price with: `cost_model` (default one GPU node), all-to-all
        redistributions allowed as `enable_alltoall` says."""
        return dataclasses.replace(self.cost_model or CostModel(), alltoall=bool(self.enable_alltoall))

    @property
    def searching(self) -> bool:
        """Whether the strategy search plans (`mode="auto"` with a search, no loaded plan)."""
        return self.mode == "auto" and self.search != "propagation" and self.plan is None

    def check(self, call: str) -> None:
        """Raises `ShardingError` (or `TypeError`) for the first rule these options break."""
        _check_choices(call, self)
        if not isinstance(self.enable_alltoall, bool):
            raise TypeError(f"{call}: enable_alltoall= takes True or False, got {self.enable_alltoall!r}.")
        _check_search(call, self)
        if self.plan is not None and not isinstance(self.plan, Plan):
            raise TypeError(f"{call}: plan= takes a jshard.Plan (from Plan.load), got {type(self.plan).__name__}.")
        check_dataset_strategy(self.dataset_strategy, call=call)
        if self.mode == "manual" and not isinstance(self.dataset_strategy, str):
            raise ShardingError(f"{call}: mode='manual' lays out arguments by in_strategy's PartitionSpecs only; a "
                                f"dataset_strategy of strategy tuples needs mode='data', 'semi_auto' or 'auto'. Give "
                                f"the batch its PartitionSpecs in in_strategy instead.")
        check_arguments(call, self)
        _check_optimizer(call, self)
        _check_accumulation(call, self)
        check_offload(call, self.offload or ())  # with a pipeline: pipeline/_parallel.py refuses it
        check_policy(self.recompute, call)
        if self.mode == "manual" and self.mesh is None:
            raise ShardingError(f"{call}: mode='manual' takes PartitionSpecs over your mesh; pass mesh=... too.")
        if self.mesh is not None and self.devices is not None and self.devices != self.mesh.devices.size:
            raise ShardingError(f"{call}: devices={self.devices} but mesh has {self.mesh.devices.size} devices; pass one of them.")


def _check_choices(call: str, c: Options) -> None:
    if c.mode not in MODES:
        raise ShardingError(f"{call}: mode={c.mode!r} is not one of {MODES}.")
    if c.propagation not in PROPAGATIONS:
        raise ShardingError(f"{call}: propagation={c.propagation!r} is not one of {PROPAGATIONS}.")
    if c.plan is not None and (c.propagation != "jshard" or c.mode == "manual"):
        raise ShardingError(
            f"{call}: plan= rebuilds a plan jshard propagated or searched; it cannot be used with "
            f"{'mode=' + repr(c.mode) if c.mode == 'manual' else 'propagation=' + repr(c.propagation)}. "
            f"Drop plan=, or use propagation='jshard' with mode='semi_auto', 'auto' or 'data'."
        )
    if c.search not in SEARCHES:
        raise ShardingError(f"{call}: search={c.search!r} is not one of {SEARCHES}.")


def _check_search(call: str, c: Options) -> None:
    if c.mode != "auto" and (c.search != "recursive" or c.memory_budget is not None):
        what = "memory_budget" if c.memory_budget is not None else f"search={c.search!r}"
        raise ShardingError(f"{call}: {what} applies to the strategy search, mode='auto' (this call has "
                            f"mode={c.mode!r}). Pass mode='auto', or drop {what.split('=')[0]}.")
    if c.mode == "auto" and c.propagation != "jshard":
        raise ShardingError(f"{call}: mode='auto' searches with jshard's own cost model; it cannot be "
                            f"used with propagation={c.propagation!r}. Drop propagation=.")
    if c.mode == "auto" and c.search == "propagation" and c.memory_budget is not None:
        raise ShardingError(f"{call}: search='propagation' cuts the batch and propagates; it does not "
                            f"weigh memory, so it cannot meet memory_budget. Use search='recursive' or 'ilp'.")
    if c.memory_budget is not None and c.memory_budget <= 0:
        raise ShardingError(f"{call}: memory_budget must be a positive number of bytes per device, "
                            f"got {c.memory_budget!r}.")


def _check_optimizer(call: str, c: Options) -> None:
    o = c.optimizer
    if o is None:
        return
    if isinstance(o.level, bool) or o.level not in (1, 2, 3):
        raise ShardingError(f"{call}: optimizer_parallel={o.level!r} is not a level; give 1 (cut the optimizer "
                            f"state), 2 (also reduce-scatter the gradients) or 3 (also cut the parameters), or "
                            f"None for no optimizer parallel.")
    try:
        threshold = o.threshold_bytes
    except (TypeError, ValueError):
        threshold = None
    if threshold is None or not threshold >= 0:
        raise ShardingError(f"{call}: optimizer_parallel_threshold={o.threshold!r} is not a size; give bytes (an "
                            f"int) or a string such as '64KiB' or '1MiB'.")
    if c.mode == "manual" or c.pipeline is not None:
        what = "a pipeline" if c.pipeline is not None else f"mode={c.mode!r}"
        raise ShardingError(f"{call}: optimizer_parallel cuts the optimizer state over the axes the strategies "
                            f"leave replicated, in mode='data', 'semi_auto' or 'auto'; it cannot be used with {what} "
                            f"yet. Use mode='data', 'semi_auto' or 'auto', or drop optimizer_parallel.")
    if o.state_argnums is not None:
        bad = [v for v in o.state_argnums if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"{call}: optimizer_state_argnums takes ints (or one int), got {bad[0]!r}.")


def _check_accumulation(call: str, c: Options) -> None:
    if not isinstance(c.optimizer_comm_recompute, bool):
        raise TypeError(f"{call}: optimizer_comm_recompute takes True or False, got {c.optimizer_comm_recompute!r}.")
    if c.optimizer_comm_recompute and (c.optimizer is None or c.optimizer.level != 3):
        level = "no optimizer_parallel" if c.optimizer is None else f"optimizer_parallel={c.optimizer.level!r}"
        raise ShardingError(f"{call}: optimizer_comm_recompute=True gathers a parameter optimizer parallel level 3 "
                            f"keeps cut again in the backward pass; this call has {level}. Pass "
                            f"optimizer_parallel=3, or drop optimizer_comm_recompute.")
    a = c.accumulation
    if a is None:
        return
    if not isinstance(a.shard, bool):
        raise TypeError(f"{call}: accumulation_shard takes True or False, got {a.shard!r}.")
    if a.steps is None or isinstance(a.steps, bool) or not isinstance(a.steps, int) or a.steps < 1:
        raise ShardingError(f"{call}: accumulation_steps={a.steps!r} is not a number of micro-batches; give a "
                            f"positive int k that divides the batch's rows (1: no accumulation).")
    if a.shard and c.mode not in ("data", "semi_auto"):
        raise ShardingError(f"{call}: accumulation_shard=True cuts the accumulated gradients over the axes the "
                            f"parameters' layout leaves free, in mode='data' or 'semi_auto'; this call has "
                            f"mode={c.mode!r}. Use mode='data' or 'semi_auto', or drop accumulation_shard.")


def check_arguments(call: str, c: Options) -> None:
    """jit's argument options: numbers are ints and names strs (else `TypeError`), and no argument is
    both static and donated, static and the batch, or static with an `in_strategy` entry."""
    for what, values, kind in (("static_argnums", c.static_argnums, int), ("donate_argnums", c.donate_argnums, int),
                               ("batch_argnums", c.batch_argnums or (), int), ("static_argnames", c.static_argnames, str),
                               ("donate_argnames", c.donate_argnames, str)):
        bad = [v for v in values if not isinstance(v, kind) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"{call}: {what} takes {kind.__name__}s (or one {kind.__name__}), got {bad[0]!r} "
                            f"in {what}={values!r}.")
    for (what, given), why in ((("donate_argnums", c.donate_argnums), "a static argument is no buffer to donate"),
                               (("batch_argnums", c.batch_argnums or ()), "a static argument is not traced, so no "
                                                                           "device holds a part of it")):
        both = sorted(set(c.static_argnums) & set(given))
        if both:
            raise ShardingError(f"{call}: argument {both[0]} is in both static_argnums={c.static_argnums} and "
                                f"{what}={given}; {why}. Drop it from one of them.")
    both = sorted(set(c.static_argnames) & set(c.donate_argnames))
    if both:
        raise ShardingError(f"{call}: {both[0]!r} is in both static_argnames={c.static_argnames} and donate_argnames="
                            f"{c.donate_argnames}; a static argument is no buffer to donate. Drop it from one of them.")
    _check_static_strategy(call, c)


def _check_static_strategy(call: str, c: Options) -> None:
    """`in_strategy` has one entry per positional argument; a static one's must be None."""
    if not isinstance(c.in_strategy, (tuple, list)):
        return
    n = len(c.in_strategy)
    for i in sorted({i % n for i in c.static_argnums if -n <= i < n}):
        if c.in_strategy[i] is not None:
            raise ShardingError(
                f"{call}: in_strategy[{i}]={c.in_strategy[i]!r} lays out argument {i}, which is static "
                f"(static_argnums={c.static_argnums}); a static argument is not traced, so it has no layout. "
                f"Give None there.")


def _as_tuple(value: Any) -> tuple:
    """Argument numbers or names as a tuple: one (an int, a str, or a wrong kind for `check` to
    name) or a sequence of them."""
    return tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else (value,)


def parse_bytes(value: int | float | str | None) -> float | None:
    """`16GiB`, `512 MiB`, `2e9` or a number of bytes, as bytes; None stays None.

    Examples:
      >>> parse_bytes("1.5KiB"), parse_bytes(4096), parse_bytes("2GB")
      (1536.0, 4096.0, 2000000000.0)
    """
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    if not isinstance(value, str):
        raise TypeError(f"a size is bytes (a number) or a string such as '64KiB', not {type(value).__name__}")
    text = value.strip().replace(" ", "")
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "B": 1}
    for unit, size in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * size
    return float(text)
