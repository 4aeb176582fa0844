"""`jshard.parallelize`: the front end of the compile core (`jshard.compile`).

It turns the keywords into one validated `Options` and keeps one `Program` per input signature, as
`jax.jit` keeps one executable; a pipeline (`pipeline=`) goes to the pipeline front end.
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
    Accumulation,
    Bound,
    Communication,
    OptimizerParallel,
    Options,
    Pipelining,
    Program,
    Search,
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
    dataset_strategy: DatasetStrategy = "data_parallel",
    batch_argnums: int | Sequence[int] | None = None,
    static_argnums: int | Sequence[int] = (),
    static_argnames: str | Sequence[str] = (),
    donate_argnums: int | Sequence[int] = (),
    donate_argnames: str | Sequence[str] = (),
    plan: Plan | None = None,
    propagation: str = "jshard",
    cost_model: CostModel | None = None,
    search: Search | str = "recursive",
    pipeline: Pipelining | None = None,
    optimizer: OptimizerParallel | int | None = None,
    accumulation: Accumulation | int | None = None,
    communication: Communication | int | None = None,
    offload: str | Sequence[str] | None = None,
    recompute: Any = None,
    **deprecated: Any,
) -> Any:
    """Runs `fn` (a decorator too) on many devices from MindSpore-style strategies, as `jax.jit` does on one.

    Args:
      fn: the function (e.g. a train step) to parallelize.
      devices: how many devices (the first `devices` of `jax.devices()`); default all, or the mesh's.
      mesh: a `jax.sharding.Mesh` to run on (`jax.make_mesh(...)`); its flattened device order is
        the rank order. A call inside `jax.set_mesh(mesh)` runs on that mesh without it.
      mode: `"data"` (the batch cut over all devices, parameters replicated, `shard` calls ignored),
        `"semi_auto"` (`shard` strategies kept, the rest follows from them), `"auto"` (no annotations
        needed: `search` finds a strategy for every operator, keeping any given as constraints) or
        `"manual"` (`in_strategy`/`out_strategy` are PartitionSpecs over `mesh`).
      in_strategy: one entry per positional argument: a strategy tuple, a `Layout` call, a
        PartitionSpec (manual), None, or a pytree prefix of the argument holding those.
      out_strategy: the same for the results.
      dataset_strategy: MindSpore's: `"data_parallel"` (dim 0 of the batch cut over all devices),
        `"full_batch"` or one strategy per batch leaf, where `in_strategy` is silent.
      batch_argnums: the positional arguments that are the batch; default the last one holding an array.
      static_argnums: as `jax.jit`'s.
      static_argnames: as `jax.jit`'s.
      donate_argnums: as `jax.jit`'s.
      donate_argnames: as `jax.jit`'s.
      plan: a `Plan` (`Plan.load`) to rebuild instead of planning.
      propagation: who lays out the operators no strategy fixes: `"jshard"`, `"xla"` (Shardy), or
        `"best"`: both from the same anchors, each compiled once, the one whose program moves fewer
        collective bytes per device runs (`plan.peer` says which and by how much; one more compile).
      cost_model: the `CostModel` the planners price with (default one GPU node), `enable_alltoall` too.
      search: with `mode="auto"`, a `Search` (method, memory budget, time limit), or its method alone.
      pipeline: a `Pipelining` (stages, micro-batches, schedule) for a `jshard.Pipeline` or a tagged step.
      optimizer: an `OptimizerParallel` (ZeRO level 1-3, threshold), or its level alone.
      accumulation: an `Accumulation` (steps, shard) for `jshard.accumulate` in the step, or its steps.
      communication: a `Communication` (multi-copy `copies`, MindSpore's `comm_fusion`), or its copies.
      offload: `("optimizer",)`, `("parameters",)` or both kept in host memory between steps (None:
        the search may choose under a budget; `()`: never).
      recompute: the policy of `jshard.recompute` regions that name none: `"full"` (default),
        `"selective"`, `"none"`, a `jax.checkpoint_policies` name or callable, or `"auto"` (searched).
      **deprecated: the keywords before the option groups (`memory_budget=`, `pipeline_stages=`,
        ...), moved into their group with a `DeprecationWarning` for one release.

    Returns:
      A `Parallelized` callable with `lower` and `plan`, called as `fn` is: PRNG keys, Flax NNX
      objects and keyword arguments are taken as `jax.jit` (`nnx.jit`) takes them.

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
    keywords = {k: v for k, v in locals().items() if k not in ("fn", "deprecated")}  # every keyword, as given
    options = Options.create(stacklevel=3, **keywords, **deprecated)
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
        return finish(program.runs(*placed(bound.args, program.in_shardings)))

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

