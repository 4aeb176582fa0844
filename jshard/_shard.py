"""`jshard.shard`: MindSpore's operator-level `shard`, for any JAX callable.

Inside a `parallelize` trace, a sharded call constrains its inputs (and its outputs, where the
operator's rule or `out_strategy` fixes them) with JAX's own `with_sharding_constraint`, so the
strategy is an ordinary equation in the jaxpr and `jax.grad` carries it into the backward pass.
Outside a trace it is the plain function, and says so once (`ShardNotAppliedWarning`).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jshard import _context
from jshard._errors import ShardingError, ShardNotAppliedWarning, api_boundary
from jshard._format import shape_str
from jshard._params import (
    broadcasting,
    constrain_parameters,
    contraction_dims,
    convolution_dims,
    lookup_dims,
    scatter_dims,
)
from jshard._source import caller
from jshard.layouts import (
    NotRefined,
    TensorLayout,
    broadcast_layouts,
    canonicalize_slot,
    canonicalize_slots,
    check_divides,
    check_layouts_broadcast,
    check_layouts_product,
    conv_layouts,
    dot_layouts,
    gather_layouts,
    layout_of,
    on_auto_axes,
    place,
    scatter_layouts,
    with_repeated_calculation,
)


@api_boundary
def shard(
    fn: Callable[..., Any],
    in_strategy: Sequence[object],
    out_strategy: Sequence[object] | None = None,
    parameter_plan: Mapping[str, object] | None = None,
) -> Callable[..., Any]:
    """Gives `fn` a MindSpore operator strategy: how each input (and output) is cut across devices.

    Args:
      fn: any callable: `jnp.matmul`, a `lax` function, a Flax NNX module, a Linen `apply`.
      in_strategy: one entry per positional input: a tuple of ints (slices per dim), a `Layout` call,
        or None (not constrained). Tuples on two operands of a contraction follow MindSpore's
        MatMul device matrix `((a, b), (b, c))` → `[a, b, c]` (the dot's left operand first,
        whatever the argument order); tuples on the table and the indices of a lookup
        (`jnp.take(table, indices, axis=0)`, `table[indices]`) follow MindSpore's Gather /
        EmbeddingLookup: `((a, b), (c, d))` with the rows whole (`a == 1`) has the device matrix
        `[a, b, c, d]`, and a row-cut table `((a, 1), (c, 1))` (`a * c` devices) the matrix
        `[c, a]`, each device looking up its block of indices in its block of rows (zeros
        outside) and an all-reduce over `a` summing them; tuples on operands that line up from
        the right are cut alike; any other tuple is its own device matrix.
      out_strategy: optional, one entry per output; otherwise the operator's rule fixes the output
        where it can (a contraction, possibly followed by elementwise ops, and elementwise ops).
      parameter_plan: regex on a parameter's path (`"kernel"`, `"layers/0/.*bias"`) → tuple or
        Layout, for the parameters of a Flax module or of pytree inputs. Each pattern must match.

    Returns:
      A callable with `fn`'s signature.

    Examples:
      >>> import jax.numpy as jnp
      >>> mm = shard(jnp.matmul, ((2, 1), (1, 4)))
      >>> import warnings
      >>> with warnings.catch_warnings(record=True) as caught:
      ...     warnings.simplefilter("always")
      ...     y = mm(jnp.ones((4, 8)), jnp.ones((8, 16)))  # outside parallelize: plain matmul, and a warning
      >>> y.shape, caught[0].category.__name__
      ((4, 16), 'ShardNotAppliedWarning')
    """
    name = getattr(fn, "__name__", type(fn).__name__)
    call = f"jshard.shard({name})"
    ins = canonicalize_slots(in_strategy, call=call, what="in_strategy")
    outs = None if out_strategy is None else canonicalize_slots(out_strategy, call=call, what="out_strategy")
    plan = _canonicalize_parameter_plan(parameter_plan, call=call)

    warned: list[bool] = []

    @functools.wraps(fn)
    def sharded(*args, **kwargs):
        ctx = _context.current()
        if ctx is None and not warned and jax.device_count() > 1:
            warned.append(True)
            warnings.warn(_not_applied_warning(call, caller()), ShardNotAppliedWarning, stacklevel=2)
        if ctx is None or ctx.mode == "data":
            return fn(*args, **kwargs)
        source = caller()
        return _Call(ctx, fn, name, call, source).run(ins, outs, plan, args, kwargs)

    sharded.in_strategy, sharded.out_strategy = ins, outs
    return sharded


def _not_applied_warning(call: str, source: str) -> str:
    return (f"{call} at {source} ran outside jshard.parallelize (eagerly or under a plain jax.jit), so its "
            f"strategy was not applied: the plain function ran, on whatever layout its inputs had. Call it inside "
            f"the function you give jshard.parallelize. For a reference run of the same model (one device), "
            f"silence this with warnings.simplefilter('ignore', jshard.ShardNotAppliedWarning). Warned once per "
            f"shard call.")


def _canonicalize_parameter_plan(plan, *, call):
    if plan is None:
        return ()
    if not isinstance(plan, Mapping):
        raise TypeError(f"{call}: parameter_plan must map path regexes to strategies, got {plan!r}.")
    return tuple(
        (pattern, canonicalize_slot(value, call=call, what=f"parameter_plan[{pattern!r}]"))
        for pattern, value in plan.items()
    )


def _broadcast_shape(shapes) -> tuple[int, ...]:
    """NumPy's broadcast of `shapes`, or `()` where they do not broadcast (no result has that shape
    and rank at once, so no rule for the result follows)."""
    try:
        return tuple(np.broadcast_shapes(*shapes))
    except ValueError:
        return ()


class _Call:
    """One sharded call traced under a context: validate, constrain, call, constrain, record."""

    def __init__(self, ctx, fn, name, call, source):
        self.ctx, self.fn, self.name, self.call, self.source = ctx, fn, name, call, source
        self.op = f"{name} at {source}"
        self.broadcast: tuple[int, ...] | None = None  # the lined-up operands' broadcast shape, if any

    def run(self, ins, outs, plan, args, kwargs):
        if len(ins) != len(args):
            raise ShardingError(
                f"{self.call}: in_strategy has {len(ins)} entries but {self.op} was called with "
                f"{len(args)} positional inputs ({', '.join(_describe(a) for a in args)}). Give one "
                f"entry per input (None leaves an input unconstrained)."
            )
        in_layouts, out_rule, partial = self._input_layouts(ins, args)
        params = []
        scope = self.ctx.next_scope()
        with jax.named_scope(scope):
            args = self._constrained(args, in_layouts)
            fn = self.fn
            if plan:
                fn, args = constrain_parameters(self, plan, fn, args, params)
            explicit = bool(jax.sharding.get_abstract_mesh().explicit_axes)
            if not explicit or (outs is None and out_rule is None):  # constraints, or the types decide the results
                leaves, tree = jax.tree_util.tree_flatten(fn(*args, **kwargs))
                out_layouts = self._output_layouts(outs, out_rule, leaves)
                leaves = [self._constrain(x, lay) if lay is not None else x for x, lay in zip(leaves, out_layouts)]
            else:  # the layouts decide: on Explicit axes, the operator runs on Auto ones (jax.sharding.auto_axes)
                found = {}

                def inner(args, kwargs):
                    leaves, found["tree"] = jax.tree_util.tree_flatten(fn(*self._constrained(args, in_layouts), **kwargs))
                    found["layouts"] = self._output_layouts(outs, out_rule, leaves)
                    leaves = [self._constrain(x, lay) if lay is not None else x
                              for x, lay in zip(leaves, found["layouts"])]
                    return leaves, [None if lay is None else self._sharding(lay) for lay in found["layouts"]]

                leaves = on_auto_axes(inner, args, kwargs)
                tree, out_layouts = found["tree"], found["layouts"]
        self.ctx.annotations.append(
            _context.Annotation(scope, self.name, self.source, tuple(in_layouts), tuple(out_layouts), partial, tuple(params))
        )
        return jax.tree_util.tree_unflatten(tree, leaves)

    def _input_layouts(self, ins, args):
        n = self.ctx.device_count
        tuples = [i for i, s in enumerate(ins) if isinstance(s, tuple)]
        for i in tuples:
            if not hasattr(args[i], "shape"):
                raise TypeError(f"{self.call}: in_strategy[{i}] is a tuple but input {i} is {_describe(args[i])}, not an array.")
            check_divides(TensorLayout(ins[i], tuple((d,) for d in range(len(ins[i])))), args[i].shape,
                          call=self.call, op=self.op, what=f"in_strategy[{i}]", dtype=args[i].dtype)
        out_rule, partial, joint = None, (), {}
        if len(tuples) >= 2:
            joint, out_rule, partial = self._joint_layouts(ins, args, tuples)
        layouts = [joint[i] if i in joint else layout_of(s, n, call=self.call, op=self.op, what=f"in_strategy[{i}]")
                   for i, s in enumerate(ins)]
        for i, lay in enumerate(layouts):
            if lay is not None:
                check_divides(lay, args[i].shape, call=self.call, op=self.op, what=f"in_strategy[{i}]", dtype=args[i].dtype)
        given = [i for i, s in enumerate(ins) if isinstance(s, TensorLayout)]
        if len(given) >= 2:
            self._check_layouts(layouts, args, given)
        return layouts, out_rule, partial

    def _check_layouts(self, layouts, args, given):
        """The checks `_joint_layouts` makes of tuples, made of `Layout`s: a contraction's result
        cut by each alias once, an elementwise operator's operands cut alike."""
        names = [f"in_strategy[{i}]" for i in given]
        dot = contraction_dims(self.fn, args, given)
        if dot is not None:
            check_layouts_product(layouts[dot.lhs], layouts[dot.rhs], dot.dims, call=self.call, op=self.op,
                                  names=(f"in_strategy[{dot.lhs}]", f"in_strategy[{dot.rhs}]"))
        elif broadcasting(self.fn, args, given):
            check_layouts_broadcast([layouts[i] for i in given], [args[i] for i in given], call=self.call,
                                    op=self.op, names=names)

    def _joint_layouts(self, ins, args, tuples):
        """Inputs whose tuples share one device matrix: a contraction's two operands, a convolution's
        image and kernel (MindSpore's Conv2D, `conv_layouts`), a scatter's operand, indices and updates
        (MindSpore's ScatterAdd ..., `scatter_layouts`), a lookup's table and indices
        (MindSpore's Gather, `gather_layouts`), or operands that line up from the right.
        Any other tuple is its own device matrix."""
        n = self.ctx.device_count
        dot = contraction_dims(self.fn, args, tuples)
        if dot is not None:
            names = (f"in_strategy[{dot.lhs}]", f"in_strategy[{dot.rhs}]")
            l, r, out_rule, partial = dot_layouts(
                ins[dot.lhs], ins[dot.rhs], dot.dims, call=self.call, op=self.op, names=names
            )
            pairs = {dot.lhs: l, dot.rhs: r}
            out_rule = out_rule if dot.rules_output else None
        elif (conv := convolution_dims(self.fn, args, tuples) if len(tuples) == 2 else None) is not None:
            names = (f"in_strategy[{conv.lhs}]", f"in_strategy[{conv.rhs}]")
            l, r, out_rule, partial = conv_layouts(ins[conv.lhs], ins[conv.rhs], conv.dims, conv.groups,
                                                   call=self.call, op=self.op, names=names)
            pairs = {conv.lhs: l, conv.rhs: r}
            out_rule = out_rule if conv.rules_output else None
        elif (scatter := scatter_dims(self.fn, args, tuples) if len(tuples) == 3 else None) is not None:
            names = tuple(f"in_strategy[{i}]" for i in scatter)
            o, i, u, out_rule = scatter_layouts(*(ins[k] for k in scatter), call=self.call, op=self.op, names=names)
            pairs, partial = {scatter.operand: o, scatter.indices: i, scatter.updates: u}, ()
        elif (lookup := lookup_dims(self.fn, args, tuples) if len(tuples) == 2 else None) is not None:
            names = (f"in_strategy[{lookup.table}]", f"in_strategy[{lookup.indices}]")
            shapes = (args[lookup.table].shape, args[lookup.indices].shape)
            t, i, out_rule, partial = gather_layouts(ins[lookup.table], ins[lookup.indices], lookup.axis, shapes, n,
                                                     call=self.call, op=self.op, names=names)
            return {lookup.table: t, lookup.indices: i}, out_rule, partial
        else:
            lays, out_rule = broadcast_layouts([ins[i] for i in tuples], [args[i] for i in tuples], call=self.call,
                                               op=self.op, names=[f"in_strategy[{i}]" for i in tuples])
            pairs, partial = dict(zip(tuples, lays)), ()
            self.broadcast = _broadcast_shape([args[i].shape for i in tuples])
        what = "in_strategy=(" + ", ".join(s.describe() if isinstance(s, TensorLayout) else str(s) for s in ins) + ")"
        repeat = lambda lay: with_repeated_calculation(lay, n, call=self.call, op=self.op, what=what)
        joint = {i: repeat(lay) for i, lay in pairs.items()}
        if out_rule is not None:
            out_rule = repeat(out_rule)
        return joint, out_rule, partial

    def _output_layouts(self, outs, out_rule, leaves):
        n = self.ctx.device_count
        if outs is not None:
            if len(outs) != len(leaves):
                raise ShardingError(
                    f"{self.call}: out_strategy has {len(outs)} entries but {self.op} returned "
                    f"{len(leaves)} arrays. Give one entry per output."
                )
            layouts = [layout_of(s, n, call=self.call, op=self.op, what=f"out_strategy[{i}]") for i, s in enumerate(outs)]
            for i, (lay, x) in enumerate(zip(layouts, leaves)):
                if lay is not None:
                    check_divides(lay, x.shape, call=self.call, op=self.op, what=f"out_strategy[{i}]", dtype=x.dtype)
            return layouts
        # The lined-up operands' rule holds for a result of their broadcast shape (an elementwise
        # function), not for another of the same rank (a gather of `x` at `idx`).
        if (out_rule is not None and len(leaves) == 1 and getattr(leaves[0], "ndim", -1) == out_rule.rank
                and self.broadcast in (None, tuple(leaves[0].shape))):
            return [out_rule]
        return [None] * len(leaves)

    def _constrained(self, args, layouts) -> list:
        return [self._constrain(a, lay) if lay is not None else a for a, lay in zip(args, layouts)]

    def _sharding(self, layout) -> NamedSharding:
        try:
            return NamedSharding(self.ctx.mesh, self.ctx.fine.partition_spec(layout))
        except NotRefined as e:
            e.who = self.op
            raise

    def _constrain(self, x, layout):
        """`x` laid out as `layout` says: a constraint on `Auto` axes, a `reshard` on `Explicit`
        ones; in a region manual over some axes (jshard.accumulate's loop) each device's slice
        is its own."""
        return place(x, self._sharding(layout))


def _describe(x) -> str:
    return shape_str(x.dtype, x.shape) if hasattr(x, "shape") else type(x).__name__
