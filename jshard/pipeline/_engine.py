"""The SPMD program of one pipelined step: `shard_map` over the stage axis, a `scan` over ticks.

Why this design. A step is ONE `jax.jit` program, so XLA sees (and schedules, and the audit reads)
everything, and no host loop drives the schedule. The mesh has a leading `stage` axis; `shard_map`
makes that axis manual. Inside a stage the other axes stay automatic (`axis_names={"stage"}`), so
the stage's data / tensor strategies (`jshard.shard` calls, `in_strategy`) still apply; or, for
pure data parallel inside stages (no `shard` calls, no `in_strategy`, `dataset_strategy=
"data_parallel"`), they are manual too (`data_axes`): every device runs its own rows, accumulates its own gradients, and the
gradients are all-reduced once per step rather than once per micro-batch. So are the axes that
`jshard.shard` tuples cut the micro-batch's rows over and no parameter over (data parallel written
as strategies, found as for a step cut by tags: `_rows.manual_rows`); the strategies drop
those axes inside (`_pin` too), and the tensor-parallel axes stay automatic. The schedule is a static
tick table (`_schedule.py`); each stage gets its own column of it from `shard_map`, loops walk
the ticks (`_ticks.scan_ticks`), and at each tick a `lax.switch` runs the stage's operation: idle,
a forward, or a backward of one micro-batch on one chunk (with zero bubble, a backward's
input-gradient part `B` or its parameter-gradient part `W`), over only the operations some stage
runs at that tick (`_ticks.Running`: a fill tick compiles no backward, a drain tick no forward).
Then `ppermute`s pass forward outputs to the next stage and input gradients to the previous one;
what arrives is written into per-chunk slot buffers (slot = micro-batch mod slots).

Only what crosses moves. Each permute carries only the `(source, target)` pairs whose source
sends at that tick (`Schedule.permutes`): no permute where nothing crosses, one where every stage
sends and receives at most one value (a forward's output or a backward's input gradient: 1F1B's
steady state, neighbours swapping), else a forward and a backward one; a stage idle in the fill or
drain is no source. A permute's pairs are static, so the ticks are cut into consecutive loops, one
per repeating pattern (`Schedule.segments`: warm-up, steady state, cool-down, each fill and drain
tick a loop of its own), each a `scan` whose body holds that pattern's ticks. The loops hand one
carry from one to the next (the compiled HLO copies no buffer between them), and the busiest
device's collective-permutes (`jshard.audit`) send exactly what must cross: `2M` activations from
an inner stage, `M` from an end one (`Schedule.sends`). A body
of two ticks (1F1B's steady state) runs two switches; each branch adds its parameter gradients
into the running sums itself and sends one value, so no gradient-sized increment stays live
between them (about 2% more temporary memory than a one-tick loop remains).

The stack is held in stage order (`Program.hold`): interleaved, stage `s` runs chunks `s, S + s,
...`, so the train program takes the stack with those chunks side by side and the stage axis cuts
dim 0 into each stage's own layers; in layer order the step would re-lay the stack between stages
on the way in and its gradients on the way out, every step (2.6x what must cross at S = 4, M = 16
on the reference GPT). `Pipelined.pack` / `unpack` convert once; inference takes the layer order.

The parameters outside the stack are held where they are used (`ends`: `_rest.StageParams`, the
rows of `first`'s and `last`'s leaves on the end stages, or `Replicated` where strategies cut them
inside the stages); `first` and `last` read their trees from this stage's row, and their
gradients are summed into a row of the same packing.

Backward is hand-written per micro-batch: a forward runs its chunk under `jax.vjp` and stores
the pullback's residuals (the leaves of the `jax.vjp` closure, less the chunk's parameters, which
stay where they are) in slot buffers; the backward rebuilds the pullback from those leaves, applies
it to the gradient it received, and accumulates parameter gradients in the scan carry. A stage
therefore holds the residuals of the micro-batches whose backward it has not run yet: `M` of them
under GPipe, at most `S` under 1F1B (and `~S` per chunk interleaved), which is why 1F1B's memory
grows with S and not with M. `first` and `last` are differentiated at their own ticks (recomputed
from the micro-batch and the stored chunk output), so every stage stores residuals of one shape.

Every switch branch ends by constraining its results to fixed shardings over the stage's own
axes (XLA requires a conditional's branches to agree). Where strategies cut the stack inside the
stages (Megatron's column / row tuples), the activations between stages and chunks are whole over
the axes that cut the model (the rows are cut only over the others, as in Megatron), the stack is
held as its `jshard.shard` calls cut it where `in_strategy` does not say, and the residuals' layouts
are the stage's plan's (`_inner.propagated`, as the tagged form lays its slots out: the ff hidden
and the heads cut, the residual stream whole); otherwise they are read from a small probe compile
of one chunk's forward on one stage's devices (`residual_specs`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _context
from jshard.pipeline._cut import without_axes
from jshard.pipeline._inner import propagated
from jshard.pipeline._model import Pipeline, stack_length
from jshard.pipeline._pullback import PullbackShape, residuals, stage_runner
from jshard.pipeline._schedule import BACKWARD, FORWARD, WEIGHTS, Schedule
from jshard.pipeline._slots import put_slot, receive_slot, replace_entry, slot_of, zero_slots
from jshard.pipeline._ticks import scan_ticks, take

STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class Specs:
    """Shardings over the stage's own (automatic) axes.

    Attributes:
      act: the activation passed between stages (its rows cut like the batch).
      shared: per leaf of the parameters outside the stack.
      layer: per leaf of the stack, for one layer (the stack's leading dim dropped).
      batch: per leaf of the batch.
      residuals: per stored residual of one chunk's forward (`residual_specs`); None until known.
    """

    act: PartitionSpec
    shared: Any
    layer: Any
    batch: Any
    residuals: tuple[PartitionSpec, ...] | None = None


@dataclasses.dataclass(frozen=True)
class Program:
    """Builds the pipelined train and inference functions of `pipe` under `schedule` on `mesh`."""

    pipe: Pipeline
    schedule: Schedule
    mesh: Mesh
    specs: Specs
    data_axes: tuple[str, ...] = ()
    ends: Any = None

    @property
    def _manual(self) -> set[str]:
        """The manual axes: the stage axis, and with `data_axes` the stage's data axes too (pure
        data parallel inside stages: every device runs its own rows, and gradients are summed
        once per step rather than per micro-batch)."""
        return {STAGE, *self.data_axes}

    def _micro_spec(self) -> PartitionSpec:
        return _P(self.data_axes) if self.data_axes else _P()

    def train(self) -> Callable[[tuple, Any], tuple[jax.Array, tuple]]:
        """`fn((ends, stack), batch) -> (loss, (g_ends, g_stack))`: `ends` the parameters outside
        the stack as `self.ends` holds them (`ends.pack(rest)`: on the stages that use them, or on
        every stage), `stack` the layer stack in stage order (`hold`: interleaved, each stage's
        chunks together; the gradients come back in that order too); the loss is the mean over
        micro-batches."""

        def fn(held, batch):
            ends, stack = held
            chunks, micro = self._chunks(stack, held=True), self._micro(batch)
            mapped = jax.shard_map(
                self._train_body, mesh=self.mesh,
                in_specs=(self.ends.spec, _P(STAGE), self._micro_spec(), _P(None, STAGE)),
                out_specs=(_P(), self.ends.spec, _P(STAGE)), axis_names=self._manual, check_vma=False,
            )
            loss, g_ends, g_chunks = mapped(ends, chunks, micro, self._table())
            return loss, (g_ends, jax.tree.map(lambda g, a: g.reshape(a.shape), g_chunks, stack))

        return fn

    def hold(self, stack):
        """The layer stack `[L, ...]` in stage order: stage `s`'s chunks `s, S + s, ...` (layers of
        virtual stages `c·S + s`) side by side, so that the stage axis cuts dim 0 into each stage's
        own layers and the step moves no parameter (interleaved; the layer order itself with one
        chunk per stage). `release` is its inverse."""
        s, v = self.schedule.stages, self.schedule.virtual
        if v == 1:
            return stack
        k = stack_length(stack) // (s * v)
        return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(v, s, k, *a.shape[1:]), 0, 1).reshape(a.shape), stack)

    def release(self, held):
        """A stack (or its gradients) in stage order (`hold`) back in layer order."""
        s, v = self.schedule.stages, self.schedule.virtual
        if v == 1:
            return held
        k = stack_length(held) // (s * v)
        return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(s, v, k, *a.shape[1:]), 0, 1).reshape(a.shape), held)

    def forward(self, broadcast: bool) -> Callable[[dict, Any], Any]:
        """`fn(params, batch) -> outputs` of `head`, rows in batch order; with `broadcast` on every
        device, otherwise with a leading stage dim whose last entry holds them."""

        def fn(params, batch):
            rest, chunks, micro = self._inputs(params, batch)
            mapped = jax.shard_map(
                lambda r, c, m, t: self._forward_body(r, c, m, t, broadcast), mesh=self.mesh,
                in_specs=(_P(), _P(STAGE), self._micro_spec(), _P(None, STAGE)),
                out_specs=_P(None, self.data_axes or None) if broadcast else _P(STAGE, None, self.data_axes or None),
                axis_names=self._manual, check_vma=False,
            )
            out = mapped(rest, chunks, micro, self._table())
            return jax.tree.map(lambda a: _unmicro(a, 0 if broadcast else 1), out)

        return fn

    def residual_specs(self, params, batch, stage_mesh: Mesh) -> tuple[PartitionSpec, ...]:
        """The layouts of one chunk forward's stored residuals on one stage's devices, so that every
        tick's branches agree on them: where the stage's strategies cut its parameters (Megatron's
        column / row cuts), as the stage's plan gives them (`_inner.propagated`: the chunk's
        parameter and activation layouts and its `jshard.shard` constraints propagated over its
        forward; the ff hidden and the heads stay cut, the residual stream whole); otherwise the
        shardings XLA gives them (`stage_mesh`, a probe compile; so also where axes run manual)."""
        chunk, act = self._chunk_and_act(params, batch)
        run = self.pipe.stage_runner(0)
        tagged = isinstance(run, list)
        probe = lambda ch, x, stage: residuals(stage_runner(run, stage) if tagged else run, ch, x)[0]
        layer = jax.tree.leaves(self.specs.layer, is_leaf=_is_spec)
        if any(spec != _P() for spec in layer) and not self.data_axes:  # manual rows: their constraints name
            sizes = dict(stage_mesh.shape)                                  # the manual axes; probed below
            jaxpr = jax.make_jaxpr(probe)(chunk, act, jax.ShapeDtypeStruct((), jnp.int32)).jaxpr
            found = propagated(jaxpr, [_P(None, *p) for p in layer] + [self.specs.act], jaxpr.outvars, sizes)
            return tuple(_P() if spec is None else spec for spec in found)
        chunk_sh = jax.tree.map(lambda p: NamedSharding(stage_mesh, _P(None, *p)), self.specs.layer, is_leaf=_is_spec)
        act_sh = NamedSharding(stage_mesh, self.specs.act)
        if self.data_axes:  # as the step runs it: manual over the data axes, one device's rows each
            act = jax.ShapeDtypeStruct((act.shape[0] * self._data_degree(), *act.shape[1:]), act.dtype)
            probe = jax.shard_map(probe, mesh=stage_mesh, in_specs=(_P(), _P(self.data_axes), _P()), out_specs=_P(),
                                  axis_names=set(self.data_axes), check_vma=False)
        shardings = (chunk_sh, act_sh, NamedSharding(stage_mesh, _P()))
        compiled = jax.jit(probe, in_shardings=shardings).lower(chunk, act, jax.ShapeDtypeStruct((), jnp.int32)).compile()
        return tuple(sh.spec for sh in jax.tree.leaves(compiled.output_shardings))

    def residual_shapes(self, params, batch) -> list[jax.ShapeDtypeStruct]:
        """The residuals one chunk's forward stores for one micro-batch (whole over the stage's
        automatic axes; with manual `data_axes`, one device's)."""
        chunk, act = self._chunk_and_act(params, batch)
        run = self.pipe.stage_runner(0)
        run = stage_runner(run, 0) if isinstance(run, list) else run
        return jax.eval_shape(lambda ch, x: residuals(run, ch, x)[0], chunk, act)

    def _chunk_and_act(self, params, batch):
        """One chunk's parameters and the activation, as one device of a stage sees them (with
        manual `data_axes`, its own rows only)."""
        rest, chunks, micro = jax.eval_shape(self._inputs, params, batch)
        chunk = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape[2:], a.dtype), chunks)
        d = self._data_degree()
        micro = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // d, *a.shape[1:]), a.dtype), micro)
        return chunk, self._act(rest, micro)

    def _inputs(self, params, batch):
        rest, stack = self.pipe.split(params)
        return rest, self._chunks(stack), self._micro(batch)

    def _chunks(self, stack, held: bool = False):
        """`[S, v, k, ...]`: stage `s`'s `v` chunks of `k` layers, from a stack in layer order (a
        transpose where interleaved: the layers move between stages) or in stage order (`held`:
        a reshape)."""
        s, v = self.schedule.stages, self.schedule.virtual
        k = stack_length(stack) // (s * v)
        if held or v == 1:
            return jax.tree.map(lambda a: a.reshape(s, v, k, *a.shape[1:]), stack)
        return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(v, s, k, *a.shape[1:]), 0, 1), stack)

    def _micro(self, batch):
        m = self.schedule.micro_batches
        # `[rows / M, M, ...]`: micro-batch i is rows i::M, column i (a reshape, not a transposed copy)
        return jax.tree.map(lambda a: a.reshape(a.shape[0] // m, m, *a.shape[1:]), batch)

    def _act(self, rest, micro) -> jax.ShapeDtypeStruct:
        first_mb = jax.tree.map(lambda a: jax.ShapeDtypeStruct((a.shape[0], *a.shape[2:]), a.dtype), micro)
        return jax.eval_shape(self.pipe.first, rest, first_mb)

    # --- inside shard_map: one stage's view -------------------------------------------------

    def _fields(self) -> tuple[str, ...]:
        kinds = ("F",) if self.schedule.forward_only else ("F", "B")
        return ("code", "chunk", "micro") + tuple(f"r{k}_{n}" for k in kinds for n in ("valid", "chunk", "micro"))

    def _table(self) -> np.ndarray:
        """The schedule as one int32 `[ticks, stages, fields]` array (`_fields`); each stage is
        handed its own column by `shard_map`."""
        sch = self.schedule
        columns = [sch.codes(), sch.field("chunk"), sch.field("micro")]
        for k in ("F",) if sch.forward_only else ("F", "B"):
            columns += list(sch.receives(k))
        return np.stack(columns, axis=-1).astype(np.int32)

    def _ops(self, ends, chunks, micro, held) -> _Ops:
        """The tick operations on this stage's `ends` (the parameters outside the stack as `held`
        holds them: `self.ends`, or a tree on every stage for inference)."""
        ctx = _context.current()
        if ctx is not None:  # `jshard.shard` inside the stage constrains over the stage-manual mesh
            ctx.mesh = jax.sharding.get_abstract_mesh()
        chunks = jax.tree.map(lambda a: a[0], chunks)  # [1, v, k, ...] -> [v, k, ...]
        run = self.pipe.stage_runner(0)
        if isinstance(run, list):
            run = stage_runner(run, jax.lax.axis_index(STAGE))
        first, last = held.tree(ends, "first"), held.tree(ends, "last")
        return _Ops(self, (first, last, held), chunks, micro, self._act(first, micro), run)

    # the tick loop and its bodies

    def _loop(self, carry, ops: _Ops, table, directions):
        """Scans the ticks, one loop per segment of the schedule (`Schedule.segments`): at each tick
        read this stage's slots, run its operation (a `switch` over small per-tick values only, so
        the buffers stay in place), write the slots, and permute what crosses at that tick.

        Where no forward runs, the branch reads the slots itself (the `switch` is handed the
        carry): such a tick writes no slot back, so nothing orders its reads after the previous
        tick's work, and in a segment of one repeat, which XLA unrolls, every tick's residuals were
        read at once ahead of the first (GPT S=4 M=16 GPipe's drain: 136 KiB live together, temp
        589 -> 625 KiB when drain ticks stopped writing back). Where a forward runs, its writes
        order the reads, and one read before the `switch` serves every branch."""
        fields = self._fields()
        kinds = ops.forward_branches() if self.schedule.forward_only else ops.train_branches()

        def tick(carry, row, permutes, running):
            mine = dict(zip(fields, row))
            c, i = mine["chunk"], mine["micro"]
            inside = not running.vstages(FORWARD)
            read = ops.read if inside else None
            branches = [self._settled(functools.partial(b, running=running), read) for b in kinds]
            out = running.switch(mine["code"], branches, carry if inside else ops.read(carry, c, i), c, i)
            return self._pass(ops.write(carry, c, i, out, running), out, mine, permutes, directions)

        return scan_ticks(self.schedule, table[:, 0], carry, tick)

    def _pass(self, carry, out, mine, permutes, directions):
        """The tick's permutes (`Schedule.permutes`), each with only the pairs whose source sends
        at this tick: one carries each source's one send (its forward's output or its backward's
        input gradient), and what arrives is an activation or a gradient as the table says; or a
        forward and a backward one apart."""
        pairs = lambda name: sorted(self.schedule.pairs(name))
        carry = dict(carry)
        if len(permutes) == 1:
            got = jax.lax.ppermute(out["send"], STAGE, pairs(permutes[0]))
            for buf, prefix in directions:
                carry[buf] = receive_slot(carry[buf], got, mine, prefix)
            return carry
        for name in permutes:  # a forward and a backward one, or none
            buf, prefix = next(d for d in directions if d[1][-1] == self.schedule.kind(name))
            carry[buf] = receive_slot(carry[buf], jax.lax.ppermute(out["send"], STAGE, pairs(name)), mine, prefix)
        return carry

    def _train_body(self, ends, chunks, micro, table):
        ends = self.ends.local(ends)
        ops = self._ops(ends, chunks, micro, self.ends)
        sch, v = self.schedule, self.schedule.virtual
        r = sch.slots("residuals")
        res = [zero_slots((v, r), x) for x in ops.residual_shapes]
        if self.specs.residuals:  # the residual slots in the layouts propagation gave them
            res = _pin(res, [_P(None, None, *p) for p in self.specs.residuals])
        carry = {
            "xin": zero_slots((v, sch.slots("activations")), ops.act),
            "gin": zero_slots((v, sch.slots("gradients")), ops.act),
            "yout": zero_slots((v, r), ops.act),
            "res": res,
            "g_rest": jax.tree.map(jnp.zeros_like, ends),
            "g_chunks": jax.tree.map(jnp.zeros_like, ops.chunks),
            "loss": jnp.zeros((), jnp.float32),
        }
        carry = self._loop(carry, ops, table, [("xin", "rF"), ("gin", "rB")])
        everyone, data = (STAGE, *self.data_axes), self._data_degree()
        loss = jax.lax.psum(carry["loss"], everyone) / (sch.micro_batches * data)
        g_rest, g_chunks = carry["g_rest"], carry["g_chunks"]
        if self.data_axes:  # each device differentiated the mean over its own rows
            g_rest, g_chunks = jax.tree.map(lambda g: g / data, jax.lax.psum((g_rest, g_chunks), self.data_axes))
        g_rest = self.ends.sum_tied(g_rest, jax.lax.axis_index(STAGE), STAGE)
        return loss, self.ends.out(g_rest), jax.tree.map(lambda a: a[None], g_chunks)

    def _data_degree(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.data_axes])) if self.data_axes else 1

    def _forward_body(self, rest, chunks, micro, table, broadcast):
        ops = self._ops(rest, chunks, micro, _EVERYWHERE)
        out = jax.eval_shape(self.pipe.head, rest, ops.act)
        m, v = self.schedule.micro_batches, self.schedule.virtual
        carry = {"xin": zero_slots((v, self.schedule.slots("activations")), ops.act),
                 "out": jax.tree.map(lambda o: jnp.zeros((m, *o.shape), o.dtype), out)}
        carry = self._loop(carry, ops, table, [("xin", "rF")])
        if broadcast:
            return jax.lax.psum(carry["out"], STAGE)
        return jax.tree.map(lambda a: a[None], carry["out"])

    def _settled(self, branch, read=None):
        """`branch` with its results constrained to the fixed shardings every branch shares; with
        `read` (`_Ops.read`), run on what it takes from the tick's carry rather than on a view."""
        sp = self.specs
        table = {
            "x": sp.act, "g": sp.act, "y": sp.act, "send": sp.act, "loss": _P(),
            "res": [_P(*p) for p in sp.residuals or ()],
            "g_rest": self.ends.grad_specs if self.ends is not None else sp.shared,
            "g_chunks": jax.tree.map(lambda p: _P(None, None, *p), sp.layer, is_leaf=_is_spec),
        }

        def run(operand, c, i):
            out = branch(operand if read is None else read(operand, c, i), c, i)
            specs = {k: table[k] if k != "out_i" else jax.tree.map(lambda _: sp.act, out[k]) for k in out}
            return _pin(out, specs)

        return run


@dataclasses.dataclass(frozen=True, eq=False)
class Replicated:
    """The parameters outside a `Pipeline`'s stack on every stage, as a tree (where strategies cut
    them inside the stages; `_rest.StageParams` holds them on the stages that use them otherwise),
    their gradients summed over all stages once per step; the interface `Program` calls.

    Attributes:
      grad_specs: per leaf, its spec over a stage's own axes.
    """

    grad_specs: Any
    spec = PartitionSpec()

    def pack(self, rest: Any) -> Any:
        return rest

    def unpack(self, held: Any) -> Any:
        return held

    def local(self, held: Any) -> Any:
        return held

    def out(self, grads: Any) -> Any:
        return grads

    def tree(self, held: Any, which: str) -> Any:
        return held

    def row(self, grads: Any, which: str) -> Any:
        return grads

    def sum_tied(self, grads: Any, stage: jax.Array, axis: str) -> Any:
        return jax.lax.psum(grads, axis)


_EVERYWHERE = Replicated(None)


def _pin(tree, specs):
    """Constrains each leaf of `tree` to its spec over the current (stage-manual) mesh, less its
    manual axes (data axes manual too: each device's rows are its own); with no automatic axes
    left there is nothing to constrain."""
    mesh = jax.sharding.get_abstract_mesh()
    if not mesh.auto_axes:
        return tree
    manual = set(mesh.manual_axes)
    return jax.tree.map(lambda x, p: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, without_axes(p, manual))),
                        tree, specs, is_leaf=_is_spec)


def _P(*entries) -> PartitionSpec:
    return PartitionSpec(*entries)


def _is_spec(x) -> bool:
    return isinstance(x, PartitionSpec)


def _unmicro(a, lead):
    """`[..., M, mb, ...]` (micro-batch i = rows i::M) back to `[..., M·mb, ...]` in batch order."""
    a = jnp.swapaxes(a, lead, lead + 1)
    return a.reshape(*a.shape[:lead], a.shape[lead] * a.shape[lead + 1], *a.shape[lead + 2:])


class _Ops:
    """The per-tick operations of one stage on small per-tick values (`read` → branch → `write`).

    Three top-level branches (idle, forward, backward; idle and forward for inference) keep the
    compiled program small; whether a forward starts from `first` or a backward from `last`
    depends on the virtual stage (`chunk * S + stage`) and is a small `cond` inside the branch
    (`_on`: none where the tick's `Running` says only one side runs). Every branch returns the same
    dict: what to write back to this tick's slots, the loss and gradient increments, and what to
    send each way.
    """

    def __init__(self, program: Program, ends, chunks, micro, act, run):
        self.pipe, self.chunks, self.micro, self.act, self.run = program.pipe, chunks, micro, act, run
        self.first_params, self.last_params, self.held = ends  # what `first` and `last` read, and how held
        self.grad_specs = program.ends.grad_specs if program.ends is not None else program.specs.shared
        self.specs = program.specs
        sch = program.schedule
        self.m, self.s, self.last_vstage = sch.micro_batches, sch.stages, sch.stages * sch.virtual - 1
        self.stage = jax.lax.axis_index(STAGE)
        self.split = sch.split_backward
        self.pullback = PullbackShape.of(run, self.chunk(0), act) if not sch.forward_only else None

    @property
    def residual_shapes(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        return cast(PullbackShape, self.pullback).stored  # a program that trains has one

    def _zero(self):
        return jnp.zeros(self.act.shape, self.act.dtype)

    def _vstage(self, c):
        return c * self.s + self.stage

    def _on(self, vstages, target, c, yes, no, specs):
        """`yes()` on virtual stage `target`, else `no()`, each result pinned to `specs` (a `cond`'s
        branches must agree on shardings): a `lax.cond` only where the tick's operation of this
        kind runs on `target` and on another virtual stage (`vstages`, from its `Running`)."""
        if target not in vstages:
            return _pin(no(), specs)
        if vstages == [target]:
            return _pin(yes(), specs)
        return jax.lax.cond(self._vstage(c) == target, lambda: _pin(yes(), specs), lambda: _pin(no(), specs))

    def chunk(self, c):
        return jax.tree.map(lambda a: take(a, c, 0), self.chunks)

    def _mb(self, i):
        return jax.tree.map(lambda a: take(a, i, 1), self.micro)

    # --- the slots of one tick ---

    def read(self, carry, c, i) -> dict:
        if "out" in carry:
            return {"x": slot_of(carry["xin"], c, i), "out_i": jax.tree.map(lambda b: take(b, i, 0), carry["out"])}
        return {"x": slot_of(carry["xin"], c, i), "g": slot_of(carry["gin"], c, i),
                "y": slot_of(carry["yout"], c, i), "res": [slot_of(b, c, i) for b in carry["res"]],
                "g_rest": carry["g_rest"], "g_chunks": carry["g_chunks"]}

    def write(self, carry, c, i, out, running) -> dict:
        """`carry` with this tick's results written back; the output and residual slots only where
        a forward runs here (elsewhere every branch hands back what it read)."""
        carry = dict(carry)
        if "out" in carry:
            carry["out"] = jax.tree.map(lambda b, o: replace_entry(b, i, o, 0), carry["out"], out["out_i"])
            return carry
        if running.vstages(FORWARD):
            carry["yout"] = put_slot(carry["yout"], c, i, out["y"])
            carry["res"] = [put_slot(b, c, i, r) for b, r in zip(carry["res"], out["res"])]
            carry["loss"] = carry["loss"] + out["loss"]
        carry["g_rest"], carry["g_chunks"] = out["g_rest"], out["g_chunks"]
        return carry

    # --- the branches ---

    def train_branches(self) -> list[Callable]:
        """Indexed by the table's codes: idle, forward, backward (with zero bubble: its `B`), `W`."""
        if self.split:
            return [self.idle, self.forward, functools.partial(self.backward, weights=False), self.weights]
        return [self.idle, self.forward, self.backward]

    def forward_branches(self) -> list[Callable]:
        return [self.idle_inference, self.infer]

    def _result(self, view, **changes) -> dict:
        base = {"y": view["y"], "res": view["res"], "loss": jnp.zeros((), jnp.float32),
                "g_chunks": view["g_chunks"], "g_rest": view["g_rest"], "send": self._zero()}
        return {**base, **changes}

    @staticmethod
    def _added(view, c, g_chunk=None, g_rest=None) -> dict:
        """The running gradient sums of `view` with this tick's increments added (inside the
        branch, so no gradient-sized increment leaves it: a two-tick loop body keeps none live)."""
        out = {}
        if g_chunk is not None:
            out["g_chunks"] = jax.tree.map(lambda acc, g: replace_entry(acc, c, take(acc, c, 0) + g, 0),
                                           view["g_chunks"], g_chunk)
        if g_rest is not None:
            out["g_rest"] = jax.tree.map(jnp.add, view["g_rest"], g_rest)
        return out

    def idle(self, view, c, i, running):
        return self._result(view)

    def _input(self, view, c, i, vstages):
        mb = self._mb(i)
        first = lambda: self.pipe.first(self.first_params, mb)
        return self._on(vstages, 0, c, first, lambda: view["x"], self.specs.act)

    def forward(self, view, c, i, running):
        """Runs chunk `c` on micro-batch `i` under `jax.vjp`, keeping its residuals and output; on
        the last virtual stage adds `last`'s loss."""
        vstages = running.vstages(FORWARD)
        stored, y, _ = residuals(self.run, self.chunk(c), self._input(view, c, i, vstages))
        mb = self._mb(i)
        last = lambda: self.pipe.last(self.last_params, y, mb).astype(jnp.float32)
        loss = self._on(vstages, self.last_vstage, c, last, lambda: jnp.zeros((), jnp.float32), _P())
        return self._result(view, y=y, res=stored, loss=loss, send=y)

    def _output_gradient(self, view, c, i, vstages):
        """`(g_rest, g_y)`: the gradient of the chunk's output, received or (on the last virtual
        stage) `last`'s, and `last`'s gradient of the shared parameters (zero elsewhere)."""
        mb, zero_rest = self._mb(i), lambda: jax.tree.map(jnp.zeros_like, view["g_rest"])

        def from_last():
            loss, pull = jax.vjp(lambda r, y: self.pipe.last(r, y, mb), self.last_params, view["y"])
            g_rest, g_y = pull(jnp.full(loss.shape, 1.0 / self.m, loss.dtype))
            return self.held.row(g_rest, "last"), g_y

        return self._on(vstages, self.last_vstage, c, from_last, lambda: (zero_rest(), view["g"]),
                        (self.grad_specs, self.specs.act))

    def backward(self, view, c, i, running, weights=True):
        """Applies the stored pullback of (chunk `c`, micro-batch `i`) to its output's gradient; on
        virtual stage 0 also differentiates `first`. With `weights=False` (zero bubble's `B`) only
        the input's gradient: the parameters' is left to `weights` (XLA drops the unused half)."""
        mb, vstages = self._mb(i), running.vstages(BACKWARD)
        g_rest, g_y = self._output_gradient(view, c, i, vstages)
        g_chunk, g_x = self.pullback.rebuild(self.chunk(c), view["res"])(g_y)
        g_first = self._on(
            vstages, 0, c,
            lambda: self.held.row(jax.vjp(lambda r: self.pipe.first(r, mb), self.first_params)[1](g_x)[0], "first"),
            lambda: jax.tree.map(jnp.zeros_like, view["g_rest"]), self.grad_specs)
        added = self._added(view, c, g_chunk if weights else None, jax.tree.map(jnp.add, g_rest, g_first))
        return self._result(view, **added, send=g_x)

    def weights(self, view, c, i, running):
        """Zero bubble's `W`: the gradient of chunk `c`'s parameters for micro-batch `i`, from the
        residuals and the output's gradient its `B` left in their slots (on the last virtual stage
        `last`'s gradient is taken again; its shared-parameter part was counted at the `B`)."""
        _, g_y = self._output_gradient(view, c, i, running.vstages(WEIGHTS))
        g_chunk, _ = self.pullback.rebuild(self.chunk(c), view["res"])(g_y)
        return self._result(view, **self._added(view, c, g_chunk))

    def idle_inference(self, view, c, i, running):
        return {"out_i": view["out_i"], "send": self._zero()}

    def infer(self, view, c, i, running):
        vstages = running.vstages(FORWARD)
        y = self.run(self.chunk(c), self._input(view, c, i, vstages))
        specs = jax.tree.map(lambda _: self.specs.act, view["out_i"])
        out_i = self._on(vstages, self.last_vstage, c, lambda: self.pipe.head(self.last_params, y),
                         lambda: view["out_i"], specs)
        return {"out_i": out_i, "send": y}
