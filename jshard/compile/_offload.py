"""The offload stage (MindSpore's heterogeneous storage): which argument leaves live in host memory
between steps, and which results update them.

`parallelize(..., offload=...)` chooses by role, optimizer parallel's (`roles`): argument 0 is the
parameters, every other argument but the batch the optimizer state; a result updates an argument
where it has the argument's tree, shapes and dtypes (`updating`). PRNG key leaves stay on the
device. The rows of a `jshard.hetero.HostTable` argument live in host memory whatever `offload`
says, laid out by the table (`table_sharding`), and are never moved to the device. `build_program`
lays the chosen leaves out in host memory (`jshard.hetero`).
"""

from __future__ import annotations

import math

import jax
import numpy as np

from jshard._errors import ShardingError
from jshard.compile._optimizer import roles, updating
from jshard.compile._options import Options
from jshard.compile._signature import dtype_of
from jshard.compile._trace import Traced
from jshard.cost import CostModel, itemsize
from jshard.hetero import HostTable, Offload, check_fits, table_sharding
from jshard.propagate import Result, priced
from jshard.search import finest_cut

SEARCHED = (("optimizer",), ("optimizer", "parameters"))
"""What the strategy search weighs keeping in host memory (`mode="auto"` under a memory budget, no
`offload=` given), after the state on the device: the optimizer state, read once per step by the
update, then the parameters too, read by the forward and the backward pass."""


def searched(traced: Traced, args: tuple, options: Options) -> list[tuple[str, ...]]:
    """The `SEARCHED` offloads this call has state for (optimizer state: an argument beyond the
    parameters and the batch)."""
    params, state = roles(args, options)
    have = {"parameters": bool(_state(traced, params)), "optimizer": bool(_state(traced, state))}
    return [what for what in SEARCHED if all(have[name] for name in what)]


def least_streamed(traced: Traced, args: tuple, options: Options, what: tuple[str, ...]) -> float:
    """The fewest bytes per device that keeping `what` in host memory streams each way per step:
    its leaves, each cut as finely as its dims allow on the mesh."""
    params, state = roles(args, options)
    ids = _state(traced, (params if "parameters" in what else set()) | (state if "optimizer" in what else set()))
    return sum(math.prod(np.shape(traced.leaves[i])) * itemsize(dtype_of(traced.leaves[i]))
               / finest_cut(np.shape(traced.leaves[i]), traced.axis_size) for i in ids)


def least_seconds(traced: Traced, cost: CostModel) -> float:
    """Seconds per step no plan of `traced` beats: its work (`Plan.work`'s pricing: each operator on
    the cost model's roofline) split evenly over every device, nothing communicated."""
    work = priced(traced.nodes, Result({}, {}, set()), traced.axis_size, cost, traced.table, traced.outvars)
    return work.compute_seconds / traced.fine.device_count


def _state(traced: Traced, ids) -> set[int]:
    """The leaves of `ids` that can live in host memory (PRNG keys stay on the device)."""
    return {i for i in ids if not jax.dtypes.issubdtype(dtype_of(traced.leaves[i]), jax.dtypes.extended)}


def offloaded(traced: Traced, args: tuple, options: Options, call: str) -> Offload | None:
    """The leaves kept in host memory, and the results that update them; None: none.

    Raises:
      ShardingError: a role asked for has no argument (no optimizer state, say); a host table too
        large for the hosts.
    """
    params, state = roles(args, options)
    chosen = {"parameters": params, "optimizer": state}
    ids: set[int] = set()
    for name in options.offload or ():
        leaves = _state(traced, chosen[name])
        if not leaves:
            raise ShardingError(_no_state_error(call, name, len(args), options))
        ids |= leaves
    tables = host_tables(args)
    for i, table in tables.items():
        shape, hosts = np.shape(traced.leaves[i]), jax.process_count() if table.cut_rows else 1
        if traced.paths[i].endswith(".rows"):  # a table's first leaf; its slots are shaped as it
            check_fits(call, shape, np.dtype(dtype_of(traced.leaves[i])), hosts, slots=len(table.slots))
        if table.cut_rows and shape[0] % traced.fine.device_count:
            raise ShardingError(_rows_error(call, traced.paths[i], shape, traced.fine.device_count))
    if not ids and not tables:
        return None
    ids |= set(tables)
    return Offload(options.offload or (), frozenset(ids), updating(traced, args, {i: i for i in ids}), frozenset(tables))


def host_tables(args: tuple) -> dict[int, HostTable]:
    """Argument leaf -> the `HostTable` whose rows (or optimizer slot, shaped as the rows) it is."""
    found, start = {}, 0
    for node in jax.tree_util.tree_leaves(args, is_leaf=lambda x: isinstance(x, HostTable)):
        if isinstance(node, HostTable):
            found.update((start + k, node) for k in range(1 + len(node.slots)))  # leaves: rows, *slots, count
        start += len(jax.tree_util.tree_leaves(node))
    return found


def anchored(in_sh: list, out_sh: list, offload: Offload | None, args: tuple, mesh) -> tuple[list, list]:
    """The host tables' rows (and the results updating them) laid out as their tables say."""
    if offload is None or not offload.resident:
        return in_sh, out_sh
    tables = host_tables(args)
    ins = [table_sharding(tables[i], mesh) if i in tables else sh for i, sh in enumerate(in_sh)]
    outs = [table_sharding(tables[offload.results[o]], mesh) if offload.results.get(o) in tables else sh
            for o, sh in enumerate(out_sh)]
    return ins, outs


def _rows_error(call: str, path: str, shape: tuple[int, ...], n: int) -> str:
    padded = -(-shape[0] // n) * n
    return (f"{call}: the host table args{path} has {shape[0]} rows, cut_rows=True cuts them over {n} devices, but "
            f"{n} does not divide {shape[0]}. Pad the table to {padded} rows (ids never reach the padding), or "
            f"pass cut_rows=False.")


def _no_state_error(call: str, name: str, n: int, options: Options) -> str:
    batch = (n - 1,) if options.batch_argnums is None else options.batch_argnums
    role = "parameter (argument 0)" if name == "parameters" else "optimizer-state (every argument but 0 and the batch)"
    return (f"{call}: offload=({name!r},) keeps the {role} leaves in host memory, but this call has none "
            f"({n} positional argument(s), the batch: {batch}). Pass that state as an argument, name the batch "
            f"with batch_argnums=, or drop {name!r} from offload.")
