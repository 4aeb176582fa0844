"""`jshard.accumulate`: gradient accumulation outside a pipeline (MindSpore's `gradient_accumulation`).

A train step `(params, opt_state, batch) -> (params, opt_state, metrics)` is one program to jshard,
which cannot tell by itself where the gradients are made; so the step names its gradient function
(as `optax.MultiSteps` wraps the optimizer and MaxText scans its gradient function):

    loss, grads = jshard.accumulate(jax.value_and_grad(loss_fn))(params, batch)

`accumulate` cuts the batch argument's rows into k micro-batches (row `i * k + j` goes to
micro-batch j, so each micro-batch stays spread over the devices that cut the batch, with no
redistribution), runs `grad_fn` on each in a `lax.scan`, sums its results in the scan carry, and
returns their mean (floating leaves; integer ones, counts, summed): one optimizer update follows,
on the mean gradient, as the full batch's step makes it where the loss is a mean over rows (for a
masked mean, where every row's mask counts the same tokens). Under `parallelize(...,
pipeline=js.Pipelining(S, M))` the same call marks what the pipeline runs: `grad_fn` is
pipelined over the M micro-batches (`jshard/pipeline/_step.py`), and the rest of the step (the
optimizer update, metrics) runs on its gradients. Under `parallelize(...,
accumulation=k)` k comes from there. Where the core names the mesh axes that cut the batch's
rows (`batch_axes` in the trace context: `compile/_core.py`), the loop runs in a `jax.shard_map`
manual over them, each device summing its own rows of each micro-batch, and one `psum` after the
loop reduces the sums: the gradients are reduced once per step, as MindSpore and Megatron do, not
once per micro-batch. With `Accumulation(shard=True)` the carry's gradients are cut over the
data-parallel axes (the core puts the cut in the trace context), and in the manual loop each
micro-batch's gradient is reduce-scattered into that cut (MindSpore's
`gradient_accumulation_shard`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore
from jax.sharding import PartitionSpec

from jshard import _context
from jshard._buckets import bucketed
from jshard._errors import ShardingError, api_boundary
from jshard._format import shape_str
from jshard.layouts import place

COPY_SCOPE = "jshard_copy"
"""The name scope of copy j's equations under multi-copy (`jshard_copy<j>`), read back from the
compiled program's metadata by the tests."""


@api_boundary
def accumulate(grad_fn: Callable[..., Any], steps: int | None = None, *, batch_argnums: int = -1) -> Callable[..., Any]:
    """`grad_fn` run on `steps` micro-batches of its batch argument, its results averaged.

    Args:
      grad_fn: the gradient function, e.g. `jax.value_and_grad(loss_fn)` (any function whose
        floating results are means over the batch's rows: loss, gradients, metrics).
      steps: k, how many micro-batches; None takes `parallelize`'s `accumulation_steps` (required
        outside `parallelize`), or in a pipeline its `micro_batches` (where `grad_fn` must be
        `jax.value_and_grad(loss_fn)` of `(params, batch)`: the pipeline runs it).
      batch_argnums: which positional argument of `grad_fn` is the batch (every array leaf of it is
        cut along dim 0).

    Under `parallelize(..., communication=js.Communication(copies=n, fusion=...))` each micro-batch
    is cut again into n copies run apart (MindSpore's multi-copy), and the gradients are reduced in
    the buckets `fusion` asks for. Under `mode="auto"` the copies run in the global view (the search
    lays out each copy; XLA reduces the gradients), and where `communication=` is not given the
    search weighs the copies itself (`Plan.communication` says what it chose and why).

    Returns:
      A function with `grad_fn`'s signature and results: floating leaves the mean over the
      micro-batches, the others their sum. With k = 1 it is `grad_fn` itself. Under
      `parallelize` in `mode="data"` or `"semi_auto"` it sums each device's micro-batches and
      reduces once, after the loop (a `shard_map` manual over the batch's axes).

    Raises:
      ShardingError: k is not a positive int (or not given outside `parallelize`), does not divide
        the batch's rows, or differs from `parallelize`'s `accumulation_steps`.

    Examples:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> loss = lambda w, x: jnp.mean((x @ w) ** 2)
      >>> w, x = jnp.ones((2, 1)), jnp.arange(8.0).reshape(4, 2)
      >>> js.accumulate(jax.value_and_grad(loss), 2)(w, x)[0] == jax.value_and_grad(loss)(w, x)[0]
      Array(True, dtype=bool)
    """
    name = getattr(grad_fn, "__name__", type(grad_fn).__name__)

    def run(*args):
        ctx = _context.current()
        call = f"jshard.accumulate({name})" + (f" in {ctx.call}" if ctx is not None else "")
        if ctx is not None and ctx.pipeline is not None:  # a full train step in a pipeline: its micro-batches
            ctx.accumulated += 1
            return ctx.pipeline(grad_fn, args, batch_argnums, steps, call)
        k = _steps(steps, ctx, call)
        communication = None if ctx is None else ctx.communication
        if ctx is not None:
            ctx.accumulated += 1
        b = batch_argnums
        if isinstance(b, bool) or not isinstance(b, int) or not -len(args) <= b < len(args):
            raise ShardingError(f"{call}: batch_argnums={batch_argnums!r} numbers no argument of the {len(args)} "
                                f"given. Number the batch argument (default -1, the last).")
        if k == 1 and communication is None:
            return grad_fn(*args)
        n = 1 if communication is None else communication.copies
        return _scanned(grad_fn, args, b % len(args), k, n, ctx, call)

    return run


def _steps(steps, ctx, call: str) -> int:
    given = None if ctx is None else ctx.accumulation_steps
    if steps is None and given is None and ctx is not None and ctx.communication is not None:
        return 1  # multi-copy or fusion alone: one micro-batch
    if steps is None and given is None:
        raise ShardingError(f"{call}: no micro-batch count: pass accumulate(grad_fn, steps=k), or call it in a step "
                            f"parallelized with accumulation=k.")
    k = given if steps is None else steps
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ShardingError(f"{call}: steps={k!r} is not a number of micro-batches; give a positive int k that "
                            f"divides the batch's rows.")
    if given is not None and k != given:
        raise ShardingError(f"{call}: steps={k} but the step is parallelized with accumulation={given}; give "
                            f"one of them (drop steps= to take parallelize's accumulation=).")
    return k


def _scanned(grad_fn, args: tuple, b: int, k: int, n: int, ctx, call: str):
    """`grad_fn` summed over k micro-batches of n copies each, then averaged (`run`)."""
    leaves = jax.tree_util.tree_leaves(args[b])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args[b])[0]]
    for x, path in zip(leaves, paths):
        rows = np.shape(x)[0] if np.ndim(x) else None
        if rows is None or rows % (k * n):
            raise ShardingError(_rows_error(call, b, path, x, k, n))
    accumulator = None if ctx is None else ctx.accumulator
    axes = None if ctx is None else ctx.batch_axes
    grad_fn = copied(grad_fn, b, n)
    if axes and _local(args, leaves, k * n, axes, ctx.mesh):
        return _reduced_once(grad_fn, args, b, k, n, axes, ctx, call)
    if k == 1 and n == 1:  # fusion alone, where XLA reduces the gradients: nothing to run apart
        return grad_fn(*args)
    if n > 1 and ctx.mode != "auto":  # a trace before the core knows the batch's axes, or none: the core refuses the last
        ctx.unreduced = _unreduced_error(call, ctx, leaves, k * n)
    # under mode="auto" the copies run in the global view: the search lays out each copy's operators
    # (and the batch), and XLA reduces the gradients where the search's layouts leave partial sums
    total = _summed(grad_fn, args, b, k, accumulator=accumulator, call=call)
    return jax.tree.map(lambda t: t / (k * n) if jnp.issubdtype(t.dtype, jnp.inexact) else t, total)


def copied(grad_fn: Callable[..., Any], b: int, n: int) -> Callable[..., Any]:
    """`grad_fn` run on n copies of its batch argument `b`'s rows (row `i * n + j` goes to copy j,
    as `_micro` deals micro-batches), each in its own name scope `jshard_copy<j>` and reading none
    of the others' values, and their results summed (MindSpore's `MicroBatchInterleaved`); n = 1:
    `grad_fn` itself. The copies' shapes are one's: `grad_fn` is traced once and its trace run n
    times (`_traced_once`), unless tracing it records something in the trace context (a `shard`
    call, a recompute region), which each copy must record for itself."""
    if n == 1:
        return grad_fn

    def run(*args):
        micro, tree = _micro(args, b, n)

        def one_copy(batch):
            return grad_fn(*args[:b], jax.tree_util.tree_unflatten(tree, batch), *args[b + 1:])

        outs, again = [], None
        for j in range(n):
            with jax.named_scope(f"{COPY_SCOPE}{j}"):
                batch = [x[j] for x in micro]
                if j == 0:
                    again = _unrecorded(lambda: _traced_once(one_copy, batch)[0])
                outs.append(one_copy(batch) if again is None else again(batch))
        return jax.tree.map(lambda *xs: functools.reduce(jnp.add, xs), *outs)

    return run


def _traced_once(fn: Callable[[list], Any], example: list) -> tuple[Callable[[list], Any], Any]:
    """`fn` (of a list of arrays) traced once on `example`: a function that runs that trace on
    arrays of the same types, its equations made in the caller's trace with their name scopes and
    source lines as traced; and the shapes of `fn`'s results."""
    closed, shapes = jax.make_jaxpr(fn, return_shape=True)(example)
    tree = jax.tree_util.tree_structure(shapes)
    return lambda leaves: jax.tree_util.tree_unflatten(tree, jcore.jaxpr_as_fun(closed)(*leaves)), shapes


def _unrecorded(make: Callable[[], Any]) -> Any:
    """`make()`, where it records nothing in the trace context; else None, the context as it was."""
    ctx = _context.current()
    if ctx is None:
        return make()
    before = _records(ctx)
    made = make()
    if _records(ctx) == before:
        return made
    for f, was in zip(dataclasses.fields(ctx), before):
        if isinstance(was, list):
            getattr(ctx, f.name)[:] = was  # in place: the list is the context's own
        else:
            setattr(ctx, f.name, was)
    return None


def _records(ctx) -> list:
    """The trace context's fields, its lists copied."""
    return [list(v) if isinstance(v, list) else v for v in (getattr(ctx, f.name) for f in dataclasses.fields(ctx))]


def _local(args: tuple, batch: list, k: int, axes: tuple[str, ...], mesh) -> bool:
    """Whether each device can sum its own micro-batches: every argument leaf an array, and each
    device's rows of every batch leaf a multiple of k."""
    ways = math.prod(mesh.shape[a] for a in axes)
    return (all(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(args))
            and all(np.shape(x)[0] % (k * ways) == 0 for x in batch))


def _reduced_once(grad_fn, args: tuple, b: int, k: int, n: int, axes: tuple[str, ...], ctx, call: str):
    """The micro-batch loop in a `shard_map` manual over the batch's `axes` (the others stay
    automatic: tensor parallel inside holds): each device sums `grad_fn` over its rows of each
    micro-batch (the same rows, `i * k + j` for micro-batch j, as the loop over the whole batch
    takes), and one `psum` after the loop reduces the sums, not one per micro-batch. With
    `accumulator` (`accumulation_shard`), a gradient its cut gives `axes` on one dim is
    reduce-scattered onto that dim after each micro-batch instead, into a carry cut so. `grad_fn`
    runs n copies (`copied`); with `ctx.communication`, the sums are reduced in its buckets
    (`jshard.bucketed`) rather than by one `psum`."""
    mesh, accumulator = ctx.mesh, ctx.accumulator
    ways = math.prod(mesh.shape[a] for a in axes)
    in_specs = tuple(jax.tree.map(lambda _, i=i: PartitionSpec(axes) if i == b else PartitionSpec(), a)
                     for i, a in enumerate(args))
    # the results' shapes ahead of the loop only where they are needed before it (the copies' bytes, the
    # accumulator's cut, which lays out the loop's results): else `grad_fn` is traced once, in the loop
    shapes = _shapes(grad_fn, args, b, k) if n > 1 or accumulator is not None else None
    if n > 1:  # the other copies' gradients, live until summed
        ctx.copy_bytes = (n - 1) * sum(math.prod(s.shape) * np.dtype(s.dtype).itemsize for s in jax.tree.leaves(shapes))
    dims = None if accumulator is None else [_scatter_dim(sh, axes) for sh in _cuts(shapes, accumulator, call)]

    def scatter(out):  # each micro-batch's gradients the accumulator cuts
        leaves, tree = jax.tree_util.tree_flatten(out)
        leaves = [x if d is None else jax.lax.psum_scatter(x, axes, scatter_dimension=d, tiled=True)
                  for x, d in zip(leaves, dims)]
        return jax.tree_util.tree_unflatten(tree, leaves)

    def local(*shards):
        out = _summed(grad_fn, shards, b, k, step=None if dims is None else scatter)
        total, tree = jax.tree_util.tree_flatten(out)
        kept = [i for i, d in enumerate(dims or [None] * len(total)) if d is None]
        if ctx.communication is None:
            summed = [jax.lax.psum(total[i], axes) for i in kept]
        else:  # flattening a leaf another mesh axis cuts would gather it: there, one all-reduce per leaf
            whole = all(size == 1 for a, size in mesh.shape.items() if a not in axes)
            grads = _gradient_leaves(out, args[0])  # the parameters' gradients: their shapes are the same here
            summed, ctx.buckets[:] = bucketed([total[i] for i in kept], axes, ctx.communication.of("allreduce"),
                                              whole, call, grads and [kept.index(i) for i in grads if i in kept])
        leaves = list(total)
        for i, t in zip(kept, summed):
            leaves[i] = t
        return jax.tree_util.tree_unflatten(tree, [t / (k * n * ways) if jnp.issubdtype(t.dtype, jnp.inexact) else t
                                                   for t in leaves])

    out_specs = PartitionSpec() if dims is None else jax.tree_util.tree_unflatten(
        jax.tree_util.tree_structure(shapes),
        [PartitionSpec() if d is None else PartitionSpec(*(axes if i == d else None for i in range(len(s.shape))))
         for s, d in zip(jax.tree.leaves(shapes), dims)])  # a lone spec: every result replicated
    # check_vma off: the carry starts invariant (zeros) and takes each device's own sums
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, axis_names=frozenset(axes),
                         check_vma=False)(*args)


def _gradient_leaves(shapes, params) -> list[int] | None:
    """The leaf positions, among the gradient function's results (`shapes`), of the result (or the
    result's element) with the tree and shapes of its first argument, the parameters: their
    gradients, in the parameters' order; None where no result is like them."""
    tree: Any = jax.tree_util.tree_structure(params)  # Any: jaxlib types PyTreeDef's == narrowly
    like = [np.shape(x) for x in jax.tree_util.tree_leaves(params)]
    parts = list(shapes) if isinstance(shapes, (tuple, list)) else []
    start = 0
    for part in [shapes, *parts]:
        if jax.tree_util.tree_structure(part) == tree and [s.shape for s in jax.tree_util.tree_leaves(part)] == like:
            return list(range(start, start + len(like)))
        if part is not shapes:
            start += len(jax.tree_util.tree_leaves(part))
    return None


def _scatter_dim(sharding, axes: tuple[str, ...]) -> int | None:
    """The dim a cut accumulator's `sharding` gives exactly `axes` (and no other dim any of them);
    None: no such dim, or no cut."""
    if sharding is None:
        return None
    dims = [tuple(p) if isinstance(p, tuple) else () if p is None else (p,) for p in sharding.spec]
    hits = [d for d, p in enumerate(dims) if p == tuple(axes)]
    others = [a for d, p in enumerate(dims) if d not in hits for a in p]
    return hits[0] if len(hits) == 1 and not set(others) & set(axes) else None


def _micro(args: tuple, b: int, k: int) -> tuple[list, Any]:
    """The batch argument's leaves cut into k micro-batches (`[k, rows / k, ...]`: row `i * k + j`
    goes to micro-batch j), and its tree."""
    leaves, tree = jax.tree_util.tree_flatten(args[b])
    return [jnp.swapaxes(jnp.reshape(x, (np.shape(x)[0] // k, k, *np.shape(x)[1:])), 0, 1) for x in leaves], tree


def _shapes(grad_fn, args: tuple, b: int, k: int):
    """The shapes of `grad_fn`'s results on one micro-batch (cut inside the shape trace, so that the
    cut leaves no unused equation in the caller's trace)."""

    def first(batch):
        micro, tree = _micro((batch,), 0, k)
        return grad_fn(*args[:b], jax.tree_util.tree_unflatten(tree, [x[0] for x in micro]), *args[b + 1:])

    return jax.eval_shape(first, args[b])


def _summed(grad_fn, args: tuple, b: int, k: int, step: Callable[[Any], Any] | None = None, accumulator=None,
            call: str = ""):
    """`grad_fn`'s results, passed through `step` where given, summed over the k micro-batches in
    a `lax.scan` (k = 1: no loop), the gradients in the carry laid out as `accumulator` cuts them
    (`_constrainer`)."""
    micro, tree = _micro(args, b, k)

    def one(batch):
        out = grad_fn(*args[:b], jax.tree_util.tree_unflatten(tree, batch), *args[b + 1:])
        return out if step is None else step(out)

    if k == 1:
        out = one([x[0] for x in micro])
        return _constrainer(out, accumulator, call)(out)

    again, shapes = _traced_once(one, [x[0] for x in micro])  # once: the loop's body and the carry's shapes
    constrain = _constrainer(shapes, accumulator, call)

    def body(total, batch):
        return constrain(jax.tree.map(jnp.add, total, again(batch))), None

    zeros = constrain(jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes))
    total, _ = jax.lax.scan(body, zeros, micro)
    return total


def _constrainer(shapes, accumulator, call: str) -> Callable[[Any], Any]:
    """Lays out the results' subtree that has the parameters' tree and shapes (the gradients) as
    `accumulator` cuts it (`_cuts`); identity without one."""
    if accumulator is None:
        return lambda total: total
    cuts = _cuts(shapes, accumulator, call)

    def constrain(total):
        leaves, tree = jax.tree_util.tree_flatten(total)
        return jax.tree_util.tree_unflatten(tree, [x if sh is None else place(x, sh)
                                                   for x, sh in zip(leaves, cuts)])

    return constrain


def _cuts(shapes, accumulator, call: str) -> list:
    """Per result leaf of the gradient function (`shapes`), the sharding `accumulator` cuts it to:
    the leaves of the result subtree with the parameters' tree and shapes (the gradients); None
    for the others.

    Raises:
      ShardingError: no result subtree is like the parameters.
    """
    tree, cut = accumulator

    def like(part) -> bool:
        return (jax.tree_util.tree_structure(part) == tree
                and [s.shape for s in jax.tree_util.tree_leaves(part)] == [shape for shape, _ in cut])

    if like(shapes):  # grad_fn is jax.grad: its result is the gradients
        return [sh for _, sh in cut]
    hits = [i for i, part in enumerate(shapes) if like(part)] if isinstance(shapes, (tuple, list)) else []
    if not hits:
        raise ShardingError(f"{call}: Accumulation(shard=True) cuts the accumulated gradients like the parameters "
                            f"(argument 0 of the step), but no result of the gradient function has their tree and "
                            f"shapes. Differentiate with respect to the parameters as the step takes them "
                            f"(jax.value_and_grad(loss_fn)(params, batch)), or drop Accumulation(shard=True).")
    return [sh for i, part in enumerate(shapes)
            for sh in ([s for _, s in cut] if i == hits[0] else [None] * len(jax.tree_util.tree_leaves(part)))]


def _rows_error(call: str, b: int, path: str, x, k: int, n: int = 1) -> str:
    shape = shape_str(x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype, np.shape(x))
    cut = f"{k} micro-batches" + (f" of {n} copies" if n > 1 else "")
    if not np.ndim(x):
        return (f"{call}: the batch (argument {b}) leaf {path or '(the argument)'} is a scalar {shape}; every leaf "
                f"of the batch is cut along its rows into the {cut}. Pass scalars in another argument.")
    rows = np.shape(x)[0]
    divisors = [d for d in range(1, rows + 1) if rows % d == 0]
    asked = f"accumulation={k}" if n == 1 else f"accumulation={k} with Communication(copies={n})"
    return (f"{call}: {asked} does not divide the {rows} rows of the batch (argument {b}) leaf "
            f"{path or '(the argument)'} {shape} (into {k * n} parts). Give a k * n that divides {rows} "
            f"({', '.join(map(str, divisors))}), or a batch of a multiple of {k * n} rows.")


def _unreduced_error(call: str, ctx, batch: list, parts: int) -> str:
    """Multi-copy or fusion asked for where jshard cannot reduce the gradients itself."""
    if not ctx.batch_axes:
        why = ("the batch's rows are not cut over the same mesh axes before planning (a batch leaf's strategy leaves "
               "its rows to the planner, or the batch leaves' strategies differ)")
        fix = ("Cut the batch's rows by dataset_strategy or in_strategy (or use mode='auto', where the copies run "
               "in the global view)")
    else:
        ways = math.prod(ctx.mesh.shape[a] for a in ctx.batch_axes)
        shapes = ", ".join(shape_str(x.dtype, np.shape(x)) for x in batch)
        why = (f"each of the {ways} devices that cut the batch ({shapes}) must hold a multiple of {parts} rows "
               f"(micro-batches x copies), and every argument must be an array")
        fix = f"Give a batch of a multiple of {parts * ways} rows"
    return (f"{call}: {ctx.communication!r} runs the copies and reduces the gradients in jshard's own buckets, "
            f"each device summing its own rows first; here it cannot: {why}. {fix}, or drop communication=.")
