"""`Staged`: the step `parallelize(fn, pipeline=js.Pipelining(S, M, schedule=...))` returns for a
plain function, cut into stages where `jshard.pipeline_stage` tags it (or by the cost model), run
by a `StagedProgram` with each stage's parameters packed on its own devices."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _context
from jshard._errors import ShardingError, api_boundary
from jshard.compile import Options, Planning, SignatureCache, abstract, placed
from jshard.pipeline._checks import (
    check_batch,
    check_float_params,
    check_staged,
    name_of,
    not_built,
    pipeline_mesh,
    shapes,
    signature,
)
from jshard.pipeline._cut import cut
from jshard.pipeline._rows import manual_rows
from jshard.pipeline._schedule import build_schedule
from jshard.pipeline._staged import StagedProgram
from jshard.pipeline._stagesearch import searched
from jshard.pipeline._step import check_marked, check_no_tracers, full_step, marks


@dataclasses.dataclass
class _StagedEntry:
    program: StagedProgram
    batch_sh: Any
    packed_sh: Any
    train: Any
    pack: Any
    unpack: Any
    compiled: jax.stages.Compiled | None = None


class Staged:
    """A train step cut into pipeline stages where `jshard.pipeline_stage` tags it (MindSpore's
    `Cell.pipeline_stage` on an ordinary network): call it for `(loss, grads)`.

    Made by `jshard.parallelize(fn, pipeline=js.Pipelining(S, M, schedule=...))` for a plain
    function `fn(params, batch)` returning a scalar loss (a mean over the batch's rows), or
    `jax.value_and_grad(loss)(params, batch)`; its forward loss is traced on one micro-batch, cut
    into stages (`_cut.py`) and run under the schedule (`_staged.py`). A full train step that marks
    its gradient function (`jshard.accumulate(jax.value_and_grad(loss_fn))(params, batch)`) runs
    that function in the pipeline and the rest of the step (the optimizer update) on its gradients
    (`_step.py`). The gradients are the pipeline's own, one backward per stage and micro-batch. With no tags the cost model cuts it
    (`_balance.py`; `program(params, batch).cut.balance`); `jshard.shard` calls inside stages hold on
    each stage's devices; with `mode="auto"` each stage's strategy is searched over its devices
    (`_stagesearch.py`; `program(params, batch).cut.plans`).

    Each stage's parameters live on its own devices only: `pack(params, batch)` lays a parameter
    tree out as `[S, width]` buffers cut over the stage axis, `train(packed, batch)` runs the step
    on them (an optimizer applied to the packed gradients keeps its state where it is used too),
    `unpack` reads buffers back as a tree, `compile` compiles the packed program, and
    `program(params, batch)` is the `StagedProgram` (`stage_bytes()`: each stage's share).
    """

    def __init__(self, fn: Any, options: Options):
        self.fn, self.options = fn, options
        self.call = f"jshard.parallelize({name_of(fn)})"
        self.pipeline = check_staged(self.call, options)
        _, self.inner, self.mesh = pipeline_mesh(self.call, options)
        self._cache: SignatureCache[_StagedEntry] = SignatureCache()
        self._packed: dict[tuple, _StagedEntry] = {}
        self._marks: SignatureCache[bool] = SignatureCache()
        self._steps: SignatureCache[Any] = SignatureCache()

    @api_boundary
    def __call__(self, *args: Any) -> Any:
        """`(loss, grads)`: the mean loss over micro-batches and its gradients, in `params`' tree
        (a parameter read by two stages gets the sum of both): `pack`, `train`, then the gradients
        unpacked. A full train step (its gradient function marked by `jshard.accumulate`) returns
        what the step returns, computed on the pipeline's gradients (`_step.py`)."""
        if self._marked(args):
            return self._full(args)(*placed(args, _replicated(self.mesh, args)))
        params, batch = self._loss_args(args)
        e = self._entry(params, batch)
        loss, grads = self._run(e, e.pack(*placed((params,), (_replicated(self.mesh, params),))), batch)
        return loss, e.unpack(grads)

    @api_boundary
    def program(self, params: Any, batch: Any) -> StagedProgram:
        """The `StagedProgram` for these arguments' shapes: the cut, its packing, the schedule."""
        return self._entry(params, batch).program

    @api_boundary
    def pack(self, params: Any, batch: Any) -> dict[str, jax.Array]:
        """`params` as the packed `[S, width]` buffers (one per dtype), each stage's row on its devices."""
        e = self._entry(params, batch)
        return e.pack(*placed((params,), (_replicated(self.mesh, params),)))

    @api_boundary
    def unpack(self, packed: dict[str, jax.Array], params: Any, batch: Any) -> Any:
        """Packed buffers (parameters or gradients) back as a tree like `params`."""
        return self._entry(params, batch).unpack(packed)

    @api_boundary
    def train(self, packed: dict[str, jax.Array], batch: Any) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`(loss, packed grads)` on packed parameters (`pack`); a tied leaf's gradient, the sum over
        its stages, is in every copy."""
        e = self._packed.get(signature((packed, batch)))
        if e is None:
            raise not_built(self.call, "packed parameters", shapes(packed), batch, "Pack")
        return self._run(e, packed, batch)

    def _run(self, e: _StagedEntry, packed, batch):
        if e.compiled is None:
            e.compiled = e.train.lower(*abstract((packed, batch))).compile()
        return e.compiled(*placed((packed, batch), (e.packed_sh, e.batch_sh)))

    @api_boundary
    def lower(self, *args: Any) -> jax.stages.Lowered:
        """The packed train program `(packed, batch) -> (loss, packed grads)`, lowered; for a full
        train step, the step's program on its arguments."""
        if self._marked(args):
            return self._full(args).lower(*abstract(args))
        params, batch = self._loss_args(args)
        e = self._entry(params, batch)
        packed = jax.eval_shape(e.program.pack, jax.tree.leaves(abstract(params)))
        return e.train.lower(packed, abstract(batch))

    @api_boundary
    def compile(self, params: Any, batch: Any) -> jax.stages.Compiled:
        """The packed train program, compiled once per input signature."""
        e = self._entry(params, batch)
        if e.compiled is None:
            e.compiled = self.lower(params, batch).compile()
        return e.compiled

    def _entry(self, params, batch) -> _StagedEntry:
        return self._cache.get((params, batch), lambda: self._build(params, batch))

    def _context(self) -> tuple:
        """A trace context's call, fine mesh, mesh (one stage's devices) and mode."""
        return self.call, self.inner, Mesh(self.mesh.devices[0], self.inner.names), "semi_auto"

    def _marked(self, args: tuple) -> bool:
        """Whether the step marks its gradient function (`jshard.accumulate`): a full train step."""
        return self._marks.get(args, lambda: marks(self.fn, args, self._context()) > 0)

    def _full(self, args: tuple):
        """The full train step's program for these arguments' shapes (`_step.py`)."""
        return self._steps.get(args, lambda: full_step(self.fn, self.mesh, self._context(), self._gradients))

    def _gradients(self, grad_fn, args: tuple, batch_argnums: int, steps: int | None, call: str):
        """`grad_fn(*args)` (`(params, batch)`) pipelined: its loss cut into stages, run on the
        schedule; `(loss, grads)` as `jax.value_and_grad` returns them. Called while the step traces."""
        check_marked(call, args, batch_argnums, steps, self.pipeline.micro_batches)
        inner = Staged(grad_fn, self.options)
        inner.call = call
        params, batch = args
        e = inner._build(abstract(params), abstract(batch))  # built once per trace of the step
        check_no_tracers(call, e.program.cut.consts)
        loss, grads = e.train(e.pack(params), batch)
        return loss, e.unpack(grads)

    def _loss_args(self, args: tuple) -> tuple[Any, Any]:
        if len(args) != 2:
            raise ShardingError(
                f"{self.call}: the step takes {len(args)} arguments and marks no gradient function. A pipelined "
                f"step is a loss (params, batch) -> scalar, jax.value_and_grad of one, or a full train step "
                f"that marks its gradient function: loss, grads = jshard.accumulate(jax.value_and_grad("
                f"loss_fn))(params, batch); the pipeline runs that call, and the rest of the step (the optimizer "
                f"update, metrics) runs on its gradients."
            )
        return args[0], args[1]

    def _data_axes(self, params, batch) -> tuple[str, ...]:
        """The stage's axes its micro-batches' rows are cut over, each device running its own rows:
        all of them under `dataset_strategy="data_parallel"`, none where the step calls
        `jshard.shard` (its strategies then lay out each stage over the stage's axes)."""
        data = self.options.dataset_strategy == "data_parallel" and self.inner.device_count > 1
        if not data or self.options.mode == "auto":  # the search lays the rows out with the rest
            return ()
        return tuple(self.inner.names) if not self._shard_calls(params, batch) else ()

    def _shard_calls(self, params, batch) -> int:
        """How many `jshard.shard` calls the step makes (traced once, shapes only)."""
        stage_mesh = Mesh(self.mesh.devices[0], self.inner.names)
        ctx = _context.TraceContext(self.call, self.inner, stage_mesh, "semi_auto")
        with _context.tracing(ctx):
            jax.eval_shape(self.fn, abstract(params), abstract(batch))
        return len(ctx.annotations)

    def _build(self, params, batch) -> _StagedEntry:
        planning = Planning.of(self.options.search.time_limit)  # one clock for the step's planning, every stage's
        c, data_axes = self.pipeline, self._data_axes(params, batch)
        check_batch(self.call, batch, c.micro_batches, self._size(data_axes))
        leaves, treedef = jax.tree_util.tree_flatten(abstract(params))
        check_float_params(self.call, params)
        staged = self._cut(abstract(params), self._micro(batch, data_axes), planning)
        if not data_axes and self.options.mode != "auto":
            data_axes, staged = self._rows_cut(params, batch, staged, planning)
        sched = build_schedule(c.schedule, stages=c.stages, micro_batches=c.micro_batches, virtual=c.virtual_stages)
        program = StagedProgram(staged, sched, self.mesh, tuple(leaves), data_axes)
        packed_sh = {name: NamedSharding(self.mesh, spec) for name, spec in program.specs().items()}
        batch_sh = jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec(data_axes or None)), batch)
        loss_sh = NamedSharding(self.mesh, PartitionSpec())

        e = _StagedEntry(
            program,
            batch_sh,
            packed_sh,
            jax.jit(program.train, in_shardings=(packed_sh, batch_sh), out_shardings=(loss_sh, packed_sh)),
            jax.jit(lambda p: program.pack(jax.tree.leaves(p)), out_shardings=packed_sh),
            jax.jit(lambda g: jax.tree_util.tree_unflatten(treedef, program.unpack(g))),
        )
        packed = jax.eval_shape(program.pack, leaves)
        self._packed.setdefault(signature((packed, batch)), e)  # what `train` finds it by
        return e

    def _micro(self, batch, data_axes: tuple[str, ...]) -> Any:
        """One device's micro-batch (shapes): `1 / (M · the data axes' devices)` of the rows."""
        d = self.pipeline.micro_batches * self._size(data_axes)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // d, *a.shape[1:]), a.dtype), abstract(batch))

    def _size(self, axes: tuple[str, ...]) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def _rows_cut(self, params, batch, staged, planning: Planning) -> tuple[tuple[str, ...], Any]:
        """Data parallel written as `jshard.shard` strategies inside the stages (`manual_rows`),
        with the cut traced again on one device's rows; `((), staged)` where none."""
        axes, again = manual_rows(
            self.call,
            self.mesh,
            self.inner.names,
            self.pipeline.micro_batches,
            staged,
            batch,
            set(),
            lambda axes: self._cut(abstract(params), self._micro(batch, axes), planning),
        )
        return (axes, again) if axes else ((), staged)

    def _cut(self, params, micro, planning: Planning):
        """The cut of `fn` on one device's micro-batch, its `jshard.shard` calls traced over one
        stage's devices: their strategies hold inside every stage (`Cut.run` binds them over the
        stage's own axes); under `mode="auto"` each stage's strategy searched on `planning`'s
        deadline."""
        stage_mesh = Mesh(self.mesh.devices[0], self.inner.names)
        ctx = _context.TraceContext(self.call, self.inner, stage_mesh, "semi_auto", recompute=self.options.recompute)
        c = self.pipeline
        with _context.tracing(ctx):
            try:
                staged = cut(self.fn, params, micro, c.stages * c.virtual_stages, self.call, self.options.costs)
            except ShardingError as e:
                if c.virtual_stages == 1:
                    raise
                raise ShardingError(  # the cut counts the tagged stages: say where that count comes from
                    f"{e} (schedule='interleaved': the tags number stages × virtual_stages = "
                    f"{c.stages} × {c.virtual_stages} = {c.stages * c.virtual_stages} stages, stage k running on "
                    f"device group k mod {c.stages}.)"
                ) from None
        if self.options.mode != "auto":
            return staged
        if ctx.annotations:
            raise ShardingError(
                f"{self.call}: mode='auto' with pipeline= searches every stage's strategy, but the step calls "
                f"jshard.shard ({len(ctx.annotations)} call(s), the first {ctx.annotations[0].name} at "
                f"{ctx.annotations[0].source}) inside its stages. Use mode='semi_auto' to keep those strategies, or "
                f"drop the shard calls to have them searched."
            )
        return searched(self.call, staged, self.options, self.inner, jax.tree.leaves(params), micro, planning)


def _replicated(mesh: Mesh, tree: Any) -> Any:
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)
