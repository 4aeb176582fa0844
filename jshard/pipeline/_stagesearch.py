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
step's per device: the pipeline's gradient sums, in-flight residuals and boundary slots are not
taken from it yet.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from jshard._errors import ShardingError
from jshard.compile import Options, build
from jshard.layouts import FineMesh
from jshard.pipeline._cut import Cut
from jshard.plan import Plan
from jshard.propagate import emission_of, emit


@dataclasses.dataclass(frozen=True, eq=False)
class SearchedCut(Cut):
    """A `Cut` whose stages run the strategies the search chose for them.

    Attributes:
      plans: per stage, the `Plan` searched over one stage's devices (`plan.summary()` lists each
        operator's strategy; `plan.search` the `SearchReport`).
    """

    plans: tuple[Plan, ...] = ()
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


def searched(call: str, cut: Cut, options: Options, inner: FineMesh, params_avals: list, micro: Any) -> SearchedCut:
    """`cut` with each stage's strategy searched over `inner`'s devices (see the module docstring);
    `params_avals` are the parameter leaves, `micro` one micro-batch's shapes."""
    batch = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in jax.tree.leaves(micro)]
    # no host offload weighed: the pipeline keeps each stage's packed state on its devices
    stage_options = dataclasses.replace(options, pipeline=None, devices=inner.device_count, batch_argnums=(1,),
                                        offload=())
    plans, emitted = [], []
    inputs = [[]] + [[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in b] for b in cut.boundary]
    for k in range(cut.stages):
        params_k = [params_avals[j] for j in cut.params[k]]
        run = lambda p, b, x, k=k: cut.run(k, p, b, x)
        program = build(run, (params_k, batch, inputs[k]), stage_options, f"{call} (stage {k})")
        _check_mesh(call, k, program.traced.mesh, inner)
        mesh = program.traced.mesh
        emission = emission_of(program.traced.nodes, program.result, dict(mesh.shape), options.enable_alltoall)
        plans.append(program.plan)
        emitted.append((program.traced.closed, emission))
    fields = {f.name: getattr(cut, f.name) for f in dataclasses.fields(Cut)}
    return SearchedCut(**fields, plans=tuple(plans), _emitted=tuple(emitted))


def _check_mesh(call: str, k: int, mesh, inner: FineMesh) -> None:
    """The stage's searched plan names the pipeline's stage axes (the fine mesh of `devices / S`)."""
    want = dict(zip(inner.names, inner.sizes))
    if dict(mesh.shape) != want:
        raise ShardingError(
            f"{call}: mode='auto' searched stage {k} on a mesh {dict(mesh.shape)}, but the pipeline's stages run on "
            f"{want}; a Layout naming its own axes inside a stage cannot be searched with pipeline_stages yet. Drop "
            f"the Layout, or use mode='semi_auto' with jshard.shard tuples inside the stages."
        )
