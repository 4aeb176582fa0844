"""Parameters a `jshard.shard` strategy cuts inside their stage, packed as they are cut.

The cut form (`_staged.py`) packs a stage's parameter leaves into one flat buffer per dtype, whole
on each of the stage's devices. A leaf a strategy cuts inside its stage (Megatron's column or row
cut, `Cut.param_specs`; or the cut a stage's search gave it, `SearchedCut.param_specs`) goes into
the buffer of its layout class instead (`CutClass`): the leaves of one dtype cut over the same
axes, each stored as its shards side by side (`to_rows`), so each device holds only its shard.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jshard.pipeline._cut import spec_axes


@dataclasses.dataclass(frozen=True)
class CutClass:
    """The parameter leaves of one dtype cut over the same axes inside their stages, packed as one
    `[S·v, n, width]` buffer cut over `stage` and `axes`: row `k` holds stage `k`'s leaves, each
    as its `n` shards (`to_rows`) side by side, so device `i` of the `n` holds shard `i` of each.

    Attributes:
      dtype: the leaves' dtype name.
      axes: the stage's axes that cut them, in mesh order.
      n: how many devices those axes hold.
      leaves: per (virtual) stage, the indices of its leaves of this class.
      specs: per leaf index, its `PartitionSpec` inside the stage.
      width: per device, the elements of the largest stage's shards.
    """

    dtype: str
    axes: tuple[str, ...]
    n: int
    leaves: tuple[tuple[int, ...], ...]
    specs: dict[int, P]
    width: int

    @property
    def key(self) -> str:
        """Its name among the packed buffers (`float32@d0.d1`; a dtype's whole buffer is named by the dtype)."""
        return f"{self.dtype}@{'.'.join(self.axes)}"

    def pack(self, k: int, leaves: Sequence[jax.Array], sizes: dict[str, int]) -> jax.Array:
        """Stage `k`'s leaves of the class as its `[n, width]` row, zero-padded."""
        rows = [to_rows(x, self.specs[j], self.axes, sizes) for j, x in zip(self.leaves[k], leaves)]
        used = sum(r.shape[1] for r in rows)
        pad = [jnp.zeros((self.n, self.width - used), self.dtype)] if self.width > used else []
        return jnp.concatenate([r.astype(self.dtype) for r in rows] + pad, axis=1) if rows or pad else \
            jnp.zeros((self.n, 0), self.dtype)

    def unpack(self, k: int, row: jax.Array, avals: Sequence[Any], sizes: dict[str, int]) -> list[jax.Array]:
        """Stage `k`'s leaves of the class read back from its `[n, width]` row (`avals`: all leaves')."""
        out, start = [], 0
        for j in self.leaves[k]:
            local = int(np.prod(avals[j].shape)) // self.n
            out.append(from_rows(row[:, start:start + local], self.specs[j], self.axes, sizes, avals[j].shape))
            start += local
        return out


def _split(shape: Sequence[int], spec: P, sizes: dict[str, int]) -> tuple[list[int], list[str | None]]:
    """Each dim of `shape` split into its cutting axes' sizes (major first) and the shard's extent:
    the sizes, and per split dim its axis (None: the shard's own extent)."""
    split, names = [], []
    for d, size in enumerate(shape):
        axes = spec_axes(spec[d:d + 1])
        split += [sizes[a] for a in axes] + [size // int(np.prod([sizes[a] for a in axes]))]
        names += [*axes, None]
    return split, names


def to_rows(x: jax.Array, spec: P, axes: Sequence[str], sizes: dict[str, int]) -> jax.Array:
    """`x`, laid out as `spec` cuts it over `axes`, as `[n, x.size / n]`: row `i` the flat shard of
    the device at position `i` of `axes` (major first).

    Examples:
      >>> to_rows(jnp.arange(8).reshape(2, 4), P(None, "a"), ("a",), {"a": 2}).tolist()
      [[0, 1, 4, 5], [2, 3, 6, 7]]
    """
    split, names = _split(x.shape, spec, sizes)
    order = [names.index(a) for a in axes] + [i for i, name in enumerate(names) if name is None]
    return jnp.transpose(x.reshape(split), order).reshape(int(np.prod([sizes[a] for a in axes])), -1)


def from_rows(rows: jax.Array, spec: P, axes: Sequence[str], sizes: dict[str, int], shape: Sequence[int]) -> jax.Array:
    """The array of `shape` whose `to_rows` is `rows`."""
    split, names = _split(shape, spec, sizes)
    order = [names.index(a) for a in axes] + [i for i, name in enumerate(names) if name is None]
    return jnp.transpose(rows.reshape([split[i] for i in order]), np.argsort(order)).reshape(shape)
