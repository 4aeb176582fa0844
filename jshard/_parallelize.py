"""`jshard.parallelize`: trace once, plan, and compile one `jax.jit` program per input signature.

Data flow: the user function is traced to a jaxpr under a `TraceContext` (so `shard` calls become
sharding constraints); the plan is read off the flattened jaxpr; the jaxpr itself is then compiled
by `jax.jit` with the planned argument and result shardings. User Python runs once per signature
(once more where a strategy needs a finer mesh than the first guess, only off 2^k device counts).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _context
from jshard._distributed import host_major
from jshard._errors import DeviceCountError, ShardingError
from jshard.layouts import FineMesh, Slot, TensorLayout, canonicalize_slot, check_divides, layout_of
from jshard.layouts._mesh import NotRefined
from jshard.propagate import Plan, build_ops, flatten
from jshard.propagate._cost import CostModel
from jshard.propagate._emit import emit, to_pspec
from jshard.propagate._engine import constraint_spec, emission_of, propagate
from jshard.propagate._factors import replicated
from jshard.propagate._plan_io import result_from_plan
from jshard.propagate._search import SEARCHES, search
from jshard.propagate._search import _human as _human  # one byte formatter for budgets and peaks

MODES = ("data", "semi_auto", "auto", "manual")
PROPAGATIONS = ("jshard", "xla")
_BOUNDARY = "the function boundary"
_BUDGET_ROUNDS = 3
DATASET_STRATEGIES = ("data_parallel", "full_batch")


@dataclasses.dataclass(frozen=True)
class _Config:
    devices: int | None
    mesh: Mesh | None
    mode: str
    in_strategy: Any
    out_strategy: Any
    donate_argnums: tuple[int, ...]
    dataset_strategy: str
    batch_argnums: tuple[int, ...] | None
    propagation: str = "jshard"
    cost_model: CostModel | None = None
    plan: Plan | None = None
    search: str = "recursive"
    memory_budget: float | None = None
    search_time_limit: float = 60.0


@dataclasses.dataclass(frozen=True)
class _Entry:
    plan: Plan
    jitted: Any
    in_shardings: tuple


def parallelize(
    fn: Callable[..., Any] | None = None,
    *,
    devices: int | None = None,
    mesh: Mesh | None = None,
    mode: str = "semi_auto",
    in_strategy: Sequence[Any] | None = None,
    out_strategy: Any = None,
    donate_argnums: int | Sequence[int] = (),
    dataset_strategy: str = "data_parallel",
    batch_argnums: int | Sequence[int] | None = None,
    propagation: str = "jshard",
    cost_model: CostModel | None = None,
    plan: Plan | None = None,
    search: str = "recursive",
    memory_budget: int | float | str | None = None,
    search_time_limit: float = 60.0,
    pipeline_stages: int | None = None,
    micro_batches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    pipeline_result_broadcast: bool = False,
) -> Any:
    """Runs `fn` on many devices from MindSpore-style strategies; usable as a decorator.

    Args:
      fn: the function (e.g. a train step) to parallelize.
      devices: how many devices (the first `devices` of `jax.devices()`); default all, or the mesh's.
      mesh: a `jax.sharding.Mesh` to run on; its flattened device order is the rank order. Required
        with `mode="manual"`, whose PartitionSpecs name its axes.
      mode: `"data"` (the batch is cut over all devices, parameters replicated, `shard` calls
        ignored as in MindSpore's DATA_PARALLEL), `"semi_auto"` (`shard` strategies kept, the rest
        follows from them), `"auto"` (no annotations needed: `search` finds a strategy for every
        operator, keeping any `shard` calls and `in_strategy` as constraints), or `"manual"`
        (`in_strategy`/`out_strategy` are PartitionSpecs over `mesh`; jshard only builds the program).
      in_strategy: one entry per positional argument: a strategy tuple, a `Layout` call, a
        PartitionSpec (manual), None, or a pytree prefix of the argument holding those.
      out_strategy: the same for the results (a pytree prefix of the output).
      donate_argnums: as `jax.jit`.
      dataset_strategy: `"data_parallel"` cuts dim 0 of every array in the batch arguments over all
        devices, `"full_batch"` replicates them; used where `in_strategy` says nothing.
      batch_argnums: which positional arguments are the batch; default the last one.
      propagation: who lays out the operators no strategy fixes: `"jshard"` (the propagation
        engine: every operator gets a strategy, an origin and a cost in the `Plan`) or `"xla"`
        (Shardy propagates from the same anchors; the baseline the benchmarks compare with).
      cost_model: the α–β `CostModel` propagation minimizes (default: one GPU node).
      plan: a `Plan` (from `Plan.load`) to rebuild instead of propagating or searching; it must
        match the function operator by operator.
      search: with `mode="auto"`: `"recursive"` (bisect the devices one mesh axis at a time, linear
        in the program's size), `"ilp"` (exact, HiGHS, for a few devices and moderate programs) or
        `"propagation"` (cut the batch, propagate as `semi_auto` does).
      memory_budget: with `mode="auto"`: bytes per device the plan must fit (an int, or a string
        such as `"16GiB"`); where devices are present the compiled program's memory is checked
        and the search tightened until it fits.
      search_time_limit: seconds the ILP may take; past it, the best plan found is used and the
        plan says so.
      pipeline_stages: S, to pipeline `fn`, a `jshard.Pipeline`: the devices form S stages of
        `devices / S` each, and the result is a `jshard.pipeline.Pipelined` step (`jshard.pipeline`).
        Only `devices`, `in_strategy` (strategies over one stage's devices) and `dataset_strategy`
        apply with it.
      micro_batches: M, how many micro-batches a step's batch is cut into (M >= S).
      schedule: `"1f1b"`, `"gpipe"` or `"interleaved"` (with `virtual_stages`).
      virtual_stages: v, model chunks per stage for `schedule="interleaved"`.
      pipeline_result_broadcast: inference outputs on every device (else on the last stage).

    Returns:
      A `Parallelized` callable with `lower` and `plan`.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> step = js.parallelize(lambda x, w: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w),
      ...                       devices=8, in_strategy=((2, 1), (1, 4)))
      >>> step(jnp.ones((4, 8)), jnp.ones((8, 16))).shape
      (4, 16)
    """
    if pipeline_stages is not None or micro_batches is not None or schedule != "1f1b" or virtual_stages != 1:
        from jshard.pipeline._parallel import pipelined

        return pipelined(fn, devices=devices, mesh=mesh, mode=mode, in_strategy=in_strategy,
                         dataset_strategy=dataset_strategy, stages=pipeline_stages, micro_batches=micro_batches,
                         schedule=schedule, virtual_stages=virtual_stages, result_broadcast=pipeline_result_broadcast)
    config = _Config(
        devices,
        mesh,
        mode,
        in_strategy,
        out_strategy,
        (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums),
        dataset_strategy,
        None if batch_argnums is None else (batch_argnums,) if isinstance(batch_argnums, int) else tuple(batch_argnums),
        propagation,
        cost_model,
        plan,
        search,
        parse_bytes(memory_budget),
        float(search_time_limit),
    )
    if fn is None:
        return lambda f: Parallelized(f, config)
    return Parallelized(fn, config)


class Parallelized:
    """A parallelized function: call it, `lower` it, or read its `plan`, as with `jax.jit`."""

    def __init__(self, fn: Callable[..., Any], config: _Config):
        self.fn, self.config = fn, config
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.call = f"jshard.parallelize({self.name})"
        _check_config(self.call, config)
        self._cache: dict[Any, _Entry] = {}
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        _no_kwargs(self.call, kwargs)
        entry = self._runnable(args)
        return entry.jitted(*_placed(args, entry.in_shardings))

    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The planned program, lowered (as `jax.jit(...).lower`)."""
        _no_kwargs(self.call, kwargs)
        return self._runnable(args).jitted.lower(*args)

    def plan(self, *args, **kwargs) -> Plan:
        """The `Plan` for these arguments (arrays or `jax.ShapeDtypeStruct`s); nothing is compiled.

        With more `devices` than are present, the plan is made on an abstract mesh (planning for a
        cluster from a laptop); such a plan cannot be run or lowered here.
        """
        _no_kwargs(self.call, kwargs)
        return self._entry(args).plan

    def _runnable(self, args) -> _Entry:
        entry = self._entry(args)
        if entry.jitted is None:
            have = jax.devices()
            raise DeviceCountError(
                f"{self.call}: devices={entry.plan.device_count}, but only {len(have)} device(s) are present "
                f"({have[0].platform}); such a plan can be made (.plan) but not run. On a CPU, call "
                f"jshard.simulate_devices({entry.plan.device_count}) before anything else to simulate them."
            )
        return entry

    def _entry(self, args) -> _Entry:
        leaves, treedef = jax.tree_util.tree_flatten(args)
        key = (treedef, tuple((np.shape(x), _dtype_of(x)) for x in leaves))
        if key not in self._cache:
            self._cache[key] = _Builder(self, args).build()
        return self._cache[key]


def _abstract(args: tuple) -> tuple:
    """`args` as shapes and dtypes: what a plan keeps to lower its program (not the arrays, which
    may be large or donated)."""
    return jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)), args)


def _placed(args: tuple, shardings: tuple) -> list:
    """`args` on their planned shardings; arrays already there pass untouched (a train loop feeds
    back its own outputs, so the hot path moves nothing)."""
    leaves, treedef = jax.tree_util.tree_flatten(args)
    targets = jax.tree_util.tree_leaves(shardings)
    moved = [
        x if isinstance(x, jax.Array) and x.sharding == s else jax.device_put(x, s)
        for x, s in zip(leaves, targets)
    ]
    return jax.tree_util.tree_unflatten(treedef, moved)


def parse_bytes(value: int | float | str | None) -> float | None:
    """`16GiB`, `512 MiB`, `2e9` or a number of bytes, as bytes; None stays None.

    Examples:
      >>> parse_bytes("1.5KiB"), parse_bytes(4096), parse_bytes("2GB")
      (1536.0, 4096.0, 2000000000.0)
    """
    if value is None or isinstance(value, (int, float)):
        return None if value is None else float(value)
    text = value.strip().replace(" ", "")
    units = {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12, "B": 1}
    for unit, size in units.items():
        if text.endswith(unit):
            return float(text[: -len(unit)]) * size
    return float(text)


def _check_config(call: str, c: _Config) -> None:
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
    if c.plan is not None and not isinstance(c.plan, Plan):
        raise TypeError(f"{call}: plan= takes a jshard.Plan (from Plan.load), got {type(c.plan).__name__}.")
    if c.dataset_strategy not in DATASET_STRATEGIES:
        raise ShardingError(f"{call}: dataset_strategy={c.dataset_strategy!r} is not one of {DATASET_STRATEGIES}.")
    if c.mode == "manual" and c.mesh is None:
        raise ShardingError(f"{call}: mode='manual' takes PartitionSpecs over your mesh; pass mesh=... too.")
    if c.mesh is not None and c.devices is not None and c.devices != c.mesh.devices.size:
        raise ShardingError(f"{call}: devices={c.devices} but mesh has {c.mesh.devices.size} devices; pass one of them.")


def _no_kwargs(call, kwargs):
    if kwargs:
        raise TypeError(f"{call}: pass arguments positionally (got keyword arguments {sorted(kwargs)}).")


def _compiled_peak(jitted, args) -> float:
    """Per-device bytes the compiled program holds at once (arguments + results + temporaries -
    donated), as XLA's buffer assignment reports them."""
    m = jitted.lower(*_abstract(args)).compile().memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _dtype_of(x):
    return x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype


class _Builder:
    """Traces, plans and jits one input signature of a `Parallelized` function."""

    def __init__(self, owner: Parallelized, args: tuple):
        self.owner, self.config, self.call, self.args = owner, owner.config, owner.call, args
        self.devices = self._devices()
        self.n = owner.config.devices if self.devices is None else len(self.devices)

    def _devices(self) -> list[jax.Device] | None:
        """The devices to run on; None for more than are present (an abstract mesh: plan only)."""
        c = self.config
        if c.mesh is not None:
            return list(c.mesh.devices.flat)
        have = host_major(jax.devices())  # ranks fill one host before the next
        want = len(have) if c.devices is None else c.devices
        return None if want > len(have) else have[:want]

    def build(self) -> _Entry:
        in_slots = self._slots(self.config.in_strategy, self.args, "in_strategy")
        paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(self.args)[0]]
        needed = self._boundary_matrices(in_slots, paths)
        while True:
            fine = self._fine_mesh(needed)
            try:
                return self._build_on(fine, in_slots, paths)
            except NotRefined as e:
                if self.config.mode == "manual":
                    raise ShardingError(_manual_mesh_error(self.call, e, self.config.mesh)) from None
                needed.append((e.matrix, e.who))

    def _boundary_matrices(self, in_slots, paths) -> list[tuple[tuple[int, ...], str]]:
        """Device matrices the fine mesh must refine before tracing: the mesh's and `in_strategy`'s."""
        c = self.config
        if c.mode == "manual":
            return []
        needed = [] if c.mesh is None else [(tuple(c.mesh.devices.shape), f"the mesh {dict(c.mesh.shape)}")]
        for slot, path in zip(in_slots, paths):
            what = f"in_strategy{path}"
            if slot is not None and not isinstance(slot, PartitionSpec):
                layout = layout_of(slot, self.n, call=self.call, op=_BOUNDARY, what=what)
                needed.append((layout.device_matrix, what))
        return needed

    def _fine_mesh(self, needed) -> FineMesh:
        if self.config.mode == "manual":
            return FineMesh.of_mesh(self.config.mesh)
        default = FineMesh.for_devices(self.n)
        if all(default.fits(m) for m, _ in needed):
            return default
        return FineMesh.refining(self.n, [m for m, _ in needed], [w for _, w in needed], call=self.call)

    def _build_on(self, fine, in_slots, paths) -> _Entry:
        """Traces, plans and jits on one fine mesh; raises `NotRefined` where it is too coarse."""
        c, args = self.config, self.args
        leaves, treedef = jax.tree_util.tree_flatten(args)
        closed, out_shape, ctx = self._trace(leaves, treedef, fine)
        out_paths, out_tree = jax.tree_util.tree_flatten_with_path(out_shape)
        nodes = flatten(closed.jaxpr)
        invars = closed.jaxpr.invars
        anchors = _boundary_anchors(self.call, nodes, invars, ctx.annotations)
        batch = self._batch_leaf_ids()
        in_sh = [self._in_sharding(path, x, s, anchors.get(v), i in batch, ctx)
                 for i, (path, x, s, v) in enumerate(zip(paths, leaves, in_slots, invars))]
        out_slots = self._slots(c.out_strategy, out_shape, "out_strategy")
        out_sh = [self._out_sharding(jax.tree_util.keystr(p), x, s, ctx) for (p, x), s in zip(out_paths, out_slots)]
        axis_size = dict(zip(fine.names, fine.sizes))
        fixed = {v: constraint_spec(sh, len(np.shape(x))) for v, sh, x in zip(invars, in_sh, leaves) if sh is not None}
        searching = c.mode == "auto" and c.search != "propagation" and c.plan is None
        budget, report = c.memory_budget, None
        for attempt in range(_BUDGET_ROUNDS):
            result = None
            if c.mode != "manual" and c.propagation == "jshard":
                if c.plan is not None:
                    result = result_from_plan(c.plan, nodes, invars, fine, self.call)
                    in_sh = [sh or (NamedSharding(ctx.mesh, p) if p is not None else None) for sh, p in zip(in_sh, c.plan.in_shardings)]
                elif searching:
                    try:
                        result, report = self._search(nodes, closed, fixed, axis_size, paths, budget)
                    except ShardingError as e:
                        if attempt == 0:
                            raise
                        raise ShardingError(
                            f"{self.call}: memory_budget={_human(c.memory_budget)} per device: the searched "
                            f"plan's compiled program held {_human(held)} per device (XLA's buffers exceed the "
                            f"search's estimate), and asked for {_human(budget)} instead the search found "
                            f"nothing: {str(e).split(': ', 1)[-1]}"
                        ) from None
                else:
                    result = propagate(nodes, fixed, axis_size, c.cost_model)
            entry = self._program(closed, nodes, result, in_sh, out_sh, leaves, treedef, out_tree, fine, ctx, report)
            if not searching or c.memory_budget is None or entry.jitted is None:
                return entry
            held = _compiled_peak(entry.jitted, args)
            report = dataclasses.replace(report, compiled_peak_bytes=held)
            if held <= c.memory_budget:
                return dataclasses.replace(entry, plan=dataclasses.replace(entry.plan, search=report))
            budget = budget * c.memory_budget / held * 0.97  # XLA holds more than the estimate: ask for less
        raise ShardingError(
            f"{self.call}: memory_budget={_human(c.memory_budget)} per device: the searched plan's "
            f"compiled program still holds {_human(held)} per device after {_BUDGET_ROUNDS} searches with "
            f"tighter estimates (XLA's temporary buffers exceed what the search models). Raise "
            f"memory_budget, or use more devices."
        )

    def _search(self, nodes, closed, fixed, axis_size, paths, budget):
        c = self.config
        invars = closed.jaxpr.invars
        consts = list(closed.jaxpr.constvars)
        fixed = {**fixed, **{v: replicated(len(v.aval.shape)) for v in consts}}
        donated = frozenset(v for i in self._donated_leaf_ids() for v in [invars[i]])
        names = {v: f"args{p}" for v, p in zip(invars, paths)}
        return search(nodes, list(invars) + consts, closed.jaxpr.outvars, fixed, axis_size, how=c.search,
                      cost=c.cost_model, budget=budget, donated=donated, names=names, call=self.call,
                      time_limit=c.search_time_limit)

    def _donated_leaf_ids(self) -> set[int]:
        ids, start = set(), 0
        for i, a in enumerate(self.args):
            count = len(jax.tree_util.tree_leaves(a))
            if i in self.config.donate_argnums:
                ids.update(range(start, start + count))
            start += count
        return ids

    def _program(self, closed, nodes, result, in_sh, out_sh, leaves, treedef, out_tree, fine, ctx, report) -> _Entry:
        """The jitted program and its `Plan` for one planning `result` (None: XLA propagates)."""
        c, args = self.config, self.args
        invars, outvars = closed.jaxpr.invars, closed.jaxpr.outvars
        evaluate = jcore.jaxpr_as_fun(closed)
        if result is not None:
            in_sh = [sh or NamedSharding(ctx.mesh, to_pspec(result.values.get(v, replicated(np.ndim(x)))))
                     for v, sh, x in zip(invars, in_sh, leaves)]
            out_sh = [sh if sh is not None or v not in result.values else NamedSharding(ctx.mesh, to_pspec(result.values[v]))
                      for v, sh in zip(outvars, out_sh)]
            evaluate = emit(closed, emission_of(nodes, result), ctx.mesh)
        in_sh = [sh or NamedSharding(ctx.mesh, PartitionSpec()) for sh in in_sh]
        in_tree = jax.tree_util.tree_unflatten(treedef, in_sh)
        out_tree_sh = jax.tree_util.tree_unflatten(out_tree, out_sh)
        run = _program(evaluate, out_tree)
        jitted = None
        if self.devices is not None:
            jitted = jax.jit(run, in_shardings=in_tree, out_shardings=out_tree_sh, donate_argnums=c.donate_argnums)
        ops = build_ops(nodes, ctx.annotations, fine, result)
        plan = Plan(ctx.mesh, fine, c.mode, ops, in_tree, out_tree_sh, tuple(ctx.annotations),
                    "xla" if result is None else "jshard", jitted and functools.partial(jitted.lower, *_abstract(args)),
                    search=report)
        return _Entry(plan, jitted, in_tree)

    def _trace(self, leaves, treedef, fine):
        avals = [jax.ShapeDtypeStruct(np.shape(x), _dtype_of(x)) for x in leaves]

        def flat_fn(*flat):
            return self.owner.fn(*jax.tree_util.tree_unflatten(treedef, flat))

        if self.config.mode == "manual":
            mesh = self.config.mesh
        elif self.devices is None:
            mesh = jax.sharding.AbstractMesh(fine.sizes, fine.names)
        else:
            mesh = fine.jax_mesh(self.devices)
        ctx = _context.TraceContext(self.call, fine, mesh, self.config.mode)
        with _context.tracing(ctx):
            closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*avals)
        return closed, out_shape, ctx

    def _slots(self, prefix, tree, what) -> list[Slot]:
        """One canonical slot per leaf of `tree`, from a pytree prefix of strategies (or None)."""
        leaves = jax.tree_util.tree_leaves(tree)
        if prefix is None:
            return [None] * len(leaves)
        if what == "in_strategy":
            if not isinstance(prefix, (tuple, list)) or len(prefix) != len(tree):
                raise ShardingError(_in_strategy_count_error(self.call, prefix, len(tree)))
            return [s for p, t, i in zip(prefix, tree, range(len(tree))) for s in self._broadcast(p, t, f"in_strategy[{i}]")]
        return self._broadcast(prefix, tree, what)

    def _broadcast(self, prefix, tree, what) -> list[Slot]:
        is_slot = lambda x: x is None or isinstance(x, (TensorLayout, PartitionSpec)) or (
            isinstance(x, (tuple, list)) and all(isinstance(i, int) for i in x) and len(x) > 0
        )
        try:
            parts = jax.tree_util.tree_map(
                lambda slot, sub: _Repeat(canonicalize_slot(slot, call=self.call, what=what), len(jax.tree_util.tree_leaves(sub))),
                prefix, tree, is_leaf=is_slot,
            )
        except ValueError as e:
            if isinstance(e, ShardingError):
                raise
            raise ShardingError(
                f"{self.call}: {what} is not a pytree prefix of the value it describes: {e}"
            ) from None
        repeats = jax.tree_util.tree_leaves(parts, is_leaf=lambda x: isinstance(x, _Repeat))
        return [r.slot for r in repeats for _ in range(r.count)]

    def _batch_leaf_ids(self) -> set[int]:
        nums = self.config.batch_argnums
        if nums is None:
            nums = (len(self.args) - 1,)
        ids, start = set(), 0
        for i, a in enumerate(self.args):
            count = len(jax.tree_util.tree_leaves(a))
            if i in nums or i - len(self.args) in nums:
                ids.update(range(start, start + count))
            start += count
        return ids

    def _in_sharding(self, path, x, slot, anchor, batch, ctx) -> NamedSharding:
        shape = np.shape(x)
        if isinstance(slot, PartitionSpec) and self.config.mode == "manual":
            return NamedSharding(ctx.mesh, slot)
        if slot is not None:
            return self._layout_sharding(slot, x, ctx, f"in_strategy{path}")
        c = self.config
        if anchor is not None and c.mode in ("semi_auto", "auto"):
            return anchor
        free = c.mode in ("semi_auto", "auto") and c.propagation == "jshard"
        searched = c.mode == "auto" and c.search != "propagation"  # the search decides the batch too
        cut_batch = c.mode != "manual" and c.dataset_strategy == "data_parallel" and not searched
        if batch and cut_batch and len(shape) > 0:
            if shape[0] % self.n:
                raise ShardingError(
                    f"{self.call}: dataset_strategy='data_parallel' cuts dim 0 of the batch input "
                    f"args{path} (shape {list(shape)}) over {self.n} devices, but {self.n} does not divide "
                    f"{shape[0]}. Use a batch size that is a multiple of {self.n}, give this argument an "
                    f"in_strategy, or pass dataset_strategy='full_batch'."
                )
            return NamedSharding(ctx.mesh, PartitionSpec(ctx.fine.names))
        return None if free else NamedSharding(ctx.mesh, PartitionSpec())

    def _out_sharding(self, path, x, slot, ctx):
        if slot is None:
            return None
        if isinstance(slot, PartitionSpec) and self.config.mode == "manual":
            return NamedSharding(ctx.mesh, slot)
        return self._layout_sharding(slot, x, ctx, f"out_strategy{path}")

    def _layout_sharding(self, slot, x, ctx, what) -> NamedSharding:
        layout = layout_of(slot, self.n, call=self.call, op=_BOUNDARY, what=what)
        check_divides(layout, np.shape(x), call=self.call, op=_BOUNDARY, what=what, dtype=_dtype_of(x))
        try:
            return NamedSharding(ctx.mesh, ctx.fine.partition_spec(layout))
        except NotRefined as e:
            e.who = what
            raise


@dataclasses.dataclass(frozen=True)
class _Repeat:
    """One strategy slot standing for `count` leaves of the value it describes."""

    slot: Slot
    count: int


def _program(evaluate: Callable[..., Any], out_tree) -> Callable[..., Any]:
    """The traced jaxpr (run by `evaluate`) as a function of the original (pytree) arguments."""

    def run(*args):
        return jax.tree_util.tree_unflatten(out_tree, evaluate(*jax.tree_util.tree_leaves(args)))

    return run


def _in_strategy_count_error(call, prefix, nargs) -> str:
    sequence = isinstance(prefix, (tuple, list))
    hint = ""
    if sequence and prefix and all(isinstance(v, int) for v in prefix):
        one = tuple(prefix)
        hint = f" in_strategy={one} looks like one strategy; for one argument write in_strategy=({one},)."
    return (
        f"{call}: in_strategy has {len(prefix) if sequence else 1} entries but the function was called "
        f"with {nargs} positional arguments. Give one entry per argument (None: the default for that "
        f"argument).{hint}"
    )


def _manual_mesh_error(call, e: NotRefined, mesh: Mesh) -> str:
    return (
        f"{call}: {e.who} uses device matrix {list(e.matrix)}, whose axes do not line up with the axes "
        f"of your mesh {dict(mesh.shape)}, and mode='manual' keeps the mesh as given. Use a strategy "
        f"or a jshard.Layout whose device-matrix axes each cover consecutive mesh axes (e.g. "
        f"Layout({tuple(mesh.devices.shape)}, {tuple(mesh.axis_names)})), or mode='semi_auto' with "
        f"mesh=... so that jshard refines the mesh."
    )


def _boundary_anchors(call, nodes, invars, annotations) -> dict:
    """Arguments that flow straight into a user constraint take its sharding as their own.

    Raises:
      ShardingError: one argument constrained two different ways by two `shard` calls.
    """
    top = set(invars)
    found: dict = {}
    where: dict = {}
    for node in nodes:
        if node.primitive != "sharding_constraint" or node.inside or node.inputs[0] not in top:
            continue
        v, sharding = node.inputs[0], _settled(node.eqn.params["sharding"])
        if v in found and found[v].spec != sharding.spec:
            raise ShardingError(
                f"{call}: one argument ({_aval_str(v)}) is constrained two ways: {found[v].spec} by "
                f"{where[v]} and {sharding.spec} by {node.source}. Configure one strategy for this value, "
                f"or make the redistribution explicit by sharding a copy."
            )
        found.setdefault(v, sharding)
        where.setdefault(v, node.source)
    return found


def _settled(sharding: NamedSharding) -> NamedSharding:
    """`sharding` with its unconstrained dims (a `vmap`ped constraint's batch dim) left whole, as an
    argument's sharding must fix every dim."""
    spec = PartitionSpec(*(None if p is PartitionSpec.UNCONSTRAINED else p for p in sharding.spec))
    return NamedSharding(sharding.mesh, spec)


def _aval_str(v) -> str:
    return f"{v.aval.dtype}[{','.join(map(str, v.aval.shape))}]"
