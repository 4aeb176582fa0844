"""The program stage: emission (the traced jaxpr re-run with the plan's constraints), `jax.jit`
with the planned argument and result shardings, and the `Plan` that records it all."""

from __future__ import annotations

import dataclasses
import functools
import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from jshard.audit import memory_figures, moved_between
from jshard.compile._boundary import argument_leaves
from jshard.compile._fusion import compiler_options
from jshard.compile._options import Options
from jshard.compile._planners import Planned
from jshard.compile._signature import abstract, dtype_of, weak_type
from jshard.compile._trace import Traced
from jshard.cost import CostModel
from jshard.hetero import Offload, offload_report, on_host_shardings, streamed
from jshard.layouts import replicated, to_pspec
from jshard.plan import CommunicationReport, Later, Plan, RecomputeReport, build_ops, recompute_report
from jshard.propagate import EMPTY, Result, Rewrite, emission_of, emit


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled signature: its `Plan`, the jitted program (None on an abstract mesh: plan
    only), the argument shardings (a pytree like the arguments) calls place their inputs on, and
    the planned layout of each value of the traced program (value -> `Spec`; empty: XLA's), and
    the traced program and the planner's `Result` it was built from (None: XLA propagates), and
    its executable where building it compiled it already (`propagation="best"`, or a budget's
    compiled check: calls run it instead of compiling `jitted` again)."""

    plan: Plan
    jitted: Any
    in_shardings: Any
    values: Mapping = dataclasses.field(default_factory=dict)
    traced: Traced | None = dataclasses.field(default=None, repr=False, compare=False)
    result: Result | None = dataclasses.field(default=None, repr=False, compare=False)
    compiled: Any = dataclasses.field(default=None, repr=False, compare=False)

    @property
    def runs(self) -> Any:
        """What a call runs: the executable compiled while building, else the jitted function."""
        return self.jitted if self.compiled is None else self.compiled


def build_program(traced: Traced, planned: Planned, in_sh: Sequence, out_sh: Sequence, devices: list | None,
                  options: Options, args: tuple, rewrite: Rewrite | None = None,
                  offload: Offload | None = None, replaced: Mapping | None = None) -> Program:
    """The jitted program and its `Plan` for one planning answer (`planned.result` None: XLA
    propagates from the anchors), the top-level program rewritten by `rewrite` where given
    (communication recompute), the equations `replaced` names emitted by its functions (the
    gradients' reduce-scatter, `Emission.replaced`); `offload`'s leaves in host memory, moved to
    the device for the step."""
    result, mesh = planned.result, traced.mesh
    evaluate = jcore.jaxpr_as_fun(traced.closed)
    emission = EMPTY
    if result is not None:
        in_sh = [sh or NamedSharding(mesh, to_pspec(result.values.get(v, replicated(np.ndim(x)))))
                 for v, sh, x in zip(traced.invars, in_sh, traced.leaves)]
        out_sh = [sh if sh is not None or v not in result.values else NamedSharding(mesh, to_pspec(result.values[v]))
                  for v, sh in zip(traced.outvars, out_sh)]
        # on Explicit axes only, the types say it all; on an abstract mesh (no devices) nothing runs it
        if devices is not None and set(mesh.explicit_axes) != set(mesh.axis_names):
            emission = emission_of(traced.nodes, result, dict(mesh.shape), options.costs.alltoall)
    if replaced:
        emission = dataclasses.replace(emission, replaced=replaced)
    if emission is not EMPTY or rewrite is not None:
        evaluate = emit(traced.closed, emission, mesh, rewrite)
    in_sh = [sh or NamedSharding(mesh, PartitionSpec()) for sh in in_sh]
    report = None
    if offload is not None:  # an updating result XLA would lay out is laid out as the leaf it updates
        out_sh = [in_sh[offload.results[o]] if sh is None and o in offload.results else sh for o, sh in enumerate(out_sh)]
        report = offload_report(offload, traced.paths, traced.leaves, in_sh, traced.out_leaves, out_sh,
                                options.cost_model or CostModel())
        in_sh, out_sh = on_host_shardings(in_sh, offload.args), on_host_shardings(out_sh, frozenset(offload.results))
        evaluate = streamed(evaluate, offload)
    in_tree = jax.tree_util.tree_unflatten(traced.treedef, in_sh)
    out_tree = jax.tree_util.tree_unflatten(traced.out_tree, out_sh)
    jitted = None
    compiling = compiler_options(options.communication, None if devices is None else devices[0].platform,
                                 bool(traced.ctx.buckets))
    if devices is not None:
        jitted = jax.jit(_unflattened(evaluate, traced.out_tree), in_shardings=in_tree, out_shardings=out_tree,
                         donate_argnums=options.donate_argnums, compiler_options=compiling or None)
    ops = _records(traced, result)
    plan = Plan(mesh, traced.fine, options.mode, ops, tuple(sh.spec for sh in in_sh),
                tuple(None if sh is None else sh.spec for sh in out_sh), traced.treedef, traced.out_tree,
                tuple(traced.ctx.annotations), "xla" if result is None else "jshard", jitted and functools.partial(jitted.lower, *abstract(args, in_tree)),
                search=planned.report, recompute=_recompute(traced, result, argument_leaves(args, options.donate_argnums)),
                offload=report, communication=_communication(traced, options, compiling),
                round_trip=None if devices is None else _round_trip(traced, in_sh, out_sh))
    return Program(plan, jitted, in_tree, {} if result is None else result.values, traced, result)


def _communication(traced: Traced, options: Options, compiling: dict) -> CommunicationReport | None:
    """What `communication=` did: copies, jshard's gradient buckets, the XLA options, their memory."""
    comm = options.communication
    if comm is None:
        return None
    buckets = tuple(traced.ctx.buckets)
    return CommunicationReport(comm.copies, buckets, tuple(sorted(compiling.items())), traced.ctx.copy_bytes,
                               max((size or 0 for leaves, _, size in buckets if leaves > 1), default=0))


def _round_trip(traced: Traced, in_sh: Sequence, out_sh: Sequence) -> float:
    """Bytes per device (the busiest device's) the next call moves to place the results that update
    arguments, where the program returns them in other layouts than it takes them: a result `k` of
    the argument `k`'s tree structure, shapes and dtypes (`(params, state, batch) -> (params, state,
    loss)`, a `TrainState` in and out; a lone result is result 0) updates it. A result XLA lays out
    (no sharding) is not priced."""
    node = traced.out_tree.node_data()  # a tuple or list of results, else one result: result 0
    args = traced.treedef.children()
    outs = traced.out_tree.children() if node and node[0] in (tuple, list) else [traced.out_tree]
    pairs, i, o = [], 0, 0
    for k, out in enumerate(outs):
        if k < len(args) and args[k] == out:
            pairs += [(i + j, o + j) for j in range(out.num_leaves)]
        i += args[k].num_leaves if k < len(args) else 0
        o += out.num_leaves
    avals = [v.aval for v in traced.outvars]
    pairs = [(i, o) for i, o in pairs if out_sh[o] is not None and hasattr(avals[o], "shape")
             and (np.shape(traced.leaves[i]), jax.dtypes.result_type(traced.leaves[i])) == (avals[o].shape, avals[o].dtype)]
    arrays = [avals[o] for _, o in pairs]
    return moved_between(arrays, [out_sh[o] for _, o in pairs], [in_sh[i] for i, _ in pairs])


def _records(traced: Traced, result) -> Later:
    """The plan's operator records, made when `Plan.ops` is first read, from the decisions as they
    are now (a copy of `result`'s tables: nothing later changes what the plan shows)."""
    if result is not None:
        result = dataclasses.replace(result, decisions=dict(result.decisions), unruled=set(result.unruled),
                                     weighed=dict(result.weighed))
    nodes, annotations, fine = traced.nodes, tuple(traced.ctx.annotations), traced.fine
    return Later(lambda: build_ops(nodes, annotations, fine, result))


def _recompute(traced: Traced, result, donated_leaves: set[int]) -> RecomputeReport | None:
    """The program's recompute regions and the memory model's peak with and without them."""
    donated = frozenset(traced.invars[i] for i in donated_leaves)
    values = {} if result is None else result.values
    return recompute_report(traced.nodes, values, traced.axis_size, traced.invars, traced.outvars, donated)


def compiled_held(jitted: Any, args: tuple, shardings: Any = None, offload: bool = False) -> tuple[Any, float]:
    """`jitted` compiled for `args`, and the per-device bytes it holds at once in device memory
    (arguments + results + temporaries - donated, `jshard.audit`'s `MemoryFigures.peak_bytes`), as
    XLA's buffer assignment reports them; arguments and results in host memory (`pinned_host`) are
    not the device's. Lowered as a call lowers it (`_given`)."""
    executable = jitted.lower(*_given(args, shardings, offload)).compile()
    return executable, float(memory_figures(executable).peak_bytes)


class Held(NamedTuple):
    """One program's compiled check: its executable (what calls run: `Program.compiled`), the
    per-device bytes it holds (as `compiled_held`'s) and the seconds XLA took to compile it."""

    executable: Any
    peak: float
    seconds: float


@dataclasses.dataclass
class Compiles:
    """The budget's compiled checks of one planning (one per `Planning` session): each distinct
    program compiled once, by what determines it (`program_key`); a program that comes again (a
    seed the search returns under a tighter estimate, a weighing's candidate alike to one checked
    before) takes the executable and figures already made.

    A program alike to one checked but for the 0-d results it lays out replicated where the other
    leaves them to XLA (`alike_key`: an optimizer level's program lays out the updated step count
    as the argument it updates, the same program without the level leaves it to XLA) holds the same
    bytes: where those are over the budget it is not compiled (it cannot be kept, and nothing runs
    it); where they fit it is compiled, for the executable a call runs.

    Attributes:
      held: each program's check, by its key.
      peaks: each program's peak, by its `alike_key`.
      compiled: the compiles made (a check taken from `held` or `peaks` is not one).
      least: the least peak any program checked held per device (inf before the first).
    """

    held: dict = dataclasses.field(default_factory=dict, repr=False)
    peaks: dict = dataclasses.field(default_factory=dict, repr=False)
    compiled: int = 0
    least: float = float("inf")

    def check(self, program: Program, args: tuple, budget: float | None = None) -> Held:
        """`program` compiled for `args` as a call lowers it, or its check made before; a program
        whose alike's peak (`alike_key`) is over `budget`, that peak without an executable."""
        assert program.jitted is not None  # checked where devices are present
        lowered = program.jitted.lower(*_given(args, program.in_shardings, bool(program.plan.offload)))
        comm = program.plan.communication
        key = program_key(lowered, program.in_shardings, () if comm is None else comm.compiler_options)
        alike = None if key is None else alike_key(key)
        found = None if key is None else self.held.get(key)
        if found is None and alike is not None and budget is not None and self.peaks.get(alike, 0.0) > budget:
            found = Held(None, self.peaks[alike], 0.0)
        if found is None:
            began = time.perf_counter()
            executable = lowered.compile()
            found = Held(executable, float(memory_figures(executable).peak_bytes), time.perf_counter() - began)
            self.compiled += 1
            if key is not None:
                self.held[key] = found
            if alike is not None:
                self.peaks[alike] = found.peak
        self.least = min(self.least, found.peak)
        return found


def program_key(lowered: Any, in_shardings: Any, options: tuple) -> tuple | None:
    """What determines the executable XLA compiles from `lowered`, or None where it cannot be read
    (the check is then not shared): the module's text (its operations, the arguments' and results'
    types, shardings, memory kinds and donated buffers), which arguments the module keeps (jax
    drops those the program does not read, so two programs reading different arguments of one
    shape print alike), the arguments' and results' tree structures, donation and types as calls
    pass them, the device each position of the meshes stands for (the text names devices by
    position), and the XLA options (`options`, as `(name, value)` pairs)."""
    kept = getattr(getattr(lowered, "_lowering", None), "compile_args", {}).get("kept_var_idx")
    if kept is None:  # jax's lowering no longer says which arguments it keeps: compiled every time
        return None
    outs = [getattr(o.sharding, "sharding", None) for o in jax.tree_util.tree_leaves(lowered.out_info)]
    meshes = [s.mesh for s in (*jax.tree_util.tree_leaves(in_shardings), *outs) if isinstance(s, NamedSharding)]
    devices = tuple(dict.fromkeys(tuple(d.id for d in m.devices.flat) for m in meshes))
    args = tuple((getattr(a, "_aval", None) or (a.shape, a.dtype), a.donated)
                 for a in jax.tree_util.tree_leaves(lowered.args_info))
    return (lowered.as_text(), tuple(sorted(kept)), lowered.in_tree, lowered.out_tree, args, devices, options)


def alike_key(key: tuple) -> tuple | None:
    """`program_key`'s `key` with the sharding of each 0-d result laid out replicated over the
    module's one mesh left out, or None where the module could lay one out otherwise (a maximal
    sharding, on one device, or another mesh): XLA lays out a 0-d result it is given no sharding
    for replicated or on one device, and it puts one on a device only where the module names one,
    so with none named the two programs are one. Results given another sharding, or with other
    attributes, keep theirs."""
    text = key[0]
    if _MAXIMAL.search(text) or len(_MESHES.findall(text)) != 1:
        return None
    return (_REPLICATED_SCALAR.sub(r"\1}", text), *key[1:])


_MESHES = re.compile(r"^\s*sdy\.mesh @", re.MULTILINE)
_MAXIMAL = re.compile(r"maximal")
_REPLICATED_SCALAR = re.compile(r'(tensor<[A-Za-z][A-Za-z0-9]*> \{jax\.result_info = "[^"]*"), sdy\.sharding = #sdy\.sharding<@mesh, \[\]>\}')
"""A 0-d result (its element type alone, no dims) with its result name and the sharding replicated
over `@mesh` as its only other attribute, in the module's signature."""


def _given(args: tuple, shardings: Any, offload: bool) -> list:
    """`args` as a call lowers them: each on its planned sharding, or, with `offload` (arguments in
    host memory, placed by the program's own shardings) or no `shardings`, as shapes."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    if offload or shardings is None:
        return list(abstract(args))
    return list(jax.tree_util.tree_unflatten(tree, [
        jax.ShapeDtypeStruct(np.shape(x), dtype_of(x), sharding=s, weak_type=weak_type(x))
        for x, s in zip(leaves, jax.tree_util.tree_leaves(shardings))]))


def _unflattened(evaluate: Callable[..., Any], out_tree) -> Callable[..., Any]:
    """The traced jaxpr (run by `evaluate`) as a function of the original (pytree) arguments."""

    def run(*args):
        return jax.tree_util.tree_unflatten(out_tree, evaluate(*jax.tree_util.tree_leaves(args)))

    return run
