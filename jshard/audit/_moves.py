"""`moved_bytes`: what placing arrays on given shardings moves, the cost a training loop pays
between two calls where a step takes an argument in one layout and returns it in another.

The audit of one compiled program (`audit`) reads the collectives inside it; a loop that feeds a
step's results back as its next arguments also pays for every result that comes back laid out
otherwise than the next call takes it (`jax.device_put` before the call). This counts those
bytes, per device: for each device, the bytes of its target shard it does not already hold
(an array not yet on devices sends every device its whole shard); the figure is the busiest
device's, as `Audit.bytes` gives a collective's bytes per device.
"""

from __future__ import annotations

import collections
import math
from typing import Any

import jax
import numpy as np


def moved_bytes(args: Any, shardings: Any) -> float:
    """Bytes per device (the busiest device's) that placing `args` on `shardings` moves.

    Args:
      args: a pytree of arrays (a step's next arguments).
      shardings: a pytree like `args` of `jax.sharding.Sharding`s (what the step takes them as).

    Returns:
      0.0 where every array is already where it is taken.

    Examples:
      >>> import jax, jax.numpy as jnp, numpy as np
      >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
      >>> mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
      >>> rows = jax.device_put(jnp.zeros((4, 2)), NamedSharding(mesh, P("x")))
      >>> moved_bytes(rows, NamedSharding(mesh, P("x"))), moved_bytes(rows, NamedSharding(mesh, P()))
      (0.0, 16.0)
    """
    received: collections.Counter = collections.Counter()
    for x, target in zip(jax.tree.leaves(args), jax.tree.leaves(shardings)):
        source = x.sharding if isinstance(x, jax.Array) else None
        received.update(_received(np.shape(x), _itemsize(x.dtype), source, target))
    return float(max(received.values(), default=0))


def moved_between(arrays: Any, sources: Any, targets: Any) -> float:
    """Bytes per device (the busiest device's) that moving arrays of the shapes and dtypes of
    `arrays` (arrays or `jax.ShapeDtypeStruct`s) from the shardings `sources` to `targets` moves:
    `moved_bytes` for arrays not made yet, as a plan prices what a loop will move."""
    received: collections.Counter = collections.Counter()
    for x, source, target in zip(jax.tree.leaves(arrays), jax.tree.leaves(sources), jax.tree.leaves(targets)):
        received.update(_received(tuple(x.shape), _itemsize(x.dtype), source, target))
    return float(max(received.values(), default=0))


def _itemsize(dtype) -> int:
    """Bytes per element, PRNG key arrays' extended dtypes (`key<fry>`: their key data) included."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.extended):
        return int(dtype.itemsize)
    return np.dtype(dtype).itemsize


def _received(shape: tuple, itemsize: int, source, target) -> collections.Counter:
    """Per device, the bytes of its shard under `target` it does not hold under `source` (None: not
    on devices yet)."""
    received: collections.Counter = collections.Counter()
    if source is not None and source.is_equivalent_to(target, len(shape)):
        return received
    held = source.devices_indices_map(shape) if source is not None else {}
    for device, index in target.devices_indices_map(shape).items():
        have = _overlap(index, held[device], shape) if device in held else 0
        received[device] += (_volume(index, shape) - have) * itemsize
    return received


def _ranges(index: tuple, shape: tuple) -> list[range]:
    return [range(*s.indices(n)) for s, n in zip(index, shape)] + [range(n) for n in shape[len(index):]]


def _volume(index: tuple, shape: tuple) -> int:
    return math.prod(len(r) for r in _ranges(index, shape))


def _overlap(a: tuple, b: tuple, shape: tuple) -> int:
    return math.prod(max(0, min(p.stop, q.stop) - max(p.start, q.start)) for p, q in zip(_ranges(a, shape),
                                                                                      _ranges(b, shape)))
