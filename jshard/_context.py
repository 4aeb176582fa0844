"""The ambient state of one jshard trace: which mesh `shard` annotations resolve against.

`parallelize` opens a `TraceContext` while it traces the user's function; `jshard.shard` reads it
to turn strategies into sharding constraints and records what it did. Outside a context, `shard`
calls the plain function.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any

from jax.sharding import Mesh

from jshard.layouts import FineMesh, TensorLayout


@dataclasses.dataclass(frozen=True, slots=True)
class Annotation:
    """What one `jshard.shard` call asked for, as recorded while tracing.

    Attributes:
      scope: the name scope its equations carry (`jshard_shard<k>`), linking it to jaxpr equations.
      name: the annotated function's name.
      source: `file:line` of the call.
      in_layouts: one per positional input (`None`: not constrained).
      out_layouts: one per output (`None`: not constrained).
      partial_axes: device-matrix axes whose cut contracted dims leave partial sums.
      params: parameter path → layout, from `parameter_plan`.
    """

    scope: str
    name: str
    source: str
    in_layouts: tuple[TensorLayout | None, ...]
    out_layouts: tuple[TensorLayout | None, ...]
    partial_axes: tuple[int, ...] = ()
    params: tuple[tuple[str, TensorLayout], ...] = ()


@dataclasses.dataclass(slots=True)
class TraceContext:
    """One trace of a parallelized function: its call name, meshes, mode and recorded annotations.

    `accumulation_steps` and `accumulator` are what `jshard.accumulate` reads (`parallelize`'s
    `accumulation_steps`, and with `accumulation_shard` the parameters' tree with each leaf's
    shape and the sharding its accumulated gradient takes); `accumulated` counts its calls;
    `batch_axes` the mesh axes that cut the batch's rows, over which `jshard.accumulate` sums each
    device's micro-batches before one reduction (None: it reduces each micro-batch).
    `recompute` is `parallelize`'s `recompute=` (the policy of `jshard.recompute` regions that name
    none); `recompute_choice` the policy this trace gives the regions left to the search
    (`policy="auto"`): one for all of them, or a tuple with one per region in the order the trace
    meets them; `auto_regions` counts those met. `pipeline`, in a full train step under
    `pipeline_stages`, runs the gradient function `jshard.accumulate` marks in the pipeline:
    `pipeline(grad_fn, args, batch_argnums, steps, call)` returns what `grad_fn(*args)` returns.
    `communication` is `parallelize`'s `communication=` (a `jshard.Communication`: the copies
    `jshard.accumulate` runs, how it buckets the gradients); `buckets` records each all-reduce it
    emits for them, as `(leaves, dtype name, bytes per device or None)`, and `copy_bytes` the bytes
    multi-copy holds beyond one copy (the other copies' gradients before their sum); `unreduced`
    why the copies could not be reduced once by jshard in this trace (the error the core raises).
    `cost` is the `CostModel` the plan is priced with, its `memory` the search's budget where one
    is given: what `jshard.attention(form="auto")` weighs its forms with. `context_cut` is the
    sequence cut `jshard.attention` calls that give no strategy take under `mode="auto"` (None:
    none); `open_attention` records each such call's `(batch rows, length)`, which the planning
    weighs context-parallel cuts for.
    """

    call: str
    fine: FineMesh
    mesh: Mesh
    mode: str
    annotations: list[Annotation] = dataclasses.field(default_factory=list)
    scopes: int = 0
    accumulation_steps: int | None = None
    accumulator: tuple | None = None
    accumulated: int = 0
    batch_axes: tuple[str, ...] | None = None
    recompute: object = None
    recompute_choice: str | tuple[str, ...] = "full"
    auto_regions: int = 0
    pipeline: Callable[..., Any] | None = None
    communication: Any = None
    buckets: list[tuple[int, str, int | None]] = dataclasses.field(default_factory=list)
    copy_bytes: int = 0
    unreduced: str | None = None
    cost: Any = None
    context_cut: int | None = None
    open_attention: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @property
    def device_count(self) -> int:
        return self.fine.device_count

    def next_scope(self) -> str:
        self.scopes += 1
        return f"jshard_shard{self.scopes - 1}"


_local = threading.local()


def current() -> TraceContext | None:
    """The innermost active trace context on this thread, or None."""
    return getattr(_local, "ctx", None)


@contextlib.contextmanager
def tracing(ctx: TraceContext) -> Iterator[TraceContext]:
    """Makes `ctx` current for the duration of the block (restored on exit, even on error)."""
    previous = current()
    _local.ctx = ctx
    try:
        yield ctx
    finally:
        _local.ctx = previous
