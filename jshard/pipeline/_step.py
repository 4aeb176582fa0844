"""A full train step in a pipeline: the gradient function `jshard.accumulate` marks is pipelined,
the rest of the step runs on its gradients.

A JAX user's train step computes the gradients and then updates the parameters (SGD by hand,
optax with its state, a Flax `TrainState`) and returns the new ones. A pipeline cuts the loss
into stages and returns `(loss, grads)`; it cannot tell by itself where in a step the gradients
are made, so the step names its gradient function, as for gradient accumulation:

    loss, grads = jshard.accumulate(jax.value_and_grad(loss_fn))(params, batch)

Under `parallelize(step, pipeline=js.Pipelining(S, M))` that call runs the pipeline on
`value_and_grad`'s loss (cut into stages, `Staged`), and returns the pipeline's loss and
gradients; the rest of the step is traced around it into one `jax.jit` program. Its arguments
and results are whole on every device of the pipeline's mesh (the packed `[S, width]` parameters
of `Staged.pack` are the form that keeps each stage's on its own devices), so a result that
updates an argument comes back in the layout the next call takes: a loop moves nothing between
calls (`jshard.audit.moved_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard import _context
from jshard._errors import ShardingError
from jshard._format import shape_str
from jshard.compile import abstract, dtype_of

Gradients = Callable[..., Any]
"""`(grad_fn, args, batch_argnums, steps, call) -> grad_fn's results`, run by the pipeline."""


def marks(fn: Callable[..., Any], args: tuple, context: tuple[Any, Any, Any, Any]) -> int:
    """How many `jshard.accumulate` calls `fn(*args)` makes (traced once, shapes only);
    `context`: `TraceContext`'s first four fields."""
    ctx = _context.TraceContext(*context, pipeline=lambda grad_fn, a, b, steps, call: grad_fn(*a))
    with _context.tracing(ctx):
        jax.eval_shape(lambda *a: fn(*a), *abstract(args))  # a new function: traced, not found in jax's cache
    return ctx.accumulated


def full_step(fn: Callable[..., Any], mesh: Mesh, context: tuple, gradients: Gradients):
    """`fn` as one jitted program over `mesh`, its `jshard.accumulate` calls run by `gradients`;
    every argument and result whole on every device, so that results updating arguments come back
    as the next call takes them."""

    def step(*a):
        with _context.tracing(_context.TraceContext(*context, pipeline=gradients)):
            return fn(*a)

    whole = NamedSharding(mesh, PartitionSpec())
    return jax.jit(step, in_shardings=whole, out_shardings=whole)


def check_marked(call: str, args: tuple, batch_argnums: int, steps: int | None, micro_batches: int) -> None:
    """The marked gradient function takes `(params, batch)`, and its micro-batches are the pipeline's.

    Raises:
      ShardingError: another signature, a batch elsewhere than argument 1, or `steps` other than
        `micro_batches`.
    """
    if len(args) != 2 or batch_argnums % max(len(args), 1) != 1:
        shapes = jax.tree.map(lambda a: shape_str(dtype_of(a), np.shape(a)), args)
        raise ShardingError(
            f"{call}: in a pipeline the marked gradient function takes (params, batch), the batch last, and "
            f"differentiates the params; it was called with {len(args)} argument(s) {shapes} and "
            f"batch_argnums={batch_argnums}. Bind the other arguments into the loss (functools.partial or a "
            f"closure over Python values) and call it as jshard.accumulate(jax.value_and_grad(loss_fn))(params, "
            f"batch).")
    if steps is not None and steps != micro_batches:
        raise ShardingError(
            f"{call}: steps={steps}, but the pipeline runs micro_batches={micro_batches} micro-batches; drop "
            f"steps= (the pipeline's micro_batches= is the count).")


def check_no_tracers(call: str, consts: Sequence) -> None:
    """A pipelined gradient function closes over no traced value of the step around it (a key
    drawn in the step, say): the pipeline's program is built apart from the step's trace.

    Raises:
      ShardingError: it does.
    """
    traced = [c for c in consts if isinstance(c, jax.core.Tracer)]
    if traced:
        x = traced[0]
        raise ShardingError(
            f"{call}: the gradient function closes over a value the step computes or takes "
            f"({shape_str(x.dtype, x.shape)}); a pipelined gradient function reads only its (params, batch). "
            f"Pass that value in the batch (with a leading row dim) or in the params, or make it a Python "
            f"or NumPy constant.")
