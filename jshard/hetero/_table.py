"""Host-resident embedding tables (MindSpore's parameter-server mode, synchronous).

A `HostTable` argument of a parallelized step lives in host memory (memory kind `pinned_host`)
and never crosses to the device: `lookup` reads the rows a batch asks for on the host and sends
only those to the device; `sparse_update` applies SGD on the host to the rows the batch touched,
from the whole batch's row gradients (gathered to every device: ids and rows, not the table). With
`cut_rows` (the default when many processes run) the rows are cut over the devices, so each host
keeps its share, sends the rows a lookup asks for, and updates only the rows it owns.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jshard import _context
from jshard._errors import ShardingError, api_boundary
from jshard._format import human_bytes, shape_str
from jshard.hetero._host import host_function, on_host


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostTable:
    """An embedding table kept in host memory between steps and used on the host.

    Attributes:
      rows: the table, `(vocabulary, dim)`.
      cut_rows: cut the rows over the devices (each host keeps its share); default: when more than
        one process runs.
    """

    rows: Any
    cut_rows: bool = dataclasses.field(default=False, metadata={"static": True})


@api_boundary
def host_table(rows: Any, *, cut_rows: bool | None = None) -> HostTable:
    """`rows` as a `HostTable` for `parallelize`: kept in host memory, looked up and updated there.

    Args:
      rows: the table, `(vocabulary, dim)`.
      cut_rows: cut the rows over the devices; None: when `jax.process_count() > 1`.

    Raises:
      ShardingError: the table (or each host's share) does not fit one host's memory.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> js.hetero.host_table(jnp.zeros((1000, 8))).rows.shape
      (1000, 8)
    """
    cut = jax.process_count() > 1 if cut_rows is None else bool(cut_rows)
    check_fits("jshard.hetero.host_table", np.shape(rows), np.dtype(rows.dtype), jax.process_count() if cut else 1)
    return HostTable(rows, cut)


def check_fits(call: str, shape: tuple[int, ...], dtype: np.dtype, hosts: int, memory: float | None = None) -> None:
    """Raises `ShardingError` where each of `hosts` hosts' share of a table exceeds `memory` bytes
    (default: this host's physical memory)."""
    memory = _host_memory() if memory is None else memory
    share = math.prod(shape) * dtype.itemsize / hosts
    if share > memory:
        need = math.ceil(math.prod(shape) * dtype.itemsize / memory)
        raise ShardingError(
            f"{call}: the embedding table {shape_str(dtype, shape)} needs {human_bytes(share)} on each of {hosts} "
            f"host(s), but a host has {human_bytes(memory)} of memory. Cut its rows over at least {need} hosts' "
            f"processes (cut_rows=True with that many processes), or store it in a narrower dtype.")


def _host_memory() -> float:
    return float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def table_sharding(table: HostTable, mesh) -> NamedSharding:
    """The rows' sharding on `mesh`: cut over every axis (`cut_rows`), else whole on each host."""
    axes = tuple(a for a, n in mesh.shape.items() if n > 1)
    return NamedSharding(mesh, PartitionSpec(axes or None, None) if table.cut_rows else PartitionSpec())


@api_boundary
def lookup(table: HostTable, ids: Any) -> jax.Array:
    """`table.rows[ids]`, read on the host; only the rows cross to the device. Differentiable in
    neither argument: train the table with `sparse_update` from the gradient of the result.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> js.hetero.lookup(js.hetero.host_table(jnp.arange(6.0).reshape(3, 2)), jnp.array([2]))
      Array([[4., 5.]], dtype=float32)
    """
    # rows cut over the devices: every device's host looks up the whole batch's ids in its own rows
    # (a masked lookup whose result is summed over the devices); the ids cross, never the rows
    return _gather(jax.lax.stop_gradient(table.rows), _whole(ids) if table.cut_rows else ids)


@api_boundary
def sparse_update(table: HostTable, ids: Any, grads: Any, learning_rate: float) -> HostTable:
    """SGD on the rows the batch touched, on the host: `rows[ids] -= learning_rate * grads`
    (repeated ids add up, as the dense gradient of `rows[ids]` does). `grads` is the gradient of
    the loss with respect to `lookup(table, ids)`.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> t = js.hetero.host_table(jnp.zeros((3, 2)))
      >>> js.hetero.sparse_update(t, jnp.array([1, 1]), jnp.ones((2, 2)), 0.5).rows[1]
      Array([-1., -1.], dtype=float32)
    """
    ids, grads = _whole(ids), _whole(grads)  # every device's host applies the whole batch's rows
    lr = np.asarray(learning_rate, grads.dtype)
    ctx = _context.current()
    if not table.cut_rows or ctx is None:
        return HostTable(_scatter(table.rows, ids, grads, lr), table.cut_rows)
    shards = np.arange(ctx.mesh.devices.size, dtype=np.int32)  # each device's host updates its own rows
    return HostTable(_scatter_blocks(table.rows, ids, grads, lr, shards), table.cut_rows)


def _whole(x: Any) -> Any:
    """`x` gathered whole to every device inside a parallelized step (outside one: as it is)."""
    ctx = _context.current()
    return x if ctx is None else jax.lax.with_sharding_constraint(x, NamedSharding(ctx.mesh, PartitionSpec()))


_gather = on_host(lambda rows, ids: rows[ids])
def _scatter_rows_by_block(rows, ids, grads, lr, shards):
    """`rows.at[ids].add(-lr * grads)` as one scatter per block of rows (`shards` blocks, the cut's),
    each taking only the ids it holds (the others fall outside it and are dropped): laid out with
    the blocks cut, every device updates its own rows and no row of the table moves."""
    n = shards.shape[0]
    size = rows.shape[0] // n

    def block_update(block, k):
        local = ids % size + (ids // size != k).astype(ids.dtype) * size  # another block's id: out of range
        return block.at[local].add(-lr * grads, mode="drop")

    return jax.vmap(block_update)(rows.reshape(n, size, rows.shape[1]), shards).reshape(rows.shape)


_scatter = host_function(lambda rows, ids, grads, lr: rows.at[ids].add(-lr * grads), jax.memory.Space.Host)
_scatter_blocks = host_function(_scatter_rows_by_block, jax.memory.Space.Host)
