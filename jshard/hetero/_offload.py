"""Offload: state kept in host memory between steps, and activations kept in host memory between
the forward and the backward pass (MindSpore's heterogeneous storage).

State (`parallelize(..., offload=("optimizer",) | ("parameters",) | both)`): the offloaded argument
leaves, and the results that update them, get shardings of memory kind `pinned_host`; the step
moves each such argument to device memory before use (`streamed`) and each updating result back
to host memory, so between steps the device holds none of it. The compile core decides which
leaves (the roles of `optimizer_parallel`: argument 0 the parameters, the others but the batch the
optimizer state) and records an `OffloadReport` in the `Plan`.

Activations (`jshard.recompute(fn, policy="offload")`, or `policy=jshard.offload_names("h")`):
`jax.checkpoint` policies that keep the chosen residuals in host memory instead of recomputing them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from jshard._errors import ShardingError, api_boundary
from jshard.cost import CostModel
from jshard.layouts import slices
from jshard.plan import HOST_MEMORY, OffloadReport

DEVICE_MEMORY = "device"

OFFLOADABLE = ("optimizer", "parameters")
"""What `parallelize(..., offload=...)` can keep in host memory: the state carried between steps."""


@dataclasses.dataclass(frozen=True)
class Offload:
    """The offload decisions for one signature.

    Attributes:
      what: the roles asked for (`OFFLOADABLE` names).
      args: argument leaves kept in host memory.
      results: result leaf -> the argument leaf it updates (kept in host memory too).
      resident: the argument leaves only the host reads (`HostTable` rows): never moved to the device.
    """

    what: tuple[str, ...]
    args: frozenset[int]
    results: Mapping[int, int]
    resident: frozenset[int] = frozenset()


def check_offload(call: str, offload: tuple) -> None:
    """Raises `ShardingError` for an `offload` entry that names no state, `TypeError` for a non-string."""
    for name in offload:
        if not isinstance(name, str):
            raise TypeError(f"{call}: offload takes names (strings) from {OFFLOADABLE}, got {name!r}.")
        if name not in OFFLOADABLE:
            raise ShardingError(_not_state_error(call, name))


def _not_state_error(call: str, name: str) -> str:
    hint = (" Activations are not kept between steps; to keep them in host memory between the forward and "
            "the backward, wrap the layer in jshard.recompute(fn, policy='offload') or "
            "policy=jshard.offload_names(...).") if name.startswith("activation") else ""
    return (f"{call}: offload=({name!r},) names {name!r}, which is not state kept between steps; offload "
            f"keeps {' and/or '.join(repr(n) for n in OFFLOADABLE)} in host memory ({HOST_MEMORY}). Give "
            f"offload=('optimizer',), ('parameters',) or ('optimizer', 'parameters').{hint}")


def on_host_shardings(shardings: Sequence[NamedSharding | None], ids: frozenset[int]) -> list:
    """`shardings` with the leaves `ids` in host memory."""
    return [sh.with_memory_kind(HOST_MEMORY) if i in ids and sh is not None else sh for i, sh in enumerate(shardings)]


def streamed(evaluate: Callable[..., Any], offload: Offload) -> Callable[..., Any]:
    """`evaluate` (flat arguments -> flat results) with the offloaded arguments moved to device
    memory before use and the results that update them moved back to host memory."""

    def run(*leaves):
        streaming = offload.args - offload.resident
        leaves = [jax.device_put(x, jax.memory.Space.Device) if i in streaming else x for i, x in enumerate(leaves)]
        outs = evaluate(*leaves)
        return [jax.device_put(y, jax.memory.Space.Host) if o in offload.results and jax.typeof(y).memory_space
                != jax.memory.Space.Host else y for o, y in enumerate(outs)]

    return run


def offload_report(offload: Offload, paths: Sequence[str], leaves: Sequence, in_sh: Sequence[NamedSharding],
                   out_leaves: Sequence, out_sh: Sequence[NamedSharding | None], cost: CostModel) -> OffloadReport:
    """The `Plan`'s record: the host leaves, their bytes per device, the bytes moved per step and
    their price on `cost`'s host link."""
    held = sum(_per_device(leaves[i], in_sh[i]) for i in offload.args)
    read = sum(_per_device(leaves[i], in_sh[i]) for i in offload.args - offload.resident)
    written = sum(_per_device(out_leaves[o], out_sh[o]) for o, i in offload.results.items() if i not in offload.resident)
    return OffloadReport(offload.what, HOST_MEMORY, tuple(f"args{paths[i]}" for i in sorted(offload.args)),
                         held, read, written, tuple(sorted(offload.args)), tuple(sorted(offload.results)),
                         cost.host_seconds(read, written))


def _per_device(x: Any, sh: NamedSharding | None) -> float:
    """Bytes of `x` one device holds laid out as `sh` (whole where `sh` is None)."""
    dtype = np.dtype(getattr(x, "dtype", np.float32))
    ways = 1 if sh is None else math.prod(slices(sh.spec, np.ndim(x), dict(sh.mesh.shape)))
    return math.prod(np.shape(x)) * dtype.itemsize / ways


@api_boundary
def offload_names(*names: str) -> Callable[..., bool]:
    """A `jshard.recompute` policy that keeps the activations named by `checkpoint_name` in host
    memory between the forward and the backward pass, and recomputes the rest.

    Args:
      names: `jax.ad_checkpoint.checkpoint_name` names; none: every matmul output without batch
        dims (what `policy="offload"` keeps).

    Returns:
      A `jax.checkpoint` policy.

    Examples:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> from jax.ad_checkpoint import checkpoint_name
      >>> layer = js.recompute(lambda w, x: jnp.tanh(checkpoint_name(x @ w, "h")), policy=js.offload_names("h"))
      >>> jax.grad(lambda w: layer(w, jnp.ones((1, 2))).sum())(jnp.eye(2)).shape
      (2, 2)
    """
    bad = [n for n in names if not isinstance(n, str)]
    if bad:
        raise TypeError(f"jshard.offload_names: names are checkpoint_name strings, got {bad[0]!r}.")
    if not names:
        return jax.checkpoint_policies.offload_dot_with_no_batch_dims(DEVICE_MEMORY, HOST_MEMORY)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=(), names_which_can_be_offloaded=names, offload_src=DEVICE_MEMORY,
        offload_dst=HOST_MEMORY)


HOST_POLICIES: dict[str, Callable[[], Callable[..., bool]]] = {"offload": offload_names}
"""`jshard.recompute`'s policy names that keep residuals in host memory (MindSpore's activation
offload): `"offload"`, every matmul output without batch dims."""
