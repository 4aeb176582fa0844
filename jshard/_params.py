"""Parameters and operator shapes for `shard`: `parameter_plan` matching and contraction detection."""

from __future__ import annotations

import re

import jax

from jshard._errors import ShardingError
from jshard.layouts import check_divides, layout_of
from jshard.propagate._graph import inline_equations

_PASSTHROUGH = {"convert_element_type", "copy", "copy_p"}


def path_str(path) -> str:
    """A pytree key path as `a/b/0`, dropping NNX's trailing `value` attribute."""
    text = jax.tree_util.keystr(path, simple=True, separator="/")
    return text[: -len("/value")] if text.endswith("/value") else text


def constrain_parameters(call, plan, fn, args, params):
    """Constrains every parameter whose path matches a `parameter_plan` regex (first match wins).

    Parameters are the leaves of pytree (non-array) inputs and, where `fn` is a Flax NNX module, its
    state. Every pattern must match at least one parameter.

    Raises:
      ShardingError: a pattern matches nothing (the message lists the paths there are).
    """
    matched: set[str] = set()
    seen: list[str] = []

    def visit(path, leaf):
        name = path_str(path)
        seen.append(name)
        for pattern, slot in plan:
            if re.search(pattern, name):
                matched.add(pattern)
                what = f"parameter_plan[{pattern!r}]"
                layout = layout_of(slot, call.ctx.device_count, call=call.call, op=f"parameter {name}", what=what)
                check_divides(layout, leaf.shape, call=call.call, op=f"parameter {name}", what=what)
                params.append((name, layout))
                return call._constrain(leaf, layout)
        return leaf

    args = [a if hasattr(a, "shape") else jax.tree_util.tree_map_with_path(visit, a) for a in args]
    fn = _constrain_module(fn, visit)
    missing = [p for p, _ in plan if p not in matched]
    if missing:
        raise ShardingError(
            f"{call.call}: parameter_plan pattern {missing[0]!r} matches no parameter of {call.op}. "
            f"Its parameters are: {', '.join(seen) or '(none)'}. Fix the pattern (a regex searched in "
            f"each path)."
        )
    return fn, args


def _constrain_module(fn, visit):
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return fn
    if not isinstance(fn, nnx.Module):
        return fn
    graphdef, state = nnx.split(fn)
    return nnx.merge(graphdef, jax.tree_util.tree_map_with_path(visit, state))


def contraction_dims(fn, args, positions):
    """`dot_general` dimension numbers when `fn` contracts its inputs at `positions[:2]`, else None.

    `fn` is traced on abstract values; it counts as a contraction when its jaxpr holds exactly one
    `dot_general`, whose operands are those two inputs (possibly after a dtype conversion).
    """
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a for a in args]
    array_pos = [i for i, a in enumerate(args) if hasattr(a, "shape")]

    def on_arrays(*arrays):
        full = list(avals)
        for i, x in zip(array_pos, arrays):
            full[i] = x
        return fn(*full)

    closed = jax.make_jaxpr(on_arrays)(*(avals[i] for i in array_pos))
    invars = closed.jaxpr.invars
    want = {invars[array_pos.index(positions[0])]: 0, invars[array_pos.index(positions[1])]: 1}
    dots = []
    for eqn, env in inline_equations(closed.jaxpr, {}):
        if eqn.primitive.name in _PASSTHROUGH:
            env[eqn.outvars[0]] = env.get(eqn.invars[0], eqn.invars[0])
        if eqn.primitive.name == "dot_general":
            dots.append((eqn, [env.get(v, v) for v in eqn.invars]))
    if len(dots) != 1:
        return None
    eqn, (lhs, rhs) = dots[0]
    if want.get(lhs) == 0 and want.get(rhs) == 1:
        return eqn.params["dimension_numbers"]
    if want.get(lhs) == 1 and want.get(rhs) == 0:
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        return (rc, lc), (rb, lb)
    return None
