"""The slotted buffers of the stacked pipeline program (`_engine.py`), `[v, slots, ...]`: chunk `c`'s
slot of micro-batch `i` read (`slot_of`), written (`put_slot`), and written where the stage received
something this tick (`receive_slot`), made (`zero_slots`); `replace_entry`, `take`'s inverse."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def replace_entry(a: jax.Array, i: jax.Array, value: jax.Array, axis: int) -> jax.Array:
    """`a` with its entry `i` along `axis` set to `value` (`take`'s inverse, one `dynamic_update_slice`)."""
    return jax.lax.dynamic_update_index_in_dim(a, value, i, axis, allow_negative_indices=False)


def _slot(buf, c, i):
    """The start of chunk `c`'s slot of micro-batch `i` in `buf` (`[v, slots, ...]`, slot = micro-batch
    mod slots): both indices non-negative (`take`)."""
    return (c, jax.lax.rem(i, buf.shape[1])) + (0,) * (buf.ndim - 2)


def slot_of(buf, c, i):
    """Chunk `c`'s slot of micro-batch `i` in `buf` (`_slot`)."""
    sizes = (1, 1, *buf.shape[2:])
    return jax.lax.dynamic_slice(buf, _slot(buf, c, i), sizes, allow_negative_indices=False).reshape(buf.shape[2:])


def put_slot(buf, c, i, value):
    """`buf` with chunk `c`'s slot of micro-batch `i` set to `value` (`_slot`)."""
    return jax.lax.dynamic_update_slice(buf, value[None, None], _slot(buf, c, i), allow_negative_indices=False)


def receive_slot(buf, value, mine, prefix):
    """Writes `value` into chunk `c`'s slot of micro-batch `i` where this stage received something."""
    c, i = mine[f"{prefix}_chunk"], mine[f"{prefix}_micro"]
    return put_slot(buf, c, i, jnp.where(mine[f"{prefix}_valid"] > 0, value, slot_of(buf, c, i)))


def zero_slots(lead: tuple[int, ...], like) -> jax.Array:
    return jnp.zeros((*lead, *like.shape), like.dtype)
