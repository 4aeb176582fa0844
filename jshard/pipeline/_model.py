"""What a pipelined model looks like: `Pipeline` (first / layer stack / last) and `pipeline_stage`.

The contract. A pipelined step is a `Pipeline` of three functions over one parameter dict:

- `first(params, micro_batch) -> x`: runs on stage 0 (e.g. the embedding);
- `layer(layer_params, x) -> x`: one block, whose parameters are `params[layers_key]`, a pytree
  of arrays stacked on a leading axis of `L` layers (as `GPTConfig(scan=True)` stores them);
  stage `s` (virtual stage `j` when interleaved) runs layers `j*k .. (j+1)*k - 1`, `k = L / (S·v)`;
- `last(params, x, micro_batch) -> loss`: runs on the last stage (e.g. the head and the loss), a
  scalar mean over the micro-batch's rows;
- optionally `head(params, x) -> outputs` for inference (outputs with the micro-batch's rows first).

`first`, `last` and `head` receive `params` without the stack, so a tied embedding (the input
embedding reused as the output projection) is simply the same entry read by `first` and `last`;
its two gradient contributions are summed across stages. The activation `x` passed between stages
is one array whose shape does not change along the stack. The loss of a step is the mean over
micro-batches of `last`; it equals the full-batch loss when `last` is a mean with equal weight per
row (e.g. a masked mean whose mask counts are equal per row).

Instead of one `layer`, `layer` may be a sequence of per-stage functions, each
`fn(stage_params, x) -> x` over its stage's slice of the stack (leading axis `k`), each tagged with
`pipeline_stage(fn, s)`, one per stage in order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import jax

from jshard._errors import ShardingError, api_boundary
from jshard.pipeline._cut import STAGE_SCOPE


@dataclasses.dataclass(frozen=True)
class StageFunction:
    """A function tagged with the pipeline stage it runs on (made by `pipeline_stage`).

    Attributes:
      fn: the function, `fn(stage_params, x) -> x`.
      stage: its stage id, `0 <= stage < pipeline_stages`.
    """

    fn: Callable[..., Any]
    stage: int

    def __call__(self, *args, **kwargs):
        """`fn(*args, **kwargs)` in the name scope that tags its operators with the stage (how a
        step passed to `parallelize(..., pipeline=js.Pipelining(S, ...))` is cut)."""
        with jax.named_scope(STAGE_SCOPE + str(self.stage)):
            return self.fn(*args, **kwargs)


@api_boundary
def pipeline_stage(fn: Callable[..., Any], stage: int) -> StageFunction:
    """Tags `fn` to run on pipeline stage `stage` (MindSpore `Cell.pipeline_stage`).

    Two uses. Inside any step passed to `parallelize(step, pipeline=js.Pipelining(S, M))`
    (the embedding, each layer of a Python loop, the head, each wrapped and called as usual): the
    operators `fn` runs are tagged with `stage`, and the step is cut there (operators outside every
    tag join the stage of their latest tagged producer). Or, in a `Pipeline`, as `layer=[...]`: one
    `fn(stage_params, x) -> x` per stage over its slice of the layer stack.

    Args:
      fn: the function; called with whatever the caller passes.
      stage: the stage id, `0 <= stage < pipeline_stages`.

    Returns:
      A `StageFunction`, callable as `fn`.

    Examples:
      >>> import jax.numpy as jnp
      >>> f = pipeline_stage(lambda p, x: x + p.sum(), 1)
      >>> f.stage, float(f(jnp.ones((2,)), 1.0))
      (1, 3.0)
    """
    if not callable(fn):
        raise TypeError(f"jshard.pipeline_stage: fn must be callable, got {type(fn).__name__}.")
    if not isinstance(stage, int) or isinstance(stage, bool) or stage < 0:
        raise TypeError(f"jshard.pipeline_stage: stage must be a non-negative int, got {stage!r}.")
    return StageFunction(fn, stage)


@dataclasses.dataclass(frozen=True)
class Pipeline:
    """A model cut into pipeline stages: `first`, a stack of layers, `last` (see the module docstring).

    Attributes:
      first: `first(params, micro_batch) -> x`, on stage 0.
      layer: `layer(layer_params, x) -> x`, one layer of the stack; or one `pipeline_stage`-tagged
        `fn(stage_params, x) -> x` per stage.
      last: `last(params, x, micro_batch) -> scalar loss`, on the last stage.
      head: optional `head(params, x) -> outputs`, on the last stage, for inference.
      layers_key: the key of `params` holding the layer stack.

    Examples:
      >>> import jax.numpy as jnp
      >>> pipe = Pipeline(first=lambda p, b: b @ p["w_in"], layer=lambda lp, x: jnp.tanh(x @ lp),
      ...                 last=lambda p, x, b: (x ** 2).mean())
      >>> params = {"w_in": jnp.ones((3, 4)), "layers": jnp.zeros((2, 4, 4))}
      >>> float(pipe.loss(params, jnp.ones((8, 3))))
      0.0
    """

    first: Callable[..., Any]
    layer: Callable[..., Any] | Sequence[StageFunction]
    last: Callable[..., Any]
    head: Callable[..., Any] | None = None
    layers_key: str = "layers"

    def split(self, params: dict) -> tuple[dict, Any]:
        """`(params without the stack, the stack)`."""
        if not isinstance(params, dict) or self.layers_key not in params:
            raise ShardingError(
                f"jshard.Pipeline: params must be a dict holding the layer stack under "
                f"{self.layers_key!r}; got {type(params).__name__}"
                f"{' with keys ' + str(sorted(params)) if isinstance(params, dict) else ''}. "
                f"Pass layers_key= to name the stack."
            )
        rest = {k: v for k, v in params.items() if k != self.layers_key}
        return rest, params[self.layers_key]

    def join(self, rest: dict, stack: Any) -> dict:
        """The inverse of `split`."""
        return {**rest, self.layers_key: stack}

    @property
    def tagged(self) -> bool:
        return not callable(self.layer)

    def stage_runner(self, k: int) -> Callable[..., Any] | list[Callable[..., Any]]:
        """`run(chunk_params, x)` over a chunk of `k` layers, or one such function per stage."""
        if self.tagged:
            return [t.fn for t in self.layer]

        def run(chunk, x):
            return jax.lax.scan(lambda h, p: (self.layer(p, h), None), x, chunk)[0]

        return run

    def body(self, stack: Any, x: jax.Array, stages: int) -> jax.Array:
        """The whole stack on `x`, as one device would run it (no pipeline)."""
        if not self.tagged:
            return self.stage_runner(0)(stack, x)
        count = stack_length(stack)
        k = count // stages
        for s, fn in enumerate(self.stage_runner(k)):
            x = fn(jax.tree.map(lambda a, s=s: a[s * k:(s + 1) * k], stack), x)
        return x

    def loss(self, params: dict, batch: Any) -> jax.Array:
        """The non-pipelined loss on the whole batch: `last(first(batch) → all layers)`."""
        rest, stack = self.split(params)
        stages = len(self.layer) if self.tagged else 1
        return self.last(rest, self.body(stack, self.first(rest, batch), stages), batch)

    def apply(self, params: dict, batch: Any) -> Any:
        """The non-pipelined inference outputs on the whole batch (needs `head`)."""
        rest, stack = self.split(params)
        stages = len(self.layer) if self.tagged else 1
        return self.head(rest, self.body(stack, self.first(rest, batch), stages))


def stack_length(stack: Any) -> int:
    """The number of layers in a stack (the leading dim its leaves share)."""
    lengths = {a.shape[0] for a in jax.tree.leaves(stack)}
    if len(lengths) != 1:
        raise ShardingError(
            f"jshard.Pipeline: the layer stack's leaves must share one leading (layer) dim; they have "
            f"{sorted(lengths)}. Stack every layer parameter on axis 0 (as GPTConfig(scan=True))."
        )
    return lengths.pop()


def check_stage_ids(call: str, layer: Sequence[Any], stages: int) -> None:
    """Per-stage functions must be tagged 0..stages-1, once each, in order.

    Raises:
      ShardingError: an untagged function, a missing id, an id out of range, or ids out of order.
    """
    untagged = [i for i, f in enumerate(layer) if not isinstance(f, StageFunction)]
    if untagged:
        raise ShardingError(
            f"{call}: layer[{untagged[0]}] has no stage id. Wrap each per-stage function as "
            f"jshard.pipeline_stage(fn, stage)."
        )
    ids = tuple(f.stage for f in layer)
    want = tuple(range(stages))
    if ids == want:
        return
    missing = sorted(set(want) - set(ids))
    if missing or len(ids) != stages:
        extra = sorted(set(ids) - set(want))
        what = (f"stage(s) {missing} have no function" if missing else "") + \
            ("; " if missing and extra else "") + (f"stage id(s) {extra} are out of range" if extra else "")
        what = what or f"{len(ids)} functions for {stages} stages"
        raise ShardingError(
            f"{call}: stage ids {ids} with stages={stages}: {what}. Tag exactly one function per "
            f"stage 0..{stages - 1} with jshard.pipeline_stage(fn, stage)."
        )
    raise ShardingError(
        f"{call}: stage ids {ids} are out of order. List the per-stage functions in stage order "
        f"{want}."
    )
