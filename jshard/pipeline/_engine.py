"""The SPMD program of one pipelined step: `shard_map` over the stage axis, a `scan` over ticks.

Why this design. A step is ONE `jax.jit` program, so XLA sees (and schedules, and the audit reads)
everything, and no host loop drives the schedule. The mesh has a leading `stage` axis; `shard_map`
makes only that axis manual (`axis_names={"stage"}`), so inside a stage the other axes stay
automatic and the stage's data / tensor strategies (`jshard.shard` calls, cut batch) still apply.
The schedule is a static tick table (`_schedule.py`); a `lax.scan` walks its ticks, and at each
tick every stage looks up its own operation (`axis_index("stage")`) and runs it through
`lax.switch`: idle, a forward, or a backward of one micro-batch on one chunk. Then one
`ppermute` passes forward outputs to the next stage and one passes input gradients to the previous
stage; what arrives is written into per-chunk slot buffers (slot = micro-batch mod slots).

Backward is hand-written per micro-batch: a backward recomputes its chunk's forward from the
stage's saved *input* under `jax.vjp` (activation checkpointing at stage boundaries) and
accumulates parameter gradients in the scan carry. So a stage stores only its inputs still
waiting for their backward: `M` of them under GPipe, at most `S` under 1F1B, which is why 1F1B's
memory grows with S and not with M. The price is one extra forward per micro-batch and stage.

Every switch branch ends by constraining its results to fixed shardings over the stage's own
axes (XLA requires a conditional's branches to agree).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard.pipeline._model import Pipeline, stack_length
from jshard.pipeline._schedule import Schedule

STAGE = "stage"


@dataclasses.dataclass(frozen=True)
class Specs:
    """Shardings over the stage's own (automatic) axes.

    Attributes:
      act: the activation passed between stages (its rows cut like the batch).
      shared: per leaf of the parameters outside the stack.
      layer: per leaf of the stack, for one layer (the stack's leading dim dropped).
      batch: per leaf of the batch.
    """

    act: PartitionSpec
    shared: Any
    layer: Any
    batch: Any


@dataclasses.dataclass(frozen=True)
class Program:
    """Builds the pipelined train and inference functions of `pipe` under `schedule` on `mesh`."""

    pipe: Pipeline
    schedule: Schedule
    mesh: Mesh
    specs: Specs

    @property
    def _stages(self) -> int:
        return self.schedule.stages

    def train(self) -> Callable[[dict, Any], tuple[jax.Array, dict]]:
        """`fn(params, batch) -> (loss, grads)`: the loss is the mean over micro-batches."""

        def fn(params, batch):
            rest, chunks, micro = self._inputs(params, batch)
            mapped = jax.shard_map(
                self._train_body, mesh=self.mesh, in_specs=(PartitionSpec(), PartitionSpec(None, STAGE), PartitionSpec()),
                out_specs=(PartitionSpec(), PartitionSpec(), PartitionSpec(None, STAGE)),
                axis_names={STAGE}, check_vma=False,
            )
            loss, g_rest, g_chunks = mapped(rest, chunks, micro)
            return loss, self.pipe.join(g_rest, self._unchunk(g_chunks, params))

        return fn

    def forward(self, broadcast: bool) -> Callable[[dict, Any], Any]:
        """`fn(params, batch) -> outputs` of `head`, rows in batch order; with `broadcast` on every
        device, otherwise with a leading stage dim whose last entry holds them."""

        def fn(params, batch):
            rest, chunks, micro = self._inputs(params, batch)
            out_spec = PartitionSpec() if broadcast else PartitionSpec(STAGE)
            mapped = jax.shard_map(
                lambda r, c, m: self._forward_body(r, c, m, broadcast), mesh=self.mesh,
                in_specs=(PartitionSpec(), PartitionSpec(None, STAGE), PartitionSpec()),
                out_specs=out_spec, axis_names={STAGE}, check_vma=False,
            )
            out = mapped(rest, chunks, micro)
            lead = 0 if broadcast else 1
            return jax.tree.map(lambda a: _unmicro(a, lead), out)

        return fn

    def _inputs(self, params, batch):
        rest, stack = self.pipe.split(params)
        s, v = self._stages, self.schedule.virtual
        k = stack_length(stack) // (s * v)
        chunks = jax.tree.map(lambda a: a.reshape(v, s, k, *a.shape[1:]), stack)
        m = self.schedule.micro_batches
        micro = jax.tree.map(lambda a: jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1), batch)
        return rest, chunks, micro

    def _unchunk(self, g_chunks, params):
        _, stack = self.pipe.split(params)
        return jax.tree.map(lambda g, a: g.reshape(a.shape), g_chunks, stack)

    # --- inside shard_map: one stage's view -------------------------------------------------

    def _state(self, rest, chunks, micro):
        first_mb = jax.tree.map(lambda a: a[0], micro)
        act = jax.eval_shape(self.pipe.first, rest, first_mb)
        v = self.schedule.virtual
        slots_f = self.schedule.slots("F")
        slots_b = 1 if self.schedule.forward_only else self.schedule.slots("B")
        return {
            "xin": jnp.zeros((v, slots_f, *act.shape), act.dtype),
            "gin": jnp.zeros((v, slots_b, *act.shape), act.dtype),
        }, act

    def _tables(self):
        sch = self.schedule
        tables = {"code": sch.codes(), "chunk": sch.field("chunk"), "micro": sch.field("micro")}
        for kind in ("F",) if sch.forward_only else ("F", "B"):
            for name, arr in zip(("valid", "chunk", "micro"), sch.receives(kind)):
                tables[f"r{kind}_{name}"] = arr
        return {k: jnp.asarray(a) for k, a in tables.items()}

    def _perms(self):
        s, cyclic = self._stages, self.schedule.virtual > 1
        fwd = [(i, (i + 1) % s) for i in range(s if cyclic else s - 1)]
        bwd = [((i + 1) % s, i) for i in range(s if cyclic else s - 1)]
        return fwd, bwd

    def _runner(self, stage):
        run = self.pipe.stage_runner(0)
        if isinstance(run, list):
            fns = run
            return lambda chunk, x: jax.lax.switch(stage, fns, chunk, x)
        return run

    def _train_body(self, rest, chunks, micro):
        chunks = jax.tree.map(lambda a: a[:, 0], chunks)  # [v, 1, k, ...] -> [v, k, ...]
        stage = jax.lax.axis_index(STAGE)
        bufs, act = self._state(rest, chunks, micro)
        carry = {**bufs, "g_rest": jax.tree.map(jnp.zeros_like, rest),
                 "g_chunks": jax.tree.map(jnp.zeros_like, chunks), "loss": jnp.zeros((), jnp.float32)}
        ops = _Ops(self, rest, chunks, micro, act, self._runner(stage))
        branches = [self._settled(b) for b in ops.train_branches()]
        fwd_perm, bwd_perm = self._perms()

        def tick(carry, row):
            mine = {k: v[stage] for k, v in row.items()}
            carry, send_f, send_b = jax.lax.switch(mine["code"], branches, carry, mine["chunk"], mine["micro"])
            carry = dict(carry)
            carry["xin"] = _receive(carry["xin"], jax.lax.ppermute(send_f, STAGE, fwd_perm), mine, "rF")
            carry["gin"] = _receive(carry["gin"], jax.lax.ppermute(send_b, STAGE, bwd_perm), mine, "rB")
            return carry, None

        carry, _ = jax.lax.scan(tick, carry, self._tables())
        loss = jax.lax.psum(carry["loss"], STAGE) / self.schedule.micro_batches
        g_rest = jax.lax.psum(carry["g_rest"], STAGE)
        return loss, g_rest, jax.tree.map(lambda a: a[:, None], carry["g_chunks"])

    def _forward_body(self, rest, chunks, micro, broadcast):
        chunks = jax.tree.map(lambda a: a[:, 0], chunks)
        stage = jax.lax.axis_index(STAGE)
        bufs, act = self._state(rest, chunks, micro)
        ops = _Ops(self, rest, chunks, micro, act, self._runner(stage))
        first_mb = jax.tree.map(lambda a: a[0], micro)
        out = jax.eval_shape(self.pipe.head, rest, jax.ShapeDtypeStruct(act.shape, act.dtype))
        del first_mb
        m = self.schedule.micro_batches
        carry = {"xin": bufs["xin"], "out": jax.tree.map(lambda o: jnp.zeros((m, *o.shape), o.dtype), out)}
        branches = [self._settled(b) for b in ops.forward_branches()]
        fwd_perm, _ = self._perms()

        def tick(carry, row):
            mine = {k: v[stage] for k, v in row.items()}
            carry, send_f, _ = jax.lax.switch(mine["code"], branches, carry, mine["chunk"], mine["micro"])
            carry = dict(carry)
            carry["xin"] = _receive(carry["xin"], jax.lax.ppermute(send_f, STAGE, fwd_perm), mine, "rF")
            return carry, None

        carry, _ = jax.lax.scan(tick, carry, self._tables())
        if broadcast:
            return jax.lax.psum(carry["out"], STAGE)
        return jax.tree.map(lambda a: a[None], carry["out"])

    def _settled(self, branch):
        """`branch` with its results constrained to the fixed shardings every branch shares."""
        sp = self.specs

        def spec_of(name, leaf_spec_tree, value):
            if name in ("xin", "gin"):
                return PartitionSpec(None, None, *sp.act)
            if name == "g_rest":
                return leaf_spec_tree
            if name == "g_chunks":
                return jax.tree.map(lambda p: PartitionSpec(None, None, *p), sp.layer,
                                    is_leaf=lambda x: isinstance(x, PartitionSpec))
            if name == "out":
                return jax.tree.map(lambda _: PartitionSpec(None, *sp.act), value)
            return PartitionSpec()

        def constrain(tree, specs):
            return jax.tree.map(lambda x, p: jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, p)),
                                tree, specs, is_leaf=lambda x: isinstance(x, PartitionSpec))

        def run(carry, c, i):
            carry, send_f, send_b = branch(carry, c, i)
            carry = {name: constrain(val, _broadcast_spec(spec_of(name, sp.shared, val), val))
                     for name, val in carry.items()}
            act = NamedSharding(self.mesh, sp.act)
            return (carry, jax.lax.with_sharding_constraint(send_f, act),
                    jax.lax.with_sharding_constraint(send_b, act))

        return run


def _broadcast_spec(spec, value):
    """A single PartitionSpec stands for every leaf of `value`."""
    if isinstance(spec, PartitionSpec):
        return jax.tree.map(lambda _: spec, value)
    return spec


def _receive(buf, value, mine, prefix):
    """Writes `value` into `buf[chunk, micro % slots]` where this stage received something."""
    slots = buf.shape[1]
    c, slot = mine[f"{prefix}_chunk"], mine[f"{prefix}_micro"] % slots
    old = buf[c, slot]
    new = jnp.where(mine[f"{prefix}_valid"] > 0, value, old)
    return jax.lax.dynamic_update_index_in_dim(buf, jax.lax.dynamic_update_index_in_dim(buf[c], new, slot, 0), c, 0)


def _unmicro(a, lead):
    """`[..., M, mb, ...]` (micro-batch i = rows i::M) back to `[..., M·mb, ...]` in batch order."""
    a = jnp.swapaxes(a, lead, lead + 1)
    return a.reshape(*a.shape[:lead], a.shape[lead] * a.shape[lead + 1], *a.shape[lead + 2:])


class _Ops:
    """The per-tick operations of one stage: each `(carry, chunk, micro) -> (carry, send_f, send_b)`."""

    def __init__(self, program: Program, rest, chunks, micro, act, run):
        self.p, self.rest, self.chunks, self.micro, self.act, self.run = program, rest, chunks, micro, act, run
        self.m = program.schedule.micro_batches

    def _zero(self):
        return jnp.zeros(self.act.shape, self.act.dtype)

    def _chunk(self, c):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, c, 0, keepdims=False), self.chunks)

    def _mb(self, i):
        return jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False), self.micro)

    @staticmethod
    def _slot(buf, c, i):
        return buf[c, i % buf.shape[1]]

    def train_branches(self) -> list[Callable]:
        return [self.idle, self.f_first, self.f_mid, self.f_last, self.b_first, self.b_mid, self.b_last]

    def forward_branches(self) -> list[Callable]:
        return [self.idle, self.f_first, self.f_mid, self.f_out]

    def idle(self, carry, c, i):
        return carry, self._zero(), self._zero()

    def f_first(self, carry, c, i):
        y = self.run(self._chunk(c), self.p.pipe.first(self.rest, self._mb(i)))
        return carry, y, self._zero()

    def f_mid(self, carry, c, i):
        return carry, self.run(self._chunk(c), self._slot(carry["xin"], c, i)), self._zero()

    def f_last(self, carry, c, i):
        y = self.run(self._chunk(c), self._slot(carry["xin"], c, i))
        loss = self.p.pipe.last(self.rest, y, self._mb(i)).astype(jnp.float32)
        return {**carry, "loss": carry["loss"] + loss}, self._zero(), self._zero()

    def f_out(self, carry, c, i):
        y = self.run(self._chunk(c), self._slot(carry["xin"], c, i))
        out = self.p.pipe.head(self.rest, y)
        carry = {**carry, "out": jax.tree.map(lambda b, o: jax.lax.dynamic_update_index_in_dim(b, o, i, 0),
                                              carry["out"], out)}
        return carry, self._zero(), self._zero()

    def _accumulate(self, carry, c, g_chunk, g_rest=None):
        g_chunks = jax.tree.map(
            lambda acc, g: jax.lax.dynamic_update_index_in_dim(acc, acc[c] + g, c, 0), carry["g_chunks"], g_chunk)
        carry = {**carry, "g_chunks": g_chunks}
        if g_rest is not None:
            carry["g_rest"] = jax.tree.map(jnp.add, carry["g_rest"], g_rest)
        return carry

    def b_first(self, carry, c, i):
        mb = self._mb(i)
        _, vjp = jax.vjp(lambda r, ch: self.run(ch, self.p.pipe.first(r, mb)), self.rest, self._chunk(c))
        g_rest, g_chunk = vjp(self._slot(carry["gin"], c, i))
        return self._accumulate(carry, c, g_chunk, g_rest), self._zero(), self._zero()

    def b_mid(self, carry, c, i):
        _, vjp = jax.vjp(self.run, self._chunk(c), self._slot(carry["xin"], c, i))
        g_chunk, g_x = vjp(self._slot(carry["gin"], c, i))
        return self._accumulate(carry, c, g_chunk), self._zero(), g_x

    def b_last(self, carry, c, i):
        mb = self._mb(i)
        loss_of = lambda r, ch, x: self.p.pipe.last(r, self.run(ch, x), mb)
        loss, vjp = jax.vjp(loss_of, self.rest, self._chunk(c), self._slot(carry["xin"], c, i))
        g_rest, g_chunk, g_x = vjp(jnp.full(loss.shape, 1.0 / self.m, loss.dtype))
        return self._accumulate(carry, c, g_chunk, g_rest), self._zero(), g_x


def np_tables(schedule: Schedule) -> dict[str, np.ndarray]:
    """The schedule's tables as numpy arrays (for inspection and tests)."""
    return {"code": schedule.codes(), "chunk": schedule.field("chunk"), "micro": schedule.field("micro")}
