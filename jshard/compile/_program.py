"""The program stage: emission (the traced jaxpr re-run with the plan's constraints), `jax.jit`
with the planned argument and result shardings, and the `Plan` that records it all."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore
from jax.sharding import NamedSharding, PartitionSpec

from jshard.compile._options import Options
from jshard.compile._planners import Planned
from jshard.compile._signature import abstract
from jshard.compile._trace import Traced
from jshard.layouts import replicated, to_pspec
from jshard.plan import Plan, build_ops
from jshard.propagate import emission_of, emit


@dataclasses.dataclass(frozen=True)
class Program:
    """One compiled signature: its `Plan`, the jitted program (None on an abstract mesh: plan
    only) and the argument shardings (a pytree like the arguments) calls place their inputs on."""

    plan: Plan
    jitted: Any
    in_shardings: Any


def build_program(traced: Traced, planned: Planned, in_sh: Sequence, out_sh: Sequence, devices: list | None,
                  options: Options, args: tuple) -> Program:
    """The jitted program and its `Plan` for one planning answer (`planned.result` None: XLA
    propagates from the anchors)."""
    result, mesh = planned.result, traced.mesh
    evaluate = jcore.jaxpr_as_fun(traced.closed)
    if result is not None:
        in_sh = [sh or NamedSharding(mesh, to_pspec(result.values.get(v, replicated(np.ndim(x)))))
                 for v, sh, x in zip(traced.invars, in_sh, traced.leaves)]
        out_sh = [sh if sh is not None or v not in result.values else NamedSharding(mesh, to_pspec(result.values[v]))
                  for v, sh in zip(traced.outvars, out_sh)]
        if set(mesh.explicit_axes) != set(mesh.axis_names):  # on Explicit axes only, the types say it all
            evaluate = emit(traced.closed, emission_of(traced.nodes, result), mesh)
    in_sh = [sh or NamedSharding(mesh, PartitionSpec()) for sh in in_sh]
    in_tree = jax.tree_util.tree_unflatten(traced.treedef, in_sh)
    out_tree = jax.tree_util.tree_unflatten(traced.out_tree, out_sh)
    jitted = None
    if devices is not None:
        jitted = jax.jit(_unflattened(evaluate, traced.out_tree), in_shardings=in_tree, out_shardings=out_tree,
                         donate_argnums=options.donate_argnums)
    ops = build_ops(traced.nodes, traced.ctx.annotations, traced.fine, result)
    plan = Plan(mesh, traced.fine, options.mode, ops, tuple(sh.spec for sh in in_sh),
                tuple(None if sh is None else sh.spec for sh in out_sh), traced.treedef, traced.out_tree,
                tuple(traced.ctx.annotations), "xla" if result is None else "jshard", jitted and functools.partial(jitted.lower, *abstract(args, in_tree)),
                search=planned.report)
    return Program(plan, jitted, in_tree)


def compiled_peak(jitted: Any, args: tuple, shardings: Any = None) -> float:
    """Per-device bytes the compiled program holds at once (arguments + results + temporaries -
    donated), as XLA's buffer assignment reports them."""
    m = jitted.lower(*abstract(args, shardings)).compile().memory_analysis()
    return float(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes)


def _unflattened(evaluate: Callable[..., Any], out_tree) -> Callable[..., Any]:
    """The traced jaxpr (run by `evaluate`) as a function of the original (pytree) arguments."""

    def run(*args):
        return jax.tree_util.tree_unflatten(out_tree, evaluate(*jax.tree_util.tree_leaves(args)))

    return run
