"""The options of one parallelized function, validated once for every front end.

`parallelize`, the pipeline front end and `jshard plan` build one `Options` (with a
`Pipelining` where a pipeline is asked for) and call `check`; each rule raises one
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
from jshard.compile._groups import (
    FUSION_KINDS,
    FUSION_MODES,
    Accumulation,
    Communication,
    Fusion,
    OptimizerParallel,
    Pipelining,
    Search,
    as_tuple,
    grouped,
    regroup,
)
from jshard.cost import CostModel
from jshard.hetero import check_offload
from jshard.layouts import DatasetStrategy, check_dataset_strategy
from jshard.plan import Plan
from jshard.search import SEARCHES

MODES = ("data", "semi_auto", "auto", "manual")
"""`parallelize`'s modes (see its docstring)."""

PROPAGATIONS = ("jshard", "xla", "best")
"""Who lays out the operators no strategy fixes: jshard's engine, Shardy, or both (their compiled
programs measured, the one moving fewer collective bytes kept)."""


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
    plan: Plan | None = None
    search: Search = Search()
    pipeline: Pipelining | None = None
    optimizer: OptimizerParallel | None = None
    accumulation: Accumulation | None = None
    communication: Communication | None = None
    offload: tuple[str, ...] | None = None
    recompute: Any = None
    context_cut: int | None = None
    """Not a keyword: the sequence cut `jshard.attention` calls that give no strategy take in this
    trace (set per candidate by the planning's weighing, `_weigh.weigh_context`, or from a loaded plan's
    `("context", n)`); None: none."""

    @classmethod
    def create(cls, call: str = "jshard.parallelize", *, donate_argnums: int | Sequence[int] = (),
               batch_argnums: int | Sequence[int] | None = None, static_argnums: int | Sequence[int] = (),
               static_argnames: str | Sequence[str] = (), donate_argnames: str | Sequence[str] = (),
               search: Search | str = "recursive", pipeline: Pipelining | None = None,
               optimizer: OptimizerParallel | int | None = None, accumulation: Accumulation | int | None = None,
               cost_model: CostModel | None = None, offload: str | Sequence[str] | None = None,
               communication: Communication | int | None = None, stacklevel: int = 2, **fields: Any) -> Options:
        """Options from `parallelize`'s keywords, normalized: argnums and argnames as tuples, each
        group as its record (`search="ilp"` as `Search("ilp")`, `optimizer=2` as
        `OptimizerParallel(2)`, `accumulation=4` as `Accumulation(4)`, `communication=2` as
        `Communication(copies=2)`), `offload` as a tuple of names
        (None where not given: the search may choose). The keywords before the groups
        (`memory_budget=`, `pipeline_stages=`, ...) are moved into them with a `DeprecationWarning`
        (`regroup`)."""
        old = {k: fields.pop(k) for k in list(fields) if k not in _FIELDS}
        groups = regroup(call, dict(search=search, pipeline=pipeline, optimizer=optimizer, accumulation=accumulation,
                                    cost_model=cost_model), old, stacklevel + 1)
        return cls(donate_argnums=as_tuple(donate_argnums), batch_argnums=None if batch_argnums is None else as_tuple(batch_argnums),
                   static_argnums=as_tuple(static_argnums), static_argnames=as_tuple(static_argnames),
                   donate_argnames=as_tuple(donate_argnames), search=grouped("search", groups["search"], call),
                   pipeline=grouped("pipeline", groups["pipeline"], call),
                   optimizer=grouped("optimizer", groups["optimizer"], call),
                   accumulation=grouped("accumulation", groups["accumulation"], call), cost_model=groups["cost_model"],
                   communication=grouped("communication", communication, call),
                   offload=None if offload is None else as_tuple(offload), **fields)

    @property
    def costs(self) -> CostModel:
        """The cost model the planners price with: `cost_model` (default one GPU node; its `alltoall`
        says whether a redistribution may be an all-to-all)."""
        return self.cost_model or CostModel()

    @property
    def searching(self) -> bool:
        """Whether the strategy search plans (`mode="auto"` with a search, no loaded plan)."""
        return self.mode == "auto" and self.search.method != "propagation" and self.plan is None

    @property
    def memory_budget(self) -> float | None:
        """The search's memory budget in bytes per device (`Search.memory_budget`), None where none is given."""
        return self.search.memory_budget

    def check(self, call: str) -> None:
        """Raises `ShardingError` (or `TypeError`) for the first rule these options break."""
        _check_choices(call, self)
        if not isinstance(self.costs.alltoall, bool):
            raise TypeError(f"{call}: CostModel(alltoall=) takes True or False, got {self.costs.alltoall!r}.")
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
        _check_communication(call, self)
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
    if c.plan is not None and (c.propagation == "xla" or c.mode == "manual"):
        raise ShardingError(
            f"{call}: plan= rebuilds a plan jshard propagated or searched; it cannot be used with "
            f"{'mode=' + repr(c.mode) if c.mode == 'manual' else 'propagation=' + repr(c.propagation)}. "
            f"Drop plan=, or use propagation='jshard' with mode='semi_auto', 'auto' or 'data'."
        )
    if c.search.method not in SEARCHES:
        raise ShardingError(f"{call}: search={c.search.method!r} is not one of {SEARCHES}.")


def _check_search(call: str, c: Options) -> None:
    if c.mode != "auto" and (c.search.method != "recursive" or c.memory_budget is not None):
        what = "Search(memory_budget=...)" if c.memory_budget is not None else f"search={c.search.method!r}"
        raise ShardingError(f"{call}: {what} applies to the strategy search, mode='auto' (this call has "
                            f"mode={c.mode!r}). Pass mode='auto', or drop it.")
    if c.mode == "auto" and c.propagation == "xla":
        raise ShardingError(f"{call}: mode='auto' searches with jshard's own cost model; it cannot be "
                            f"used with propagation={c.propagation!r}. Drop propagation=.")
    if c.mode == "auto" and c.search.method == "propagation" and c.memory_budget is not None:
        raise ShardingError(f"{call}: search='propagation' cuts the batch and propagates; it does not "
                            f"weigh memory, so it cannot meet a memory_budget. Use js.Search('recursive', ...) or 'ilp'.")
    if c.memory_budget is not None and c.memory_budget <= 0:
        raise ShardingError(f"{call}: Search(memory_budget=) must be a positive number of bytes per device, "
                            f"got {c.memory_budget!r}.")


def _check_optimizer(call: str, c: Options) -> None:
    o = c.optimizer
    if o is None:
        return
    if isinstance(o.level, bool) or o.level not in (1, 2, 3):
        raise ShardingError(f"{call}: OptimizerParallel(level={o.level!r}) is not a level; give 1 (cut the "
                            f"optimizer state), 2 (also reduce-scatter the gradients) or 3 (also cut the "
                            f"parameters), or optimizer=None for no optimizer parallel.")
    try:
        threshold = o.threshold_bytes
    except (TypeError, ValueError):
        threshold = None
    if threshold is None or not threshold >= 0:
        raise ShardingError(f"{call}: OptimizerParallel(threshold={o.threshold!r}) is not a size; give bytes (an "
                            f"int) or a string such as '64KiB' or '1MiB'.")
    if c.mode == "manual" or c.pipeline is not None:
        what = "a pipeline" if c.pipeline is not None else f"mode={c.mode!r}"
        raise ShardingError(f"{call}: optimizer= (optimizer parallel) cuts the optimizer state over the axes the "
                            f"strategies leave replicated, in mode='data', 'semi_auto' or 'auto'; it cannot be used "
                            f"with {what} yet. Use mode='data', 'semi_auto' or 'auto', or drop optimizer=.")
    if o.state_argnums is not None:
        bad = [v for v in o.state_argnums if not isinstance(v, int) or isinstance(v, bool)]
        if bad:
            raise TypeError(f"{call}: OptimizerParallel(state_argnums=) takes ints (or one int), got {bad[0]!r}.")
    if not isinstance(o.comm_recompute, bool):
        raise TypeError(f"{call}: OptimizerParallel(comm_recompute=) takes True or False, got {o.comm_recompute!r}.")
    if o.comm_recompute and o.level != 3:
        raise ShardingError(f"{call}: OptimizerParallel(comm_recompute=True) gathers a parameter that level 3 "
                            f"keeps cut again in the backward pass; this call has level={o.level!r}. Pass "
                            f"level=3, or drop comm_recompute.")


def _check_accumulation(call: str, c: Options) -> None:
    a = c.accumulation
    if a is None:
        return
    if not isinstance(a.shard, bool):
        raise TypeError(f"{call}: Accumulation(shard=) takes True or False, got {a.shard!r}.")
    if a.steps is None or isinstance(a.steps, bool) or not isinstance(a.steps, int) or a.steps < 1:
        raise ShardingError(f"{call}: Accumulation(steps={a.steps!r}) is not a number of micro-batches; give a "
                            f"positive int k that divides the batch's rows (1: no accumulation).")
    if a.shard and c.mode not in ("data", "semi_auto"):
        raise ShardingError(f"{call}: Accumulation(shard=True) cuts the accumulated gradients over the axes the "
                            f"parameters' layout leaves free, in mode='data' or 'semi_auto'; this call has "
                            f"mode={c.mode!r}. Use mode='data' or 'semi_auto', or drop shard=True.")


def _check_communication(call: str, c: Options) -> None:
    m = c.communication
    if m is None:
        return
    if isinstance(m.copies, bool) or not isinstance(m.copies, int) or m.copies < 1:
        raise ShardingError(f"{call}: Communication(copies={m.copies!r}) is not a number of copies; give a positive "
                            f"int n that divides each device's rows of the batch (1: no multi-copy).")
    if c.pipeline is not None or c.mode == "manual":
        what = "a pipeline" if c.pipeline is not None else f"mode={c.mode!r}"
        raise ShardingError(f"{call}: communication= arranges the collectives of the gradient function "
                            f"jshard.accumulate marks, in mode='data', 'semi_auto' or 'auto'; it cannot be used with "
                            f"{what} yet. Drop communication=, or use one of those modes.")
    if m.fusion is None:
        return
    if not isinstance(m.fusion, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in m.fusion):
        raise TypeError(f"{call}: Communication(fusion=) takes MindSpore's comm_fusion dict ({{'allreduce': {{'mode': "
                        f"'size', 'config': 32}}, ...}}) or {{kind: js.Fusion(...)}}, got {type(m.fusion).__name__}.")
    for kind, f in m.fusion:
        _check_fusion(call, kind, f)


def _check_fusion(call: str, kind: str, f: Any) -> None:
    where = f"Communication(fusion={{{kind!r}: ...}})"
    if kind == "openstate":
        raise TypeError(f"{call}: comm_fusion's openstate takes True or False, got {f!r}.")
    if kind not in FUSION_KINDS:
        raise ShardingError(f"{call}: {where}: {kind!r} is not a collective comm_fusion configures; give "
                            f"{', '.join(map(repr, FUSION_KINDS))} or 'openstate'.")
    if not isinstance(f, Fusion):
        raise TypeError(f"{call}: {where} takes {{'mode': ..., 'config': ...}} or a js.Fusion, got {f!r}.")
    if f.mode not in FUSION_MODES:
        raise ShardingError(f"{call}: {where}: mode={f.mode!r} is not one of {FUSION_MODES}.")
    if f.mode == "size" and (isinstance(f.config, bool) or not isinstance(f.config, (int, float)) or f.config < 0):
        raise ShardingError(f"{call}: {where}: mode='size' takes config, a threshold in MiB (0 or more), got "
                            f"{f.config!r}. Give e.g. {{'mode': 'size', 'config': 32}}.")
    if f.mode == "index":
        good = (kind == "allreduce" and isinstance(f.config, tuple) and f.config
                and all(isinstance(i, int) and not isinstance(i, bool) and i > 0 for i in f.config)
                and list(f.config) == sorted(set(f.config)))
        if not good:
            raise ShardingError(f"{call}: {where}: mode='index' splits the gradients' all-reduce at ascending leaf "
                                f"indices (positive ints), for 'allreduce' only; got config={f.config!r}. Give e.g. "
                                f"{{'allreduce': {{'mode': 'index', 'config': [2, 5]}}}}, or mode='size' for {kind!r}.")
    if f.mode == "auto" and f.config is not None:
        raise ShardingError(f"{call}: {where}: mode='auto' takes no config (got {f.config!r}); use mode='size' "
                            f"for a threshold.")


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


_FIELDS = frozenset(f.name for f in dataclasses.fields(Options)) - {"context_cut"}
"""The keywords `Options.create` passes through; any other is an old spelling `regroup` moves."""
