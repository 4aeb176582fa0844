"""`mode="auto"` with `pipeline_stages`: each stage's strategy searched over its own devices.

MindSpore's pipeline with its recursive search: the step is cut into stages (`_cut.py`, tagged or
balanced by the cost model), then each stage's function `run(params_k, micro_batch, inputs)` goes
through the compile core (`jshard.compile.build`) on one stage's devices (`devices / S`), with
`mode="auto"` and the step's `search`, cost model and `memory_budget` (a budget per device: the
search keeps the stage within it, as it does for a whole program). The answer is a `Plan` per stage
(its operators' searched strategies, `origin="searched"`) and the emission that places its
constraints; `SearchedCut.run` replays a stage with those constraints bound over the mesh in
context (inside the pipeline's `shard_map`, the stage's own automatic axes), so the strategies hold
on whichever stage's devices run it; a parameter the search cuts is packed cut so
(`SearchedCut.param_specs`, `_staged.CutClass`). The budget a stage's search is given is the
step's per device less what the pipeline holds outside the stage's program: `in_flight`, the
residuals of the micro-batches in flight and the boundary slots, and the parameter gradients'
running sums, as large as the stage's parameters as its plan cuts them (`gradient_bytes`): reserved
first as the parameters cut over all of a stage's devices, and where a plan cuts them coarser, the
stages are searched again under what that plan's need, until a search's plans fit what it reserved.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from jshard._errors import ShardingError
from jshard._format import human_bytes
from jshard.compile import Options, Planning, build
from jshard.layouts import FineMesh
from jshard.pipeline._cut import Cut, spec_axes
from jshard.pipeline._schedule import Schedule, build_schedule
from jshard.plan import Plan
from jshard.propagate import emission_of, emit


@dataclasses.dataclass(frozen=True, eq=False)
class SearchedCut(Cut):
    """A `Cut` whose stages run the strategies the search chose for them.

    Attributes:
      plans: per stage, the `Plan` searched over one stage's devices (`plan.summary()` lists each
        operator's strategy; `plan.search` the `SearchReport`).
      pipeline_bytes: what the pipeline holds per device outside a stage's program (`in_flight` and
        the gradient sums reserved, `gradient_bytes`), taken from the `memory_budget` each stage's
        search is given.
    """

    plans: tuple[Plan, ...] = ()
    pipeline_bytes: int = 0
    _emitted: tuple[tuple[jcore.ClosedJaxpr, Any], ...] = ()  # per stage: its traced program, its emission

    def param_specs(self) -> tuple[PartitionSpec | None, ...]:
        """Per parameter leaf, the layout the search gave it as an argument of its (first) stage's
        program (`Plan.in_specs`), so the pipeline packs it cut as the search planned it."""
        specs: list[PartitionSpec | None] = [None] * len(self._param_vars)
        for plan, idx in zip(self.plans, self.params):
            for j, spec in zip(idx, plan.in_specs):
                specs[j] = spec if specs[j] is None else specs[j]
        return tuple(specs)

    def run(self, k: int, params_k: list, batch: list, inputs: list) -> list:
        """Stage `k` as `Cut.run`, its operators under the searched strategies."""
        closed, emission = self._emitted[k]
        return emit(closed, emission, jax.sharding.get_abstract_mesh())(*params_k, *batch, *inputs)


def searched(call: str, cut: Cut, options: Options, inner: FineMesh, params_avals: list, micro: Any,
             planning: Planning) -> SearchedCut:
    """`cut` with each stage's strategy searched over `inner`'s devices (see the module docstring);
    `params_avals` are the parameter leaves, `micro` one micro-batch's shapes. Every stage's
    planning, each search again under a larger reserve included, runs on `planning`'s one deadline
    (`Search.time_limit` bounds the step's planning, not each stage's)."""
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(micro)]
    inputs = [[]] + [[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in b] for b in cut.boundary]
    c = options.pipeline
    assert c is not None and c.stages is not None and c.micro_batches is not None  # the pipeline checked them
    schedule = build_schedule(c.schedule, stages=c.stages, micro_batches=c.micro_batches, virtual=c.virtual_stages)
    extra = in_flight(cut, schedule, params_avals, batch, inputs)
    # the gradient sums at the least they can take: every stage's parameters cut over all its devices
    grads = schedule.virtual * max(_nbytes([params_avals[j] for j in idx]) for idx in cut.params) // inner.device_count
    budget = options.memory_budget
    if budget is not None and budget <= extra + grads:
        raise ShardingError(
            f"{call}: memory_budget={human_bytes(budget)} per device, but the pipeline alone holds "
            f"{human_bytes(extra)} per device outside its stages' programs (the residuals of the micro-batches in "
            f"flight and the boundary slots under schedule={c.schedule!r}, S={c.stages}, M={c.micro_batches}) and "
            f"at least {human_bytes(grads)} of gradient sums (the largest stage's parameters cut over its "
            f"{inner.device_count} devices), leaving the search nothing. Raise memory_budget above "
            f"{human_bytes(extra + grads)}, or hold fewer micro-batches in flight "
            f"({'smaller micro-batches' if c.schedule == '1f1b' else 'schedule=1f1b'})."
        )
    search = lambda held: _search_stages(call, cut, options, inner, params_avals, batch, inputs, held, planning)
    if budget is None:
        plans, emitted = search(extra)
        grads = gradient_bytes(cut, plans, params_avals, schedule.virtual)
    else:  # the gradient sums, laid out as the plans cut the parameters, are reserved before the search
        for _ in range(_RESERVES):  # from the finest cut; where a plan cuts coarser, again under its own
            plans, emitted = search(extra + grads)
            needed = gradient_bytes(cut, plans, params_avals, schedule.virtual)
            if needed <= grads:
                break
            grads = needed
        else:
            raise ShardingError(_no_room_error(call, budget, extra, needed))
    fields = {f.name: getattr(cut, f.name) for f in dataclasses.fields(Cut)}
    return SearchedCut(**fields, plans=tuple(plans), pipeline_bytes=extra + grads, _emitted=tuple(emitted))


_RESERVES = 3
"""How many times the stages are searched at most, each under the gradient sums the last one's plans need."""


def _search_stages(call: str, cut: Cut, options: Options, inner: FineMesh, params_avals: list, batch: list,  # noqa: PLR0913
                   inputs: list, held: int, planning: Planning) -> tuple[list[Plan], list]:
    """Each stage's plan and emission, searched over `inner`'s devices under the step's
    `memory_budget` less the `held` bytes the pipeline holds per device outside the stage's program,
    each in a session of its own on `planning`'s deadline (`Planning.sharing`)."""
    budget = options.memory_budget
    # no host offload weighed: the pipeline keeps each stage's packed state on its devices
    stage_options = dataclasses.replace(options, pipeline=None, devices=inner.device_count, batch_argnums=(1,),
                                        offload=(), search=dataclasses.replace(
                                            options.search, memory_budget=None if budget is None else budget - held))
    plans, emitted = [], []
    for k in range(cut.stages):
        params_k = [params_avals[j] for j in cut.params[k]]
        run = lambda p, b, x, k=k: cut.run(k, p, b, x)
        where = f"{call} (stage {k}" + (f"; memory_budget less the pipeline's {human_bytes(held)} outside it)"
                                         if budget is not None else ")")
        program = build(run, (params_k, batch, inputs[k]), stage_options, where, planning.sharing())
        assert program.traced is not None and program.result is not None  # a program built by the search has both
        _check_mesh(call, k, program.traced.mesh, inner)
        mesh = program.traced.mesh
        emission = emission_of(program.traced.nodes, program.result, dict(mesh.shape), options.costs.alltoall)
        plans.append(program.plan)
        emitted.append((program.traced.closed, emission))
    return plans, emitted


def gradient_bytes(cut: Cut, plans: list[Plan], params_avals: list, virtual: int = 1) -> int:
    """Bytes per device of the parameter gradients' running sums the pipeline carries through its
    loop (`_staged.py`: laid out as the packed parameters): per stage, its leaves divided by the
    devices its plan cuts each over (`Plan.in_specs`), the largest stage's, `virtual` chunks of it."""
    def stage(k: int) -> int:
        sizes = dict(plans[k].mesh.shape)
        return sum(_nbytes([params_avals[j]]) // int(np.prod([sizes[a] for a in spec_axes(spec)]))
                   for j, spec in zip(cut.params[k], plans[k].in_specs))
    return virtual * max((stage(k) for k in range(cut.stages)), default=0)


def _no_room_error(call: str, budget: int, extra: int, grads: int) -> str:
    return (f"{call}: memory_budget={human_bytes(budget)} per device: the pipeline holds {human_bytes(extra)} per "
            f"device in flight (residual and boundary slots), and each of {_RESERVES} searches of its stages, "
            f"under what the gradient sums of the one before need (the parameters as it cut them, last "
            f"{human_bytes(grads)}), cut them coarser than it reserved. Raise memory_budget, or use more "
            f"pipeline stages.")


def in_flight(cut: Cut, schedule: Schedule, params_avals: list, batch: list, inputs: list) -> int:
    """Bytes per device the pipeline holds outside a stage's program (`_staged.py`): the slots of
    the residuals of the micro-batches in flight (the pullbacks' leaves less the parameters) and of
    the boundary values received each way, each slot as wide as the widest stage's (an estimate by
    bytes: the packed buffers take the widest per dtype), whole on each of the stage's devices (an
    upper bound: where the plans cut them, they are stored cut, `_inner.stage_layouts`)."""
    res = max(_residual_bytes(cut, k, [params_avals[j] for j in cut.params[k]], batch, inputs[k])
              for k in range(cut.stages))
    send = max((_nbytes(b) for b in cut.boundary), default=0)
    back = max((_nbytes([a for a in b if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)]) for b in cut.boundary),
               default=0)
    slots = schedule.slots
    return schedule.virtual * (slots("residuals") * res + slots("activations") * send + slots("gradients") * back)


def _residual_bytes(cut: Cut, k: int, params_k: list, batch: list, inputs: list) -> int:
    """The bytes stage `k` stores per micro-batch for its backward: its pullback's leaves, less its parameters."""
    floats = [n for n, a in enumerate(inputs) if jax.numpy.issubdtype(a.dtype, jax.numpy.inexact)]

    def stored(p, xs):
        merged = list(inputs)
        for n, x in zip(floats, xs):
            merged[n] = x

        def run(p, xs):
            for n, x in zip(floats, xs):
                merged[n] = x
            return [y for y in cut.run(k, p, batch, merged) if jax.numpy.issubdtype(y.dtype, jax.numpy.inexact)]

        pull = jax.vjp(run, p, xs)[1]
        return [leaf for leaf in jax.tree.leaves(pull) if not any(leaf is q for q in p)]

    return _nbytes(jax.eval_shape(stored, params_k, [inputs[n] for n in floats]))


def _nbytes(avals) -> int:
    return sum(int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for a in avals)


def _check_mesh(call: str, k: int, mesh, inner: FineMesh) -> None:
    """The stage's searched plan names the pipeline's stage axes (the fine mesh of `devices / S`)."""
    want = dict(zip(inner.names, inner.sizes))
    if dict(mesh.shape) != want:
        raise ShardingError(
            f"{call}: mode='auto' searched stage {k} on a mesh {dict(mesh.shape)}, but the pipeline's stages run on "
            f"{want}; a Layout naming its own axes inside a stage cannot be searched with pipeline_stages yet. Drop "
            f"the Layout, or use mode='semi_auto' with jshard.shard tuples inside the stages."
        )
