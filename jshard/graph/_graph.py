"""jaxpr → a flat list of operator nodes, with call-like sub-jaxprs inlined in place.

`pjit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call` and `remat` bodies are inlined: their
variables are renamed to the outer ones, so a value keeps one identity across the boundary.
(Emission binds a `remat` equation again around its body's constraints, so the recompute stays.)
Loop and branch bodies (`scan`, `while`, `cond`) stay nested: the loop is one node, and its body's
equations follow it as nodes marked with the enclosing primitive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

from jax.extend import core as jcore

from jshard._compat import source_info_util

REMAT = frozenset({"remat", "remat2", "checkpoint"})
"""The primitives `jax.checkpoint` (and so `flax.linen.remat`, `nnx.remat`, `jshard.recompute`) leaves."""
INLINE = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}) | REMAT
NESTED = frozenset({"scan", "while", "cond"})
CONSTRAINT = "sharding_constraint"
"""The primitive `jax.lax.with_sharding_constraint` (and so `jshard.shard`) leaves in a jaxpr."""
JSHARD_SCOPE = "jshard_"
"""The prefix of the name scopes jshard's own constraints carry (`jshard_shard<k>`, `jshard_gather`);
a constraint without one is the model's own."""


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class Node:
    """One equation of the flattened program.

    Attributes:
      eqn: the jaxpr equation.
      inputs: its operands, renamed to outer variables (or literals).
      outputs: its results.
      inside: the enclosing loop or branch primitive (`"scan"`), or `""` at top level.
      scope: its name stack (`jvp(jshard_shard0)`), which ties it to `shard` annotations.
      source: `file:line (function)` of the user code that made it.
      weight: how many times it runs per call (the product of the enclosing scans' lengths).
      bodies: for a loop or branch, `(invars, outvars)` of each body, renamed like `inputs`.
    """

    eqn: jcore.JaxprEqn
    inputs: tuple
    outputs: tuple
    inside: str
    scope: str
    source: str
    weight: int = 1
    bodies: list = dataclasses.field(default_factory=list)

    @property
    def primitive(self) -> str:
        return self.eqn.primitive.name

    @property
    def backward(self) -> bool:
        return "transpose(" in self.scope


def operand_vars(node: Node) -> tuple[list, list]:
    """The operator's inputs and outputs as the rules see them (bodies' results and parameters
    appended for loops and branches)."""
    ins, outs = list(node.inputs), list(node.outputs)
    for b_in, b_out in node.bodies:
        ins += b_out
        outs += b_in
    return ins, outs


def inline_equations(jaxpr: jcore.Jaxpr, env: dict) -> Iterator[tuple[jcore.JaxprEqn, dict]]:
    """Equations of `jaxpr` with call-like sub-jaxprs inlined; `env` maps inner vars to outer ones."""
    for eqn in jaxpr.eqns:
        sub = sub_jaxpr(eqn)
        if sub is None:
            yield eqn, env
            continue
        for v_in, v_out in zip(sub.invars, eqn.invars):
            env[v_in] = resolve(env, v_out)
        yield from inline_equations(sub, env)
        for v_out, v_in in zip(eqn.outvars, sub.outvars):
            env[v_out] = resolve(env, v_in)


def resolve(env: dict, v):
    """The outer identity of `v` (literals stand for themselves)."""
    return env.get(v, v) if isinstance(v, jcore.Var) else v


def sub_jaxpr(eqn: jcore.JaxprEqn) -> jcore.Jaxpr | None:
    """The body of a call-like equation, to inline; None for every other equation."""
    if eqn.primitive.name not in INLINE:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        if key in eqn.params:
            sub = eqn.params[key]
            return sub.jaxpr if hasattr(sub, "jaxpr") else sub
    return None


def nested_jaxprs(eqn: jcore.JaxprEqn) -> list[jcore.Jaxpr]:
    """Bodies of a loop or branch equation (scan body, while cond+body, cond branches)."""
    params = eqn.params
    found = [params[k] for k in ("jaxpr", "cond_jaxpr", "body_jaxpr") if k in params]
    found += list(params.get("branches", ()))
    return [j.jaxpr if hasattr(j, "jaxpr") else j for j in found]


def flatten(jaxpr: jcore.Jaxpr) -> list[Node]:
    """Every equation of `jaxpr` as a `Node`, in program order, nested jaxprs flattened in place."""
    nodes: list[Node] = []
    _collect(jaxpr, {}, "", 1, nodes)
    return nodes


def _collect(jaxpr, env, inside, weight, nodes):
    for eqn, env_now in inline_equations(jaxpr, env):
        info = eqn.source_info
        node = Node(
            eqn,
            tuple(resolve(env_now, v) for v in eqn.invars),
            tuple(eqn.outvars),
            inside,
            str(info.name_stack),
            source_info_util.summarize(info),
            weight,
        )
        nodes.append(node)
        if eqn.primitive.name in NESTED:
            inner = weight * eqn.params.get("length", 1)
            for body in nested_jaxprs(eqn):
                body_env: dict = {}
                _collect(body, body_env, eqn.primitive.name, inner, nodes)
                node.bodies.append((list(body.invars), [resolve(body_env, v) for v in body.outvars]))
