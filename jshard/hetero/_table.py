"""Host-resident embedding tables (MindSpore's parameter-server mode, synchronous).

A `HostTable` argument of a parallelized step lives in host memory (memory kind `pinned_host`)
and never crosses to the device: `lookup` reads the rows a batch asks for on the host and sends
only those to the device; `sparse_update` applies the table's optimizer on the host to the rows the
batch touched, from the whole batch's row gradients (gathered to every device: ids and rows, not
the table): SGD, lazy Adam (MindSpore's `LazyAdam`: the moments of the touched rows only) or
Adagrad (MindSpore's `SparseApplyAdagrad`), their slots kept in host memory beside the rows. With
`cut_rows` (the default when many processes run) the rows are cut over the devices, so each host
keeps its share, sends the rows a lookup asks for, and updates only the rows it owns.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from jshard import _context
from jshard._errors import ShardingError, api_boundary
from jshard._format import human_bytes, shape_str
from jshard.hetero._host import host_function, on_host
from jshard.layouts import place

TABLE_OPTIMIZERS = ("sgd", "adam", "adagrad")
"""The optimizers a `HostTable` updates its rows with (`host_table(..., optimizer=)`)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HostTable:
    """An embedding table kept in host memory between steps and used on the host.

    Attributes:
      rows: the table, `(vocabulary, dim)`.
      slots: the optimizer's per-row state, each shaped as `rows` and kept in host memory with them
        (Adam: the first and second moments; Adagrad: the squared-gradient accumulator; SGD: none).
      count: Adam's step count (an int32 scalar, on the device), else None.
      cut_rows: cut the rows over the devices (each host keeps its share); default: when more than
        one process runs.
      optimizer: one of `TABLE_OPTIMIZERS`.
      hyper: the optimizer's constants (Adam: `(b1, b2, eps)`).
    """

    rows: Any
    slots: tuple = ()
    count: Any = None
    cut_rows: bool = dataclasses.field(default=False, metadata={"static": True})
    optimizer: str = dataclasses.field(default="sgd", metadata={"static": True})
    hyper: tuple[float, ...] = dataclasses.field(default=(), metadata={"static": True})


@api_boundary
def host_table(rows: Any, *, cut_rows: bool | None = None, optimizer: str = "sgd", b1: float = 0.9,
               b2: float = 0.999, eps: float = 1e-8, initial_accumulator: float = 0.1) -> HostTable:
    """`rows` as a `HostTable` for `parallelize`: kept in host memory, looked up and updated there.

    Args:
      rows: the table, `(vocabulary, dim)`.
      cut_rows: cut the rows over the devices; None: when `jax.process_count() > 1`.
      optimizer: what `sparse_update` applies to the touched rows: `"sgd"`, `"adam"` (lazy Adam,
        MindSpore's `LazyAdam`: `optax.adam`'s update with `b1`, `b2`, `eps`, on the touched rows and
        their moments only) or `"adagrad"` (MindSpore's `SparseApplyAdagrad`, its accumulator
        starting at `initial_accumulator`).

    Raises:
      ShardingError: the table with its optimizer slots (or each host's share) does not fit one
        host's memory; an optimizer not in `TABLE_OPTIMIZERS`.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> js.hetero.host_table(jnp.zeros((1000, 8))).rows.shape
      (1000, 8)
      >>> len(js.hetero.host_table(jnp.zeros((1000, 8)), optimizer="adam").slots)
      2
    """
    call = "jshard.hetero.host_table"
    if optimizer not in TABLE_OPTIMIZERS:
        raise ShardingError(f"{call}: optimizer={optimizer!r} is no table optimizer; sparse_update applies one of "
                            f"{TABLE_OPTIMIZERS} to the rows a batch touched. Give one of them, or keep the table "
                            f"among the parameters (on the device) for another optimizer.")
    cut = jax.process_count() > 1 if cut_rows is None else bool(cut_rows)
    n_slots = {"sgd": 0, "adam": 2, "adagrad": 1}[optimizer]
    check_fits(call, np.shape(rows), np.dtype(rows.dtype), jax.process_count() if cut else 1, slots=n_slots)
    if optimizer == "adam":
        return HostTable(rows, (jnp.zeros_like(rows), jnp.zeros_like(rows)), jnp.zeros((), jnp.int32), cut, optimizer,
                         (float(b1), float(b2), float(eps)))
    if optimizer == "adagrad":
        return HostTable(rows, (jnp.full_like(rows, initial_accumulator),), None, cut, optimizer)
    return HostTable(rows, (), None, cut)


def check_fits(call: str, shape: tuple[int, ...], dtype: np.dtype, hosts: int, memory: float | None = None,
               slots: int = 0) -> None:
    """Raises `ShardingError` where each of `hosts` hosts' share of a table (with `slots` optimizer
    slots shaped as it) exceeds `memory` bytes (default: this host's physical memory)."""
    memory = _host_memory() if memory is None else memory
    total = math.prod(shape) * dtype.itemsize * (1 + slots)
    share = total / hosts
    if share > memory:
        need = math.ceil(total / memory)
        kept = f" with its {slots} optimizer slot(s)" if slots else ""
        raise ShardingError(
            f"{call}: the embedding table {shape_str(dtype, shape)}{kept} needs {human_bytes(share)} on each of "
            f"{hosts} host(s), but a host has {human_bytes(memory)} of memory. Cut its rows over at least {need} "
            f"hosts' processes (cut_rows=True with that many processes), or store it in a narrower dtype.")


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
    """The table's optimizer on the rows the batch touched, on the host; `grads` is the gradient of
    the loss with respect to `lookup(table, ids)` (repeated ids add up, as the dense gradient of
    `rows[ids]` does). SGD: `rows[ids] -= learning_rate * grads`. Adam (lazy): the touched rows'
    moments and rows updated as `optax.adam(learning_rate, b1, b2, eps)` updates them, the step
    count shared; the other rows and their moments unchanged. Adagrad: `acc[ids] += g**2`,
    `rows[ids] -= learning_rate * g / sqrt(acc[ids])`.

    Examples:
      >>> import jax.numpy as jnp, jshard as js
      >>> t = js.hetero.host_table(jnp.zeros((3, 2)))
      >>> js.hetero.sparse_update(t, jnp.array([1, 1]), jnp.ones((2, 2)), 0.5).rows[1]
      Array([-1., -1.], dtype=float32)
      >>> t = js.hetero.host_table(jnp.zeros((3, 2)), optimizer="adam")
      >>> js.hetero.sparse_update(t, jnp.array([1]), jnp.ones((1, 2)), 0.5).rows[:, 0].round(3)  # Adam's first step: lr
      Array([ 0. , -0.5,  0. ], dtype=float32)
    """
    ids, grads = _whole(ids), _whole(grads)  # every device's host applies the whole batch's rows
    lr = np.asarray(learning_rate, grads.dtype)
    ctx = _context.current()
    shards = None if not table.cut_rows or ctx is None else np.arange(ctx.mesh.devices.size, dtype=np.int32)
    if table.optimizer == "sgd":
        rows = _scatter(table.rows, ids, grads, lr) if shards is None else _scatter_blocks(table.rows, ids, grads, lr, shards)
        return dataclasses.replace(table, rows=rows)
    count = None if table.count is None else table.count + 1
    rule = _RULES[table.optimizer](table.hyper, lr, count)
    arrays = (table.rows, *table.slots)
    new = _rows_update(arrays, ids, grads, rule) if shards is None else _rows_update_blocks(arrays, ids, grads, rule,
                                                                                             shards)
    return dataclasses.replace(table, rows=new[0], slots=tuple(new[1:]), count=count)


def _whole(x: Any) -> Any:
    """`x` gathered whole to every device inside a parallelized step (outside one: as it is)."""
    ctx = _context.current()
    return x if ctx is None else place(x, NamedSharding(ctx.mesh, PartitionSpec()))


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


def _adam(hyper: tuple[float, ...], lr, count):
    """Lazy Adam on gathered rows: `(rows, m, v), g -> (rows, m, v)`, as `optax.adam` updates them."""
    b1, b2, eps = hyper

    def rule(arrays, g, lr, count):
        rows, m, v = arrays
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
        t = count.astype(g.dtype)
        m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
        return rows - lr * m_hat / (jnp.sqrt(v_hat) + eps), m, v

    return rule, (lr, count)


def _adagrad(hyper: tuple[float, ...], lr, count):
    """Adagrad on gathered rows: `(rows, acc), g -> (rows, acc)` (MindSpore's `SparseApplyAdagrad`)."""

    def rule(arrays, g, lr):
        rows, acc = arrays
        acc = acc + g * g
        return rows - lr * g / jnp.sqrt(acc), acc

    return rule, (lr,)


_RULES = {"adam": _adam, "adagrad": _adagrad}


def _summed(ids, grads):
    """Each position's row gradient summed over the positions with the same id (a row's whole
    gradient, as the dense gradient of `rows[ids]` adds repeated ids)."""
    return (ids[:, None] == ids[None, :]).astype(grads.dtype) @ grads


def _rows_update(arrays: tuple, ids, grads, rule) -> tuple:
    """`rule` applied on the host to the touched rows of the table's arrays (rows and slots)."""
    fn, consts = rule

    def update(arrays, ids, grads, *consts):
        new = fn(tuple(a[ids] for a in arrays), _summed(ids, grads), *consts)
        return tuple(a.at[ids].set(n) for a, n in zip(arrays, new))  # a repeated id writes one value

    return host_function(update, jax.memory.Space.Host)(arrays, ids, grads, *consts)


def _rows_update_blocks(arrays: tuple, ids, grads, rule, shards) -> tuple:
    """`_rows_update` with the rows cut into blocks (`shards`, the cut's): each block takes only the
    ids it holds, so every device's host updates its own rows and no row of the table moves."""
    fn, consts = rule
    n = shards.shape[0]
    size = arrays[0].shape[0] // n

    def update(arrays, ids, grads, shards, *consts):
        g = _summed(ids, grads)

        def block_update(blocks, k):
            local = ids % size + (ids // size != k).astype(ids.dtype) * size  # another block's id: out of range
            new = fn(tuple(jnp.take(b, local, axis=0, mode="clip") for b in blocks), g, *consts)
            return tuple(b.at[local].set(x, mode="drop") for b, x in zip(blocks, new))

        cut = tuple(a.reshape(n, size, *a.shape[1:]) for a in arrays)
        return tuple(b.reshape(a.shape) for a, b in zip(arrays, jax.vmap(block_update)(cut, shards)))

    return host_function(update, jax.memory.Space.Host)(arrays, ids, grads, shards, *consts)
