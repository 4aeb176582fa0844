"""`shard_batch`, `local_slices` and `ShardedLoader`: a batch as global arrays over all processes.

A batch's strategy is MindSpore's `dataset_strategy`: `"data_parallel"` cuts dim 0 of every array
over all devices, `"full_batch"` gives every device the whole batch, and a tuple with one strategy
per array (`((1, 1, 2, 4),)` cuts an NHWC image's H 2-way and W 4-way) or a `Layout` call per array
cuts what it says, with MindSpore's repeated calculation for tuples covering fewer devices. Devices
are ranked host-major (`jshard._distributed.host_major`), so a process holds one contiguous block
of the global batch, and `parallelize` on the same devices sees the same `NamedSharding`s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jshard._distributed import host_major
from jshard._errors import ShardingError, api_boundary
from jshard.layouts import DatasetStrategy, FineMesh, dataset_slots, layout_of, slices


@api_boundary
def batch_shardings(ndims: Sequence[int], strategy: DatasetStrategy = "data_parallel", *,
                    devices: int | None = None, call: str = "jshard.data.batch_shardings") -> list[NamedSharding]:
    """The `NamedSharding` of each batch array (given by its number of dims) under `strategy`.

    Args:
      ndims: each array's number of dims, in the batch's leaf order.
      strategy: a `DatasetStrategy`.
      devices: how many devices (the first of `jax.devices()`, host-major); default all.
      call: the public call, for errors.

    Examples:
      >>> [s.spec for s in batch_shardings([2, 1], "data_parallel")]
      [P(('d0', 'd1', 'd2'),), P(('d0', 'd1', 'd2'),)]
      >>> [s.spec for s in batch_shardings([4], ((1, 1, 2, 4),))]
      [P(None, None, 'd0', ('d1', 'd2'))]
    """
    chosen = _devices(devices, call)
    n = len(chosen)
    layouts = [layout_of(slot, n, call=call, op="the batch", what=f"dataset_strategy[{i}]")
               for i, slot in enumerate(dataset_slots(ndims, strategy, n, call=call))]
    fine = FineMesh.refining(n, [lay.device_matrix for lay in layouts], [f"dataset_strategy[{i}]" for i in range(len(layouts))],
                             call=call)
    mesh = fine.jax_mesh(chosen)
    return [NamedSharding(mesh, fine.partition_spec(lay)) for lay in layouts]


@api_boundary
def shard_batch(local_batch: Any, strategy: DatasetStrategy = "data_parallel", *, devices: int | None = None) -> Any:
    """Global arrays from each process's part of a batch (`jax.make_array_from_process_local_data`).

    Each process passes the block of every array that its devices hold under `strategy`: with
    `"data_parallel"` on 2 processes, process 0 passes the first half of the rows and process 1 the
    second; with `"full_batch"` every process passes the whole batch. In one process that block is
    the whole batch. `local_slices` says which block a process holds.

    Args:
      local_batch: a pytree of arrays, this process's block of each.
      strategy: a `DatasetStrategy` (default `"data_parallel"`).
      devices: how many devices (the first of `jax.devices()`, host-major); default all.

    Returns:
      The same pytree of global `jax.Array`s.

    Raises:
      ShardingError: a strategy whose count or rank does not fit the batch, or a local block whose
        dims the strategy's local slices do not divide.

    Examples:
      >>> batch = shard_batch((np.zeros((8, 3)), np.arange(8)))
      >>> batch[0].shape, batch[0].sharding.spec
      ((8, 3), P(('d0', 'd1', 'd2'),))
    """
    call = "jshard.data.shard_batch"
    leaves, treedef = jax.tree_util.tree_flatten(local_batch)
    leaves = [np.asarray(x) for x in leaves]
    shardings = batch_shardings([x.ndim for x in leaves], strategy, devices=devices, call=call)
    for i, (x, s) in enumerate(zip(leaves, shardings)):
        _check_local(call, i, x, s)
    arrays = [jax.make_array_from_process_local_data(s, x) for x, s in zip(leaves, shardings)]
    return jax.tree_util.tree_unflatten(treedef, arrays)


@api_boundary
def local_slices(global_shape: Sequence[int], sharding: NamedSharding) -> tuple[slice, ...]:
    """The block of a `global_shape` array that this process's devices hold under `sharding`.

    Examples:
      >>> local_slices((8, 3), batch_shardings([2])[0])   # one process: everything
      (slice(0, 8, None), slice(0, 3, None))
    """
    index = sharding.addressable_devices_indices_map(tuple(global_shape))
    out = []
    for d, size in enumerate(global_shape):
        starts = [idx[d].indices(size)[0] for idx in index.values()]
        stops = [idx[d].indices(size)[1] for idx in index.values()]
        out.append(slice(min(starts), max(stops)))
    return tuple(out)


class ShardedLoader:
    """Global batches from a row-addressable source, each process reading only the rows it holds.

    `read(start, stop)` returns rows `start:stop` of the dataset as a pytree of arrays (a memory map,
    a file of records, a database query). Batch `k` is rows `k * batch_size .. (k + 1) * batch_size`;
    under `strategy` each process asks `read` for its own rows of it only (with `"full_batch"`: all
    of them), keeps its block of the other dims, and gets global arrays back.

    Args:
      read: `read(start, stop) -> pytree of arrays` with `stop - start` rows each.
      batch_size: global rows per batch.
      shapes: the global shape of each array of one batch (leaf order), e.g. `[(32, 16), (32,)]`.
      strategy: a `DatasetStrategy` (default `"data_parallel"`).
      devices: how many devices (the first of `jax.devices()`, host-major); default all.

    Examples:
      >>> data = np.arange(64.0).reshape(16, 4)
      >>> loader = ShardedLoader(lambda a, b: data[a:b], 8, [(8, 4)])
      >>> loader.rows, float(loader.batch(1).sum()) == float(data[8:].sum())
      ((0, 8), True)
    """

    def __init__(self, read: Callable[[int, int], Any], batch_size: int, shapes: Sequence[Sequence[int]],
                 strategy: DatasetStrategy = "data_parallel", *, devices: int | None = None):
        call = "jshard.data.ShardedLoader"
        shapes = [tuple(s) for s in shapes]
        if any(not s or s[0] != batch_size for s in shapes):
            raise ShardingError(f"{call}: every array of a batch has batch_size={batch_size} rows in dim 0; "
                                f"shapes are {shapes}.")
        self.read, self.batch_size, self.strategy, self.devices = read, batch_size, strategy, devices
        self.shardings = batch_shardings([len(s) for s in shapes], strategy, devices=devices, call=call)
        self.blocks = [local_slices(s, sh) for s, sh in zip(shapes, self.shardings)]
        rows = {(b[0].start, b[0].stop) for b in self.blocks}
        if len(rows) != 1:
            raise ShardingError(f"{call}: the strategy {strategy} gives this process different rows of different "
                                f"arrays ({sorted(rows)}); cut dim 0 the same way for every array of the batch.")
        self.rows: tuple[int, int] = rows.pop()
        """This process's rows of every batch, `(start, stop)`."""

    @api_boundary
    def batch(self, k: int) -> Any:
        """Batch `k` as global arrays; this process reads only its rows of it."""
        start = k * self.batch_size
        local = self.read(start + self.rows[0], start + self.rows[1])
        leaves, treedef = jax.tree_util.tree_flatten(local)
        blocks = [np.asarray(x)[(slice(None),) + b[1:]] for x, b in zip(leaves, self.blocks)]
        arrays = [jax.make_array_from_process_local_data(s, x) for x, s in zip(blocks, self.shardings)]
        return jax.tree_util.tree_unflatten(treedef, arrays)


def _devices(count: int | None, call: str) -> list[jax.Device]:
    have = host_major(jax.devices())
    if count is None:
        return have
    if count < 1 or count > len(have):
        raise ShardingError(f"{call}: devices={count}, but {len(have)} device(s) are present; give 1..{len(have)}.")
    return have[:count]


def _check_local(call: str, i: int, x: np.ndarray, sharding: NamedSharding) -> None:
    """The local block must split evenly into the slices this process's devices hold."""
    for d, (size, s) in enumerate(zip(x.shape, local_slices(slices(sharding.spec, x.ndim, dict(sharding.mesh.shape)), sharding))):
        pieces = s.stop - s.start
        if size % pieces:
            raise ShardingError(
                f"{call}: batch array {i} is {x.shape} on this process (process {jax.process_index()}), and its "
                f"devices hold {pieces} slices of dim {d}, but {pieces} does not divide {size}. Give each "
                f"process a block whose dim {d} is a multiple of {pieces}."
            )

