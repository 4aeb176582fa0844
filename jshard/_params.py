"""Parameters and operator shapes for `shard`: `parameter_plan` matching, and contraction and lookup
detection."""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

import jax
import numpy as np
from jax.extend import core as jcore

from jshard._errors import ShardingError
from jshard.graph import PARAMETER_SCOPE, inline_equations, resolve
from jshard.layouts import DotDims, check_divides, layout_of
from jshard.rules import ELEMENTWISE

_PASSTHROUGH = {"convert_element_type", "copy", "copy_p"}
_ELEMENTWISE = _PASSTHROUGH | {
    "abs", "add", "add_any", "div", "erf", "exp", "integer_pow", "log", "logistic", "max", "min",
    "mul", "neg", "pow", "rsqrt", "select_n", "sign", "sqrt", "square", "sub", "tanh",
}
"""Primitives through which a result keeps its operand's layout (a bias, an activation)."""


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
    _check_not_linen(call, fn)
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
                check_divides(layout, leaf.shape, call=call.call, op=f"parameter {name}", what=what, dtype=leaf.dtype)
                params.append((name, layout))
                with jax.named_scope(f"{PARAMETER_SCOPE}{len(params) - 1}"):  # Annotation.params[k]'s value
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


def _check_not_linen(call, fn) -> None:
    """Raises where `fn` is a Linen module: its parameters are made and read inside its call (its
    scope), out of a `parameter_plan`'s reach; the message names the ways that reach them."""
    linen = sys.modules.get("flax.linen")
    if linen is None or not isinstance(fn, linen.Module):
        return
    raise ShardingError(_linen_error(call, type(fn).__name__))


def _linen_error(call, name: str) -> str:
    return (
        f"{call.call}: parameter_plan on the Linen module {name} at {call.source}: a Linen module makes and reads "
        f"its parameters inside its call (in its scope), bound or not, where shard cannot reach them. Any of these "
        f"does: (1) shard the module's apply, whose parameters are an argument: jshard.shard(model.apply, "
        f"in_strategy=(None, ...), parameter_plan={{'{name}_0/kernel': (1, 4)}}); (2) give the parameters their "
        f"strategy at the boundary: jshard.parallelize(step, in_strategy=...) with a tuple or Layout at the "
        f"kernel's place in the params tree; (3) logical axis rules: kernel_init=nn.with_logical_partitioning(init, "
        f"('embed', 'mlp')) and nn.logical_axis_rules under jax.set_mesh (jshard reads them as the model's own "
        f"anchors); or (4) shard the matmul itself: jshard.shard(jnp.matmul, ((2, 1), (1, 4)))(x, kernel) in a "
        f"module of your own. See docs/howto/linen.md."
    )


def _constrain_module(fn, visit):
    try:
        from flax import nnx
    except ImportError:  # pragma: no cover - flax is a dependency
        return fn
    if not isinstance(fn, nnx.Module):
        return fn
    graphdef, state = nnx.split(fn)
    copy = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(visit, state))

    def call(*args, **kwargs):
        # The module runs on a copy holding the constrained parameters; what the call changes in it
        # (batch statistics, an RNG stream's count) is written back to `fn`, as a direct call leaves it.
        before = [jax.tree_util.tree_leaves(v) for _, v in nnx.to_flat_state(nnx.state(copy))]
        result = copy(*args, **kwargs)
        changed = [(path, v) for (path, v), old in zip(nnx.to_flat_state(nnx.state(copy)), before)
                   if any(a is not b for a, b in zip(jax.tree_util.tree_leaves(v), old))]
        if changed:
            nnx.update(fn, nnx.from_flat_state(changed))
        return result

    return call


class Contraction(NamedTuple):
    """The one `dot_general` of a `shard`ed function, in terms of the function's own inputs.

    Attributes:
      lhs / rhs: positions among the inputs of the dot's left and right operands.
      dims: its dimension numbers, counted in those inputs' own dims (before any transpose).
      rules_output: the function returns the dot's result, up to elementwise ops of the same shape
        (a bias, an activation), so the contraction's output layout is the function's.
    """

    lhs: int
    rhs: int
    dims: DotDims
    rules_output: bool


_FOUND: dict = {}
"""`contraction_dims` and `lookup_dims` answers by (finder, function, abstract arguments, positions)."""
_CACHE_SIZE = 4096


def contraction_dims(fn, args, positions) -> Contraction | None:
    """`_contraction_dims`, cached per function and abstract arguments (a model calls the same
    sharded matmul once per layer; tracing it once is enough)."""
    return _cached(_contraction_dims, fn, args, positions)


def lookup_dims(fn, args, positions) -> Lookup | None:
    """`_lookup_dims`, cached as `contraction_dims` is."""
    return _cached(_lookup_dims, fn, args, positions)


def _cached(find, fn, args, positions):
    key = (find, fn, tuple((a.shape, a.dtype) if hasattr(a, "shape") else a for a in args), tuple(positions))
    try:
        if key in _FOUND:
            return _FOUND[key]
    except TypeError:  # an unhashable argument: no caching
        return find(fn, args, positions)
    if len(_FOUND) >= _CACHE_SIZE:
        _FOUND.clear()
    _FOUND[key] = found = find(fn, args, positions)
    return found


def _contraction_dims(fn, args, positions) -> Contraction | None:
    """The contraction of the inputs at `positions[:2]` when `fn` has one, else None.

    `fn` is traced on abstract values; it is a contraction when its jaxpr holds exactly one
    `dot_general`, whose operands are those two inputs, possibly after a dtype conversion, a
    transpose that keeps the order of the free dims (`x @ w.T`), or a squeeze of size-1 dims
    (`jnp.matmul` of a batch of 1: the squeezed dims of both operands are its batch dims). The operands may come in either
    order (`einsum("ij,kj->ki", x, w)` multiplies `w` by `x`).
    """
    closed, invars = _traced(fn, args)
    # var -> (input position, perm): dim d of the var is dim perm[d] of that input.
    source = {invars[i]: (i, tuple(range(len(args[i].shape)))) for i in positions[:2]}
    squeezed: dict[int, tuple[int, ...]] = {}  # input position -> its size-1 dims squeezed away (`jnp.matmul`'s batch of 1)
    env: dict
    dots, env = [], {}
    for eqn, env in inline_equations(closed.jaxpr, env):
        # literals (a 0-d constant operand) are no input's value, and are not hashable
        ins = [_var(env, v) for v in eqn.invars]
        name = eqn.primitive.name
        if name in _PASSTHROUGH and ins[0] in source:
            source[eqn.outvars[0]] = source[ins[0]]
        elif name == "transpose" and ins[0] in source:
            i, perm = source[ins[0]]
            source[eqn.outvars[0]] = (i, tuple(perm[p] for p in eqn.params["permutation"]))
        elif name == "squeeze" and ins[0] in source:
            i, perm = source[ins[0]]
            gone = eqn.params["dimensions"]
            squeezed[i] = squeezed.get(i, ()) + tuple(perm[d] for d in gone)
            source[eqn.outvars[0]] = (i, tuple(p for d, p in enumerate(perm) if d not in gone))
        elif name == "dot_general":
            dots.append((eqn, ins))
    if len(dots) != 1 or any(v not in source for v in dots[0][1]):
        return None
    eqn, (lhs, rhs) = dots[0]
    (li, lperm), (ri, rperm) = source[lhs], source[rhs]
    if {li, ri} != set(positions[:2]):
        return None
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    if not (_keeps_free_order(lperm, lc, lb) and _keeps_free_order(rperm, rc, rb)):
        return None
    on_inputs = lambda perm, ds: tuple(perm[d] for d in ds)
    lsq, rsq = squeezed.get(li, ()), squeezed.get(ri, ())
    if len(lsq) != len(rsq):  # a size-1 dim of one operand only: a free dim of it
        lsq = rsq = ()
    dims = ((on_inputs(lperm, lc), on_inputs(rperm, rc)),
            (lsq + on_inputs(lperm, lb), rsq + on_inputs(rperm, rb)))
    return Contraction(li, ri, dims, _rules_output(closed.jaxpr, env, eqn))


def _traced(fn, args):
    """`fn` traced on abstract values of its array inputs (the others as they are): the closed jaxpr
    and, per array input's position, its input var."""
    avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a for a in args]
    array_pos = [i for i, a in enumerate(args) if hasattr(a, "shape")]

    def on_arrays(*arrays):
        full = list(avals)
        for i, x in zip(array_pos, arrays):
            full[i] = x
        return fn(*full)

    closed = jax.make_jaxpr(on_arrays)(*(avals[i] for i in array_pos))
    return closed, dict(zip(array_pos, closed.jaxpr.invars))


def _keeps_free_order(perm, contract, batch) -> bool:
    free = [perm[d] for d in range(len(perm)) if d not in contract and d not in batch]
    return free == sorted(free)


def _rules_output(jaxpr, env, dot) -> bool:
    """Whether `jaxpr`'s one output is `dot`'s result after elementwise ops of the same shape."""
    shape, ruled = dot.outvars[0].aval.shape, {dot.outvars[0]}
    for eqn, env in inline_equations(jaxpr, env):
        if eqn.primitive.name in _ELEMENTWISE and any(_var(env, v) in ruled for v in eqn.invars):
            ruled.update(v for v in eqn.outvars if v.aval.shape == shape)
    outs = [resolve(env, v) for v in jaxpr.outvars]
    return len(outs) == 1 and isinstance(outs[0], jcore.Var) and outs[0] in ruled


def _var(env, v) -> jcore.Var | None:
    """The outer var `v` stands for; None for a literal (a 0-d constant: no input's value, unhashable)."""
    v = resolve(env, v)
    return v if isinstance(v, jcore.Var) else None


class Lookup(NamedTuple):
    """The one `gather` of a `shard`ed function that is MindSpore's Gather (`jnp.take(table,
    indices, axis)`, `table[indices]`, an embedding lookup), in terms of the function's inputs.

    Attributes:
      table / indices: positions among the inputs of the gathered tensor (MindSpore's
        `input_params`) and of the indices.
      axis: the table dim the indices select along.
    """

    table: int
    indices: int
    axis: int


def _lookup_dims(fn, args, positions) -> Lookup | None:
    """The lookup of the inputs at `positions[:2]` when `fn` is one, else None (see `Lookup`).

    `fn` is traced on abstract values; it is a lookup when its jaxpr holds exactly one `gather`
    whose operand is one of the two inputs (possibly after a dtype conversion) and whose indices
    are computed from the other alone (JAX's negative-index wrap-around), taking one element along
    one axis and every other dim whole, and `fn` returns its result.
    """
    closed, invars = _traced(fn, args)
    source = {invars[i]: i for i in positions[:2]}  # var -> the input it is (up to a conversion)
    depends = {v: {i} for i, v in invars.items()}  # var -> the inputs it is computed from
    env: dict
    gathers, env = [], {}
    for eqn, env in inline_equations(closed.jaxpr, env):
        ins = [resolve(env, v) for v in eqn.invars]
        used = set().union(*(depends.get(v, set()) for v in ins if isinstance(v, jcore.Var)))
        for v in eqn.outvars:
            depends[v] = used
        if eqn.primitive.name in _PASSTHROUGH and isinstance(ins[0], jcore.Var) and ins[0] in source:
            source[eqn.outvars[0]] = source[ins[0]]
        elif eqn.primitive.name == "gather":
            gathers.append((eqn, ins))
    if len(gathers) != 1:
        return None
    eqn, (operand, indices) = gathers[0]
    outs = [resolve(env, v) for v in closed.jaxpr.outvars]
    if not isinstance(operand, jcore.Var) or operand not in source or len(outs) != 1 or outs[0] is not eqn.outvars[0]:
        return None
    table = source[operand]
    other = positions[1] if table == positions[0] else positions[0]
    if not isinstance(indices, jcore.Var) or depends.get(indices) != {other}:
        return None
    axis = _gather_axis(eqn, args[table].shape, args[other].shape)
    return None if axis is None else Lookup(table, other, axis)


def _gather_axis(eqn, table_shape, indices_shape) -> int | None:
    """The axis of a `gather` that takes one element along it and every other table dim whole, its
    result `table[:axis] + indices + table[axis + 1:]`; else None."""
    dn, sizes = eqn.params["dimension_numbers"], eqn.params["slice_sizes"]
    if len(dn.collapsed_slice_dims) != 1 or tuple(dn.start_index_map) != tuple(dn.collapsed_slice_dims):
        return None
    if dn.operand_batching_dims:
        return None
    axis = dn.collapsed_slice_dims[0]
    whole = all(s == (1 if d == axis else n) for d, (s, n) in enumerate(zip(sizes, table_shape)))
    want = (*table_shape[:axis], *indices_shape, *table_shape[axis + 1:])
    return axis if whole and tuple(eqn.outvars[0].aval.shape) == want else None


class Convolution(NamedTuple):
    """The one convolution of a `shard`ed function (MindSpore's Conv2D), in terms of its inputs.

    Attributes:
      lhs / rhs: positions among the inputs of the image and of the kernel.
      dims: `(lhs_spec, rhs_spec, out_spec)` of its dimension numbers.
      groups: its feature group count.
      rules_output: the function returns the convolution's result (up to elementwise ops).
    """

    lhs: int
    rhs: int
    dims: tuple
    groups: int
    rules_output: bool


def convolution_dims(fn, args, positions) -> Convolution | None:
    """`_convolution_dims`, cached as `contraction_dims` is."""
    return _cached(_convolution_dims, fn, args, positions)


def _convolution_dims(fn, args, positions) -> Convolution | None:
    """The convolution of the inputs at `positions[:2]` when `fn` holds exactly one
    `conv_general_dilated`, whose image and kernel are those inputs (possibly after a dtype
    conversion), with no batch groups; else None."""
    closed, invars = _traced(fn, args)
    source = {invars[i]: i for i in positions[:2]}
    env: dict
    convs, env = [], {}
    for eqn, env in inline_equations(closed.jaxpr, env):
        ins = [_var(env, v) for v in eqn.invars]
        if eqn.primitive.name in _PASSTHROUGH and ins[0] in source:
            source[eqn.outvars[0]] = source[ins[0]]
        elif eqn.primitive.name == "conv_general_dilated":
            convs.append((eqn, ins))
    if len(convs) != 1 or any(v not in source for v in convs[0][1]):
        return None
    eqn, (lhs, rhs) = convs[0]
    if eqn.params["batch_group_count"] != 1 or {source[lhs], source[rhs]} != set(positions[:2]):
        return None
    numbers = eqn.params["dimension_numbers"]
    dims = (numbers.lhs_spec, numbers.rhs_spec, numbers.out_spec)
    return Convolution(source[lhs], source[rhs], dims, eqn.params["feature_group_count"],
                       _rules_output(closed.jaxpr, env, eqn))


def broadcasting(fn, args, positions) -> bool:
    """`_broadcasting`, cached as `contraction_dims` is."""
    return _cached(_broadcasting, fn, args, positions)


def _broadcasting(fn, args, positions) -> bool:
    """Whether `fn` is elementwise over the inputs at `positions`, NumPy-broadcast: its jaxpr holds
    only elementwise operators and broadcasts, and its one result has their broadcast shape."""
    try:
        shape = tuple(np.broadcast_shapes(*(args[i].shape for i in positions)))
    except ValueError:
        return False
    closed, _ = _traced(fn, args)
    allowed = {*ELEMENTWISE, "broadcast_in_dim"}
    if any(eqn.primitive.name not in allowed for eqn, _ in inline_equations(closed.jaxpr, {})):
        return False
    outs = closed.jaxpr.outvars
    return len(outs) == 1 and tuple(outs[0].aval.shape) == shape


class Scatter(NamedTuple):
    """The one scatter of a `shard`ed function that is MindSpore's ScatterAdd / ScatterUpdate /
    ScatterMax ... (`table.at[indices].add(updates)`), in terms of the function's inputs.

    Attributes:
      operand / indices / updates: positions among the inputs of the scattered-into tensor, the
        indices (rows of `operand`) and the updates.
    """

    operand: int
    indices: int
    updates: int


_SCATTERS = ("scatter", "scatter-add", "scatter_add", "scatter-mul", "scatter_mul", "scatter-min", "scatter_min",
             "scatter-max", "scatter_max", "scatter-sub", "scatter_sub")


def scatter_dims(fn, args, positions) -> Scatter | None:
    """`_scatter_dims`, cached as `contraction_dims` is."""
    return _cached(_scatter_dims, fn, args, positions)


def _scatter_dims(fn, args, positions) -> Scatter | None:
    """The scatter of the inputs at `positions` (three of them) when `fn` holds exactly one scatter
    into rows (`table.at[indices].add(updates)`: indices select along dim 0 of the operand) whose
    operand is one of the inputs (possibly after a dtype conversion), whose updates and indices are
    computed each from another one alone, and whose result `fn` returns; else None."""
    closed, invars = _traced(fn, args)
    source = {invars[i]: i for i in positions}
    depends = {v: {i} for i, v in invars.items()}
    env: dict
    scatters, env = [], {}
    for eqn, env in inline_equations(closed.jaxpr, env):
        ins = [_var(env, v) for v in eqn.invars]
        used = set().union(*(depends.get(v, set()) for v in ins if v is not None))
        for v in eqn.outvars:
            depends[v] = used
        if eqn.primitive.name in _PASSTHROUGH and ins[0] in source:
            source[eqn.outvars[0]] = source[ins[0]]
        elif eqn.primitive.name in _SCATTERS:
            scatters.append((eqn, ins))
    outs = [resolve(env, v) for v in closed.jaxpr.outvars]
    if len(scatters) != 1 or len(outs) != 1 or outs[0] is not scatters[0][0].outvars[0]:
        return None
    eqn, (operand, indices, updates) = scatters[0]
    numbers = eqn.params["dimension_numbers"]
    if operand not in source or numbers.scatter_dims_to_operand_dims != (0,) or numbers.inserted_window_dims != (0,):
        return None
    found = depends.get(updates, set()), depends.get(indices, set())  # the updates may be computed (`divide`: 1 / u)
    if any(len(f) != 1 for f in found) or {source[operand], *found[0], *found[1]} != set(positions):
        return None
    return Scatter(source[operand], *found[1], *found[0])
