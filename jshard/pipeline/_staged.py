"""The SPMD program of a step cut into stages (`_cut.py`): per-stage bodies under one schedule.

The stacked form (`_engine.py`) runs one layer function on every stage; a cut step's stages differ
(stage 0 the embedding and two layers, the last the head and the loss), so here every forward or
backward tick is a `lax.switch` on the stage index over the bodies of the stages that run it at
that tick (`_ticks.Running`: a fill tick compiles the first stages' forwards only), and the values of
differing shapes are packed as one flat buffer per dtype:

- **parameters where they are used**: stage `k`'s parameter leaves (`Cut.params[k]`) packed into
  one row per dtype of a `[S, width]` buffer cut over the `stage` axis, so a device holds its own
  stage's parameters only (the width is the largest stage's share; a smaller stage's row is padded).
  A leaf a `jshard.shard` strategy cuts inside its stage (Megatron's column or row cut: `Cut.param_specs`)
  goes into a buffer of its layout class instead (`CutClass`: the leaves of one dtype cut over the same
  axes), `[S, n, width]` cut over `stage` and those axes, each leaf stored shard by shard (`_inner.py`):
  a device holds its stage's share of it divided by the `n` devices that cut it.
  A leaf read by two stages (a tied embedding) is in both rows, and its gradient is summed over
  them once per step (a `psum` over the stage axis of those leaves only), so both copies stay equal
  under any optimizer applied to the packed state;
- **boundaries**: what crosses `k -> k+1` (`Cut.boundary[k]`) packed into a buffer of the widest
  boundary; the input gradients sent back, their float part;
- **stored residuals**: a forward runs its stage under `jax.vjp` and stores the pullback's leaves
  (less the stage's parameters, read again) packed per dtype, the width of the largest stage's;
  the backward rebuilds the pullback from them and sends the input gradient back. A stage holds
  the residuals of the micro-batches in flight, `M` under GPipe and at most `S` under 1F1B.

Zero bubble (`"zb-h1"`) runs each backward as two ticks, `B` and `W`, its pullback split at the
equations (`_split.py`): `B` stores its handoff to the `W` in the micro-batch's residual slot,
re-packed with the residuals the `W` reads (the others are dead once `B` ran; the slot lives until
the `W` anyway), or in slots of its own where some stage's does not fit. Interleaved
(`virtual_stages=v`) runs `S·v` cut stages, stage `k` on device group `k mod S` as its chunk
`k // S`: a group's stages are its `v` rows of the packed parameters (`StagedProgram.row`), and
every slot buffer holds `v` chunks' slots.

The tick table, micro-batch order and slot counts are the `Schedule`'s, as in the stacked form;
with data parallel inside stages (`dataset_strategy="data_parallel"`: every axis of the stage; or
`jshard.shard` strategies cutting the micro-batch's rows: the axes `Cut.row_axes` names, which cut
no parameter) those axes are manual (`data_axes`): each device runs its own rows, its gradients
accumulate unreduced over the schedule's loop, and one `psum` after it sums them, once per step.

Only what crosses moves, as in the stacked form: the ticks run as the schedule's loops of one
repeating permute pattern (`Schedule.segments`, `scan_ticks`), and each permute carries only the
pairs whose source sends at that tick (`Schedule.permutes`): forward, backward, or both at once
(`FB`) where stage `s` sends forward while `s + 1` sends back, in the boundary's buffers. A two-tick loop body
(1F1B's steady state) runs two switches; the backward adds its parameter gradient into the running
sum inside its branch, so neither switch outputs a gradient-sized increment that XLA would keep
live across both ticks.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jshard.pipeline._buffers import (
    Buffers,
    Flat,
    has_automatic_axes,
    laid,
    put_row,
    receive,
    row_at,
    slot,
    whole_on_stage,
    widths,
    zero_buffers,
)
from jshard.pipeline._cut import Cut, spec_axes
from jshard.pipeline._engine import STAGE
from jshard.pipeline._inner import CutClass, StageLayouts, stage_layouts, stage_vjp, stored
from jshard.pipeline._schedule import BACKWARD, FORWARD, IDLE, WEIGHTS, Schedule
from jshard.pipeline._split import SplitBackward
from jshard.pipeline._ticks import scan_ticks, select


def _inexact(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


@dataclasses.dataclass(frozen=True, eq=False)
class StagedProgram:
    """The packed train step of `cut` under `schedule` on `mesh` (`stage` axis first).

    Attributes:
      cut: the per-stage functions.
      schedule: the tick table (one chunk per stage).
      mesh: the pipeline's mesh.
      param_avals: the parameter leaves' shapes and dtypes (flat).
      data_axes: the stage's axes its micro-batches' rows are cut over (pure data parallel).
    """

    cut: Cut
    schedule: Schedule
    mesh: Mesh
    param_avals: tuple[jax.ShapeDtypeStruct, ...]
    data_axes: tuple[str, ...] = ()

    # --- the packed layouts ---

    @functools.cached_property
    def classes(self) -> tuple[CutClass, ...]:
        """The layout classes of the leaves a `jshard.shard` strategy cuts inside their one stage
        (`Cut.param_specs`; a leaf of two stages, a tied one, stays whole: its copies are summed)."""
        stages_of: dict[int, int] = {}
        for idx in self.cut.params:
            for j in idx:
                stages_of[j] = stages_of.get(j, 0) + 1
        sizes, order = dict(self.mesh.shape), list(self.mesh.axis_names)
        found: dict[tuple[str, tuple[str, ...]], dict[int, P]] = {}
        for j, spec in enumerate(self.cut.param_specs()):
            axes = tuple(sorted(spec_axes(spec), key=order.index)) if spec is not None else ()
            if axes and stages_of.get(j) == 1 and not set(axes) & set(self.data_axes):
                found.setdefault((np.dtype(self.param_avals[j].dtype).name, axes), {})[j] = spec
        out = []
        for (dtype, axes), specs in sorted(found.items()):
            n = int(np.prod([sizes[a] for a in axes]))
            leaves = tuple(tuple(j for j in idx if j in specs) for idx in self.cut.params)
            width = max(sum(int(np.prod(self.param_avals[j].shape)) // n for j in ls) for ls in leaves)
            out.append(CutClass(dtype, axes, n, leaves, specs, width))
        return tuple(out)

    @property
    def held(self) -> tuple[tuple[int, ...], ...]:
        """Per (virtual) stage, its leaves packed whole on each of its devices (in no `CutClass`)."""
        cut = {j for c in self.classes for j in c.specs}
        return tuple(tuple(j for j in idx if j not in cut) for idx in self.cut.params)

    @property
    def param_flats(self) -> list[Flat]:
        """Per (virtual) stage, the packing of its whole leaves (`held`)."""
        return [Flat.of([self.param_avals[j] for j in idx]) for idx in self.held]

    @property
    def param_widths(self) -> dict[str, int]:
        return widths(self.param_flats)

    @functools.cached_property
    def layouts(self) -> StageLayouts | None:
        """The layouts the stages' strategies leave their boundary values and residuals in, over
        the stage's automatic axes (`stage_layouts`); None where the stage has none (one device,
        or every axis a data axis): all whole."""
        auto = self.automatic_axes
        return stage_layouts(self.cut, self.param_avals, self.param_specs, auto) if auto else None

    @property
    def automatic_axes(self) -> dict[str, int]:
        """The stage's axes its strategies lay values out over (not `stage`, no data axis), with their sizes."""
        return {a: n for a, n in self.mesh.shape.items() if a != STAGE and a not in self.data_axes and n > 1}

    @property
    def param_specs(self) -> tuple[P | None, ...]:
        """Per parameter leaf, its layout inside its stage as the packed buffers hold it: its
        `CutClass`'s spec, or None (whole)."""
        cut = {j: spec for c in self.classes for j, spec in c.specs.items()}
        return tuple(cut.get(j) for j in range(len(self.param_avals)))

    def _boundary_flats(self, grads: bool) -> list[Flat]:
        """Per boundary, the packing of its values (`grads`: of their gradients, the float ones),
        each laid out as the stage sending it makes it (a gradient as its value)."""
        out = []
        for k, b in enumerate(self.cut.boundary):
            specs = self.layouts.boundary[k] if self.layouts else (None,) * len(b)
            kept = [n for n, a in enumerate(b) if _inexact(a) or not grads]
            out.append(Flat.of([b[n] for n in kept], [specs[n] for n in kept], dict(self.mesh.shape)))
        return out

    def row(self, k: int) -> int:
        """The packed row of (virtual) stage `k`: device `k % S`'s rows are consecutive, its chunk
        `k // S` the `k // S`-th of them (`k` itself with one chunk per stage)."""
        s, v = self.schedule.stages, self.schedule.virtual
        return (k % s) * v + k // s

    def write(self, k: int, leaves: Sequence[jax.Array]) -> Buffers:
        """(Virtual) stage `k`'s row of each packed buffer from its leaves (`Cut.params[k]` order):
        `[width]` per dtype, `[n, width]` per `CutClass`."""
        of = dict(zip(self.cut.params[k], leaves))
        row = self.param_flats[k].pack([of[j] for j in self.held[k]], self.param_widths)
        sizes = dict(self.mesh.shape)
        return {**row, **{c.key: c.pack(k, [of[j] for j in c.leaves[k]], sizes) for c in self.classes}}

    def read(self, k: int, row: Buffers) -> list[jax.Array]:
        """(Virtual) stage `k`'s leaves (`Cut.params[k]` order) from its row of each buffer (`write`)."""
        got = dict(zip(self.held[k], self.param_flats[k].unpack(row)))
        sizes = dict(self.mesh.shape)
        for c in self.classes:
            got.update(zip(c.leaves[k], c.unpack(k, row[c.key], self.param_avals, sizes)))
        return [got[j] for j in self.cut.params[k]]

    def zeros(self, lead: int | None) -> Buffers:
        """Zero buffers of the packed layout (`[lead, ...]` per buffer, or one row with None)."""
        at = () if lead is None else (lead,)
        return {**zero_buffers(lead, self.param_widths),
                **{c.key: jnp.zeros((*at, c.n, c.width), c.dtype) for c in self.classes}}

    def specs(self) -> dict[str, P]:
        """Each packed buffer's `PartitionSpec` on the pipeline's mesh: `stage`, then a class's axes."""
        return {**{name: P(STAGE) for name in self.param_widths}, **{c.key: P(STAGE, c.axes) for c in self.classes}}

    def place(self, buffers: Buffers) -> Buffers:
        """Packed buffers (any leading dims) inside a stage: a dtype's whole on each of the stage's
        devices (`whole_on_stage`), a `CutClass`'s `n` dim cut over its axes."""
        axes = {c.key: c.axes for c in self.classes}
        whole = whole_on_stage({name: b for name, b in buffers.items() if name not in axes})
        if not axes or len(whole) == len(buffers) or not has_automatic_axes():
            return {**buffers, **whole}
        return {**whole, **{name: jax.lax.with_sharding_constraint(b, P(*[None] * (b.ndim - 2), axes[name], None))
                            for name, b in buffers.items() if name in axes}}

    def pack(self, leaves: Sequence[jax.Array]) -> Buffers:
        """The parameter leaves as `[S·v, ...]` buffers, row `row(k)` (virtual) stage `k`'s."""
        rows = [self.write(k, [leaves[j] for j in idx]) for k, idx in enumerate(self.cut.params)]
        order = sorted(range(len(rows)), key=self.row)
        return {name: jnp.stack([rows[k][name] for k in order]) for name in rows[0]}

    def unpack(self, packed: Buffers) -> list[jax.Array]:
        """The parameter leaves read from `[S·v, ...]` buffers (a leaf of no stage: zeros)."""
        out: list = [None] * len(self.param_avals)
        for k, idx in enumerate(self.cut.params):
            for j, x in zip(idx, self.read(k, {name: b[self.row(k)] for name, b in packed.items()})):
                out[j] = x if out[j] is None else out[j]
        return [jnp.zeros(a.shape, a.dtype) if x is None else x for x, a in zip(out, self.param_avals)]

    def stage_bytes(self) -> tuple[int, ...]:
        """Bytes of each stage's own parameters (its share; a tied leaf counts in each stage)."""
        return tuple(sum(int(np.prod(self.param_avals[j].shape)) * np.dtype(self.param_avals[j].dtype).itemsize
                         for j in idx) for idx in self.cut.params)

    def device_bytes(self) -> int:
        """Bytes of packed parameters one device holds: its rows of every buffer (the widest stage's
        share; a `CutClass`'s divided by the devices that cut it)."""
        v = self.schedule.virtual
        whole = sum(w * np.dtype(name).itemsize for name, w in self.param_widths.items())
        return v * (whole + sum(c.width * np.dtype(c.dtype).itemsize for c in self.classes))

    # --- the step ---

    def train(self, packed: Buffers, batch: Any) -> tuple[jax.Array, Buffers]:
        """`(loss, packed gradients)`: the loss is the mean over micro-batches; a tied leaf's
        gradient is the sum over its stages, in every copy."""
        micro = _micro(batch, self.schedule.micro_batches)
        spec = P(None, self.data_axes) if self.data_axes else P()
        mapped = jax.shard_map(
            self._body, mesh=self.mesh,
            in_specs=(P(STAGE), jax.tree.map(lambda _: spec, micro), P(None, STAGE)),
            out_specs=(P(), P(STAGE)), axis_names={STAGE, *self.data_axes}, check_vma=False,
        )
        return mapped(packed, micro, self._table())

    def _table(self) -> np.ndarray:
        """`[ticks, stages, 9]` int32: kind (0 idle, 1 forward, 2 backward or zero bubble's `B`, 3
        zero bubble's `W`), micro-batch, what arrives each way (`valid`, `micro`), then the chunks
        of the operation and of what arrives each way (interleaved; 0 otherwise)."""
        sch = self.schedule
        codes = sch.codes()
        kind = np.select([codes == IDLE, codes == FORWARD, codes == BACKWARD, codes == WEIGHTS], [0, 1, 2, 3], -1)
        (fv, fc, fm), (bv, bc, bm) = sch.receives("F"), sch.receives("B")
        return np.stack([kind, sch.field("micro"), fv, fm, bv, bm, sch.field("chunk"), fc, bc], axis=-1).astype(np.int32)

    def _slots(self) -> dict[str, int]:
        """Slots per chunk of each carried buffer (its rows: `v` times as many, chunk by chunk)."""
        sch = self.schedule
        n = {"xin": sch.slots("activations"), "res": sch.slots("residuals"), "gin": sch.slots("gradients")}
        return {**n, "hand": n["res"]} if sch.split_backward else n

    def _body(self, packed, micro, table):
        sch, n = self.schedule, self._slots()
        ticks = _Ticks(self, packed, micro)
        bw, gw, v = ticks.bw, ticks.gw, sch.virtual
        carry = {
            "xin": zero_buffers(v * n["xin"], bw), "res": zero_buffers(v * n["res"], ticks.rw),
            "gin": zero_buffers(v * n["gin"], gw), "g": self.place(self.zeros(v)),
            "loss": jnp.zeros((), jnp.float32),
        }
        branches = [ticks.idle, ticks.forward, ticks.backward]
        if sch.split_backward:  # `B` stores its handoff to the `W` (`_split.py`): in the residuals' slot
            if not ticks.hand_in_res:  # where it fits in what the `W` leaves unread, else in slots of its own
                carry["hand"] = zero_buffers(v * n["hand"], ticks.hw)
            branches = [ticks.idle, ticks.forward, ticks.input_grad, ticks.weights]

        def tick(carry, row, permutes, running):
            kind, i, c = row[0], row[1], row[6]
            at = {name: slot(c, i, k) for name, k in n.items()}
            view = {"x": row_at(carry["xin"], at["xin"]), "res": row_at(carry["res"], at["res"]),
                    "g_in": row_at(carry["gin"], at["gin"]), "g": carry["g"], "c": c}
            if "hand" in carry:
                view["hand"] = row_at(carry["hand"], at["hand"])
            out = running.switch(kind, [functools.partial(b, running=running) for b in branches], view, i)
            carry = dict(carry)
            carry["res"] = put_row(carry["res"], at["res"], out["res"])
            if "hand" in carry:
                carry["hand"] = put_row(carry["hand"], at["hand"], out["hand"])
            carry["g"] = out["g"]
            carry["loss"] = carry["loss"] + out["loss"]
            return self._pass(carry, out, row, permutes)

        carry = scan_ticks(sch, table[:, 0], carry, tick)
        d = self._data_degree()
        loss = jax.lax.psum(carry["loss"], (STAGE, *self.data_axes)) / (sch.micro_batches * d)
        g = carry["g"]
        if self.data_axes:  # each device differentiated the mean over its own rows
            g = jax.tree.map(lambda x: x / d, jax.lax.psum(g, self.data_axes))
        return loss, self._sum_tied(g)

    def _pass(self, carry, out, row, permutes):
        """The tick's permutes (`Schedule.permutes`), each with only the pairs whose source sends
        at this tick: forward (`send_f`, all boundary values), backward (`send_b`, their float
        gradients), or `FB`, carrying each source's one send either way: the gradients' buffers are
        the boundary's float buffers (same widths), so it sends the boundary's buffers, holding a
        gradient where the stage ran a backward. What arrives is written where the table says it
        arrives."""
        kind, n = row[0], self._slots()
        fv, fm, bv, bm = row[2], slot(row[7], row[3], n["xin"]), row[4], slot(row[8], row[5], n["gin"])
        pairs = lambda name: sorted(self.schedule.pairs(name))
        f, b = out["send_f"], out["send_b"]
        carry = dict(carry)
        for name in permutes:
            direction = self.schedule.kind(name)
            if direction == "F":
                carry["xin"] = receive(carry["xin"], jax.lax.ppermute(f, STAGE, pairs(name)), fv, fm)
            elif direction == "B":
                carry["gin"] = receive(carry["gin"], jax.lax.ppermute(b, STAGE, pairs(name)), bv, bm)
            else:
                send = {d: jnp.where(kind == FORWARD, x, b[d]) if d in b else x for d, x in f.items()}
                got = jax.lax.ppermute(send, STAGE, pairs(name))
                carry["xin"] = receive(carry["xin"], got, fv, fm)
                carry["gin"] = receive(carry["gin"], {d: got[d] for d in b}, bv, bm)
        return carry

    def _sum_tied(self, g: Buffers) -> Buffers:
        """Each leaf read by more than one stage gets the sum of its stages' gradients, in every copy
        (`g`: this device's `[v, width]` rows, chunk by chunk)."""
        holders: dict[int, list[int]] = {}
        for k, idx in enumerate(self.cut.params):
            for j in idx:
                holders.setdefault(j, []).append(k)
        tied = [j for j, ks in holders.items() if len(ks) > 1]
        if not tied:
            return g
        flats, tied_flat = self.param_flats, Flat.of([self.param_avals[j] for j in tied])
        tw, held = widths([tied_flat]), self.held  # a tied leaf is in no CutClass: the whole buffers hold it
        g, cut = {name: x for name, x in g.items() if name in self.param_widths}, \
            {name: x for name, x in g.items() if name not in self.param_widths}

        s_, v = self.schedule.stages, self.schedule.virtual
        chunk = lambda c: {name: x[c] for name, x in g.items()}

        def mine(s):
            total = zero_buffers(None, tw)
            for c in range(v):
                k = c * s_ + s
                leaves = dict(zip(held[k], flats[k].unpack(chunk(c))))
                part = tied_flat.pack([leaves.get(j, jnp.zeros(self.param_avals[j].shape, self.param_avals[j].dtype))
                                       for j in tied], tw)
                total = jax.tree.map(jnp.add, total, part)
            return total

        stage = jax.lax.axis_index(STAGE)
        total = jax.lax.psum(jax.lax.switch(stage, [lambda s=s: mine(s) for s in range(s_)]), STAGE)
        summed = dict(zip(tied, tied_flat.unpack(total)))

        def put_back(s):
            rows = []
            for c in range(v):
                k = c * s_ + s
                leaves = flats[k].unpack(chunk(c))
                rows.append(flats[k].pack([summed.get(j, x) for j, x in zip(held[k], leaves)], self.param_widths))
            return {name: jnp.stack([r[name] for r in rows]) for name in self.param_widths}

        return {**jax.lax.switch(stage, [lambda s=s: put_back(s) for s in range(s_)]), **cut}

    def _data_degree(self) -> int:
        return int(np.prod([self.mesh.shape[a] for a in self.data_axes])) if self.data_axes else 1


class _Ticks:
    """One stage's tick operations (idle, forward, backward), each a switch over the stage index;
    every one returns the same dict: the residuals to store, what to send each way, the parameter
    gradients' running sum (the backward adds its own to `view["g"]`) and the loss increment."""

    def __init__(self, program: StagedProgram, params: Buffers, micro: Any):
        self.p, self.params, self.micro = program, program.place(params), micro
        self.cut, self.m, self.s = program.cut, program.schedule.micro_batches, program.schedule.stages
        self.bf, self.gf = program._boundary_flats(False), program._boundary_flats(True)
        self.bw, self.gw = widths(self.bf), widths(self.gf)
        self.stage, sizes = jax.lax.axis_index(STAGE), dict(program.mesh.shape)
        self.pulls = [self._pullback_shape(k) for k in range(self.cut.stages)]
        self.rf = [Flat.of(res, self._residual_specs(k, res), sizes) for k, (_, _, res) in enumerate(self.pulls)]
        self.rw = widths(self.rf)
        if program.schedule.split_backward:
            self.splits = [self._split(k) for k in range(self.cut.stages)]
            hands = [self._handoff_specs(k, split) for k, split in enumerate(self.splits)]
            self.hf = [Flat.of(split.handoff, specs, sizes) for split, specs in zip(self.splits, hands)]
            self.hw = widths(self.hf)
            # what the `W` reads of each stage's residuals, and that with `B`'s handoff (`after_b`)
            self.kept = [[n for n in range(len(self.rf[k].avals)) if split.weight_reads[len(self.cut.params[k]) + n]]
                         for k, split in enumerate(self.splits)]
            self.af = [Flat.of([self.rf[k].avals[n] for n in kept] + list(split.handoff),
                               [self.rf[k].specs[n] for n in kept] + hands[k], sizes)
                       for k, (kept, split) in enumerate(zip(self.kept, self.splits))]
            self.hand_in_res = all(size <= self.rw.get(name, 0) for f in self.af for name, size in f.sizes.items())

    def _handoff_specs(self, k, split: SplitBackward) -> list[P | None]:
        """The layouts of stage `k`'s handoff from its `B` to its `W` (`SplitBackward.handoff_specs`),
        from its parameters', residuals' and received gradient's; all whole with no layouts."""
        if self.p.layouts is None:
            return [None] * len(split.handoff)
        cot = [None] if k == self.cut.stages - 1 else list(self.gf[k].specs)
        params = [self.p.param_specs[j] for j in self.cut.params[k]]
        return split.handoff_specs(params + list(self.rf[k].specs) + cot, self.p.automatic_axes)

    def _result(self, view, **changes) -> dict:
        base = {"res": view["res"], "send_f": zero_buffers(None, self.bw), "send_b": zero_buffers(None, self.gw),
                "g": view["g"], "loss": jnp.zeros((), jnp.float32)}
        if "hand" in view:
            base["hand"] = view["hand"]
        return self._hold({**base, **changes})

    def _hold(self, tree: dict) -> dict:
        """A tick's values in the one layout every branch ends with: each buffer as its name says
        (`laid`), the parameter gradients' sum `g` laid out as the packed parameters (`place`)."""
        return {**laid({name: x for name, x in tree.items() if name != "g"}), "g": self.p.place(tree["g"])}

    def idle(self, view, i, running):
        return self._result(view)

    def _at_stage(self, view, code, running, at):
        """`at(k)` for this tick's (virtual) stage `k`, over the stages that run operation `code` here
        (`Running`): a fill tick compiles the first stages' bodies only."""
        stages = running.vstages(code)
        return select(self._vstage(view), stages, {k: (lambda k=k: at(k)) for k in stages})

    def _vstage(self, view):
        """The (virtual) stage this device runs at this tick: chunk `c` of stage `s` is `c·S + s`."""
        return view["c"] * self.s + self.stage

    def _params(self, k) -> list:
        """Stage `k`'s parameter leaves, from this device's row of chunk `k // S`."""
        return self.p.read(k, {name: b[k // self.s] for name, b in self.params.items()})

    def _add(self, g: Buffers, k, g_params) -> Buffers:
        """The running gradient sum with stage `k`'s parameter gradients added to its chunk's row."""
        row = self.p.write(k, g_params)
        return {name: x.at[k // self.s].add(row[name]) for name, x in g.items()}

    def _mb(self, i) -> list:
        return [jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in jax.tree.leaves(self.micro)]

    def _vjp(self, k, i, x_buffers):
        """Stage `k` on micro-batch `i` under `jax.vjp` (`stage_vjp`):
        `(outputs, pullback of the float outputs, parameters)`."""
        ins = self.bf[k - 1].unpack(x_buffers) if k else []
        params_k = self._params(k)
        return (*stage_vjp(self.cut, k, params_k, ins, self._mb(i)), params_k)

    def _residual_specs(self, k, res) -> tuple[P | None, ...]:
        """Stage `k`'s residuals' layouts (`StagedProgram.layouts`; all whole where there are none)."""
        layouts = self.p.layouts
        if layouts is None or layouts.residual_shapes[k] != tuple(tuple(a.shape) for a in res):
            return (None,) * len(res)  # traced apart from the program, its residuals did not line up: whole
        return layouts.residuals[k]

    def _pullback_shape(self, k):
        """Stage `k`'s `_stored` structure, its residuals as shapes (traced once, not run)."""
        found = {}

        def probe(x_buffers):
            tree, param_of, res = stored(*self._vjp(k, 0, x_buffers)[1:])
            found["tree"], found["param_of"] = tree, param_of
            return res

        res = jax.eval_shape(probe, zero_buffers(None, self.bw))
        return found["tree"], found["param_of"], res

    def forward(self, view, i, running):
        """Runs the stage on micro-batch `i` under `jax.vjp`, storing its residuals; sends its
        outputs on, or (the last stage) adds its loss."""
        view = self._hold(view)

        def at(k):
            outs, pull, params_k = self._vjp(k, i, view["x"])
            res = self.rf[k].pack(stored(pull, params_k)[2], self.rw)
            if k == self.cut.stages - 1:
                return self._result(view, res=res, loss=outs[0].astype(jnp.float32))
            return self._result(view, res=res, send_f=self.bf[k].pack(outs, self.bw))

        return self._at_stage(view, FORWARD, running, at)

    def backward(self, view, i, running):
        """Rebuilds the stored pullback of micro-batch `i`, applies it to the gradient received
        (the last stage: the loss's `1 / M`), and sends the input gradient back."""
        view = self._hold(view)

        def at(k):
            tree, param_of, _ = self.pulls[k]
            params_k, stored = self._params(k), iter(self.rf[k].unpack(view["res"]))
            pull = jax.tree.unflatten(tree, [next(stored) if j is None else params_k[j] for j in param_of])
            if k == self.cut.stages - 1:
                loss = self.cut.loss_aval
                cot = [jnp.full(loss.shape, 1.0 / self.m, loss.dtype)]
            else:
                cot = self.gf[k].unpack(view["g_in"])
            g_params, g_x = pull(cot)
            send_b = self.gf[k - 1].pack(g_x, self.gw) if k else zero_buffers(None, self.gw)
            return self._result(view, g=self._add(view["g"], k, g_params), send_b=send_b)

        return self._at_stage(view, BACKWARD, running, at)

    # --- zero bubble: the backward split into `B` and `W` (`_split.py`) ---

    def _pullback_args(self, k, view) -> list:
        """`[params_k, residuals, cotangent]` of stage `k`'s stored pullback for this tick's micro-batch."""
        if k == self.cut.stages - 1:
            loss = self.cut.loss_aval
            cot = [jnp.full(loss.shape, 1.0 / self.m, loss.dtype)]
        else:
            cot = self.gf[k].unpack(view["g_in"])
        return [self._params(k), self.rf[k].unpack(view["res"]), cot]

    def _split(self, k) -> SplitBackward:
        tree, param_of, stored = self.pulls[k]

        def bwd(params_k, res, cot):
            it = iter(res)
            pull = jax.tree.unflatten(tree, [next(it) if j is None else params_k[j] for j in param_of])
            return pull(cot)

        params_k = [self.p.param_avals[j] for j in self.cut.params[k]]
        cot = [self.cut.loss_aval] if k == self.cut.stages - 1 else list(self.gf[k].avals)
        return SplitBackward.of(bwd, [params_k, list(stored), cot], n_params=len(params_k))

    def input_grad(self, view, i, running):
        """Zero bubble's `B`: the input gradient of micro-batch `i`, sent back, and the handoff its
        `W` reads stored; the parameters' gradient is left to `weights`. The handoff goes into the
        micro-batch's residual slot, re-packed with the residuals the `W` reads (`after_b`: the
        rest are dead once `B` ran, and the slot lives until the `W` anyway), where every stage's
        fits; else into slots of its own."""

        def at(k):
            args = self._pullback_args(k, view)
            g_x, hand = self.splits[k].input_grad(args)
            send_b = self.gf[k - 1].pack(g_x, self.gw) if k else zero_buffers(None, self.gw)
            if self.hand_in_res:
                res = self.af[k].pack([args[1][n] for n in self.kept[k]] + list(hand), self.rw)
                return self._result(view, send_b=send_b, res=res)
            return self._result(view, send_b=send_b, hand=self.hf[k].pack(hand, self.hw))

        return self._at_stage(view, BACKWARD, running, at)

    def weights(self, view, i, running):
        """Zero bubble's `W`: the parameters' gradient of micro-batch `i`, from the residuals and the
        received gradient still in their slots and the handoff its `B` stored, added to the sum."""

        def at(k):
            if not self.hand_in_res:
                g_params = self.splits[k].weight_grad(self._pullback_args(k, view), self.hf[k].unpack(view["hand"]))
                return self._result(view, g=self._add(view["g"], k, g_params))
            params_k, _, cot = self._pullback_args(k, view)
            after = self.af[k].unpack(view["res"])
            res = [jnp.zeros(a.shape, a.dtype) for a in self.rf[k].avals]  # the ones the `W` does not read
            for n, x in zip(self.kept[k], after):
                res[n] = x
            g_params = self.splits[k].weight_grad([params_k, res, cot], after[len(self.kept[k]):])
            return self._result(view, g=self._add(view["g"], k, g_params))

        return self._at_stage(view, WEIGHTS, running, at)


def _micro(batch, m: int):
    """`[rows, ...]` leaves as `[M, rows / M, ...]`, micro-batch `i` the rows `i::M` (the stacked
    form's order)."""
    return jax.tree.map(lambda a: jnp.swapaxes(a.reshape(a.shape[0] // m, m, *a.shape[1:]), 0, 1), batch)


