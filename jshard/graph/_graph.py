"""jaxpr → a flat list of operator nodes, with call-like sub-jaxprs inlined in place.

`pjit`, `closed_call`, `custom_jvp_call`, `custom_vjp_call` and `remat` bodies are inlined: their
variables are renamed to the outer ones, so a value keeps one identity across the boundary.
(Emission binds a `remat` equation again around its body's constraints, so the recompute stays.)
Loop and branch bodies (`scan`, `while`, `cond`) stay nested: the loop is one node, and its body's
equations follow it as nodes marked with the enclosing primitive.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

from jax.extend import core as jcore

from jshard._source import user_source

REMAT = frozenset({"remat", "remat2", "checkpoint"})
"""The primitives `jax.checkpoint` (and so `flax.linen.remat`, `nnx.remat`, `jshard.recompute`) leaves."""
INLINE = frozenset({"pjit", "jit", "call", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call"}) | REMAT
NESTED = frozenset({"scan", "while", "cond"})
RECOMPUTE_SCOPE = "jshard_recompute_"
"""The name scope `jshard.recompute` runs a function in, followed by its policy's name
(`jshard_recompute_selective`): how a `Plan` tells its operators from a bare `jax.checkpoint`'s."""
MANUAL = "shard_map"
"""The primitive a `jax.shard_map` region leaves in a jaxpr (its body, in per-device shapes, stays
inside its equation)."""
CONSTRAINT = "sharding_constraint"
"""The primitive `jax.lax.with_sharding_constraint` (and so `jshard.shard`) leaves in a jaxpr."""
JSHARD_SCOPE = "jshard_"
"""The prefix of the name scopes jshard's own constraints carry (`jshard_shard<k>`, `jshard_gather`);
a constraint without one is the model's own."""
PARAMETER_SCOPE = "parameter_plan"
"""The name scope (inside its `shard` call's) of the constraint a `parameter_plan` entry puts on a
parameter, numbered as the call's `Annotation.params` (`jshard_shard3/parameter_plan0`)."""
AUTO_LABEL = "auto"
"""A `jshard.recompute(policy="auto")` region's scope is `RECOMPUTE_SCOPE + AUTO_LABEL + "<k>_<policy>"`:
its number in the trace and the policy the search gave it (`"none"` too: scoped, not recomputed)."""
COMM_KEPT_LABEL = "_comm_kept"
"""Ends the scope label of a `jshard.recompute(..., mp_comm_recompute=False)` region
(`jshard_recompute_full_comm_kept`)."""


@dataclasses.dataclass(frozen=True)
class KeepComm:
    """A remat policy saving what `policy` saves (None: nothing, `jax.checkpoint`'s default) that
    marks its region as keeping the results of its collectives: MindSpore's
    `recompute(mp_comm_recompute=False)` (`jshard.recompute`). Emission gives the backward pass's
    run of such a region the values the forward pass's collectives made instead of making them again.

    Attributes:
      policy: the region's own policy.
    """

    policy: Callable[..., Any] | None

    def __call__(self, prim, *args, **params):
        return False if self.policy is None else self.policy(prim, *args, **params)

    def __repr__(self) -> str:
        return f"{remat_policy_name(self.policy)}, mp_comm_recompute=False"


@dataclasses.dataclass(slots=True, eq=False)
class Node:
    """One equation of the flattened program. Not frozen, as a value would be: a node is known by
    its identity, `flatten` makes one per equation (a frozen dataclass's `__init__`, each field set
    through `object.__setattr__`, took a third of flattening a 36,000-equation program), and nothing
    sets a field once `flatten` has made it and its `bodies`.

    Attributes:
      eqn: the jaxpr equation.
      inputs: its operands, renamed to outer variables (or literals).
      outputs: its results.
      inside: the enclosing loop or branch primitive (`"scan"`), or `""` at top level.
      scope: its name stack (`jvp(jshard_shard0)`), which ties it to `shard` annotations.
      source: `file:line (function)` of the user code that made it.
      weight: how many times it runs per call (the product of the enclosing scans' lengths).
      bodies: for a loop or branch, `(invars, outvars)` of each body, renamed like `inputs`.
      remat: inside a `remat` body (`jax.checkpoint`, `jshard.recompute`): its policy's name
        (`remat_policy_name`); `""` outside one. A remat body's scope is prefixed with the remat
        equation's, so that the recomputation in the backward pass counts as backward.
      loop: the index of the enclosing loop or branch node (the computation XLA compiles it in),
        -1 at top level.
      body: which of the enclosing node's `bodies` it belongs to (a `while`'s condition 0 and body
        1, a `cond`'s branches in order); 0 at top level.
      primitive: the equation's primitive's name (read once: every stage reads it per node).
    """

    eqn: jcore.JaxprEqn
    inputs: tuple
    outputs: tuple
    inside: str
    scope: str
    source: str
    weight: int = 1
    bodies: list = dataclasses.field(default_factory=list)
    remat: str = ""
    loop: int = -1
    body: int = 0
    primitive: str = dataclasses.field(init=False)

    def __post_init__(self):
        self.primitive = self.eqn.primitive.name

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
    for eqn, env_now, _, _, _ in _inlined(jaxpr, env, (), None, None):
        yield eqn, env_now


def _inlined(jaxpr: jcore.Jaxpr, env: dict, callers, remat, prefix) -> Iterator[tuple]:
    """`inline_equations`, each equation with the call equations it was inlined from (outermost
    first), its innermost enclosing remat equation (or None) and the name stack of the calls down to
    the equation (whose own name stack is relative to the innermost call), None at the top."""
    for eqn in jaxpr.eqns:
        sub = sub_jaxpr(eqn)
        if sub is None:
            yield eqn, env, callers, remat, prefix
            continue
        for v_in, v_out in zip(sub.invars, eqn.invars):
            env[v_in] = resolve(env, v_out)
        # An inner equation's name stack is relative to its call (a jitted `jnp.mod` inside a
        # `shard` call): the call's own stack goes before it, so the region's scope reaches it.
        inner = eqn.source_info.name_stack if prefix is None else prefix + eqn.source_info.name_stack
        yield from _inlined(sub, env, callers + (eqn,), eqn if eqn.primitive.name in REMAT else remat, inner)
        for v_out, v_in in zip(eqn.outvars, sub.outvars):
            env[v_out] = resolve(env, v_in)


def remat_policy_name(policy) -> str:
    """A remat equation's `policy` param in words: `"full"` (None: nothing saved, `jax.checkpoint`'s
    default), a policy function's name (`"nothing_saveable"`), or a policy object's repr
    (`"DotsSaveable(only_if_no_batch_dims=False)"`, what `jax.checkpoint_policies.dots_saveable` is)."""
    if policy is None:
        return "full"
    return getattr(policy, "__name__", None) or repr(policy)


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


_SUB_KEYS = frozenset({"jaxpr", "call_jaxpr", "fun_jaxpr", "cond_jaxpr", "body_jaxpr", "branches"})


def distinct_calls(closed: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """`closed` with each further occurrence of a sub-jaxpr copied with fresh variables.

    JAX caches the jaxpr of a jitted function (`jnp.take`'s `_take`, `jax.nn.softmax`) per
    abstract signature, so two calls of it hold one jaxpr object, and inlined in place its
    variables would stand for both calls' values at once. Every plan keys values by variable, so
    each call gets its own.
    """
    return jcore.ClosedJaxpr(_distinct(closed.jaxpr, set(), fresh=False), closed.consts)


def _distinct(jaxpr: jcore.Jaxpr, seen: set, fresh: bool) -> jcore.Jaxpr:
    env: dict = {}

    def new(v):
        if not fresh or isinstance(v, jcore.DropVar):
            return v
        env[v] = jcore.Var(v.aval)
        return env[v]

    def get(v):
        return env.get(v, v) if isinstance(v, jcore.Var) else v

    constvars, invars = [new(v) for v in jaxpr.constvars], [new(v) for v in jaxpr.invars]
    eqns, changed = [], fresh
    for eqn in jaxpr.eqns:
        if not fresh and _SUB_KEYS.isdisjoint(eqn.params):  # no sub-jaxpr to copy, no variable to rename
            eqns.append(eqn)
            continue
        params = {k: _distinct_param(v, seen) if k in _SUB_KEYS else v for k, v in eqn.params.items()}
        moved = any(params[k] is not eqn.params[k] for k in params)
        if fresh or moved:
            eqn = eqn.replace(invars=[get(v) for v in eqn.invars], outvars=[new(v) for v in eqn.outvars], params=params)
        changed = changed or moved
        eqns.append(eqn)
    if not changed:
        return jaxpr
    return jaxpr.replace(constvars=constvars, invars=invars, outvars=[get(v) for v in jaxpr.outvars], eqns=eqns)


def _distinct_param(value, seen: set):
    """A sub-jaxpr parameter (open, closed, or a tuple of branches) with `_distinct` applied."""
    if isinstance(value, tuple):
        out = tuple(_distinct_param(v, seen) for v in value)
        return value if all(a is b for a, b in zip(out, value)) else out
    inner = value.jaxpr if isinstance(value, jcore.ClosedJaxpr) else value
    if not isinstance(inner, jcore.Jaxpr):
        return value
    again = id(inner) in seen
    seen.add(id(inner))
    done = _distinct(inner, seen, fresh=again)
    if done is inner:
        return value
    return jcore.ClosedJaxpr(done, value.consts) if isinstance(value, jcore.ClosedJaxpr) else done


def flatten(jaxpr: jcore.Jaxpr) -> list[Node]:
    """Every equation of `jaxpr` as a `Node`, in program order, nested jaxprs flattened in place."""
    nodes: list[Node] = []
    _collect(jaxpr, {}, "", 1, nodes, {})
    return nodes


def _source(eqn, callers) -> str:
    """The user's line that made `eqn`; for one traced inside a library's call with no user frame of
    its own (a `custom_jvp` rule's body, as `jax.nn.relu`'s), the line of the innermost call that has
    one; with none anywhere, the library's line."""
    for e in (eqn, *reversed(callers)):
        source = user_source(e.source_info, strict=True)
        if source:
            return source
    return user_source(eqn.source_info)


def _scope(scopes: dict, prefix, stack) -> str:
    """`str(prefix + stack)` (`str(stack)` for no `prefix`), read once per pair of name-stack objects
    (`scopes` keeps them, so their ids stay theirs): the equations of one layer share theirs (a
    96-layer GPT's 36,382 hold 7,161, which read as 7 scopes)."""
    key = (id(prefix), id(stack))
    found = scopes.get(key)
    if found is None:
        found = scopes[key] = (prefix, stack, str(stack if prefix is None else prefix + stack))
    return found[2]


def _collect(jaxpr, env, inside, weight, nodes, scopes, outer=None, loop=-1, body=0):
    var = jcore.Var
    for eqn, env_now, callers, remat, prefix in _inlined(jaxpr, env, (), outer,
                                                         outer and outer.source_info.name_stack):
        get = env_now.get  # `resolve`, inlined: the loop is per equation
        node = Node(
            eqn,
            tuple([get(v, v) if isinstance(v, var) else v for v in eqn.invars]),
            tuple(eqn.outvars),
            inside,
            _scope(scopes, prefix, eqn.source_info.name_stack),
            _source(eqn, callers),
            weight,
            [],
            "" if remat is None else remat_policy_name(remat.params.get("policy")),
            loop,
            body,
        )
        nodes.append(node)
        if eqn.primitive.name in NESTED:
            inner, here = weight * eqn.params.get("length", 1), len(nodes) - 1
            for b, sub in enumerate(nested_jaxprs(eqn)):
                body_env: dict = {}
                _collect(sub, body_env, eqn.primitive.name, inner, nodes, scopes, remat, here, b)
                node.bodies.append((list(sub.invars), [resolve(body_env, v) for v in sub.outvars]))


def dead_nodes(nodes: Sequence[Node], outputs: Collection) -> set[int]:
    """The top-level operators no result of the program needs: a `jax.grad`'s primal loss, the
    count of maxima a `reduce_max`'s derivative makes and drops, and what only they use. XLA
    removes them, so nothing they would move is moved. A result a call returns is known outside
    the call by another variable (inlining maps it): a result nobody uses whose type is that of
    such a program result counts as needed. Operators inside loop and branch bodies, and those
    with effects, are never dead."""
    users: dict = {}  # var -> the nodes reading it (`operand_vars`' inputs)
    var = jcore.Var
    for i, node in enumerate(nodes):
        for v in operand_vars(node)[0] if node.bodies else node.inputs:
            if isinstance(v, var):
                found = users.get(v)
                if found is None:
                    users[v] = {i}
                else:
                    found.add(i)
    kept = {v for v in outputs if isinstance(v, var)}
    made = {v for node in nodes for v in node.outputs}
    returned = {v.aval for v in kept if v not in made}  # results of inlined calls, by type
    dead: set[int] = set()
    for i in range(len(nodes) - 1, -1, -1):
        node = nodes[i]
        if node.inside or node.eqn.effects or node.bodies:
            continue
        for v in node.outputs:  # dead where every result is unkept and read by dead nodes alone
            if v in kept:
                break
            readers = users.get(v)
            if readers is None:
                if v.aval in returned:  # read by nobody here: a result known outside by another variable
                    break
            elif not readers <= dead:
                break
        else:
            dead.add(i)
    return dead
