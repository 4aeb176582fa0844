"""The cost model: α–β collectives per mesh axis, redistribution between layouts, compute.

Collective time on a group of `n` devices moving a shard of `B` bytes (DESIGN.md): all-gather and
reduce-scatter `(n-1)/n·B·n`, all-reduce `2(n-1)/n·B`, all-to-all `(n-1)/n·B`, collective-permute
`B`, over the slowest axis of the group, plus its latency. Payloads are predicted in the audit's convention (the
gathered result of an all-gather, the operand of the others), so prediction and compiled program
compare figure for figure.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from jshard.layouts import Spec


class Comm(NamedTuple):
    """One predicted collective: `kind`, payload bytes per device, and the mesh axes of its group."""

    kind: str
    bytes: float
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """α–β costs per mesh axis and a peak compute rate.

    Attributes:
      bandwidth: bytes/s per device on an axis with no override (default: NVLink-class 100 GB/s).
      latency: seconds per collective on such an axis.
      flops: floating-point operations per second per device.
      axes: per-axis `(bandwidth, latency)` overrides, e.g. `{"d0": (12.5e9, 2e-5)}` for an axis
        that crosses hosts.

    Examples:
      >>> CostModel().time(Comm("all-reduce", 1e6, ("d0",)), {"d0": 2}) > 0
      True
    """

    bandwidth: float = 100e9
    latency: float = 5e-6
    flops: float = 100e12
    axes: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)

    def time(self, comm: Comm, axis_size: Mapping[str, int]) -> float:
        n = math.prod(axis_size[a] for a in comm.axes)
        if n <= 1:
            return 0.0
        bw = min(self.axes.get(a, (self.bandwidth, self.latency))[0] for a in comm.axes)
        lat = max(self.axes.get(a, (self.bandwidth, self.latency))[1] for a in comm.axes)
        moved = {
            "all-gather": (n - 1) / n * comm.bytes,
            "reduce-scatter": (n - 1) / n * comm.bytes,
            "all-reduce": 2 * (n - 1) / n * comm.bytes,
            "all-to-all": (n - 1) / n * comm.bytes,
            "collective-permute": comm.bytes,
        }[comm.kind]
        return lat + moved / bw


def _permuted(src: Spec, dst: Spec, axis_size: Mapping[str, int]) -> bool:
    """Whether `src` and `dst` cut every dim into as many slices (held by other devices)."""
    cut = lambda axes: math.prod(axis_size[a] for a in axes)
    return [cut(axes) for axes in src] == [cut(axes) for axes in dst]


def local_bytes(shape: Sequence[int], itemsize: int, spec: Spec, axis_size: Mapping[str, int]) -> float:
    """Bytes of one device's slice of a value laid out by `spec`."""
    cut = math.prod(axis_size[a] for axes in spec for a in axes)
    return math.prod(shape) * itemsize / cut


def redistribution(
    shape: Sequence[int], itemsize: int, src: Spec, dst: Spec, axis_size: Mapping[str, int]
) -> list[Comm]:
    """The collectives that turn layout `src` into `dst`.

    Where every dim is cut into as many slices on both sides (axes swapped or renamed), each device
    sends its slice to the device that holds it in `dst`: a collective-permute. Otherwise an axis
    that moves to another dim is an all-to-all; one that `dst` drops, an all-gather; one that only
    `dst` has, a local slice (free).
    """
    if src == dst:
        return []
    if _permuted(src, dst, axis_size):  # each device sends its slice to the one that holds it in `dst`
        changed = tuple(dict.fromkeys(a for s, t in zip(src, dst) if s != t for a in s + t))
        return [Comm("collective-permute", local_bytes(shape, itemsize, src, axis_size), changed)]
    where_src = {a: d for d, axes in enumerate(src) for a in axes}
    where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
    moved = tuple(a for a, d in where_src.items() if a in where_dst and where_dst[a] != d)
    dropped = tuple(a for a in where_src if a not in where_dst)
    same = all(
        tuple(a for a in s if a in where_dst and where_dst[a] == d) == tuple(a for a in t if a in where_src)
        for d, (s, t) in enumerate(zip(src, dst))
    )
    comms = []
    if moved or not same:
        axes = moved or tuple(a for a in where_src if a in where_dst)
        comms.append(Comm("all-to-all", local_bytes(shape, itemsize, src, axis_size), axes))
    if dropped:
        kept = tuple(tuple(a for a in axes if a not in dropped) for axes in src)
        comms.append(Comm("all-gather", local_bytes(shape, itemsize, kept, axis_size), dropped))
    return comms


def stages(src: Spec, dst: Spec, axis_size: Mapping[str, int]) -> list[Spec]:
    """The layouts that take a value from `src` to `dst` the way `redistribution` prices it: first
    the collectives (`dst` without the axes it adds at the minor end of a dim), then the local
    slice by those new axes. Constrained as one step, XLA may find no direct way and gather the
    whole value first (its SPMD partitioner's "involuntary full rematerialization")."""
    if _permuted(src, dst, axis_size):
        return [dst]
    have = {a for axes in src for a in axes}
    mid = []
    for axes in dst:
        n = len(axes)
        while n and axes[n - 1] not in have:
            n -= 1
        mid.append(tuple(axes[:n]))
    mid = tuple(mid)
    return [mid, dst] if mid not in (src, dst) else [dst]

