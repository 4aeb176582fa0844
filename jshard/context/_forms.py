"""The three forms of context-parallel attention, each the body of a `shard_map` manual over the
mesh axes that cut the sequence: every device holds a run of the sequence of its queries, keys
and values (`[batch, length / n, heads, head_dim]`), and

- `gathered`: all-gathers the keys and values, then attends its queries to the whole sequence;
- `ring`: passes the keys and values around the ring of the n devices (n - 1 collective-permutes
  of each), attending to each block as it arrives, the softmax accumulated online (flash
  attention's running max and sum);
- `ulysses`: trades the sequence cut for a heads cut by all-to-all (DeepSpeed-Ulysses), attends
  over the whole sequence on its heads, and trades back: the key/value heads are cut n ways, so
  n must divide them (grouped-query attention limits it to the key/value heads).

Positions: with `zigzag`, the sequence is stored in zig-zag order over the n devices (device i
holds the i-th and the (2n-1-i)-th of 2n equal chunks, `zigzag`), which gives each device the same
share of a causal mask's work; the masks read each row's true position. A causal ring skips the
masked half of every block from another device (what the zig-zag order balances).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

Axes = tuple[str, ...]
"""The mesh axes that cut the sequence, major to minor (one name, or a merged dim's several)."""

_MASKED = -0.7 * float(np.finfo(np.float32).max)
"""A masked score: far below any real one, finite, so that a row masked in one block gives
`exp(masked - max) = 0` and no NaN."""


def zigzag(x: jax.Array, parts: int, axis: int = 1) -> jax.Array:
    """`x` with its `axis` reordered zig-zag over `parts` devices: cut into `2 * parts` equal
    chunks, device i's run (the i-th of `parts` equal runs) holds chunks i and `2 * parts - 1 - i`.

    Examples:
      >>> zigzag(jnp.arange(8), 2, axis=0).tolist()
      [0, 1, 6, 7, 2, 3, 4, 5]
    """
    chunks = jnp.split(x, 2 * parts, axis=axis)
    return jnp.concatenate([c for i in range(parts) for c in (chunks[i], chunks[2 * parts - 1 - i])], axis=axis)


def unzigzag(x: jax.Array, parts: int, axis: int = 1) -> jax.Array:
    """The inverse of `zigzag`: `x`'s `axis` back in sequence order.

    Examples:
      >>> unzigzag(zigzag(jnp.arange(8), 2, axis=0), 2, axis=0).tolist()
      [0, 1, 2, 3, 4, 5, 6, 7]
    """
    chunks = jnp.split(x, 2 * parts, axis=axis)
    stored = [c for i in range(parts) for c in (i, 2 * parts - 1 - i)]  # the chunk each stored slot holds
    return jnp.concatenate([chunks[stored.index(c)] for c in range(2 * parts)], axis=axis)


def positions(device, length: int, parts: int, zigzag_order: bool) -> jax.Array:
    """The sequence positions of the `length // parts` rows device `device` (a traced index) holds."""
    local = length // parts
    if not zigzag_order:
        return device * local + jnp.arange(local)
    half = local // 2
    first = device * half + jnp.arange(half)
    return jnp.concatenate([first, (2 * parts - 1 - device) * half + jnp.arange(half)])


def _scores(q: jax.Array, k: jax.Array, scale: float) -> jax.Array:
    """`[b, kv, g, tq, tk]` scores of queries `[b, tq, h, d]` against keys `[b, tk, kv, d]`."""
    b, t, h, d = q.shape
    kv = k.shape[2]
    grouped = q.reshape(b, t, kv, h // kv, d)
    return jnp.einsum("bqkgd,bskd->bkgqs", grouped, k, preferred_element_type=jnp.float32) * scale


def _values(p: jax.Array, v: jax.Array) -> jax.Array:
    """`[b, tq, kv, g, d]` of weights `[b, kv, g, tq, tk]` on values `[b, tk, kv, d]` (float32)."""
    return jnp.einsum("bkgqs,bskd->bqkgd", p, v.astype(jnp.float32))


def _masked(s: jax.Array, q_pos, k_pos, causal: bool) -> jax.Array:
    return jnp.where(q_pos[:, None] >= k_pos[None, :], s, _MASKED) if causal else s


TILE = 1024
"""The keys per tile where `jshard.attention`'s `block` is None and the keys are longer than this
and a multiple of it: shorter keys (or a length it does not divide) are attended whole."""


def tile_of(block: int | None, keys: int) -> int | None:
    """The keys per tile that attention over `keys` keys takes for `block` (None: `TILE` where the
    keys are longer than it and a multiple of it), or None: the keys whole."""
    if block is None:
        return TILE if keys > TILE and keys % TILE == 0 else None
    return block if block < keys else None


def attend(q, k, v, q_pos, k_pos, causal: bool, scale: float, block: int | None = None) -> jax.Array:
    """Attention of `q` on `k`, `v` (grouped-query), masked by positions where `causal`: plain where
    `tile_of(block, keys)` is None, else tiled (`_tiled`: the scores of `tile` keys at a time)."""
    tile = tile_of(block, k.shape[1])
    if tile is not None:
        return _tiled(q, k, v, q_pos, k_pos, _Tiles(causal, scale, tile))
    s = _scores(q, k, scale)
    w = jax.nn.softmax(s + _bias(_varying(q_pos, q), k_pos)[None, None, None] if causal else s, axis=-1)
    b, t, h, d = q.shape
    return _values(w, v).reshape(b, t, h, d).astype(q.dtype)


class _Tiles(NamedTuple):
    """Tiled attention's static settings (the custom VJP's non-differentiable argument)."""

    causal: bool
    scale: float
    tile: int

    def mask(self, q_pos, k_pos):
        return (q_pos, k_pos) if self.causal else None


def _in_tiles(tile: int, *xs):
    """`xs` (keys, values `[b, t, kv, d]`; positions `[t]`) cut on their sequence dim into tiles of
    `tile`, the tiles stacked on a new leading dim (what `lax.scan` steps over)."""

    def cut(x):
        axis = 0 if x.ndim == 1 else 1
        shape = (*x.shape[:axis], x.shape[axis] // tile, tile, *x.shape[axis + 1 :])
        return jnp.moveaxis(x.reshape(shape), axis, 0)

    return tuple(cut(x) for x in xs)


def _taken(state, q, k, v, scale: float, mask, tile: int | None):
    """`_Online.add` of `q`'s scores on keys `k` (masked by `mask`, `(q_pos, k_pos)` or None), a
    tile of `tile` keys at a time where `tile` is not None: each tile's scores live only in its step."""
    tiles = _key_tiles(k, v, mask, tile)
    if tiles is None:
        s = _scores(q, k, scale)
        return _Online.add(state, s if mask is None else s + _bias(*mask)[None, None, None], v)
    mask = None if mask is None else (_varying(mask[0], q), mask[1])

    def step(state, kvp):
        k_t, v_t, p_t = kvp
        return _taken(state, q, k_t, v_t, scale, None if mask is None else (mask[0], p_t), None), None

    return jax.lax.scan(step, state, tiles)[0]


def _key_tiles(k, v, mask, tile: int | None):
    """`k`, `v` and their positions (`mask[1]`, zeros without a mask) cut into tiles of `tile` keys
    (`_in_tiles`), what the tiled forward and backward scan over; None where the keys are taken
    whole (no tile, or one that does not cut them into several)."""
    if tile is None or tile >= k.shape[1] or k.shape[1] % tile:
        return None
    k_pos = jnp.zeros(k.shape[1], jnp.int32) if mask is None else jnp.broadcast_to(mask[1], (k.shape[1],))
    return _in_tiles(tile, k, v, k_pos)


def _bias(q_pos, k_pos) -> jax.Array:
    """`[tq, tk]`: 0 where a query may see a key, `_MASKED` where the causal mask hides it (added
    to the scores rather than selected, so nothing of the scores' full shape is made from the
    positions alone)."""
    return jnp.where(q_pos[:, None] >= k_pos[None, :], 0.0, _MASKED).astype(jnp.float32)


def _varying(pos: jax.Array, x: jax.Array) -> jax.Array:
    """`pos` plus a zero read from `x`. Positions are constants (iotas and `axis_index`); under
    `jax.checkpoint` inside a `lax.scan` (a recomputed layer), JAX's partial evaluation keeps
    what is made of constants alone as residuals and hoists them out of the loop: every tile's
    mask, O(length^2) bytes. Made of `x`, the masks are recomputed with the scores instead. The zero
    is a reduction of all of `x` (a scalar all-reduce where `x` is cut, where a slice of one element
    would gather it), which XLA folds away (an integer times zero)."""
    return pos + jnp.isnan(x).any().astype(pos.dtype) * 0


def _grads_tiled(rows: _Rows, k, v, scale: float, mask, tile: int | None):
    """`_grads`, a tile of `tile` keys at a time where `tile` is not None: `dq` summed over the
    tiles, `dk`, `dv` each tile's own."""
    tiles = _key_tiles(k, v, mask, tile)
    if tiles is None:
        return _grads(rows, k, v, scale, mask)

    def step(dq, kvp):
        k_t, v_t, p_t = kvp
        gq, gk, gv = _grads(rows, k_t, v_t, scale, None if mask is None else (mask[0], p_t))
        return dq + gq, (gk, gv)

    dq, (dk, dv) = jax.lax.scan(step, jnp.zeros_like(rows.q), tiles)
    whole = lambda x: jnp.moveaxis(x, 0, 1).reshape(k.shape)  # noqa: E731
    return dq, whole(dk), whole(dv)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _tiled(q, k, v, q_pos, k_pos, cfg: _Tiles) -> jax.Array:
    """Memory-efficient attention (Rabe and Staats; flash attention's schedule without its kernel):
    the keys and values taken a tile at a time with the softmax accumulated online, forward and
    backward, the backward recomputing each tile's weights from the saved log-sum-exp, so no more
    than one tile's scores `[b, kv, g, t, tile]` are ever held, not all `[b, kv, g, t, t]`."""
    return _tiled_fwd(q, k, v, q_pos, k_pos, cfg)[0]


def _tiled_fwd(q, k, v, q_pos, k_pos, cfg: _Tiles):
    state = _taken(_Online.start(q, k.shape[2]), q, k, v, cfg.scale, cfg.mask(q_pos, k_pos), cfg.tile)
    out = _Online.result(state, q)
    return out, (q, k, v, q_pos, k_pos, out, state[0] + jnp.log(state[1]))


def _tiled_bwd(cfg: _Tiles, saved, dout):
    q, k, v, q_pos, k_pos, out, lse = saved
    rows = _rows(q, dout, out, lse, k.shape[2])
    dq, dk, dv = _grads_tiled(rows, k, v, cfg.scale, cfg.mask(q_pos, k_pos), cfg.tile)
    return dq.reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def gathered(q, k, v, *, axes: Axes, parts: int, causal: bool, scale: float, zigzag_order: bool, block=None):
    """Queries on their run; keys and values all-gathered over `axes`."""
    me, length = jax.lax.axis_index(axes), q.shape[1] * parts
    k, v = (jax.lax.all_gather(x, axes, axis=1, tiled=True) for x in (k, v))
    every = jnp.concatenate([positions(i, length, parts, zigzag_order) for i in range(parts)])
    return attend(q, k, v, positions(me, length, parts, zigzag_order), every, causal, scale, block)


def ulysses(q, k, v, *, axes: Axes, parts: int, causal: bool, scale: float, zigzag_order: bool, block=None):
    """Heads for sequence by all-to-all, attention over the whole sequence, then back."""
    length = q.shape[1] * parts
    q, k, v = (jax.lax.all_to_all(x, axes, 2, 1, tiled=True) for x in (q, k, v))
    every = jnp.concatenate([positions(i, length, parts, zigzag_order) for i in range(parts)])
    out = attend(q, k, v, every, every, causal, scale, block)
    return jax.lax.all_to_all(out, axes, 1, 2, tiled=True)


class _Online:
    """Flash attention's running state for one device's queries: max, sum and unnormalised output."""

    @staticmethod
    def start(q, kv: int):
        b, t, h, d = q.shape
        shape = (b, kv, h // kv, t)
        return (
            jnp.full(shape, _MASKED, jnp.float32),
            jnp.zeros(shape, jnp.float32),
            jnp.zeros((b, t, kv, h // kv, d), jnp.float32),
        )

    @staticmethod
    def add(state, s, v):
        """`state` with the block of scores `s` `[b, kv, g, tq, tk]` on values `v` taken in."""
        m, l, o = state
        new = jnp.maximum(m, s.max(-1))
        p, old = jnp.exp(s - new[..., None]), jnp.exp(m - new)
        l = l * old + p.sum(-1)
        o = o * jnp.moveaxis(old, 3, 1)[..., None] + _values(p, v)
        return new, l, o

    @staticmethod
    def result(state, q):
        _, l, o = state
        return (o / jnp.moveaxis(l, 3, 1)[..., None]).reshape(q.shape).astype(q.dtype)


class _Ring(NamedTuple):
    """A ring's static settings (hashable: the custom VJP's non-differentiable argument)."""

    axes: Axes
    parts: int
    causal: bool
    scale: float
    zigzag_order: bool
    tile: int | None

    @property
    def balanced(self) -> bool:
        return self.causal and self.zigzag_order

    def passed(self, xs):
        """`xs` sent on to the next device of the ring."""
        return tuple(jax.lax.ppermute(x, self.axes, [(i, (i + 1) % self.parts) for i in range(self.parts)]) for x in xs)


def ring(q, k, v, *, axes: Axes, parts: int, causal: bool, scale: float, zigzag_order: bool, block=None):
    """Keys and values passed around the ring: forward, `parts - 1` collective-permutes of each;
    backward, the same passes again, beside the keys' and values' gradients, which travel with
    their block and one pass more, home. Each device keeps its own blocks only (the backward
    recomputes each block's weights from the saved log-sum-exp, as flash attention does). Where
    `tile_of(block, ...)` of a block's keys is not None, each block is taken a tile at a time."""
    tile = tile_of(block, k.shape[1] // 2 if causal and zigzag_order else k.shape[1])
    return _ring(q, k, v, _Ring(axes, parts, causal, scale, zigzag_order, tile))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _ring(q, k, v, cfg: _Ring) -> jax.Array:
    return _ring_forward(q, k, v, cfg)[0]


def _ring_forward(q, k, v, cfg: _Ring):
    """The output and each query row's log-sum-exp of its scores `[b, kv, g, tq]`."""
    me, length = jax.lax.axis_index(cfg.axes), q.shape[1] * cfg.parts
    q_pos = positions(me, length, cfg.parts, cfg.zigzag_order)

    def block(state, kv, source):
        k_blk, v_blk = kv
        if cfg.balanced:
            return _zigzag_block(state, q, k_blk, v_blk, me, source, cfg.scale, cfg.tile)
        k_pos = positions(source, length, cfg.parts, cfg.zigzag_order)
        return _taken(state, q, k_blk, v_blk, cfg.scale, (q_pos, k_pos) if cfg.causal else None, cfg.tile)

    def step(carry, i):
        state, kv = carry
        return (block(state, kv, (me - i) % cfg.parts), cfg.passed(kv)), None

    state = _Online.start(q, k.shape[2])
    (state, kv), _ = jax.lax.scan(step, (state, (k, v)), jnp.arange(cfg.parts - 1))
    state = block(state, kv, (me - cfg.parts + 1) % cfg.parts)
    return _Online.result(state, q), state[0] + jnp.log(state[1])


def _zigzag_block(state, q, k, v, me, source, scale: float, tile: int | None):
    """One block of a causal ring in zig-zag order. Device i holds chunks (i, 2n-1-i): its own
    block is causal within; a block from device j < i is seen whole by both its query chunks
    through its first key chunk only (its second comes after both); one from j > i is seen whole
    through both key chunks by the second query chunk only. Half a block's work either way."""
    half = q.shape[1] // 2

    def own(state):
        pos = jnp.arange(q.shape[1]) % half + jnp.where(jnp.arange(q.shape[1]) < half, 0, 2 * half)
        return _taken(state, q, k, v, scale, (pos, pos), tile)

    def earlier(state):
        return _taken(state, q, k[:, :half], v[:, :half], scale, None, tile)

    def later(state):
        m, l, o = state
        low = (m[..., :half], l[..., :half], o[:, :half])
        high = _taken((m[..., half:], l[..., half:], o[:, half:]), q[:, half:], k, v, scale, None, tile)
        return tuple(jnp.concatenate([a, b], axis=-1 if i < 2 else 1) for i, (a, b) in enumerate(zip(low, high)))

    branch = jnp.where(source == me, 0, jnp.where(source < me, 1, 2))
    return jax.lax.switch(branch, (own, earlier, later), state)


def _ring_fwd(q, k, v, cfg: _Ring):
    out, lse = _ring_forward(q, k, v, cfg)
    return out, (q, k, v, out, lse)


def _ring_bwd(cfg: _Ring, saved, dout):
    q, k, v, out, lse = saved
    rows = _rows(q, dout, out, lse, k.shape[2])
    me, length = jax.lax.axis_index(cfg.axes), q.shape[1] * cfg.parts
    q_pos = positions(me, length, cfg.parts, cfg.zigzag_order)

    def block(kv_blk, source):
        if cfg.balanced:
            return _zigzag_grads(rows, *kv_blk, me, source, cfg.scale, cfg.tile)
        k_pos = positions(source, length, cfg.parts, cfg.zigzag_order)
        return _grads_tiled(rows, *kv_blk, cfg.scale, (q_pos, k_pos) if cfg.causal else None, cfg.tile)

    def step(carry, i):
        dq, kv_blk, dkv = carry
        gq, gk, gv = block(kv_blk, (me - i) % cfg.parts)
        return (dq + gq, cfg.passed(kv_blk), cfg.passed((dkv[0] + gk, dkv[1] + gv))), None

    zeros = jnp.zeros(k.shape, jnp.float32)
    start = (jnp.zeros_like(rows.q), (k, v), (zeros, zeros))
    (dq, kv_blk, dkv), _ = jax.lax.scan(step, start, jnp.arange(cfg.parts - 1))
    gq, gk, gv = block(kv_blk, (me - cfg.parts + 1) % cfg.parts)
    dk, dv = cfg.passed((dkv[0] + gk, dkv[1] + gv))  # home: each block's gradients to its own device
    return (dq + gq).reshape(q.shape).astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


_ring.defvjp(_ring_fwd, _ring_bwd)


class _Rows(NamedTuple):
    """One device's query rows as the backward reads them (grouped `[b, t, kv, g, d]`, float32):
    queries, the output's cotangent, the scores' log-sum-exp and `sum(dout * out)` per row."""

    q: jax.Array
    dout: jax.Array
    lse: jax.Array
    delta: jax.Array

    def half(self, upper: bool):
        """The rows of one of the two chunks a zig-zag device holds."""
        n = self.q.shape[1] // 2
        cut = slice(n, None) if upper else slice(None, n)
        return _Rows(self.q[:, cut], self.dout[:, cut], self.lse[..., cut], self.delta[..., cut])


def _rows(q, dout, out, lse, kv: int) -> _Rows:
    """The `_Rows` of queries `q` `[b, t, h, d]`, their output `out`, its cotangent `dout` and the
    scores' log-sum-exp `lse` over `kv` key/value heads."""
    b, t, h, d = q.shape
    grouped = lambda x: x.reshape(b, t, kv, h // kv, d).astype(jnp.float32)  # noqa: E731
    return _Rows(grouped(q), grouped(dout), lse, jnp.einsum("bqkgd,bqkgd->bkgq", grouped(dout), grouped(out)))


def _grads(rows: _Rows, k, v, scale: float, mask):
    """The gradients of the rows' attention to one block of keys `k` and values `v`: `(dq, dk, dv)`."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", rows.q, k, preferred_element_type=jnp.float32) * scale
    if mask is not None:
        q_pos, k_pos = mask
        s = _masked(s, q_pos, k_pos, True)
    p = jnp.exp(s - rows.lse[..., None])
    dv = jnp.einsum("bkgqs,bqkgd->bskd", p, rows.dout)
    ds = p * (jnp.einsum("bqkgd,bskd->bkgqs", rows.dout, v.astype(jnp.float32)) - rows.delta[..., None]) * scale
    return jnp.einsum("bkgqs,bskd->bqkgd", ds, k.astype(jnp.float32)), jnp.einsum("bkgqs,bqkgd->bskd", ds, rows.q), dv


def _zigzag_grads(rows: _Rows, k, v, me, source, scale: float, tile: int | None):
    """`_zigzag_block`'s three cases, backward: the same halves of the block."""
    half = k.shape[1] // 2

    def own():
        pos = jnp.arange(2 * half) % half + jnp.where(jnp.arange(2 * half) < half, 0, 2 * half)
        return _grads_tiled(rows, k, v, scale, (pos, pos), tile)

    def earlier():
        dq, dk, dv = _grads_tiled(rows, k[:, :half], v[:, :half], scale, None, tile)
        pad = [(0, 0), (0, half), (0, 0), (0, 0)]
        return dq, jnp.pad(dk, pad), jnp.pad(dv, pad)

    def later():
        dq, dk, dv = _grads_tiled(rows.half(True), k, v, scale, None, tile)
        return jnp.pad(dq, [(0, 0), (half, 0), (0, 0), (0, 0), (0, 0)]), dk, dv

    branch = jnp.where(source == me, 0, jnp.where(source < me, 1, 2))
    return jax.lax.switch(branch, (own, earlier, later))


FORMS = {"gather": gathered, "ring": ring, "ulysses": ulysses}
"""Form name -> its `shard_map` body."""
