"""Gradient buckets: MindSpore's `comm_fusion` where jshard reduces the gradients itself.

Where `jshard.accumulate` runs in a `shard_map` manual over the batch's axes, each device sums its
own gradients and jshard emits their reduction. With `parallelize(..., communication=
js.Communication(fusion=...))` that reduction is cut into buckets, as MindSpore's fusion groups
and PyTorch DDP's buckets cut it: the leaves, in `jax.tree.leaves` order of what the gradient
function returns, are dealt into buckets (`size`: a new bucket where the next leaf would pass the
threshold, a leaf larger than it alone; `index`: split at the given leaf indices; threshold 0: one
leaf per bucket; `index` counts the parameters' gradients, as MindSpore counts parameters), and
each bucket's leaves of one dtype are flattened into one buffer and reduced
by one `psum`: one all-reduce per bucket and dtype, whatever the backend's combiner would do (the
program is compiled with it off, `jshard/compile/_fusion.py`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jshard._errors import ShardingError
from jshard.compile import Fusion

Bucket = tuple[int, str, int | None]
"""One all-reduce jshard emits for the gradients: `(leaves, dtype name, bytes per device)`; the
bytes None where other mesh axes may cut the leaf (its bytes per device are XLA's to decide)."""


def buckets(sizes: Sequence[int], fusion: Fusion, gradients: Sequence[int] | None = None) -> list[list[int]]:
    """The leaf indices of each bucket, in order, for leaves of `sizes` bytes. `index` counts the
    parameters' gradients (`gradients`: their leaf indices, in the parameters' order; None: every
    leaf), as MindSpore counts parameters; the other leaves (the loss, metrics) join the first bucket.

    Examples:
      >>> buckets([4, 4, 4, 8], Fusion("size", 8 / 2**20))
      [[0, 1], [2], [3]]
      >>> buckets([4, 4, 4, 8], Fusion("index", (1, 3)))
      [[0], [1, 2], [3]]
      >>> buckets([4, 4, 4, 8], Fusion("index", (1,)), gradients=[1, 2, 3])
      [[0, 1], [2, 3]]
      >>> buckets([4, 4], Fusion("size", 0))
      [[0], [1]]
    """
    if fusion.mode == "index":
        order = list(range(len(sizes)) if gradients is None else gradients)
        cuts = [0, *(i for i in fusion.config if i < len(order)), len(order)]
        split = [[order[i] for i in range(a, c)] for a, c in zip(cuts, cuts[1:]) if c > a] or [[]]
        split[0] = sorted({*split[0], *(i for i in range(len(sizes)) if i not in set(order))})
        return [bucket for bucket in split if bucket]
    limit = fusion.threshold_bytes
    assert limit is not None  # mode "size" or "auto"
    out: list[list[int]] = []
    held = 0
    for i, size in enumerate(sizes):
        if not out or held + size > limit:
            out.append([])
            held = 0
        out[-1].append(i)
        held += size
    return out


def bucketed(leaves: Sequence[jax.Array], axes: tuple[str, ...], fusion: Fusion | None, flat: bool,
             call: str, gradients: Sequence[int] | None = None) -> tuple[list[jax.Array], list[Bucket]]:
    """`leaves` summed over the manual mesh `axes`, one `psum` per bucket and dtype, and a record of
    each; `fusion` None: `auto` (64 MiB buckets); `gradients` as `buckets` takes them. `flat` False
    (other mesh axes may cut the leaves, so flattening one would gather it): one `psum` per leaf,
    `auto` included.

    Raises:
      ShardingError: `flat` is False and `fusion` (`size` or `index`) puts several leaves in a bucket.
    """
    given = fusion
    fusion = fusion or Fusion()
    sizes = [math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves]
    dealt = buckets(sizes, fusion, gradients)
    if not flat and given is not None and given.mode != "auto" and any(len(b) > 1 for b in dealt):
        raise ShardingError(_gathering_error(call, given))
    out: dict[int, jax.Array] = {}
    made: list[Bucket] = []
    for bucket in dealt if flat else [[i] for i in range(len(leaves))]:
        for dtype in dict.fromkeys(np.dtype(leaves[i].dtype) for i in bucket):
            ids = [i for i in bucket if np.dtype(leaves[i].dtype) == dtype]
            buffer = jnp.concatenate([jnp.ravel(leaves[i]) for i in ids]) if len(ids) > 1 else leaves[ids[0]]
            summed = jax.lax.psum(buffer, axes)
            made.append((len(ids), dtype.name, sum(sizes[i] for i in ids) if flat else None))
            if len(ids) == 1:
                out[ids[0]] = summed
                continue
            offsets = np.cumsum([0, *(math.prod(np.shape(leaves[i])) for i in ids)])
            for i, a, b in zip(ids, offsets, offsets[1:]):
                out[i] = jnp.reshape(summed[a:b], np.shape(leaves[i]))
    return [out[i] for i in range(len(leaves))], made


def _gathering_error(call: str, fusion: Fusion) -> str:
    return (f"{call}: Communication(fusion={{'allreduce': {{'mode': {fusion.mode!r}, 'config': {fusion.config!r}}}}}) "
            f"puts several gradients in one all-reduce, which jshard makes by flattening them into one buffer; "
            f"here mesh axes besides the batch's may cut them, and flattening a cut gradient would gather it. "
            f"Give the allreduce mode 'auto' or 'size' 0 (one all-reduce per gradient), or use mode='data'.")
