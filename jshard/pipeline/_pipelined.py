"""`Pipelined`: the step `parallelize(pipe, pipeline=js.Pipelining(S, M, schedule=...))` returns for a
`jshard.Pipeline` (first / layer stack / last). It turns the stage-internal strategies into
PartitionSpecs over the pipeline's mesh and jits the `Program` of `_engine.py` once per input
signature."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _context
from jshard._errors import ShardingError, api_boundary
from jshard.compile import Options, SignatureCache, abstract, dtype_of, placed
from jshard.layouts import canonicalize_strategy_tree, check_divides, dataset_slots, layout_of
from jshard.pipeline._checks import (
    check_batch,
    check_config,
    check_layers,
    name_of,
    not_built,
    pipeline_mesh,
    shapes,
    signature,
)
from jshard.pipeline._cut import Cut, cut, spec_axes, without_axes
from jshard.pipeline._engine import STAGE, Program, Replicated, Specs
from jshard.pipeline._model import Pipeline, pipeline_stage, stack_length
from jshard.pipeline._plan import PipelinePlan, plan_of
from jshard.pipeline._rest import StageParams
from jshard.pipeline._rows import manual_rows
from jshard.pipeline._schedule import build_schedule


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
        self.call = f"jshard.parallelize({name_of(pipe)})"
        self.pipeline = check_config(self.call, pipe, options)
        self.n, self.inner, self.mesh = pipeline_mesh(self.call, options)
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
        e = self._held.get(signature((held, batch)))
        if e is None:
            raise not_built(self.call, "held parameters of shapes", shapes(jax.tree.leaves(held)), batch, "Hold")
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
        shares = (
            ends.stage_bytes()
            if isinstance(ends, StageParams)
            else (sum(np.size(a) * dtype_of(a).itemsize for a in jax.tree.leaves(rest)),) * self.pipeline.stages
        )
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
            raise ShardingError(
                f"{self.call}.forward: the Pipeline has no head; pass head=fn(params, x) "
                f"returning the outputs to run inference."
            )
        e = self._entry(params, batch)

        def build():
            sched = build_schedule(
                self._schedule_name(),
                stages=self.pipeline.stages,
                micro_batches=self.pipeline.micro_batches,
                virtual=self.pipeline.virtual_stages,
                forward_only=True,
            )
            prog = dataclasses.replace(e.program, schedule=sched)
            return jax.jit(
                self._traced(prog.forward(self.pipeline.result_broadcast), e.mode),
                in_shardings=(e.param_sh, e.batch_sh),
            )

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
        check_layers(self.call, layers, c.stages, c.virtual_stages)
        check_batch(self.call, batch, c.micro_batches, self._data_degree())
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
        data_axes, model_axes, cut_specs = (
            (self.inner.names, (), None)
            if pure
            else self._rows_manual(params, batch, (r_specs, layer_specs))
            if calls
            else ((), (), None)
        )
        if cut_specs is not None:  # a layer leaf no in_strategy lays out: held as its shard calls cut it
            leaves, treedef = jax.tree_util.tree_flatten(layer_specs, is_leaf=_is_spec)
            found = cut_specs[len(jax.tree.leaves(r_specs, is_leaf=_is_spec)) :]
            layer_specs = jax.tree_util.tree_unflatten(
                treedef, [f if p == PartitionSpec() and f is not None else p for p, f in zip(leaves, found)]
            )
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
        stack_sh = jax.tree.map(
            lambda p: NamedSharding(self.mesh, PartitionSpec(STAGE, *p)), layer_specs, is_leaf=_is_spec
        )
        rest_sh = _named(self.mesh, r_specs)
        param_sh = self.pipe.join(rest_sh, stack_sh)
        ends_sh = (
            rest_sh
            if isinstance(ends, Replicated)
            else {name: NamedSharding(self.mesh, PartitionSpec(STAGE)) for name in ends.widths}
        )
        batch_sh = _named(self.mesh, batch_specs)
        held_sh = (ends_sh, stack_sh)
        train = jax.jit(
            self._traced(program.train(), mode),
            in_shardings=(held_sh, batch_sh),
            out_shardings=(NamedSharding(self.mesh, PartitionSpec()), held_sh),
        )
        pack = jax.jit(ends.pack, out_shardings=ends_sh)
        unpack = jax.jit(ends.unpack, out_shardings=rest_sh)
        hold, release = (
            (program.hold, program.release)
            if c.virtual_stages == 1
            else (jax.jit(program.hold, out_shardings=stack_sh), jax.jit(program.release, out_shardings=stack_sh))
        )
        e = _Entry(program, param_sh, batch_sh, train, layers, mode, pack, unpack, hold, release, held_sh)
        held = (jax.eval_shape(ends.pack, abstract(rest)), abstract(stack))
        self._held.setdefault(signature((held, batch)), e)  # what `train` finds it by
        return e

    def _rows_manual(self, params, batch, param_specs) -> tuple[tuple[str, ...], tuple[str, ...], tuple]:
        """Data parallel written as `jshard.shard` strategies inside the stages (`manual_rows`): the
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
        one = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape[1:] if not self.pipe.tagged else (k, *a.shape[1:]), a.dtype), stack
        )
        step = pipeline_stage(functools.partial(_through_one_layer, self.pipe), 0)

        def trace(d: int) -> Cut:
            micro = jax.tree.map(
                lambda a: jax.ShapeDtypeStruct((a.shape[0] // d, *a.shape[1:]), a.dtype), abstract(batch)
            )
            ctx = _context.TraceContext(
                self.call, self.inner, stage_mesh, "semi_auto", recompute=self.options.recompute
            )
            with _context.tracing(ctx):
                return cut(step, (rest, one), micro, 1, self.call)

        taken = {a for spec in jax.tree.leaves(param_specs, is_leaf=_is_spec) for a in spec_axes(spec)}
        found = trace(c.micro_batches)
        model = taken | {a for spec in found.param_specs() if spec is not None for a in spec_axes(spec)}
        axes = manual_rows(
            self.call,
            self.mesh,
            self.inner.names,
            c.micro_batches,
            found,
            batch,
            taken,
            lambda axes: trace(c.micro_batches * self._size(axes)),
        )[0]
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
        micro_batch = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct((a.shape[0] // rows, *a.shape[1:]), a.dtype), abstract(batch)
        )

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
        return jax.tree_util.tree_unflatten(
            treedef, [self._spec(s, x, "dataset_strategy") for s, x in zip(slots, leaves)]
        )


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


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _named(mesh, specs):
    return jax.tree.map(lambda p: NamedSharding(mesh, p), specs, is_leaf=_is_spec)
