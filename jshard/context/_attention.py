"""`jshard.attention`: dot-product attention (causal, grouped-query) whose sequence a strategy may
cut over mesh axes (context parallel), run in the form `choose` picks or the caller names."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jshard import _context
from jshard._errors import ShardingError, api_boundary
from jshard._format import shape_str
from jshard._source import caller
from jshard.context._choose import AttentionShape, ContextChoice, choose, refusal
from jshard.context._forms import FORMS, TILE, attend
from jshard.cost import CostModel
from jshard.layouts import TensorLayout, check_divides, layout_of, place

_CALL = "jshard.attention"

Strategy = tuple[int, ...] | TensorLayout | None
"""The queries' layout: a strategy tuple or a `Layout` of their four dims, or None."""


@api_boundary
def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    causal: bool = False,
    strategy: Strategy = None,
    form: str = "auto",
    zigzag: bool = False,
    scale: float | None = None,
    block: int | None = None,
) -> jax.Array:
    """Dot-product attention of `q` `[batch, length, heads, head_dim]` on `k`, `v`
    `[batch, length, kv_heads, head_dim]` (grouped-query where `kv_heads < heads`), as
    `jax.nn.dot_product_attention` computes it; under `jshard.parallelize`, laid out by `strategy`.

    Where `strategy` cuts the sequence (dim 1), the attention runs context parallel over the mesh
    axes that cut it, in one of three forms: `"gather"` (keys and values all-gathered), `"ring"`
    (keys and values passed around the devices by collective-permute, the softmax accumulated as
    they arrive) or `"ulysses"` (heads traded for sequence by all-to-all; its degree must divide
    the key/value heads). `form="auto"` takes the one the cost model predicts fastest among those
    whose keys and values fit the memory (`jshard.context_choice` says why).

    Long keys are attended a tile of `block` keys at a time (memory-efficient attention: the
    softmax accumulated online, the backward recomputing each tile's weights), so a device holds
    one tile's scores `[batch, kv_heads, heads / kv_heads, its queries, block]` rather than all of
    them; the result is the same within the dtype's rounding. In the ring, each block that arrives
    is taken a tile at a time.

    Args:
      q: queries `[batch, length, heads, head_dim]`.
      k: keys `[batch, length, kv_heads, head_dim]`.
      v: values, shaped as `k`.
      causal: each position attends to itself and the positions before it.
      strategy: `q`'s layout, a strategy tuple or a `Layout` of its four dims (batch, sequence,
        heads, head_dim: the last must stay whole); `k` and `v` take the same. None: no layout of
        its own (XLA's, from its operands).
      form: `"auto"`, `"gather"`, `"ring"` or `"ulysses"`.
      zigzag: the sequence is stored in zig-zag order over the devices that cut it
        (`jshard.zigzag`), which balances a causal mask's work: each device then skips the same
        masked half of every ring block.
      scale: the scores' factor; default `1 / sqrt(head_dim)`.
      block: keys per tile; it must divide the keys each device attends at once (the sequence;
        the ring's: the sequence over the devices that cut it, half that with `zigzag` and
        `causal`; `form="auto"` does not weigh a ring whose blocks it does not divide). None:
        tiles of 1024 keys where those keys are more than 1024 and a multiple of it, else the
        keys whole (the scores held whole, as small cases always were).

    Returns:
      `[batch, length, heads, head_dim]`, laid out as `strategy`.

    Raises:
      ShardingError: a cut of the head_dim, a strategy that does not divide the shapes, or a form
        that cannot run on this cut (Ulysses over more devices than key/value heads), or a `block`
        that does not divide the keys each device attends.

    Examples:
      >>> q = jnp.ones((1, 8, 4, 2)); kv = jnp.ones((1, 8, 2, 2))
      >>> attention(q, kv, kv, causal=True).shape
      (1, 8, 4, 2)
    """
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    _check_shapes(q, k, v)
    ctx = _context.current()
    if ctx is not None and strategy is None and ctx.mode == "auto":
        strategy = _open_cut(ctx, q)
    if ctx is None or strategy is None or ctx.mode == "data":
        _check_block(block, q, q.shape[1], "the sequence")
        pos = jnp.arange(q.shape[1])
        return attend(q, k, v, pos, pos, causal, scale, block)
    layout, spec = _spec(ctx, strategy, q, k)
    sharding = NamedSharding(ctx.mesh, spec)
    sequence = _axes(spec[1])
    if not sequence:  # nothing to run context parallel: XLA lays the attention out from its operands
        _check_block(block, q, q.shape[1], "the sequence")
        q, k, v = place(q, sharding), place(k, sharding), place(v, sharding)
        pos = jnp.arange(q.shape[1])
        return place(attend(q, k, v, pos, pos, causal, scale, block), sharding)
    parts = math.prod(ctx.mesh.shape[a] for a in sequence)
    chosen, why = _form(form, _local_shape(q, k, spec, ctx.mesh.shape, parts), sequence, ctx, zigzag, spec, q,
                        block, causal and zigzag)
    if chosen == "ring":
        halved = causal and zigzag
        keys = q.shape[1] // parts // (2 if halved else 1)
        _check_block(block, q, keys, f"the ring's blocks (the sequence over {parts} devices{', halved' * halved})")
    else:
        _check_block(block, q, q.shape[1], "the sequence")
    body = functools.partial(
        FORMS[chosen], axes=sequence, parts=parts, causal=causal, scale=scale, zigzag_order=zigzag, block=block
    )
    run = jax.shard_map(body, mesh=ctx.mesh, in_specs=(spec,) * 3, out_specs=spec, check_vma=False)
    scope = ctx.next_scope()
    with jax.named_scope(scope):  # the region's record names the form and why (`Plan.explain`)
        out = run(place(q, sharding), place(k, sharding), place(v, sharding))
    name = f"jshard.attention(form={form!r}): {why}"
    ctx.annotations.append(_context.Annotation(scope, name, caller(), (layout,) * 3, (layout,)))
    return out


def context_choice(
    q_shape: tuple[int, ...],
    kv_heads: int,
    sequence: dict[str, int],
    *,
    itemsize: int = 4,
    cost: CostModel | None = None,
    zigzag: bool = False,
) -> ContextChoice:
    """The form `jshard.attention(form="auto")` takes for queries of global shape `q_shape`
    `[batch, length, heads, head_dim]` whose sequence `sequence` (mesh axis -> size) cuts, and why.

    Examples:
      >>> context_choice((1, 65536, 32, 128), 8, {"sp": 16}).refused["ulysses"][:27]
      'Ulysses cuts the heads 16 w'
    """
    b, t, h, d = q_shape
    shape = AttentionShape(b, t, h, kv_heads, d, itemsize)
    return choose(shape, tuple(sequence), sequence, cost or CostModel(), zigzag)


def _open_cut(ctx, q) -> tuple[int, ...] | None:
    """A strategy=None call under `mode="auto"`: recorded for the planning's weighing of context
    parallel (`TraceContext.open_attention`, where its keys are past one tile), and the strategy the
    weighing's candidate gives it (`TraceContext.context_cut`): the sequence cut that many ways, the
    batch over the devices left where its rows divide; None (no strategy) where the cut does not
    divide the sequence."""
    batch, length = q.shape[:2]
    if length > TILE:
        ctx.open_attention.append((batch, length))
    n = ctx.context_cut
    if n is None or n < 2 or length % n or ctx.device_count % n:
        return None
    return (math.gcd(batch, ctx.device_count // n), n, 1, 1)


def _check_block(block: int | None, q, keys: int, what: str) -> None:
    if block is not None and (not isinstance(block, int) or block < 1 or keys % block):
        raise ShardingError(
            f"{_CALL}: block={block!r} on q {shape_str(q.dtype, q.shape)}: each device attends {keys} keys at "
            f"once ({what}), which tiles of {block} do not divide. Pass a positive divisor of {keys}, or "
            "block=None (tiles of 1024 where they divide, else the keys whole)."
        )


def _check_shapes(q, k, v) -> None:
    ok = (
        q.ndim == k.ndim == v.ndim == 4
        and k.shape == v.shape
        and q.shape[:2] == k.shape[:2]
        and q.shape[3] == k.shape[3]
        and q.shape[2] % k.shape[2] == 0
    )
    if not ok:
        raise ShardingError(
            f"{_CALL}: takes q [batch, length, heads, head_dim] and k, v [batch, length, kv_heads, head_dim] "
            f"with kv_heads dividing heads; got q {shape_str(q.dtype, q.shape)}, k {shape_str(k.dtype, k.shape)}, "
            f"v {shape_str(v.dtype, v.shape)}."
        )


def _spec(ctx, strategy, q, k) -> tuple[TensorLayout, P]:
    op = f"attention of q {shape_str(q.dtype, q.shape)}"
    layout = layout_of(strategy, ctx.device_count, call=_CALL, op=op, what="strategy")
    check_divides(layout, q.shape, call=_CALL, op=op, what="strategy", dtype=q.dtype)
    spec = ctx.fine.partition_spec(layout)
    spec = P(*spec, *([None] * (4 - len(spec))))
    heads = math.prod(ctx.mesh.shape[a] for a in _axes(spec[2]))
    if spec[3] is not None or k.shape[2] % heads:
        raise ShardingError(
            f"{_CALL}: strategy {layout.describe()} cuts {op}'s "
            + (
                "head_dim, which each device needs whole to take its dot products"
                if spec[3] is not None
                else f"heads {heads} ways, which do not divide its {k.shape[2]} key/value heads"
            )
            + ". Cut the batch, the sequence or the heads (by a divisor of the key/value heads) instead."
        )
    return layout, spec


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _local_shape(q, k, spec: P, sizes, parts: int) -> AttentionShape:
    cut = [math.prod(sizes[a] for a in _axes(e)) for e in spec]
    return AttentionShape(
        q.shape[0] // cut[0],
        q.shape[1],
        q.shape[2] // cut[2],
        k.shape[2] // cut[2],
        q.shape[3],
        np.dtype(q.dtype).itemsize,
    )


def _form(form: str, shape: AttentionShape, sequence, ctx, zigzag: bool, spec: P, q, block: int | None,  # noqa: PLR0913
          halved: bool) -> tuple[str, str]:
    """The form to run, and why: `form="auto"` weighs only the forms that can run (`refusal`: a
    ring whose blocks the call's `block` does not divide is not weighed)."""
    if form not in ("auto", *FORMS):
        raise ValueError(f"{_CALL}: form={form!r}; pass 'auto', 'gather', 'ring' or 'ulysses'.")
    parts = math.prod(ctx.mesh.shape[a] for a in sequence)
    if form == "auto" and all(refusal(f, shape, parts, zigzag, block, halved) for f in FORMS):
        form = "gather"  # every form refused: the gather's reason is the one every form shares
    elif form == "auto":
        choice = choose(shape, sequence, dict(ctx.mesh.shape), ctx.cost or CostModel(), zigzag, block, halved)
        return choice.form, choice.why
    why = refusal(form, shape, parts, zigzag)
    if why is not None:
        fix = (
            "cut the sequence over fewer devices than key/value heads, or take form='ring' or 'gather'"
            if form == "ulysses"
            else "pad the sequence to a multiple of it"
        )
        raise ShardingError(
            f"{_CALL}: form={form!r} on q {shape_str(q.dtype, q.shape)} with strategy {spec} "
            f"(the sequence cut {parts} ways over {', '.join(sequence)}): {why}. To fix: {fix}."
        )
    return form, f"{form}, as the call names it"
