"""The option groups `parallelize` takes, one frozen record per concern.

`parallelize` reads like `jax.jit`: the function, where it runs, the strategies, jit's own options,
and one object per concern (`Search`, `Pipelining`, `OptimizerParallel`, `Accumulation`,
`Communication`), as Alpa
groups its solver options and MindSpore's `AutoParallel` its `hsdp`/`pipeline` settings. The
keywords these replaced (`memory_budget=`, `pipeline_stages=`, `optimizer_parallel=`, ...) still work
for one release: `regroup` maps them onto the groups and warns with `DeprecationWarning`.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence
from typing import Any

SizeLike = int | float | str
"""A size in bytes: a number, or a string such as `"64KiB"`, `"16GiB"` or `"2e9"`."""


@dataclasses.dataclass(frozen=True)
class Search:
    """How `mode="auto"` finds a strategy for every operator (`parallelize(..., search=js.Search(...))`).

    A plain string is the method alone: `search="ilp"` is `search=js.Search("ilp")`.

    Attributes:
      method: `"recursive"` (bisect the devices one mesh axis at a time, linear in the program's
        size), `"ilp"` (exact, HiGHS, for a few devices and moderate programs) or `"propagation"`
        (cut the batch, propagate as `mode="semi_auto"` does).
      memory_budget: bytes per device the plan must fit (an int, or a size such as `"16GiB"`);
        where devices are present the compiled program's memory is checked and the search
        tightened until it fits. None: the memory of one device, estimated only (the cost model's
        device kind, else the devices present's, else on an abstract mesh no budget). Nothing
        fitting raises `jshard.MemoryBudgetError`.
      time_limit: seconds planning one input signature may take, all of it, counted from when
        `parallelize` first meets the signature (before tracing): tracing, every search and
        weighing (sequence cuts, recompute policies, optimizer levels, offload placements,
        communication) and building the plan share this deadline, as a pipeline's stages, each
        searched on its own devices, share it with the cut. Near it a weighing starts no
        further candidate once one fits, and stops the one it is planning between units of work
        (the search's levels and moves, traces), dropping it whole: the plan kept is always one
        built whole, with time kept back to build it (measured on this planning's builds). Where
        no plan is complete when it passes, the first complete one is finished. The ILP stops at
        the best plan found. The plan says what was left out and by how much the limit was passed,
        where it was (`SearchReport.skipped`).
      replay: with `"recursive"`: plan the interior layers of a run of identical layers (an
        unrolled Python loop over layers) once and replay the decision on each, as a scanned body is
        planned once; False weighs every operator on its own (slower at depth).

    Examples:
      >>> import jshard as js
      >>> js.Search("recursive", memory_budget="16GiB").memory_budget
      17179869184.0
    """

    method: str = "recursive"
    memory_budget: SizeLike | None = None
    time_limit: float = 60.0
    replay: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "memory_budget", parse_bytes(self.memory_budget))
        object.__setattr__(self, "time_limit", float(self.time_limit))


@dataclasses.dataclass(frozen=True)
class Pipelining:
    """Pipeline parallel (`parallelize(..., pipeline=js.Pipelining(stages=2, micro_batches=4))`).

    The devices form `stages` groups; `fn` is a `jshard.Pipeline` (stacked layers), a loss or
    `value_and_grad` step whose parts are tagged with `jshard.pipeline_stage(fn, k)`, or a full train
    step that marks its gradient function (`js.accumulate(jax.value_and_grad(loss_fn))(params,
    batch)`): the pipeline runs that call, and the optimizer update runs on its gradients. Only `devices`, `in_strategy`
    (strategies over one stage's devices) and `dataset_strategy` apply beside it.

    Attributes:
      stages: S, the number of stages.
      micro_batches: M, micro-batches per step (M >= S).
      schedule: `"1f1b"`, `"gpipe"`, `"interleaved"` (with `virtual_stages`) or `"zb-h1"` (zero
        bubble: each backward split into its input- and weight-gradient parts, the latter run in
        the bubble).
      virtual_stages: v, model chunks per stage for `schedule="interleaved"`.
      result_broadcast: inference outputs on every device (else on the last stage).
    """

    stages: int | None = None
    micro_batches: int | None = None
    schedule: str = "1f1b"
    virtual_stages: int = 1
    result_broadcast: bool = False

    @property
    def asked(self) -> bool:
        """Whether any option differs from its default (a pipeline was asked for)."""
        return (self.stages is not None or self.micro_batches is not None or self.schedule != "1f1b"
                or self.virtual_stages != 1)


@dataclasses.dataclass(frozen=True)
class OptimizerParallel:
    """Optimizer parallel, ZeRO (`parallelize(..., optimizer=js.OptimizerParallel(2))`): MindSpore's
    `enable_parallel_optimizer` with `optimizer_level`, `parallel_optimizer_threshold` and
    `parallel_optimizer_comm_recompute`. A plain int is the level alone: `optimizer=2`.

    Roles: argument 0 is the parameters, the batch is the batch, the other arguments the optimizer
    state. Each state leaf is cut over the data-parallel devices (the mesh axes its layout leaves
    replicated) on its largest dim they divide, as the argument's and the updated result's sharding,
    so the state stays cut between steps. A leaf no free axis divides stays whole
    (`plan.summary()` names it). Without it, `mode="auto"` under a memory budget no plan meets
    weighs levels 1-3 itself (`plan.optimizer.why`).

    Attributes:
      level: 1 cuts the optimizer state; 2 also reduce-scatters the gradients (emitted by jshard,
        so it is there on every backend; `plan.optimizer.reduce_scattered` counts them); 3 also
        cuts the parameters, all-gathered before use (FSDP).
      threshold: bytes, or a size such as `"64KiB"` (the default); smaller leaves stay whole.
      state_argnums: the optimizer-state arguments; None: every one but argument 0 and the batch.
      comm_recompute: with level 3: the backward pass all-gathers each cut parameter again instead
        of keeping the forward pass's gathered copy alive; more all-gather bytes for fewer live ones.
    """

    level: int
    threshold: SizeLike = "64KiB"
    state_argnums: int | Sequence[int] | None = None
    comm_recompute: bool = False

    def __post_init__(self) -> None:
        if self.state_argnums is not None:
            object.__setattr__(self, "state_argnums", as_tuple(self.state_argnums))

    @property
    def threshold_bytes(self) -> float:
        return parse_bytes(self.threshold)


@dataclasses.dataclass(frozen=True)
class Accumulation:
    """Gradient accumulation (`parallelize(..., accumulation=js.Accumulation(4))`): MindSpore's
    `gradient_accumulation` and `gradient_accumulation_shard`. A plain int is the steps alone.

    The step wraps its gradient function in `jshard.accumulate` (`loss, grads =
    js.accumulate(jax.value_and_grad(loss_fn))(params, batch)`), which runs it on `steps`
    micro-batches of the batch's rows in a `lax.scan` and returns the mean; the optimizer updates
    once per step. In `mode="data"` and `"semi_auto"` each device sums its own micro-batches and one
    `psum` after the loop reduces the gradients once per step.

    Attributes:
      steps: k, the micro-batches one step's batch is cut into; it divides the batch's rows.
      shard: whether the accumulated gradients are cut over the data-parallel axes the parameters'
        layout leaves free (ZeRO-style), rather than held whole on every data-parallel device.
    """

    steps: int
    shard: bool = False


FUSION_KINDS = ("allreduce", "allgather", "reducescatter")
"""The collective kinds MindSpore's `comm_fusion` configures, in its spelling."""

FUSION_MODES = ("auto", "size", "index")
"""How one kind is fused: `auto` (the backend's own combiner), `size` (a threshold in MiB) or
`index` (split indices, all-reduce only)."""

AUTO_MIB = 64
"""MindSpore's `auto` fusion threshold in MiB: the bucket size where jshard reduces the gradients itself."""


@dataclasses.dataclass(frozen=True)
class Fusion:
    """How one kind of collective is fused: one entry of MindSpore's `comm_fusion`
    (`{"mode": "size", "config": 32}`).

    Attributes:
      mode: `"auto"`: the backend's own combiner decides (jshard passes XLA no threshold; where
        jshard reduces the gradients itself, buckets of 64 MiB, MindSpore's default); `"size"`:
        collectives fused up to `config` MiB each (0: every collective kept apart); `"index"`
        (all-reduce only): the gradients split into buckets before the parameters numbered
        `config` (in `jax.tree.leaves` order of the parameters, as MindSpore numbers them; the
        loss and any other result of the gradient function join the first bucket).
      config: the threshold in MiB (`"size"`), the ascending split indices (`"index"`), or None (`"auto"`).

    Examples:
      >>> import jshard as js
      >>> js.Fusion("size", 32).threshold_bytes
      33554432
    """

    mode: str = "auto"
    config: Any = None

    def __post_init__(self) -> None:
        if isinstance(self.config, list):
            object.__setattr__(self, "config", tuple(self.config))

    @property
    def threshold_bytes(self) -> int | None:
        """The fusion threshold in bytes (`"auto"`: 64 MiB; `"index"`: None)."""
        if self.mode == "index":
            return None
        return int((AUTO_MIB if self.mode == "auto" or self.config is None else self.config) * 2**20)


@dataclasses.dataclass(frozen=True)
class Communication:
    """How the step's communication is arranged (`parallelize(...,
    communication=js.Communication(copies=2, fusion={"allreduce": {"mode": "size", "config": 32}}))`):
    MindSpore's multi-copy parallel (`MicroBatchInterleaved(net, interleave_num)`) and its
    `comm_fusion` context.

    Both work on the gradient function the step marks with `jshard.accumulate` (`loss, grads =
    js.accumulate(jax.value_and_grad(loss_fn))(params, batch)`), as gradient accumulation does.

    Attributes:
      copies: n, the copies the batch's rows are cut into inside one step (row `i * n + j` goes
        to copy j). Each copy runs the gradient function on its own rows, none reading another's
        values, so XLA may run one copy's collectives while another computes; the copies'
        gradients are summed on each device, then reduced once. XLA's all-reduce combiner is off
        for the program (it would merge the copies' collectives into one, joining the copies), and
        the gradients are reduced in jshard's own buckets (`fusion`). Each copy holds the
        activations of `1/n` of the batch; the plan's `communication` report gives the memory.
      fusion: MindSpore's `comm_fusion`: a dict (`{"openstate": True, "allreduce": {"mode":
        "size", "config": 32}, "allgather": ..., "reducescatter": ...}`), or per kind a `Fusion`.
        Each kind is mapped onto XLA's combiner thresholds where the backend takes one (GPU),
        onto switching its combiner off (threshold 0), and where jshard reduces the gradients
        itself (`jshard.accumulate` with the batch cut over the data-parallel axes), onto buckets
        of its own: one all-reduce per bucket. `openstate=False` keeps every collective apart.

    Examples:
      >>> import jshard as js
      >>> c = js.Communication(fusion={"allreduce": {"mode": "index", "config": [2, 5]}})
      >>> c.of("allreduce")
      Fusion(mode='index', config=(2, 5))
    """

    copies: int = 1
    fusion: Any = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "fusion", _fusion_table(self.fusion))

    def of(self, kind: str) -> Fusion | None:
        """The fusion `kind` (`"allreduce"`, `"allgather"`, `"reducescatter"`) is given, None where
        the configuration is silent on it (the backend's default)."""
        return None if self.fusion is None else dict(self.fusion).get(kind)


def _fusion_table(given: Any) -> Any:
    """MindSpore's `comm_fusion` dict as `((kind, Fusion), ...)` in kind order, hashable as options
    are (`openstate=False`: every kind `size` 0); None stays None; anything else is left for
    `Options.check` to name."""
    if not isinstance(given, dict):
        return given
    table = dict(given)
    openstate = table.pop("openstate", True)
    out: dict[str, Any] = {}
    for kind, value in table.items():
        out[kind] = Fusion(**value) if isinstance(value, dict) else value
    if openstate is False:
        out = {kind: Fusion("size", 0) for kind in FUSION_KINDS}
    elif openstate is not True:
        out["openstate"] = openstate  # for the check to name
    return tuple(sorted(out.items()))


_MOVED = {
    "memory_budget": ("search", "memory_budget"),
    "search_time_limit": ("search", "time_limit"),
    "search_replay": ("search", "replay"),
    "pipeline_stages": ("pipeline", "stages"),
    "micro_batches": ("pipeline", "micro_batches"),
    "schedule": ("pipeline", "schedule"),
    "virtual_stages": ("pipeline", "virtual_stages"),
    "pipeline_result_broadcast": ("pipeline", "result_broadcast"),
    "optimizer_parallel": ("optimizer", "level"),
    "optimizer_parallel_threshold": ("optimizer", "threshold"),
    "optimizer_state_argnums": ("optimizer", "state_argnums"),
    "optimizer_comm_recompute": ("optimizer", "comm_recompute"),
    "accumulation_steps": ("accumulation", "steps"),
    "accumulation_shard": ("accumulation", "shard"),
    "enable_alltoall": ("cost_model", "alltoall"),
}
"""Each keyword `parallelize` took before the option groups: the group and field it moved to."""

_GROUPS = {"search": Search, "pipeline": Pipelining, "optimizer": OptimizerParallel,
           "accumulation": Accumulation, "communication": Communication}
_REQUIRED = {"optimizer": "level", "accumulation": "steps"}


def _asked(group: Any) -> bool:
    if isinstance(group, Pipelining):
        return group.asked
    unset = type(group)(None)  # the old keywords at their defaults
    return group != unset


_SPELLED = {"search": "js.Search", "pipeline": "js.Pipelining", "optimizer": "js.OptimizerParallel",
            "accumulation": "js.Accumulation", "cost_model": "js.CostModel",
            "communication": "js.Communication"}


def grouped(name: str, value: Any, call: str) -> Any:
    """`value` given as `name=` (`search`, `pipeline`, `optimizer`, `accumulation`, `communication`)
    as its group's record: None stays None; the shorthand (a method name, a level, a number of steps
    or copies) fills the
    group's first field; anything else must already be the group."""
    kind = _GROUPS[name]
    if value is None or isinstance(value, kind):
        return value
    shorthand = {"search": str, "optimizer": int, "accumulation": int, "communication": int}.get(name)
    if shorthand is not None and isinstance(value, shorthand):
        return kind(value)
    first = dataclasses.fields(kind)[0].name
    short = f", or {shorthand.__name__} ({first})" if shorthand else ""
    raise TypeError(f"{call}: {name}= takes a {_SPELLED[name]}(...){short}, got {type(value).__name__} {value!r}.")


def regroup(call: str, groups: dict[str, Any], old: dict[str, Any], stacklevel: int = 2) -> dict[str, Any]:
    """The groups (`search`, `pipeline`, `optimizer`, `accumulation`, `cost_model`, as given) with the
    keywords of `old` (the spellings before the groups) moved into them, each old keyword warned of
    with `DeprecationWarning` naming its new spelling (`stacklevel` as `warnings.warn` counts it from
    the caller). A group given both ways is refused; an unknown keyword is a `TypeError`, as Python's."""
    unknown = sorted(set(old) - set(_MOVED))
    if unknown:
        raise TypeError(f"{call}: got an unexpected keyword argument {unknown[0]!r}")
    moved: dict[str, dict[str, Any]] = {}
    for key, value in old.items():
        group, field = _MOVED[key]
        moved.setdefault(group, {})[field] = value
        warnings.warn(f"{call}: {key}= is deprecated; write {group}={_SPELLED[group]}({field}=...) "
                      f"(the old keyword works for one more release).", DeprecationWarning, stacklevel=stacklevel + 1)
    out = dict(groups)
    for group, fields in moved.items():
        given = out.get(group)
        if group == "cost_model":
            from jshard.cost import CostModel  # noqa: PLC0415  (kept lazy: the groups import nothing of jshard's)

            out[group] = dataclasses.replace(given or CostModel(), **fields)
        elif group == "search" and isinstance(given, str):  # search="ilp", memory_budget=...: one Search
            out[group] = Search(given, **fields)
        elif given is None:  # a group the old keywords leave at its defaults stays off, as it did
            made = _GROUPS[group](**{_REQUIRED.get(group, "stages"): None, **fields})
            out[group] = made if _asked(made) else None
        else:
            both = ", ".join(sorted(f"{k}=" for k in old if _MOVED[k][0] == group))
            raise TypeError(f"{call}: {group}= and {both} both set the {group} options; give "
                            f"{group}={_SPELLED[group]}(...) alone.")
    return out


def as_tuple(value: Any) -> tuple:
    """Argument numbers or names as a tuple: one (an int, a str, or a wrong kind for a check to
    name) or a sequence of them."""
    return tuple(value) if isinstance(value, Sequence) and not isinstance(value, str) else (value,)


def parse_bytes(value: SizeLike | None) -> float | None:
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
