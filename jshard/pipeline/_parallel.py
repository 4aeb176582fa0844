"""`parallelize(pipe, pipeline=js.Pipelining(S, M, schedule=...))`: a pipelined step.

The front end of the pipeline package, on the compile core's pieces: the same validated `Options`
(with its `Pipelining`), the same per-signature cache, strategy canonicalizer and dataset
policy as `parallelize`. It checks the pipeline's own rules (raising `ShardingError`s that name the
call, the value and the fix), builds the mesh (a leading `stage` axis of size S, then the stage's
own fine mesh over `devices / S` devices), turns the stage-internal strategies into
PartitionSpecs, and jits the `Program` of `_engine.py` once per input signature.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _context
from jshard._errors import DeviceCountError, ShardingError, api_boundary
from jshard._format import shape_str
from jshard.compile import (
    Options,
    Planning,
    SignatureCache,
    abstract,
    dtype_of,
    placed,
)
from jshard.layouts import (
    FineMesh,
    canonicalize_strategy_tree,
    check_dataset_strategy,
    check_divides,
    dataset_slots,
    layout_of,
)
from jshard.pipeline._cut import Cut, cut, spec_axes, without_axes
from jshard.pipeline._engine import STAGE, Program, Replicated, Specs
from jshard.pipeline._model import Pipeline, check_stage_ids, pipeline_stage, stack_length
from jshard.pipeline._plan import PipelinePlan, plan_of
from jshard.pipeline._rest import StageParams
from jshard.pipeline._schedule import SCHEDULES, build_schedule
from jshard.pipeline._staged import StagedProgram
from jshard.pipeline._stagesearch import searched
from jshard.pipeline._step import check_marked, check_no_tracers, full_step, marks


class _Checked(NamedTuple):
    """`options.pipeline` as `_check_options` passed it: `stages` and `micro_batches` given."""

    stages: int
    micro_batches: int
    schedule: str
    virtual_stages: int
    result_broadcast: bool


@dataclasses.dataclass
class _Entry:
    program: Program
    param_sh: Any
    batch_sh: Any
    train: Any
    stack_layers: int
    mode: str
    pack: Any
    unpack: Any
    hold: Any
    release: Any
    held_sh: Any = None
    compiled: jax.stages.Compiled | None = None


class Pipelined:
    """A pipelined step: call it for `(loss, grads)`, `forward` it for inference, or read its `plan`.

    Made by `jshard.parallelize(pipe, pipeline=js.Pipelining(...))` for a `jshard.Pipeline`.

    A training loop may hold its parameters as the program does and skip the conversions of each
    call: `pack(params, batch)` gives `(ends, stack)`, the parameters outside the stack on the
    stages that use them and the stack in stage order (interleaved: each stage's chunks side by
    side, `Program.hold`; the layer order with one chunk per stage), `train(held, batch)` returns
    `(loss, grads)` in that same form (an optimizer applied to them keeps every value where it is),
    and `unpack(held, params, batch)` gives a tree in the user's layer order back (for a checkpoint
    or an evaluation). Calling the step does all three each time.
    """

    def __init__(self, pipe: Pipeline, options: Options):
        self.pipe, self.options = pipe, options
        self.call = f"jshard.parallelize({_name(pipe)})"
        self.pipeline = _check_config(self.call, pipe, options)
        self.n, self.inner, self.mesh = _pipeline_mesh(self.call, options)
        self._cache: SignatureCache[_Entry] = SignatureCache()
        self._forwards: SignatureCache[Any] = SignatureCache()
        self._held: dict[tuple, _Entry] = {}

    @api_boundary
    def __call__(self, params: dict, batch: Any) -> tuple[jax.Array, dict]:
        """`(loss, grads)`: the loss is the mean over micro-batches, the grads are those of that loss
        (`pack`, the compiled `train`, then the gradients unpacked into `params`' tree)."""
        e = self._entry(params, batch)
        params, batch = placed((params, batch), (e.param_sh, e.batch_sh))
        rest, stack = self.pipe.split(params)
        loss, (g_ends, g_stack) = self.compile(params, batch)((e.pack(rest), e.hold(stack)), batch)
        return loss, self.pipe.join(e.unpack(g_ends), e.release(g_stack))

    @api_boundary
    def pack(self, params: dict, batch: Any) -> tuple[Any, Any]:
        """`params` as the train program holds them: `(ends, stack)`, the parameters outside the
        stack packed on the stages that use them, the stack in stage order (`Program.hold`)."""
        e = self._entry(params, batch)
        rest, stack = self.pipe.split(placed((params,), (e.param_sh,))[0])
        return e.pack(rest), e.hold(stack)

    @api_boundary
    def unpack(self, held: tuple[Any, Any], params: dict, batch: Any) -> dict:
        """Held parameters or gradients (`pack`, `train`) back as a tree like `params`, the stack in
        layer order."""
        e = self._entry(params, batch)
        ends, stack = held
        return self.pipe.join(e.unpack(ends), e.release(stack))

    @api_boundary
    def train(self, held: tuple[Any, Any], batch: Any) -> tuple[jax.Array, tuple[Any, Any]]:
        """`(loss, grads)` on held parameters (`pack`), the gradients held alike."""
        e = self._held.get(_signature((held, batch)))
        if e is None:
            raise _not_built(self.call, "held parameters of shapes", _shapes(jax.tree.leaves(held)), batch, "Hold")
        if e.compiled is None:
            e.compiled = e.train.lower(*abstract((held, batch))).compile()
        return e.compiled(*placed((held, batch), (e.held_sh, e.batch_sh)))

    @api_boundary
    def lower(self, params: dict, batch: Any) -> jax.stages.Lowered:
        """The pipelined train program `((ends, stack), batch) -> (loss, (g_ends, g_stack))`,
        lowered (as `jax.jit(...).lower`): `ends` the parameters outside the stack, packed on the
        stages that use them (`stage_bytes`), `stack` in stage order (`pack`)."""
        e = self._entry(params, batch)
        rest, stack = self.pipe.split(abstract(params))
        return e.train.lower((jax.eval_shape(e.program.ends.pack, rest), stack), abstract(batch))

    @api_boundary
    def stage_bytes(self, params: dict, batch: Any) -> tuple[int, ...]:
        """Bytes of the parameters each stage holds: its layers, and the parameters outside the
        stack that its `first` (stage 0) or `last` / `head` (the last stage) read; every stage holds
        all of those where strategies cut them inside the stages."""
        e = self._entry(params, batch)
        rest, stack = self.pipe.split(params)
        layers = sum(np.size(a) * dtype_of(a).itemsize for a in jax.tree.leaves(stack)) // self.pipeline.stages
        ends = e.program.ends
        shares = ends.stage_bytes() if isinstance(ends, StageParams) else \
            (sum(np.size(a) * dtype_of(a).itemsize for a in jax.tree.leaves(rest)),) * self.pipeline.stages
        return tuple(int(layers + share) for share in shares)

    @api_boundary
    def compile(self, params: dict, batch: Any) -> jax.stages.Compiled:
        """The pipelined train program, compiled once per input signature (calls, `plan().audit()`
        and `memory_analysis()` share it)."""
        e = self._entry(params, batch)
        if e.compiled is None:
            e.compiled = self.lower(params, batch).compile()
        return e.compiled

    @api_boundary
    def forward(self, params: dict, batch: Any) -> Any:
        """Inference: the forward-only schedule, `head`'s outputs for every row in batch order.

        With `pipeline_result_broadcast=True` every device holds them; otherwise they keep a
        leading stage dim and only `out[-1]` (the last stage's) holds them.
        """
        if self.pipe.head is None:
            raise ShardingError(f"{self.call}.forward: the Pipeline has no head; pass head=fn(params, x) "
                                f"returning the outputs to run inference.")
        e = self._entry(params, batch)

        def build():
            sched = build_schedule(self._schedule_name(), stages=self.pipeline.stages,
                                   micro_batches=self.pipeline.micro_batches, virtual=self.pipeline.virtual_stages,
                                   forward_only=True)
            prog = dataclasses.replace(e.program, schedule=sched)
            return jax.jit(self._traced(prog.forward(self.pipeline.result_broadcast), e.mode),
                           in_shardings=(e.param_sh, e.batch_sh))

        return self._forwards.get((params, batch), build)(*placed((params, batch), (e.param_sh, e.batch_sh)))

    @api_boundary
    def plan(self, params: dict, batch: Any) -> PipelinePlan:
        """The `PipelinePlan`: stages, schedule table and picture, bubble, memory, boundary bytes."""
        e = self._entry(params, batch)
        compile_ = functools.partial(self.compile, params, batch)
        return plan_of(e.program, self.mesh, e.stack_layers, params, batch, compile_)

    def _schedule_name(self) -> str:
        return "gpipe" if self.pipeline.schedule == "gpipe" else self.pipeline.schedule

    def _entry(self, params, batch) -> _Entry:
        return self._cache.get((params, batch), lambda: self._build(params, batch))

    def _build(self, params, batch) -> _Entry:
        c, strategy = self.pipeline, self.options.in_strategy
        rest, stack = self.pipe.split(params)
        layers = stack_length(stack)
        _check_layers(self.call, layers, c.stages, c.virtual_stages)
        _check_batch(self.call, batch, c.micro_batches, self._data_degree())
        rest_specs = self._specs(strategy[0] if strategy else None, params, "in_strategy[0]")
        r_specs, s_specs = self.pipe.split(rest_specs)
        layer_specs = jax.tree.map(lambda p: self._layer_spec(p), s_specs, is_leaf=_is_spec)
        batch_specs = self._batch_specs(batch)
        first_batch = jax.tree.leaves(batch_specs, is_leaf=_is_spec)
        act = PartitionSpec(first_batch[0][0] if first_batch and len(first_batch[0]) else None)
        sched = build_schedule(c.schedule, stages=c.stages, micro_batches=c.micro_batches, virtual=c.virtual_stages)
        stage_mesh = Mesh(self.mesh.devices[0], self.inner.names)
        calls = self._has_shard_calls(params, batch, stage_mesh)
        pure = self._pure_data() and not calls
        mode = "data" if pure else "semi_auto"
        data_axes, model_axes, cut_specs = (self.inner.names, (), None) if pure else \
            self._rows_manual(params, batch, (r_specs, layer_specs)) if calls else ((), (), None)
        if cut_specs is not None:  # a layer leaf no in_strategy lays out: held as its shard calls cut it
            leaves, treedef = jax.tree_util.tree_flatten(layer_specs, is_leaf=_is_spec)
            found = cut_specs[len(jax.tree.leaves(r_specs, is_leaf=_is_spec)):]
            layer_specs = jax.tree_util.tree_unflatten(treedef, [
                f if p == PartitionSpec() and f is not None else p for p, f in zip(leaves, found)])
        if model_axes:  # Megatron: the residual stream is whole over the axes that cut the model
            act = without_axes(act, set(model_axes))
            if not self._batch_given():
                batch_specs = jax.tree.map(lambda p: without_axes(p, set(model_axes)), batch_specs, is_leaf=_is_spec)
        program = Program(self.pipe, sched, self.mesh, Specs(act, r_specs, layer_specs, batch_specs), data_axes)
        if pure:
            residuals = tuple(PartitionSpec() for _ in program.residual_shapes(params, batch))
        else:
            residuals = self._traced(program.residual_specs, mode, stage_mesh)(params, batch, stage_mesh)
        ends = self._ends(params, batch, r_specs, mode)
        program = dataclasses.replace(program, specs=dataclasses.replace(program.specs, residuals=residuals), ends=ends)
        stack_sh = jax.tree.map(lambda p: NamedSharding(self.mesh, PartitionSpec(STAGE, *p)), layer_specs, is_leaf=_is_spec)
        rest_sh = _named(self.mesh, r_specs)
        param_sh = self.pipe.join(rest_sh, stack_sh)
        ends_sh = rest_sh if isinstance(ends, Replicated) else \
            {name: NamedSharding(self.mesh, PartitionSpec(STAGE)) for name in ends.widths}
        batch_sh = _named(self.mesh, batch_specs)
        held_sh = (ends_sh, stack_sh)
        train = jax.jit(self._traced(program.train(), mode), in_shardings=(held_sh, batch_sh),
                        out_shardings=(NamedSharding(self.mesh, PartitionSpec()), held_sh))
        pack = jax.jit(ends.pack, out_shardings=ends_sh)
        unpack = jax.jit(ends.unpack, out_shardings=rest_sh)
        hold, release = (program.hold, program.release) if c.virtual_stages == 1 else \
            (jax.jit(program.hold, out_shardings=stack_sh), jax.jit(program.release, out_shardings=stack_sh))
        e = _Entry(program, param_sh, batch_sh, train, layers, mode, pack, unpack, hold, release, held_sh)
        held = (jax.eval_shape(ends.pack, abstract(rest)), abstract(stack))
        self._held.setdefault(_signature((held, batch)), e)  # what `train` finds it by
        return e

    def _rows_manual(self, params, batch, param_specs) -> tuple[tuple[str, ...], tuple[str, ...], tuple]:
        """Data parallel written as `jshard.shard` strategies inside the stages (`_manual_rows`): the
        axes to run manual, found on `first`, one layer (one chunk per stage where `layer` is per
        stage) and `last` traced as one stage (`cut`), and traced again on one device's rows;
        `param_specs`: the `in_strategy` specs, whose axes stay automatic. Returns those axes and
        the stage's axes that cut parameters (`in_strategy` or `jshard.shard` on a parameter: the
        model's axes, over which the activations between layers stay whole, as in Megatron), and
        per leaf of `(rest, one layer)` the spec its `jshard.shard` calls give it (`Cut.param_specs`),
        which the stack is held as where `in_strategy` gives none."""
        c, stage_mesh = self.pipeline, Mesh(self.mesh.devices[0], self.inner.names)
        rest, stack = self.pipe.split(abstract(params))
        k = stack_length(stack) // c.stages
        one = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[1:] if not self.pipe.tagged else (k, *a.shape[1:]),
                                                          a.dtype), stack)
        step = pipeline_stage(functools.partial(_through_one_layer, self.pipe), 0)

        def trace(d: int) -> Cut:
            micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // d, *a.shape[1:]), a.dtype),
                                 abstract(batch))
            ctx = _context.TraceContext(self.call, self.inner, stage_mesh, "semi_auto", recompute=self.options.recompute)
            with _context.tracing(ctx):
                return cut(step, (rest, one), micro, 1, self.call)

        taken = {a for spec in jax.tree.leaves(param_specs, is_leaf=_is_spec) for a in spec_axes(spec)}
        found = trace(c.micro_batches)
        model = taken | {a for spec in found.param_specs() if spec is not None for a in spec_axes(spec)}
        axes = _manual_rows(self.call, self.mesh, self.inner.names, c.micro_batches, found, batch,
                            taken, lambda axes: trace(c.micro_batches * self._size(axes)))[0]
        return axes, tuple(a for a in self.inner.names if a in model), found.param_specs()

    def _size(self, axes: tuple[str, ...]) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def _ends(self, params, batch, r_specs, mode) -> StageParams | Replicated:
        """How the parameters outside the stack are held: on the stages that read them, packed
        (`StageParams`), unless strategies cut one of them inside the stages (then on every stage)."""
        if any(spec != PartitionSpec() for spec in jax.tree.leaves(r_specs, is_leaf=_is_spec)):
            return Replicated(r_specs)
        rest, _ = self.pipe.split(abstract(params))
        rows = self.pipeline.micro_batches
        micro_batch = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // rows, *a.shape[1:]), a.dtype),
                                   abstract(batch))

        def of():
            act = jax.eval_shape(self.pipe.first, rest, micro_batch)
            return StageParams.of(self.pipe, rest, micro_batch, act, self.pipeline.stages)

        return self._traced(of, mode, Mesh(self.mesh.devices[0], self.inner.names))()

    def _traced(self, fn, mode: str, mesh: Mesh | None = None):
        """`fn` traced with `jshard.shard` calls resolving against one stage's devices (over `mesh`,
        default the pipeline's); with `mode="data"` they are plain calls."""
        ctx_args = (self.call, self.inner, self.mesh if mesh is None else mesh, mode)

        @functools.wraps(fn)
        def run(*args):
            with _context.tracing(_context.TraceContext(*ctx_args, recompute=self.options.recompute)):
                return fn(*args)

        return run

    def _pure_data(self) -> bool:
        """Pure data parallel inside stages asked for: rows cut over the stage's devices, no
        `in_strategy` (the model must also have no `jshard.shard` calls: `_has_shard_calls`)."""
        c = self.options
        return c.dataset_strategy == "data_parallel" and not c.in_strategy and self.inner.device_count > 1

    def _has_shard_calls(self, params, batch, stage_mesh: Mesh) -> bool:
        """Whether the model calls `jshard.shard` (traced once, shapes only): then its strategies
        apply inside the stages, which keep their axes automatic."""
        ctx = _context.TraceContext(self.call, self.inner, stage_mesh, "semi_auto")
        with _context.tracing(ctx):
            jax.eval_shape(self.pipe.loss, params, batch)
        return bool(ctx.annotations)

    def _data_degree(self) -> int:
        return self.inner.device_count if self.options.dataset_strategy == "data_parallel" else 1

    def _specs(self, prefix, tree, what):
        """One `PartitionSpec` over a stage's devices per leaf of `tree`, from a strategy pytree prefix."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        slots = canonicalize_strategy_tree(prefix, tree, call=self.call, what=what)
        return jax.tree_util.tree_unflatten(treedef, [self._spec(s, x, what) for s, x in zip(slots, leaves)])

    def _spec(self, slot, x, what) -> PartitionSpec:
        if slot is None:
            return PartitionSpec()
        layout = layout_of(slot, self.inner.device_count, call=self.call, op="a pipeline stage", what=what)
        check_divides(layout, np.shape(x), call=self.call, op="a pipeline stage", what=what, dtype=dtype_of(x))
        return self.inner.partition_spec(layout)

    def _layer_spec(self, spec: PartitionSpec) -> PartitionSpec:
        if len(spec) and spec[0] is not None:
            raise ShardingError(
                f"{self.call}: a layer-stack parameter's strategy cuts its leading (layer) dim ({spec}); "
                f"the pipeline cuts that dim over stages itself. Give 1 (or 'None') for dim 0."
            )
        return PartitionSpec(*spec[1:])

    def _batch_given(self) -> bool:
        """Whether `in_strategy[1]` lays the batch out (else the dataset policy does)."""
        c = self.options
        return bool(c.in_strategy and len(c.in_strategy) > 1 and c.in_strategy[1] is not None)

    def _batch_specs(self, batch):
        c = self.options
        if self._batch_given():
            return self._specs(c.in_strategy[1], batch, "in_strategy[1]")
        leaves, treedef = jax.tree_util.tree_flatten(batch)
        slots = dataset_slots([np.ndim(x) for x in leaves], c.dataset_strategy, self.inner.device_count, call=self.call)
        return jax.tree_util.tree_unflatten(treedef, [self._spec(s, x, "dataset_strategy") for s, x in zip(slots, leaves)])


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
        self.call = f"jshard.parallelize({_name(fn)})"
        self.pipeline = _check_staged(self.call, options)
        _, self.inner, self.mesh = _pipeline_mesh(self.call, options)
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
        e = self._packed.get(_signature((packed, batch)))
        if e is None:
            raise _not_built(self.call, "packed parameters", _shapes(packed), batch, "Pack")
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
                f"update, metrics) runs on its gradients.")
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
        _check_batch(self.call, batch, c.micro_batches, self._size(data_axes))
        leaves, treedef = jax.tree_util.tree_flatten(abstract(params))
        _check_float_params(self.call, params)
        staged = self._cut(abstract(params), self._micro(batch, data_axes), planning)
        if not data_axes and self.options.mode != "auto":
            data_axes, staged = self._rows_cut(params, batch, staged, planning)
        sched = build_schedule(c.schedule, stages=c.stages, micro_batches=c.micro_batches, virtual=c.virtual_stages)
        program = StagedProgram(staged, sched, self.mesh, tuple(leaves), data_axes)
        packed_sh = {name: NamedSharding(self.mesh, spec) for name, spec in program.specs().items()}
        batch_sh = jax.tree.map(lambda _: NamedSharding(self.mesh, PartitionSpec(data_axes or None)), batch)
        loss_sh = NamedSharding(self.mesh, PartitionSpec())

        e = _StagedEntry(
            program, batch_sh, packed_sh,
            jax.jit(program.train, in_shardings=(packed_sh, batch_sh), out_shardings=(loss_sh, packed_sh)),
            jax.jit(lambda p: program.pack(jax.tree.leaves(p)), out_shardings=packed_sh),
            jax.jit(lambda g: jax.tree_util.tree_unflatten(treedef, program.unpack(g))),
        )
        packed = jax.eval_shape(program.pack, leaves)
        self._packed.setdefault(_signature((packed, batch)), e)  # what `train` finds it by
        return e

    def _micro(self, batch, data_axes: tuple[str, ...]) -> Any:
        """One device's micro-batch (shapes): `1 / (M · the data axes' devices)` of the rows."""
        d = self.pipeline.micro_batches * self._size(data_axes)
        return jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // d, *a.shape[1:]), a.dtype), abstract(batch))

    def _size(self, axes: tuple[str, ...]) -> int:
        return int(np.prod([self.mesh.shape[a] for a in axes]))

    def _rows_cut(self, params, batch, staged, planning: Planning) -> tuple[tuple[str, ...], Any]:
        """Data parallel written as `jshard.shard` strategies inside the stages (`_manual_rows`),
        with the cut traced again on one device's rows; `((), staged)` where none."""
        axes, again = _manual_rows(self.call, self.mesh, self.inner.names, self.pipeline.micro_batches, staged, batch,
                                   set(), lambda axes: self._cut(abstract(params), self._micro(batch, axes), planning))
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


def _manual_rows(call: str, mesh: Mesh, names, micro_batches: int, found: Cut, batch, taken: set,
                 retrace) -> tuple[tuple[str, ...], Any]:
    """Data parallel written as `jshard.shard` strategies inside the stages, in either form: the
    stage's axes (of `names`) the strategies `found` traced cut the micro-batch's rows over and no
    parameter cuts (`Cut.row_axes`; `taken`: axes `in_strategy` cuts parameters over), to run manual,
    so each device runs its own rows and the gradients are reduced once per step. Returns those
    axes and `retrace(axes)` (the step traced on one device's rows, which checks that every
    strategy still divides them), or `((), None)`: none, or rows that do not split evenly, or a
    strategy that no longer divides one device's rows. Those axes then stay automatic (XLA
    reduces each micro-batch's gradients), and a `UserWarning` says so and why."""
    rows = jax.tree.leaves(abstract(batch))[0].shape[0] // micro_batches
    taken = taken | {a for spec in found.param_specs() if spec is not None for a in spec_axes(spec)}
    axes = tuple(a for a in names if a in set(found.row_axes(rows)) - taken)
    if not axes:
        return (), None
    d = micro_batches * int(np.prod([mesh.shape[a] for a in axes]))
    uneven = [x for x in jax.tree.leaves(abstract(batch)) if x.shape[0] % d]
    if uneven:
        why = (f"a batch array {shape_str(uneven[0].dtype, uneven[0].shape)} does not split into micro_batches × "
               f"{'·'.join(axes)} = {d} equal parts")
    else:
        try:
            return axes, retrace(axes)
        except ShardingError as e:
            why = f"the step does not trace on one device's rows ({e})"
    warnings.warn(
        f"{call}: the jshard.shard strategies inside the stages cut the micro-batch's rows over "
        f"{', '.join(axes)}, but {why}; those axes stay automatic, so XLA reduces the gradients at every "
        f"micro-batch's backward ({micro_batches} times per step) instead of once. Fix: a batch "
        f"whose rows split evenly over micro_batches and those axes.", UserWarning, stacklevel=4)
    return (), None


def _through_one_layer(pipe: Pipeline, params, micro_batch) -> jax.Array:
    """`pipe`'s loss through `first`, one layer (or, where `layer` is per stage, each stage's
    function on one chunk) and `last`: every strategy the stages run, traced without a loop."""
    rest, layer = params
    x = pipe.first(rest, micro_batch)
    if pipe.tagged:
        for fn in pipe.stage_runner(0):
            x = fn(layer, x)
    else:
        x = pipe.layer(layer, x)
    return pipe.last(rest, x, micro_batch)


def _pipeline_mesh(call: str, options: Options) -> tuple[int, FineMesh, Mesh]:
    """`(devices, the stage's fine mesh, the pipeline's mesh)`: a leading `stage` axis of S, then
    each stage's own fine mesh over `devices / S` devices."""
    assert options.pipeline is not None and options.pipeline.stages is not None  # _check_options checked both
    have, stages = jax.devices(), options.pipeline.stages
    n = len(have) if options.devices is None else options.devices
    if n > len(have):
        raise DeviceCountError(
            f"{call}: devices={n}, but only {len(have)} device(s) are present; a pipelined "
            f"step runs on devices present. On a CPU call jshard.simulate_devices({n}) first."
        )
    _check_divides_devices(call, n, stages)
    inner = FineMesh.for_devices(n // stages)
    return n, inner, Mesh(np.asarray(have[:n], dtype=object).reshape(stages, *inner.sizes), (STAGE, *inner.names))


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _named(mesh, specs):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=_is_spec)


def _name(pipe) -> str:
    return getattr(pipe, "__name__", type(pipe).__name__)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _check_config(call: str, pipe: Pipeline, options: Options) -> _Checked:
    c = _check_options(call, options)
    if pipe.tagged:
        if c.virtual_stages != 1:
            raise ShardingError(f"{call}: per-stage functions (pipeline_stage) run one chunk per stage; "
                                f"virtual_stages={c.virtual_stages} needs one layer function instead.")
        check_stage_ids(call, list(pipe.layer), c.stages)
    return c


def _check_staged(call: str, options: Options) -> _Checked:
    """The options a step cut by `pipeline_stage` tags takes: no `in_strategy` (interleaved: the
    tags number `stages × virtual_stages` stages, `Staged`)."""
    c = _check_options(call, options)
    if options.in_strategy:
        raise ShardingError(f"{call}: in_strategy= sets strategies inside the stages of a jshard.Pipeline; a step cut "
                            f"by jshard.pipeline_stage tags packs each stage's parameters into one buffer per dtype, "
                            f"which takes no per-leaf strategy. Drop in_strategy= and give the operators strategies "
                            f"with jshard.shard inside the stages (they hold on each stage's devices), or use a "
                            f"jshard.Pipeline.")
    return c


def _check_float_params(call: str, params: Any) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
        if not jax.numpy.issubdtype(dtype_of(x), jax.numpy.inexact):
            raise ShardingError(
                f"{call}: params{jax.tree_util.keystr(path)} ({dtype_of(x)}{list(np.shape(x))}) is not a float array; "
                f"a pipelined step differentiates every parameter. Pass integer state in the batch, or close over it."
            )


def _signature(tree: Any) -> tuple:
    """The shapes and dtypes of `tree`'s leaves, and its structure: which program takes it."""
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    return treedef, tuple((tuple(np.shape(x)), str(dtype_of(x))) for x in leaves)


def _replicated(mesh: Mesh, tree: Any) -> Any:
    return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), tree)


def _check_options(call: str, options: Options) -> _Checked:
    """The pipeline options every pipelined step checks (stages, schedule, micro-batches, dataset),
    returned with `stages` and `micro_batches` known to be given."""
    c = options.pipeline
    assert c is not None  # `pipelined` makes a pipelined step only with one
    if not isinstance(c.stages, int) or c.stages < 2:
        raise ShardingError(f"{call}: stages={c.stages!r}; a pipeline needs at least 2 stages "
                            f"(drop pipeline= to run without one).")
    if c.schedule not in SCHEDULES:
        raise ShardingError(f"{call}: schedule={c.schedule!r} is not one of {SCHEDULES}.")
    if c.micro_batches is None or c.micro_batches < c.stages:
        raise ShardingError(
            f"{call}: micro_batches={c.micro_batches} with stages={c.stages}: every stage needs a "
            f"micro-batch in flight, so micro_batches must be at least {c.stages}. Pass micro_batches="
            f"{2 * c.stages} or more (the bubble is (S-1)/(M+S-1))."
        )
    if c.virtual_stages != 1 and c.schedule != "interleaved":
        raise ShardingError(f"{call}: virtual_stages={c.virtual_stages} needs schedule='interleaved' "
                            f"(got {c.schedule!r}).")
    if not isinstance(c.virtual_stages, int) or c.virtual_stages < 1:
        raise ShardingError(f"{call}: virtual_stages={c.virtual_stages!r} must be a positive int.")
    if c.schedule == "interleaved" and c.micro_batches % c.stages:
        raise ShardingError(
            f"{call}: schedule='interleaved' runs micro-batches in groups of stages={c.stages}, but "
            f"micro_batches={c.micro_batches} is not a multiple of {c.stages}. Use micro_batches="
            f"{math.ceil(c.micro_batches / c.stages) * c.stages}."
        )
    check_dataset_strategy(options.dataset_strategy, call=call, tuples=False)
    return _Checked(c.stages, c.micro_batches, c.schedule, c.virtual_stages, c.result_broadcast)


def _check_divides_devices(call: str, n: int, stages: int) -> None:
    if n % stages:
        raise ShardingError(
            f"{call}: devices={n} is not divisible by stages={stages}; each stage runs on "
            f"devices / stages devices. Use stages in {_divisors(n)[1:]}, or a device "
            f"count that is a multiple of {stages}."
        )


def _check_layers(call: str, layers: int, stages: int, virtual: int) -> None:
    chunks = stages * virtual
    if layers % chunks:
        raise ShardingError(
            f"{call}: the layer stack has {layers} layers, which stages={stages} × virtual_stages="
            f"{virtual} = {chunks} chunks cannot share equally. Use a layer count that is a multiple of "
            f"{chunks}, or stages × virtual_stages in {_divisors(layers)}."
        )


def _check_batch(call: str, batch: Any, micro: int, data: int) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        where = f"batch{jax.tree_util.keystr(path)} (shape {list(np.shape(x))})"
        if not np.ndim(x):
            raise ShardingError(f"{call}: {where} is a scalar; every batch array needs a leading row dim "
                                f"that micro_batches={micro} cuts. Pass scalars in params, or give them rows.")
        rows = np.shape(x)[0]
        if rows % micro:
            raise ShardingError(
                f"{call}: micro_batches={micro} must divide the batch's rows, but {where} has "
                f"{rows} rows. Use a batch size that is a multiple of {micro}, or micro_batches in "
                f"{[d for d in _divisors(rows) if d > 1]}."
            )
        if (rows // micro) % data:
            raise ShardingError(
                f"{call}: {where} gives micro-batches of {rows // micro} rows, which the stage's "
                f"{data} devices cannot cut equally (dataset_strategy='data_parallel'). Use a batch size "
                f"that is a multiple of {micro * data}, fewer micro_batches, or dataset_strategy='full_batch'."
            )


def pipelined(fn: Any, options: Options) -> Pipelined | Any:
    """What `parallelize(..., pipeline=js.Pipelining(S, ...))` returns: a `Pipelined` (or a decorator making one).

    Of the `Options`, only `devices`, `in_strategy` (strategies over one stage's devices),
    `dataset_strategy` and `pipeline` apply; for a step cut into stages also `cost_model` (the
    balance of an untagged step), and with `mode="auto"` `search` and `memory_budget` (each stage's
    strategy searched over its devices).
    """
    call = f"jshard.parallelize({_name(fn) if fn is not None else 'fn'})"
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
        raise ShardingError(f"{call}: offload={options.offload} keeps state in host memory in the one-program "
                            f"path; it cannot be used with a pipeline yet. Drop offload= or the pipeline.")
    if fn is None:
        return lambda f: _pipelined_step(f, options)
    return _pipelined_step(fn, options)


def _pipelined_step(fn: Any, options: Options) -> Pipelined | Staged:
    """A `Pipelined` step for a `jshard.Pipeline`, a `Staged` one for a function tagged with
    `jshard.pipeline_stage`."""
    if isinstance(fn, Pipeline):
        if options.mode == "auto":
            raise ShardingError(
                f"jshard.parallelize({_name(fn)}): mode='auto' searches the strategies inside the stages of a step cut "
                f"into stages (pipeline_stage tags, or none: cut by the cost model); a jshard.Pipeline's stages take "
                f"in_strategy and jshard.shard calls. Use mode='semi_auto' with the Pipeline, or pass its loss as a "
                f"plain function with mode='auto'."
            )
        return Pipelined(fn, options)
    if not callable(fn):
        raise TypeError(
            f"jshard.parallelize({_name(fn)}): pipeline= needs a jshard.Pipeline or a function whose parts "
            f"are tagged with jshard.pipeline_stage(fn, k), got {type(fn).__name__}."
        )
    return Staged(fn, options)


def _shapes(arrays) -> list[str] | dict[str, str]:
    """`arrays` (a list, or a dict by name) as shape strings, for errors."""
    if isinstance(arrays, dict):
        return {k: shape_str(dtype_of(v), np.shape(v)) for k, v in arrays.items()}
    return [shape_str(dtype_of(x), np.shape(x)) for x in arrays]


def _not_built(call: str, what: str, shapes, batch, verb: str) -> ShardingError:
    """`train` called on parameters `pack` never made for these shapes."""
    return ShardingError(
        f"{call}.train: no pipeline was built for {what} {shapes} and a batch of shapes "
        f"{_shapes(jax.tree.leaves(batch))}. {verb} them with {call}.pack(params, batch) for a batch of these "
        f"shapes first."
    )
