"""`jshard.parallelize`: the front end of the compile core (`jshard.compile`).

It turns the keywords into one validated `Options` and keeps one `Program` per input signature,
as `jax.jit` keeps one executable: the core traces, plans and compiles (see ARCHITECTURE.md); a
pipeline (`pipeline_stages=`) goes to the pipeline front end with the same options.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.sharding import Mesh

from jshard._errors import DeviceCountError, api_boundary
from jshard._nnx import split_graphs
from jshard.compile import (
    Bound,
    Options,
    Program,
    SignatureCache,
    abstract,
    bind,
    build,
    placed,
    resolve,
)
from jshard.cost import CostModel
from jshard.layouts import DatasetStrategy
from jshard.plan import Plan


@api_boundary
def parallelize(
    fn: Callable[..., Any] | None = None,
    *,
    devices: int | None = None,
    mesh: Mesh | None = None,
    mode: str = "semi_auto",
    in_strategy: Sequence[Any] | None = None,
    out_strategy: Any = None,
    donate_argnums: int | Sequence[int] = (),
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnames: str | Sequence[str] = (),
    dataset_strategy: DatasetStrategy = "data_parallel",
    batch_argnums: int | Sequence[int] | None = None,
    propagation: str = "jshard",
    cost_model: CostModel | None = None,
    enable_alltoall: bool = True,
    plan: Plan | None = None,
    search: str = "recursive",
    memory_budget: int | float | str | None = None,
    search_time_limit: float = 60.0,
    search_replay: bool = True,
    pipeline_stages: int | None = None,
    micro_batches: int | None = None,
    schedule: str = "1f1b",
    virtual_stages: int = 1,
    pipeline_result_broadcast: bool = False,
    optimizer_parallel: int | None = None,
    optimizer_parallel_threshold: int | float | str = "64KiB",
    optimizer_state_argnums: int | Sequence[int] | None = None,
    optimizer_comm_recompute: bool = False,
    accumulation_steps: int | None = None,
    accumulation_shard: bool = False,
    offload: str | Sequence[str] | None = None,
    recompute: Any = None,
) -> Any:
    """Runs `fn` on many devices from MindSpore-style strategies; usable as a decorator.

    Args:
      fn: the function (e.g. a train step) to parallelize.
      devices: how many devices (the first `devices` of `jax.devices()`); default all, or the mesh's.
      mesh: a `jax.sharding.Mesh` to run on; its flattened device order is the rank order. Required
        with `mode="manual"`, whose PartitionSpecs name its axes. Without it, a call made inside
        `jax.set_mesh(mesh)` runs on that mesh. jshard plans on your mesh as given (its axis names,
        sizes and `Auto`/`Explicit` types), traces under it, and reads the model's own constraints,
        placements and types as anchors (`origin="model"`).
      mode: `"data"` (the batch is cut over all devices, parameters replicated, `shard` calls
        ignored as in MindSpore's DATA_PARALLEL), `"semi_auto"` (`shard` strategies kept, the rest
        follows from them), `"auto"` (no annotations needed: `search` finds a strategy for every
        operator, keeping any `shard` calls and `in_strategy` as constraints), or `"manual"`
        (`in_strategy`/`out_strategy` are PartitionSpecs over `mesh`; jshard only builds the program).
      in_strategy: one entry per positional argument: a strategy tuple, a `Layout` call, a
        PartitionSpec (manual), None, or a pytree prefix of the argument holding those. A static
        argument's entry is None. Keyword arguments take no entry: they are laid out as any
        argument without one (left to the planner in `semi_auto` and `auto` with
        `propagation="jshard"`, else replicated), and are never the batch.
      out_strategy: the same for the results (a pytree prefix of the output).
      donate_argnums: as `jax.jit`.
      static_argnums: as `jax.jit`: these positional arguments are not traced; their values must be
        hashable, and each new value builds (traces, plans, compiles) a new program.
      static_argnames: as `jax.jit`: the same for arguments by name (completed from
        `static_argnums` through `fn`'s signature, and the other way round).
      donate_argnames: as `jax.jit`: donate arguments by name (keyword arguments too).
      dataset_strategy: MindSpore's: `"data_parallel"` cuts dim 0 of every array in the batch
        arguments over all devices, `"full_batch"` replicates them, and a tuple holds one strategy
        tuple or `Layout` call per leaf of the batch arguments (in leaf order), as `jshard.data`
        takes it; used where `in_strategy` says nothing.
      batch_argnums: which positional arguments are the batch; default the last one not static that
        holds an array of at least one dim that is not a PRNG key (`step(state, batch, key)`: `batch`).
      propagation: who lays out the operators no strategy fixes: `"jshard"` (the propagation
        engine: every operator gets a strategy, an origin and a cost in the `Plan`) or `"xla"`
        (Shardy propagates from the same anchors; the baseline the benchmarks compare with).
      cost_model: the α–β `CostModel` propagation minimizes (default: one GPU node).
      enable_alltoall: MindSpore's switch: whether a redistribution that moves a mesh axis from one
        tensor dim to another (a transpose or reshape between two layouts) may be an all-to-all.
        Off, the cost model prices such a move as an all-gather and a local slice, and the emitted
        program constrains the gathered layout in between, so XLA emits no all-to-all for it.
        Default on, unlike MindSpore's (off): XLA's partitioner emits all-to-alls natively, and a
        move by all-to-all sends 1/n of the all-gather's bytes (the README gives the GPT-3 plan's
        predicted step both ways).
      plan: a `Plan` (from `Plan.load`) to rebuild instead of propagating or searching; it must
        match the function operator by operator.
      search: with `mode="auto"`: `"recursive"` (bisect the devices one mesh axis at a time, linear
        in the program's size), `"ilp"` (exact, HiGHS, for a few devices and moderate programs) or
        `"propagation"` (cut the batch, propagate as `semi_auto` does).
      memory_budget: with `mode="auto"`: bytes per device the plan must fit (an int, or a string
        such as `"16GiB"`); where devices are present the compiled program's memory is checked
        and the search tightened until it fits. Default: the memory of one device, estimated only:
        `cost_model.memory` (`CostModel.for_device("H100")`), else the devices present's
        (`jshard.cost.device_memory`), else (an abstract mesh) no budget. Nothing fitting raises
        `jshard.MemoryBudgetError`.
      search_time_limit: seconds the ILP may take; past it, the best plan found is used and the
        plan says so.
      search_replay: with `search="recursive"`: plan the interior layers of a repeated run of
        identical layers (an unrolled Python loop over layers: the same operators, shapes and
        wiring, layer after layer) once and replay the decision on each, the way a scanned body is
        planned once, then improve the replayed plan operator by operator; the search's work is
        then flat in the depth. False: every operator weighed on its own (slower at depth).
      pipeline_stages: S, to pipeline `fn`, a `jshard.Pipeline`: the devices form S stages of
        `devices / S` each, and the result is a `jshard.pipeline.Pipelined` step (`jshard.pipeline`).
        Only `devices`, `in_strategy` (strategies over one stage's devices) and `dataset_strategy`
        apply with it. Or `fn` is any loss or `value_and_grad` step whose parts are tagged with
        `jshard.pipeline_stage(fn, k)`: it is cut at the tags, a `jshard.pipeline.Staged` step; or
        a full train step that marks its gradient function (`js.accumulate(jax.value_and_grad(
        loss_fn))(params, batch)`), which the pipeline runs, the update running on its gradients.
      micro_batches: M, how many micro-batches a step's batch is cut into (M >= S).
      schedule: `"1f1b"`, `"gpipe"`, `"interleaved"` (with `virtual_stages`) or `"zb-h1"` (zero bubble:
        each backward split into its input-gradient and weight-gradient parts, the latter run in the bubble).
      virtual_stages: v, model chunks per stage for `schedule="interleaved"`.
      pipeline_result_broadcast: inference outputs on every device (else on the last stage).
      optimizer_parallel: MindSpore's `enable_parallel_optimizer` / `optimizer_level` (ZeRO), in
        `mode="data"`, `"semi_auto"` and `"auto"` (over the axes the search leaves the state
        replicated on; the search then plans around the cut): `1` cuts every optimizer-state leaf of at least
        `optimizer_parallel_threshold` bytes over the data-parallel devices (the mesh axes its
        layout leaves replicated) on its largest dim they divide, as the argument's and the
        updated result's sharding, so the state stays cut between steps; the update is computed
        cut, from each device's slice of the summed gradients (all-reduce + dynamic-slice on
        XLA:CPU). `2` reduce-scatters the gradients, and jshard emits the reduce-scatter itself so
        it is there on every backend: the backward pass's product that sums a gradient over the
        data-parallel axes runs in a `jax.shard_map` manual over them alone, ending in
        `lax.psum_scatter` onto the state's cut (also in a `lax.scan` body over stacked layers;
        not for a gradient cut on a dim another axis cuts: XLA's all-reduce + slice there;
        `plan.optimizer.reduce_scattered` counts them). `3` cuts the parameters too, all-gathered before use (FSDP), and
        reduce-scatters as `2`. Roles:
        argument 0 is the parameters, the batch is the batch, the other arguments the state. A
        result updates an argument where it has the argument's tree, shapes and dtypes. A leaf
        no free axis divides stays whole (`plan.summary()` names it). None: off, except that
        with `mode="auto"` and a memory budget no plan meets without it, the search weighs levels
        1-3 itself and builds the fastest that fits (`plan.optimizer.why`, `plan.search.optimizer`).
      optimizer_parallel_threshold: bytes, or a size such as `"64KiB"` (the default, as
        MindSpore's `parallel_optimizer_threshold`); smaller leaves stay whole.
      optimizer_state_argnums: the optimizer-state arguments, where not every other one is.
      optimizer_comm_recompute: with `optimizer_parallel=3` (MindSpore's
        `parallel_optimizer_comm_recompute`): the backward pass all-gathers each cut parameter
        again (behind `lax.optimization_barrier`, so XLA keeps the two gathers apart) instead of
        keeping the forward pass's gathered copy alive until then, and the optimizer update reads
        the cut parameter; more all-gather bytes for fewer live ones (`plan.summary()` counts them).
      accumulation_steps: k, gradient accumulation (MindSpore's `gradient_accumulation`): the step
        wraps its gradient function in `jshard.accumulate` (`loss, grads =
        js.accumulate(jax.value_and_grad(loss_fn))(params, batch)`), which runs it on k
        micro-batches of the batch's rows in a `lax.scan` and returns the mean; the optimizer
        updates once per step. In `mode="data"` and `"semi_auto"`, where every batch leaf's rows
        are cut over the same axes before planning, the loop runs in a `jax.shard_map` manual over
        them: each device sums its own micro-batches and one `psum` after the loop reduces the
        gradients once per step (else XLA reduces each micro-batch's). k must divide the batch's rows (and, with the `"data_parallel"`
        dataset strategy, leave micro-batches the devices divide). None: off.
      accumulation_shard: MindSpore's `gradient_accumulation_shard`, in `mode="data"` and
        `"semi_auto"`: the accumulated gradients (the scan carry) are cut over the data-parallel
        axes their parameter's layout leaves free, on its largest dim they divide (as
        `optimizer_parallel` cuts it; leaves under `optimizer_parallel_threshold` stay whole when
        `optimizer_parallel` is set), instead of being held whole on every data-parallel device;
        in the manual loop each micro-batch's gradient is reduce-scattered into the cut carry
        (`lax.psum_scatter`, where the cut puts exactly the batch's axes on one dim).
      offload: MindSpore's heterogeneous storage: `("optimizer",)`, `("parameters",)` or both keep
        the optimizer-state leaves, the parameter leaves or both (the roles above; PRNG keys stay)
        in host memory between steps (memory kind `"pinned_host"` on the program's argument
        shardings and on the results that update them); the step streams each to the device for
        use and the update back. `plan.summary()` names the host leaves and the bytes moved per
        step (`plan.offload`, a `jshard.plan.OffloadReport`). None (the default): nothing, but with
        `mode="auto"` and a memory budget that binds the search weighs keeping the optimizer state
        (then the parameters too) in host memory, the streaming priced on the cost model's
        `host_bandwidth`, and keeps the fastest plan that fits (`plan.search.offload`); `()`: never.
        Activations: `jshard.recompute(fn, policy="offload")`. A `jshard.hetero.HostTable` argument
        lives in host memory without it.
      recompute: the policy of the `jshard.recompute` regions that name none (MindSpore's
        parallel-wide recompute default): `"full"`, `"selective"`, `"none"`, a
        `jax.checkpoint_policies` name or callable, or `"auto"`: with `mode="auto"` the search
        traces the step once per policy ("none", "selective", "full", the same for every such
        region), prices each region under each policy (the bytes it keeps for the backward pass,
        the FLOPs it runs again), gives each region the least recompute whose estimated peak fits
        the memory budget, and builds the fastest plan that fits;
        `plan.search.recompute` lists the uniform policies weighed, `plan.search.regions` each
        region's choice; elsewhere `"auto"` is `"full"`. Pipelines apply it in their stages.
        None: `"full"`.

    Returns:
      A `Parallelized` callable with `lower` and `plan`. Call it as `fn` is called: keyword
      arguments are traced as `jax.jit` traces them. PRNG keys (`jax.random.key`, or raw `uint32`
      `jax.random.PRNGKey`s) may be arguments and results, and `jax.random` (dropout) may run
      inside: a key array's dims are laid out like any tensor's, and each device draws the values
      one device would. Flax NNX graph objects (modules, `nnx.Optimizer`, `nnx.Rngs`) may be
      arguments and results, as `nnx.jit` takes them: the step's updates to them (parameters,
      optimizer state, batch statistics, RNG counts) are seen by the caller.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> step = js.parallelize(lambda x, w: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w),
      ...                       devices=8, in_strategy=((2, 1), (1, 4)))
      >>> step(jnp.ones((4, 8)), jnp.ones((8, 16))).shape
      (4, 16)

      As `jax.jit`, with static and keyword arguments (the batch: `x`, the last one not static):

      >>> power = js.parallelize(lambda x, n, *, bias: x**n + bias, devices=8, static_argnums=1)
      >>> power(jnp.full(8, 2.0), 3, bias=jnp.float32(1.0))[:2]
      Array([9., 9.], dtype=float32)
    """
    options = Options.create(
        devices=devices, mesh=mesh, mode=mode, in_strategy=in_strategy, out_strategy=out_strategy,
        donate_argnums=donate_argnums, static_argnums=static_argnums, static_argnames=static_argnames,
        donate_argnames=donate_argnames, dataset_strategy=dataset_strategy, batch_argnums=batch_argnums,
        propagation=propagation, cost_model=cost_model, enable_alltoall=enable_alltoall, plan=plan, search=search, memory_budget=memory_budget,
        search_time_limit=search_time_limit, search_replay=search_replay, pipeline_stages=pipeline_stages, micro_batches=micro_batches,
        schedule=schedule, virtual_stages=virtual_stages, pipeline_result_broadcast=pipeline_result_broadcast,
        optimizer_parallel=optimizer_parallel, optimizer_parallel_threshold=optimizer_parallel_threshold,
        optimizer_state_argnums=optimizer_state_argnums, optimizer_comm_recompute=optimizer_comm_recompute,
        accumulation_steps=accumulation_steps, accumulation_shard=accumulation_shard, offload=offload, recompute=recompute,
    )
    if options.pipeline is not None:
        from jshard.pipeline import pipelined  # noqa: PLC0415  (the pipeline front end builds on this module's core)

        return pipelined(fn, options)
    if fn is None:
        return lambda f: Parallelized(f, options)
    return Parallelized(fn, options)


class Parallelized:
    """A parallelized function: call it, `lower` it, or read its `plan`, as with `jax.jit`."""

    def __init__(self, fn: Callable[..., Any], options: Options):
        functools.update_wrapper(self, fn)  # first, so that fn's own attributes cannot shadow ours
        self.fn, self.options = fn, options
        self.name = getattr(fn, "__name__", type(fn).__name__)
        self.call = f"jshard.parallelize({self.name})"
        options.check(self.call)
        self.options = resolve(fn, options, self.call)
        self._cache: SignatureCache[Program] = SignatureCache()

    @api_boundary
    def __call__(self, *args, **kwargs):
        bound, options, finish = self._bind(args, kwargs)
        program = self._runnable(bound, options)
        return finish(program.jitted(*placed(bound.args, program.in_shardings)))

    @api_boundary
    def lower(self, *args, **kwargs) -> jax.stages.Lowered:
        """The planned program, lowered (as `jax.jit(...).lower`). Its arguments are the traced ones:
        the positional arguments (a static one as None), then the keyword arguments' values in name order
        (a Flax NNX object as its state). They are taken on the plan's shardings, as a call places
        them (an array committed elsewhere, say replicated where the plan cuts it, is moved, not
        refused as `jax.jit` refuses it); with `offload`, as shapes (they need not lie in host memory
        yet)."""
        bound, options, _ = self._bind(args, kwargs)
        program = self._runnable(bound, options)
        return program.jitted.lower(*(abstract(bound.args) if program.plan.offload
                                      else placed(bound.args, program.in_shardings)))

    @api_boundary
    def plan(self, *args, **kwargs) -> Plan:
        """The `Plan` for these arguments (arrays or `jax.ShapeDtypeStruct`s); nothing is compiled.

        With more `devices` than are present, the plan is made on an abstract mesh (planning for a
        cluster from a laptop); such a plan cannot be run or lowered here. With Flax NNX objects
        among the arguments, the plan's results are `(result, the objects' states)`.
        """
        bound, options, _ = self._bind(args, kwargs)
        return self._program(bound, options).plan

    def _bind(self, args: tuple, kwargs: dict) -> tuple[Bound, Options, Callable[[Any], Any]]:
        """The call as the core traces it, the options for it, and what turns the program's results
        into the function's (updating the caller's NNX objects, `_nnx.py`)."""
        o = self.options
        graphs = split_graphs(self.fn, args, kwargs, o.static_argnums, o.static_argnames, self.call)
        if graphs is None:
            return bind(self.fn, o, args, kwargs, self.call), o, lambda out: out
        options = dataclasses.replace(o, out_strategy=None if o.out_strategy is None else (o.out_strategy, None))
        return bind(graphs.fn, options, graphs.args, graphs.kwargs, self.call), options, graphs.finish

    def _program(self, bound: Bound, options: Options) -> Program:
        return self._cache.get(bound.args, lambda: build(bound.fn, bound.args, bound.options(options, self.call),
                                                         self.call), bound.key)

    def _runnable(self, bound: Bound, options: Options) -> Program:
        program = self._program(bound, options)
        if program.jitted is None:
            have = jax.devices()
            raise DeviceCountError(
                f"{self.call}: devices={program.plan.device_count}, but only {len(have)} device(s) are present "
                f"({have[0].platform}); such a plan can be made (.plan) but not run. On a CPU, call "
                f"jshard.simulate_devices({program.plan.device_count}) before anything else to simulate them."
            )
        return program

