"""Emission: the traced jaxpr re-run with sharding constraints where the plan needs them.

Not every value is constrained: XLA's own propagation carries a layout through an operator of one
input whose dims all pass through (unary elementwise, transpose, a scalar broadcast). jshard
constrains every other output the plan fixes (where inputs meet, a dim must be whole, partial sums
are left, a reshape or a new factor appears), and, where an operator must receive an input in
another layout than it was made in (a redistribution), both that input and the value where it is
made. Call-like equations (`pjit`, `custom_jvp_call`, ...) are inlined where a constraint falls
inside them; loop and branch bodies are rebuilt with theirs, and so are `remat` bodies
(`jax.checkpoint`, `jshard.recompute`): the remat equation is bound again with its policy,
`prevent_cse` and `differentiated` params, so the program recomputes what `jax.jit` would (inlined,
XLA would merge the recomputed forward pass with the first and keep its values). The backward
pass's run of a remat whose policy is a `KeepComm` (`jshard.recompute(..., mp_comm_recompute=False)`)
takes, for each value a collective makes in it, the value the forward pass's run made (found by
matching equations on their inputs from the remat's operands on), so it communicates no more.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

import jax
from jax.extend import core as jcore
from jax.sharding import Mesh, NamedSharding

from jshard._compat import linear_util as lu
from jshard._compat import partial_eval as pe
from jshard._compat import source_info_util
from jshard._errors import ShardingError
from jshard._source import user_source
from jshard.cost import array_of, redistribution, stages
from jshard.graph import CONSTRAINT, INLINE, NESTED, REMAT, KeepComm, Node, operand_vars
from jshard.layouts import Spec, place, to_pspec, typed_spec
from jshard.propagate._result import Result
from jshard.rules import PER_DEVICE

_BODY_KEYS = ("jaxpr", "cond_jaxpr", "body_jaxpr")


@dataclasses.dataclass(frozen=True)
class Emission:
    """Where to constrain: `outputs` maps a value to its layout, right after it is made;
    `inputs` maps `(id(eqn), operand index)` to the layouts the equation's operand passes through,
    the last the one it must receive (operand indices past the equation's own inputs are its
    bodies' results, as in `operand_vars`); `replaced` maps `id(eqn)` to a function of the
    equation's inputs that computes its outputs in its stead, laid out as it lays them out (no
    output constraint follows: e.g. a gradient reduce-scattered in a `shard_map`);
    `communicated` holds the values (and `inputs` keys) a collective makes there: a
    redistribution, partial sums summed, a model constraint's move; `per_device` maps `id(eqn)` to
    the input and output layouts an equation XLA's partitioner would gather whole
    (`jshard.rules.PER_DEVICE`) runs in, on each device's slices, in a `shard_map` manual over the
    axes that cut them."""

    outputs: Mapping
    inputs: Mapping
    replaced: Mapping = dataclasses.field(default_factory=dict)
    communicated: frozenset = frozenset()
    per_device: Mapping = dataclasses.field(default_factory=dict)


EMPTY = Emission({}, {})
"""No constraints: the program as traced (for a `Rewrite` alone)."""

Rewrite = Callable[[], Callable[[int, jcore.JaxprEqn, list, Callable], list]]
"""A rewrite of the top-level program: called once per run (each trace of the emitted function),
it gives `(index, eqn, ins, read) -> ins`, the values a top-level equation takes in place of `ins`
(`read(var)` gives any value made before it)."""


class _Interpreter:
    def __init__(self, emission: Emission, mesh: Mesh, rewrite: Rewrite | None = None):
        self.emission, self.mesh, self.rewrite = emission, mesh, rewrite
        self._touched: dict[int, bool] = {}
        self._scopes: list[tuple[jcore.Jaxpr, dict]] = []  # the jaxprs being run, innermost last
        self._received: dict = {}  # (id(eqn), k) -> the operand a collective made for it, as run

    def constrain(self, x, spec: Spec):
        return place(x, NamedSharding(self.mesh, to_pspec(spec)))

    def run(self, jaxpr: jcore.Jaxpr, consts, args, top: bool = False, kept: Mapping | None = None) -> list:
        """`jaxpr` run under its constraints; `kept` maps values (and `(id(eqn), k)` operands) to
        what they are instead of made (`_kept`)."""
        rewrite = self.rewrite() if top and self.rewrite is not None else None
        kept = kept or {}
        env: dict = {}
        read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
        for v, x in zip(jaxpr.constvars, consts):
            env[v] = x
        for v, x in zip(jaxpr.invars, args):
            env[v] = x
        self._scopes.append((jaxpr, env))
        try:
            for t, eqn in enumerate(jaxpr.eqns):
                if eqn.outvars and all(v in kept for v in eqn.outvars):
                    outs = [kept[v] for v in eqn.outvars]
                else:
                    ins = [read(v) for v in eqn.invars]
                    if rewrite is not None:
                        ins = rewrite(t, eqn, ins, read)
                    ins = [kept.get((id(eqn), k)) if (id(eqn), k) in kept else self._in(eqn, k, x)
                           for k, x in enumerate(ins)]
                    replaced = self.emission.replaced.get(id(eqn))
                    if replaced is not None:
                        env.update(zip(eqn.outvars, replaced(ins)))
                        continue
                    local = self.emission.per_device.get(id(eqn))
                    outs = self._eqn(eqn, ins) if local is None else self._per_device(eqn, ins, *local)
                for v, x in zip(eqn.outvars, outs):
                    env[v] = self._out(v, x)
        finally:
            self._scopes.pop()
        return [read(v) for v in jaxpr.outvars]

    def _in(self, eqn, k, x):
        for spec in self.emission.inputs.get((id(eqn), k), ()):
            x = self.constrain(x, spec)
        if (id(eqn), k) in self.emission.communicated:
            self._received[(id(eqn), k)] = x
        return x

    def _out(self, v, x):
        spec = self.emission.outputs.get(v)
        return x if spec is None else self.constrain(x, spec)

    def _eqn(self, eqn, ins) -> list:
        name = eqn.primitive.name
        if name in REMAT and (self._touches(eqn) or _keeps(eqn)):
            return self._remat(eqn, ins)
        if name in INLINE and self._touches(eqn):
            sub = _closed(eqn)
            return self.run(sub.jaxpr, sub.consts, ins)
        params = eqn.params
        if name in NESTED and self._touches(eqn):
            params = self._rebuilt(eqn)
        return _bind(eqn, params, ins)

    def _per_device(self, eqn, ins, in_specs, out_specs) -> list:
        """`eqn` run on each device's slices of `ins` (laid out as `in_specs`), in a `shard_map`
        manual over the axes that cut them: the cuts its rule lets through, no collective."""
        axes = frozenset(a for spec in in_specs for dim in spec for a in dim)
        mapped = jax.shard_map(lambda *xs: _bind(eqn, eqn.params, xs), mesh=self.mesh,
                               in_specs=tuple(map(to_pspec, in_specs)), out_specs=list(map(to_pspec, out_specs)),
                               axis_names=axes)
        return list(mapped(*ins))

    def _remat(self, eqn, ins) -> list:
        """The remat equation bound again, its body re-run under its constraints, its params kept."""
        body = _closed(eqn)
        kept = self._kept(eqn, body.jaxpr) if _keeps(eqn) else None
        rebuilt = _retraced(lambda *args: self.run(body.jaxpr, body.consts, args, kept=kept), body)
        jaxpr = pe.convert_constvars_jaxpr(rebuilt.jaxpr)  # as jax.checkpoint binds: consts first
        return _bind(eqn, {**eqn.params, "jaxpr": jaxpr}, [*rebuilt.consts, *ins])

    def _touches(self, eqn) -> bool:
        """Whether a constraint falls inside this equation's sub-jaxprs."""
        key = id(eqn)
        if key not in self._touched:
            self._touched[key] = False
            bodies = [_closed(eqn).jaxpr] if eqn.primitive.name in INLINE else [j.jaxpr for j in _nested_closed(eqn)]
            constrained = {k[0] for k in self.emission.inputs} | set(self.emission.replaced) | set(self.emission.per_device)
            self._touched[key] = key in constrained or any(
                id(e) in constrained or any(v in self.emission.outputs for v in e.outvars) or (e.primitive.name in INLINE | NESTED and self._touches(e))
                for body in bodies
                for e in body.eqns
            )
        return self._touched[key]

    def _kept(self, eqn, body: jcore.Jaxpr) -> dict:
        """For a remat keeping its collectives' results: each value (or operand) a collective makes
        in its body -> the value the enclosing program made for it already (its forward pass's run
        of the region). A body equation is that program's equation of the same primitive and params
        on the same values, the remat's operands standing for its body's inputs."""
        jaxpr, env = self._scopes[-1]
        made, same = _numbered(jaxpr.eqns[: next(t for t, e in enumerate(jaxpr.eqns) if e is eqn)])
        same = {**same, **{b: same.get(o, o) for b, o in zip(body.invars, eqn.invars)}}
        kept: dict = {}
        matched = False
        for e in body.eqns:
            ins = [same.get(v) if isinstance(v, jcore.Var) else v for v in e.invars]
            if any(v is None for v in ins):
                continue
            twin = _twin(made, e, ins)
            if twin is None:
                continue
            matched = True
            same.update(zip(e.outvars, twin.outvars))
            kept.update({v: env[w] for v, w in zip(e.outvars, twin.outvars) if v in self.emission.communicated and w in env})
            kept.update({(id(e), k): self._received[(id(twin), k)] for k in range(len(e.invars))
                         if (id(e), k) in self.emission.communicated and (id(twin), k) in self._received})
        made_here = [e for e in body.eqns if any(v in self.emission.communicated for v in e.outvars)]
        if not matched and made_here:
            raise ShardingError(_unkept_error(user_source(made_here[0].source_info)))
        return kept

    def _rebuilt(self, eqn) -> dict:
        """The loop's or branch's params with every body re-run under its constraints."""
        params = dict(eqn.params)
        offset = len(eqn.invars)
        new = []
        for body in _nested_closed(eqn):
            start = offset
            offset += len(body.jaxpr.outvars)
            new.append(self._rebuild(eqn, body, start))
        if "branches" in params:
            params["branches"] = tuple(new)
        else:
            for key, body in zip([k for k in _BODY_KEYS if k in params], new):
                params[key] = body
        return params

    def _rebuild(self, eqn, body: jcore.ClosedJaxpr, start: int) -> jcore.ClosedJaxpr:
        def fn(*args):
            outs = self.run(body.jaxpr, body.consts, args)
            return [self._in(eqn, start + k, x) for k, x in enumerate(outs)]

        return _retraced(fn, body)


def _keeps(eqn) -> bool:
    """Whether `eqn` is the backward pass's run of a remat keeping its collectives' results (a
    forward-only run, not differentiated, has nothing to keep)."""
    return isinstance(eqn.params.get("policy"), KeepComm) and bool(eqn.params.get("differentiated"))


def _unkept_error(source: str) -> str:
    return (f"jshard.recompute(..., mp_comm_recompute=False): the backward pass runs the region at {source} again "
            f"where its forward pass's values are out of reach (in another loop: a lax.scan over layers runs the "
            f"forward and the backward pass in two scans), so the results of its collectives cannot be kept. Call "
            f"the layers in a Python loop, or use mp_comm_recompute=True (the collectives run again).")


def _key(v):
    """A value as `_kept` matches equations' inputs: a variable itself, a literal by its value."""
    return v if isinstance(v, jcore.Var) else ("literal", str(v))


def _numbered(eqns) -> tuple[dict, dict]:
    """Value numbering of `eqns`: `(primitive, *inputs) -> [equations]`, each the first of the
    equations alike on the same values, and each value -> the one made first of those alike."""
    made: dict = {}
    same: dict = {}
    for e in eqns:
        ins = [same.get(v, v) if isinstance(v, jcore.Var) else v for v in e.invars]
        twin = _twin(made, e, ins)
        if twin is None:
            made.setdefault((e.primitive, *map(_key, ins)), []).append(e)
        else:
            same.update(zip(e.outvars, twin.outvars))
    return made, same


def _twin(made: dict, e: jcore.JaxprEqn, ins: list):
    """The equation of `made` that makes what `e` makes on `ins` (effect-free), or None."""
    if e.effects:
        return None
    return next((f for f in made.get((e.primitive, *map(_key, ins)), ()) if _same_params(e, f)), None)


def _same_params(a: jcore.JaxprEqn, b: jcore.JaxprEqn) -> bool:
    try:
        return bool(a.params == b.params)
    except (TypeError, ValueError):  # params holding arrays: not comparable, so not known to be the same
        return False


def _retraced(fn: Callable[..., list], body: jcore.ClosedJaxpr) -> jcore.ClosedJaxpr:
    """`fn` traced on the avals of `body`'s inputs."""
    traced = lu.wrap_init(fn, debug_info=body.jaxpr.debug_info)
    jaxpr, _, consts = pe.trace_to_jaxpr_dynamic(traced, [v.aval for v in body.jaxpr.invars])
    return jcore.ClosedJaxpr(jaxpr, consts)


def _bind(eqn, params: dict, ins) -> list:
    """`eqn`'s primitive bound to `ins` with `params`, under the equation's source line and context."""
    bind_params = eqn.primitive.get_bind_params(params)
    name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
    with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
        out = eqn.primitive.bind(*ins, **bind_params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _closed(eqn) -> jcore.ClosedJaxpr:
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            return sub if isinstance(sub, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(sub, ())
    raise ValueError(f"no sub-jaxpr in {eqn.primitive.name}")


def _nested_closed(eqn) -> list[jcore.ClosedJaxpr]:
    params = eqn.params
    found = [params[k] for k in _BODY_KEYS if k in params] + list(params.get("branches", ()))
    return [j if isinstance(j, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(j, ()) for j in found]


def emit(closed: jcore.ClosedJaxpr, emission: Emission, mesh: Mesh, rewrite: Rewrite | None = None) -> Callable[..., list]:
    """A function of the jaxpr's flat inputs that runs it with `emission`'s constraints (and
    `rewrite`'s values in the top-level equations' inputs)."""
    interpreter = _Interpreter(emission, mesh, rewrite)

    def run(*args):
        return interpreter.run(closed.jaxpr, closed.consts, args, top=True)

    return run


def emission_of(nodes: Sequence[Node], result: Result, axis_size: Mapping[str, int], alltoall: bool = True) -> Emission:  # noqa: C901  (one pass over the operators, each kind of constraint in its branch)
    """The constraints that make XLA follow `result`: outputs whose layout is a choice (not
    implied by the inputs), and inputs an operator receives in another layout than they were made
    (with the value pinned where it is made too), in the `stages` the cost model prices; a `shard`
    call's own constraint is reached through the same stages (without `alltoall`, a move that would
    be an all-to-all goes through its gathered layout: `jshard.cost.gathered_layout`). A value whose
    type fixes its layout (`Explicit` mesh axes) is never constrained: its type already says, and
    JAX's own `reshard`s move it."""
    outputs, inputs, communicated, per_device = {}, {}, set(), {}
    moves = lambda v, dst: bool(redistribution(*array_of(v), result.values[v], dst, axis_size, alltoall))
    for i, d in result.decisions.items():
        node = nodes[i]
        if node.primitive == CONSTRAINT:
            v = node.inputs[0]
            if isinstance(v, jcore.Var) and v in result.values and typed_spec(v.aval) is None:
                if moves(v, d.out_specs[0]):  # its route's stages: below
                    communicated.add(node.outputs[0])
            continue
        if node.primitive in PER_DEVICE and any(dim for spec in d.in_specs for dim in spec):
            per_device[id(node.eqn)] = (d.in_specs, d.out_specs)
        if not d.implied:
            reduced = any(c.kind in _REDUCTIONS for c in d.comms)
            for v, spec in zip(node.outputs, d.out_specs):
                if result.values.get(v) == spec and typed_spec(v.aval) is None:
                    outputs[v] = spec
                    if reduced:
                        communicated.add(v)
        ins, _ = operand_vars(node)
        for k, v in enumerate(ins):
            if (isinstance(v, jcore.Var) and v in result.values and result.values[v] != d.in_specs[k]
                    and typed_spec(v.aval) is None):
                inputs[(id(node.eqn), k)] = tuple(stages(result.values[v], d.in_specs[k], axis_size, alltoall))
                outputs[v] = result.values[v]  # pin the value where it is made, or XLA may move the cut upstream
                if moves(v, d.in_specs[k]):
                    communicated.add((id(node.eqn), k))
    for node in nodes:  # a `shard` call's input arriving in another layout: through the stages too
        v = node.inputs[0] if node.primitive == CONSTRAINT else None
        if not isinstance(v, jcore.Var) or v not in result.values or typed_spec(v.aval) is not None:
            continue
        src, dst = result.values[v], result.values.get(node.outputs[0])
        route = stages(src, dst, axis_size, alltoall) if dst is not None else []
        if len(route) > 1:
            inputs[(id(node.eqn), 0)] = tuple(route[:-1])
            outputs[v] = src
    return Emission(outputs, inputs, communicated=frozenset(communicated), per_device=per_device)


_REDUCTIONS = ("all-reduce", "reduce-scatter")
"""The collectives that sum an operator's partial results (`Decision.comms`): its constrained outputs
are what they make."""
