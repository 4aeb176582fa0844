"""Zero bubble's split backward for a cut stage: its pullback cut into `B` and `W` at the equations.

ZB-H1 (`Schedule.split_backward`) runs a stage's backward in two ticks: `B`, the gradient of the
stage's inputs (the previous stage waits for it), and `W`, the gradient of its parameters (nobody
waits for it). The stacked form (`_engine.py`) runs the whole pullback at both ticks and lets XLA
drop the unused half, so `W` computes again every gradient of an intermediate activation its
parameters' gradients read: a stage of `L` layers repeats `L - 1` layers' input-gradient products.

Here the pullback is traced once to a jaxpr (`bwd(params, residuals, cotangents) -> (g_params,
g_inputs)`, calls inlined) and its equations are split: `B` runs the equations the input gradients
need; `W` runs the rest of what the parameter gradients need, reading the pullback's inputs again
(the residuals and the received gradient stay in their slots until the `W`) and the values `B`
made that it reads (`handoff`: mostly the gradients of the outputs of the stage's matmuls, which
`B` stores for the `W`). Every equation runs once: the split costs the handoff's memory, from the
`B` to the `W`, and no compute; `weight_reads` says which of the pullback's arguments the `W` reads,
so the staged program stores the handoff where the residuals only `B` read were (`_staged.py`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend import core as jcore
from jax.sharding import PartitionSpec as P

from jshard.graph import inline_equations, resolve
from jshard.pipeline._inner import propagated


@dataclasses.dataclass(frozen=True, eq=False)
class _Eqn:
    eqn: Any
    inputs: tuple
    outputs: tuple


@dataclasses.dataclass(frozen=True, eq=False)
class SplitBackward:
    """A pullback's equations split into the input-gradient part (`B`) and the parameter-gradient
    part (`W`) (see the module docstring).

    Attributes:
      handoff: the shapes and dtypes of the values `B` makes and `W` reads, in order.
      weight_reads: per leaf of the pullback's arguments (flat, in order), whether `W` reads it
        (`weight_grad` may be given anything of its shape for the others).

    Examples:
      >>> import jax.numpy as jnp
      >>> def bwd(w, x, g):  # the pullback of y = tanh(x @ w) @ w at cotangent g
      ...     return jax.vjp(lambda w, x: jnp.tanh(x @ w) @ w, w, x)[1](g)
      >>> w, x = jnp.eye(2) / 2, jnp.ones((3, 2))
      >>> split = SplitBackward.of(bwd, (w, x, jnp.ones((3, 2))), n_params=1)
      >>> g_x, handoff = split.input_grad([w, x, jnp.ones((3, 2))])
      >>> g_w = split.weight_grad([w, x, jnp.ones((3, 2))], handoff)
      >>> ref_w, ref_x = bwd(w, x, jnp.ones((3, 2)))
      >>> bool(jnp.allclose(g_x[0], ref_x)), bool(jnp.allclose(g_w[0], ref_w))
      (True, True)
    """

    _jaxpr: Any
    _consts: dict
    _b: tuple[_Eqn, ...]
    _w: tuple[_Eqn, ...]
    _b_outs: tuple
    _w_outs: tuple
    _handoff: tuple
    handoff: tuple[jax.ShapeDtypeStruct, ...]
    weight_reads: tuple[bool, ...]

    @classmethod
    def of(cls, bwd: Callable, args: Sequence[Any], n_params: int) -> SplitBackward:
        """Traces `bwd(*args)` (returning `(g_params, g_inputs)`, `n_params` leaves first) and splits it."""
        closed = jax.make_jaxpr(bwd)(*args)
        jaxpr = closed.jaxpr
        env: dict = {}
        eqns = [_Eqn(e, tuple(resolve(env_now, v) for v in e.invars), tuple(e.outvars))
                for e, env_now in inline_equations(jaxpr, env)]
        outs = [resolve(env, v) for v in jaxpr.outvars]
        b_outs, w_outs = tuple(outs[n_params:]), tuple(outs[:n_params])
        b = _needed(eqns, b_outs, set())
        made_in_b = {v for e in b for v in e.outputs}
        w = _needed(eqns, w_outs, {id(e) for e in b})
        read_by_w = [v for e in w for v in e.inputs] + list(w_outs)
        handoff = tuple(dict.fromkeys(v for v in read_by_w if isinstance(v, jcore.Var) and v in made_in_b))
        read = {v for v in read_by_w if isinstance(v, jcore.Var)}
        return cls(jaxpr, dict(zip(jaxpr.constvars, closed.consts)), tuple(b), tuple(w),
                   b_outs, w_outs, handoff,
                   tuple(jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in handoff),
                   tuple(v in read for v in jaxpr.invars))

    def handoff_specs(self, arg_specs: Sequence[P | None], axis_sizes: dict[str, int]) -> list[P | None]:
        """The layouts of the handoff's values over the stage's automatic axes (`axis_sizes`), from
        those of the pullback's arguments (`arg_specs`, flat; None: whole), propagated over its
        equations (`propagated`)."""
        return propagated(self._jaxpr, arg_specs, self._handoff, axis_sizes)

    def input_grad(self, args: Sequence[Any]) -> tuple[list, list]:
        """`B`: `(g_inputs, handoff values)` from the pullback's arguments."""
        env = _run(self._b, self._start(args))
        return [_read(env, v) for v in self._b_outs], [env[v] for v in self._handoff]

    def weight_grad(self, args: Sequence[Any], handoff: Sequence[Any]) -> list:
        """`W`: the parameters' gradients from the pullback's arguments and `B`'s handoff."""
        env = self._start(args)
        env.update(zip(self._handoff, handoff))
        return [_read(_run(self._w, env), v) for v in self._w_outs]

    def _start(self, args) -> dict:
        env = dict(self._consts)
        env.update(zip(self._jaxpr.invars, jax.tree.leaves(list(args))))
        return env


def _needed(eqns: list[_Eqn], outs, skip: set[int]) -> list[_Eqn]:
    """The equations (not in `skip`) that `outs` depend on, in program order."""
    live, kept = {v for v in outs if isinstance(v, jcore.Var)}, []
    for e in reversed(eqns):
        if id(e) not in skip and any(v in live for v in e.outputs):
            kept.append(e)
            live.update(v for v in e.inputs if isinstance(v, jcore.Var))
    return kept[::-1]


def _read(env: dict, v):
    return v.val if isinstance(v, jcore.Literal) else env[v]


def _run(eqns: Sequence[_Eqn], env: dict) -> dict:
    for e in eqns:
        params = e.eqn.primitive.get_bind_params(e.eqn.params)
        out = e.eqn.primitive.bind(*(_read(env, v) for v in e.inputs), **params)
        env.update(zip(e.outputs, out if e.eqn.primitive.multiple_results else [out]))
    return env
