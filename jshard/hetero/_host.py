"""`jshard.on_host`: an operator run on the host inside the compiled step (MindSpore's
`primitive_target="CPU"`).

The function runs under `compute_on("device_host")`: XLA runs its operators on the host of each
device, on that device's data. Its operands are moved to host memory first, so that a table kept
in host memory (`parallelize(..., offload=("parameters",))`) is read where it lies and only the
looked-up rows cross to the device. Its results are moved to device memory.

The backward pass runs on the host too (a `custom_vjp`): JAX's transpose of a host-memory value
makes device-memory zeros, so the backward takes its operands in device memory; a primal operand
whose value the backward does not read (a table under a lookup) is not moved, as XLA drops the
unused copy. Each cotangent goes back to its operand's memory.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import jax
from jax.experimental.compute_on import compute_on

from jshard._errors import ShardingError, api_boundary
from jshard._format import var_str
from jshard.graph import flatten

HOST_COMPUTE = "device_host"
"""The `compute_on` compute type of the host attached to each device."""

COLLECTIVES = frozenset({
    "psum", "psum2", "psum_invariant", "pmax", "pmin", "pmean", "ppermute", "pbroadcast", "all_gather",
    "all_gather_invariant", "all_to_all", "reduce_scatter", "psum_scatter", "axis_index", "pgather",
    "sharding_constraint", "shard_map", "ragged_all_to_all",
})
"""Primitives that talk to other devices (or lay values out over them): a host operator, which runs
on one device's host on that device's data, cannot run them."""


@api_boundary
def on_host(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run on the host inside the same compiled step (MindSpore's `primitive_target="CPU"`);
    usable as a decorator.

    Its operands are moved to host memory and its results back to device memory as needed; it works
    under `jax.grad` (the backward runs on the host too) and inside `jax.jit` and `parallelize`. The
    canonical use is an embedding lookup whose table is kept in host memory.

    Args:
      fn: a function of arrays (pytrees) that runs on one device's data: no collectives, no
        `jshard.shard` or sharding constraints inside.

    Returns:
      A function called as `fn` is.

    Raises:
      ShardingError: (when called) `fn` runs a collective or a sharding constraint.

    Examples:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> lookup = js.on_host(lambda table, ids: table[ids])
      >>> table, ids = jnp.arange(12.0).reshape(6, 2), jnp.array([1, 4])
      >>> lookup(table, ids)
      Array([[2., 3.],
             [8., 9.]], dtype=float32)
      >>> jax.grad(lambda t: lookup(t, ids).sum())(table)[:, 0]
      Array([0., 1., 0., 0., 1., 0.], dtype=float32)
    """
    return host_function(fn, jax.memory.Space.Device)


def _host_compute(fn: Callable[..., Any], results: Any) -> Callable[..., Any]:
    """`fn` under `compute_on("device_host")`, its results in memory `results` (where its operands
    lie). JAX 0.11 asks for the results' memory (`out_memory_spaces`); 0.10 takes the compute type
    alone, as a context manager."""
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        keywords: Any = compute_on  # typed as JAX 0.10's (compute_type) alone
        return keywords(fn, compute_type=HOST_COMPUTE, out_memory_spaces=results)
    return compute_on(HOST_COMPUTE)(fn)


def host_function(fn: Callable[..., Any], results_in: jax.memory.Space) -> Callable[..., Any]:
    """`on_host(fn)` with its results left in memory `results_in` (`Space.Host`: a table updated on
    the host stays there)."""
    name = getattr(fn, "__name__", type(fn).__name__)
    call = f"jshard.on_host({name})"
    forward = _host_compute(jax.jit(fn), jax.memory.Space.Host)
    backward = _host_compute(jax.jit(lambda args, ct: jax.vjp(fn, *args)[1](ct)), jax.memory.Space.Device)

    @jax.custom_vjp
    def run(*args):
        return _to(forward(*_to(args, jax.memory.Space.Host)), results_in)

    def run_fwd(*args):
        return run(*args), args

    def run_bwd(args, ct):
        cts = backward(_to(args, jax.memory.Space.Device), _to(ct, jax.memory.Space.Device))
        return tuple(jax.tree.map(lambda c, a: jax.device_put(c, jax.typeof(a).memory_space), cts, args))

    run.defvjp(run_fwd, run_bwd)

    @functools.wraps(fn)
    def checked(*args):
        _check_host(fn, args, call)
        return run(*args)

    return checked


def host_operators(hlo: str) -> tuple[str, ...]:
    """The HLO operations of `hlo` (a module's text) marked to run on the host, by opcode.

    Read it from `lowered.as_text(dialect="hlo")`: XLA:CPU fuses the marked operations into
    device kernels and drops the mark from the compiled text (its host and device are one).

    Examples:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> lookup = js.on_host(lambda table, ids: table[ids])
      >>> text = jax.jit(lookup).lower(jnp.ones((6, 2)), jnp.array([1, 4])).as_text(dialect="hlo")
      >>> "gather" in js.hetero.host_operators(text)
      True
    """
    found = []
    for line in hlo.splitlines():
        if '_xla_compute_type="host"' in line and " = " in line:
            found.append(_OPCODE.search(line.split(" = ", 1)[1]).group(1))
    return tuple(found)


_OPCODE = re.compile(r"\s([a-z][\w-]*)\(")
"""The opcode in an HLO instruction's right-hand side: `f32[16,8]{1,0} gather(...)`."""


def _to(tree: Any, space: jax.memory.Space) -> Any:
    """Every array leaf of `tree` in memory `space` (left as it is where it already lies there)."""
    return jax.tree.map(lambda x: x if jax.typeof(x).memory_space == space else jax.device_put(x, space), tree)


def _check_host(fn: Callable[..., Any], args: tuple, call: str) -> None:
    """Raises `ShardingError` where `fn` runs an operator a host cannot (a collective)."""
    closed = jax.make_jaxpr(lambda *xs: fn(*_to(xs, jax.memory.Space.Host)))(*args)  # as `run` calls it
    bad = [node for node in flatten(closed.jaxpr) if node.primitive in COLLECTIVES]
    if bad:
        raise ShardingError(_collective_error(call, bad[0]))


def _collective_error(call: str, node) -> str:
    on = ", ".join(var_str(v) for v in node.inputs)
    return (f"{call}: the host function runs {node.primitive} on {on} ({node.source}), which talks to other devices "
            f"or lays values out over them; a host operator runs on each device's host on that device's data "
            f"alone. Call {node.primitive} outside the host function (on its operands or results), or drop "
            f"jshard.on_host.")
