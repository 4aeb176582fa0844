"""The cost model: α–β collectives per mesh axis, redistribution between layouts, compute.

Collective time on a group of `n` devices moving a shard of `B` bytes (DESIGN.md): all-gather and
reduce-scatter `(n-1)/n·B·n`, all-reduce `2(n-1)/n·B`, all-to-all `(n-1)/n·B`, collective-permute
`B`, over the slowest axis of the group, plus its latency. Payloads are predicted in the audit's convention (the
gathered result of an all-gather, the operand of the others), so prediction and compiled program
compare figure for figure.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from jshard._errors import ShardingError
from jshard.cost._devices import DEVICE_KINDS, HOST_BANDWIDTH, kind_of
from jshard.layouts import Spec


class Comm(NamedTuple):
    """One predicted collective: `kind`, payload bytes per device, and the mesh axes of its group."""

    kind: str
    bytes: float
    axes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class CostModel:
    """α–β costs per mesh axis, a roofline per operator, and whether collectives overlap compute.

    Attributes:
      bandwidth: bytes/s per device on an axis with no override (default: NVLink-class 100 GB/s).
      latency: seconds per collective on such an axis.
      flops: floating-point operations per second per device: the rate of every operator but the
        matrix products (and theirs where `matmul_flops` is None).
      axes: per-axis `(bandwidth, latency)` overrides, e.g. `{"d0": (12.5e9, 2e-5)}` for an axis
        that crosses hosts.
      device: the device kind planned for (`"H100"`), or None: the devices present, if any.
      memory: bytes per device: the default `memory_budget` of the strategy search; None: the
        present devices' (`device_memory`), else no budget.
      alltoall: whether a redistribution may move a mesh axis from one tensor dim to another by
        all-to-all (MindSpore's `enable_alltoall`); if not, the axes that move are all-gathered
        first and the result sliced locally (`redistribution`). Default on, unlike MindSpore's:
        XLA's partitioner emits all-to-alls natively, and a move by all-to-all sends 1/n of the
        all-gather's bytes.
      host_bandwidth: bytes/s one way on the link between a device's memory and its host's (PCIe,
        NVLink-C2C), which state kept in host memory crosses every step (`host_seconds`).
      matmul_flops: the rate a dot or a convolution reaches (a large product's, below the peak);
        None: `flops`.
      memory_bandwidth: bytes/s of the device's own memory, which bounds the operators that move
        more bytes than they compute on (`compute_seconds`); None: memory traffic is not priced.
      overlap: whether a collective runs beside the compute that does not depend on it (GPU: XLA
        makes collectives asynchronous and its latency-hiding scheduler moves independent work
        into their shadow); False (the CPU stand-ins, and the default): every collective waits for
        the compute before it and holds up the compute after it.

    `CostModel.for_device("H100")` fills `flops`, `bandwidth`, `memory`, `host_bandwidth`,
    `matmul_flops`, `memory_bandwidth` and `overlap` from `DEVICE_KINDS`.

    Examples:
      >>> CostModel().time(Comm("all-reduce", 1e6, ("d0",)), {"d0": 2}) > 0
      True
    """

    bandwidth: float = 100e9
    latency: float = 5e-6
    flops: float = 100e12
    axes: Mapping[str, tuple[float, float]] = dataclasses.field(default_factory=dict)
    device: str | None = None
    memory: float | None = None
    alltoall: bool = True
    host_bandwidth: float = HOST_BANDWIDTH
    matmul_flops: float | None = None
    memory_bandwidth: float | None = None
    overlap: bool = False

    @classmethod
    def for_device(cls, name: str, **overrides) -> CostModel:
        """The cost model of a known device kind (`DEVICE_KINDS`: `"H100"`, `"H200"`, `"A100"`, `"GH200"`).

        Examples:
          >>> m = CostModel.for_device("h100")
          >>> m.device, m.flops, m.memory / 2**30, m.overlap
          ('H100', 989000000000000.0, 80.0, True)

        Raises:
          ShardingError: `name` is no known device kind.
        """
        found = kind_of(name)
        if found is None:
            raise ShardingError(f"jshard.cost.CostModel.for_device({name!r}): no such device kind; the known kinds "
                                f"are {', '.join(DEVICE_KINDS)}. Or give CostModel(flops=..., bandwidth=..., "
                                f"memory=...) for another device.")
        known, kind = found
        return cls(**{"bandwidth": kind.bandwidth, "flops": kind.flops, "device": known, "memory": kind.memory,
                      "host_bandwidth": kind.host_bandwidth, "matmul_flops": kind.matmul_flops,
                      "memory_bandwidth": kind.memory_bandwidth, "overlap": kind.overlap, **overrides})

    def compute_seconds(self, flops: float, traffic: float = 0.0, matmul: bool = False) -> float:
        """Seconds one operator computes on one device: the roofline of its `flops` at the rate of
        its units (`matmul_flops` for a dot or a convolution, `flops` otherwise) and its `traffic`,
        the bytes it moves through device memory (`memory_bandwidth`), whichever takes longer.

        Examples:
          >>> m = CostModel(flops=100e12, matmul_flops=50e12, memory_bandwidth=1e12)
          >>> m.compute_seconds(1e12, 1e9, matmul=True), m.compute_seconds(1e9, 1e9)
          (0.02, 0.001)
        """
        rate = (self.matmul_flops or self.flops) if matmul else self.flops
        seconds = flops / rate
        if self.memory_bandwidth and traffic:
            seconds = max(seconds, traffic / self.memory_bandwidth)
        return seconds

    def host_seconds(self, read: float, written: float) -> float:
        """Seconds per step to stream `read` bytes per device from host memory to the device and
        `written` bytes back: the host link is full duplex (PCIe, NVLink-C2C), so the two directions
        overlap each other; they are not taken to overlap the step's compute (XLA's scheduler may
        hide part of them behind it: the price is an upper bound).

        Examples:
          >>> CostModel(host_bandwidth=1e9).host_seconds(2e9, 1e9)
          2.0
        """
        return max(read, written) / self.host_bandwidth

    def group_latency(self, axes: Sequence[str]) -> float:
        """Seconds one collective over the mesh `axes` waits whatever it moves: its slowest axis's latency.

        Examples:
          >>> CostModel(axes={"d0": (12.5e9, 2e-5)}).group_latency(("d0", "d1"))
          2e-05
        """
        return max(self.axes.get(a, (self.bandwidth, self.latency))[1] for a in axes)

    def time(self, comm: Comm, axis_size: Mapping[str, int]) -> float:
        n = math.prod(axis_size[a] for a in comm.axes)
        if n <= 1:
            return 0.0
        bw = min(self.axes.get(a, (self.bandwidth, self.latency))[0] for a in comm.axes)
        lat = self.group_latency(comm.axes)
        moved = {
            "all-gather": (n - 1) / n * comm.bytes,
            "reduce-scatter": (n - 1) / n * comm.bytes,
            "all-reduce": 2 * (n - 1) / n * comm.bytes,
            "all-to-all": (n - 1) / n * comm.bytes,
            "collective-permute": comm.bytes,
        }[comm.kind]
        return lat + moved / bw


def _finer(src: Spec, dst: Spec, axis_size: Mapping[str, int]) -> bool:
    """Whether `dst` cuts every dim into a multiple of the slices `src` does: each `dst` slice lies
    within one `src` slice, so some device already holds it."""
    cut = lambda axes: math.prod(axis_size[a] for a in axes)
    return all(cut(t) % cut(s) == 0 for s, t in zip(src, dst))


def local_bytes(shape: Sequence[int], itemsize: int, spec: Spec, axis_size: Mapping[str, int]) -> float:
    """Bytes of one device's slice of a value laid out by `spec`."""
    return math.prod(shape) * itemsize / _slices(spec, axis_size)


def _slices(spec: Spec, axis_size: Mapping[str, int]) -> int:
    """How many slices `spec` cuts a value into (the mesh axes it cuts over, multiplied)."""
    return math.prod(axis_size[a] for axes in spec for a in axes)


def slice_counter(axis_size: Mapping[str, int]) -> Callable[[Spec], int]:
    """How many slices a `Spec` cuts a value into on the mesh `axis_size`, counted once per spec: a
    plan holds tens of thousands of values laid out by a few hundred specs (the memory model's peak
    reads one count per value)."""
    counted: dict[Spec, int] = {}

    def count(spec: Spec) -> int:
        found = counted.get(spec)
        if found is None:
            found = counted[spec] = _slices(spec, axis_size)
        return found

    return count


def redistribution(
    shape: Sequence[int], itemsize: int, src: Spec, dst: Spec, axis_size: Mapping[str, int], alltoall: bool = True
) -> list[Comm]:
    """The collectives that turn layout `src` into `dst`, one step of `stages` after another.

    Each step is one whose route through XLA's SPMD partitioner is known (`_step`): a finer layout
    (a local slice, or a collective-permute), a coarser one (all-gathers, after a permute where axes
    move or a major one goes), or the same axes in other places (all-to-alls, then a permute). The
    engine constrains each stage, so the compiled program moves what this prices.

    Without `alltoall` (MindSpore's `enable_alltoall` off), a move that would take an all-to-all
    all-gathers the axes that change dim first (`gathered_layout`), then goes on from there.

    The route does not depend on the value's shape: it is found once per pair of layouts and mesh
    (`_route`), and each collective's payload is the value's bytes over the cut of the layout it moves.
    """
    if src == dst:
        return []
    total = math.prod(shape) * itemsize
    return [Comm(kind, total / cut, axes) for kind, cut, axes in _route(src, dst, tuple(axis_size.items()), alltoall)]


_Moved = tuple[str, Spec, tuple[str, ...]]
"""One collective of a route: its kind, the layout whose one device's slice it moves, its mesh axes."""


@functools.lru_cache(maxsize=65536)
def _route(src: Spec, dst: Spec, sizes: tuple[tuple[str, int], ...],
           alltoall: bool) -> tuple[tuple[str, int, tuple[str, ...]], ...]:
    """`redistribution`'s collectives from `src` to `dst` on a mesh of `sizes`, each as its kind,
    the cut of the layout it moves (its payload: the value's bytes over it) and its axes."""
    axis_size, moved, at = dict(sizes), [], src
    for stage in stages(src, dst, axis_size, alltoall):
        moved += _step(at, stage, axis_size)
        at = stage
    return tuple((kind, _slices(layout, axis_size), axes) for kind, layout, axes in moved)


def _step(src: Spec, dst: Spec, axis_size: Mapping[str, int]) -> list[_Moved]:
    """One stage's collectives, as XLA's SPMD partitioner moves it.

    Where `dst` cuts every dim into a multiple of `src`'s slices, a device whose `src` axes lead its
    `dst` axes in every dim slices its part locally (free); otherwise each device slices the part
    another device needs and a collective-permute sends it there (axes swapped, renamed or
    reordered). Where `dst` keeps, of `src`'s axes, a coarser cut of every dim: the axes dropped
    from the minor ends of their dims are all-gathered one dim at a time, the minor dim first; where
    it keeps other than their leading axes (an axis moved, or a major one dropped), a
    collective-permute of the slices comes first. Between layouts of the same axes, all-to-alls as
    XLA walks them, then a collective-permute where the axes stand otherwise (`_all_to_alls`).
    """
    if src == dst:
        return []
    if _finer(src, dst, axis_size):
        if all(t[: len(s)] == s for s, t in zip(src, dst)):
            return []
        changed = tuple(dict.fromkeys(a for s, t in zip(src, dst) if s != t for a in s + t))
        return [("collective-permute", dst, changed)]
    where_src = {a: d for d, axes in enumerate(src) for a in axes}
    where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
    dropped = tuple(a for a in where_src if a not in where_dst)
    if _finer(dst, src, axis_size) and set(where_dst) <= set(where_src):
        if any(t != s[: len(t)] for s, t in zip(src, dst)):
            # Every dim keeps a cut dividing its own: XLA permutes the slices to devices grouped as
            # `dst` groups them (the moved axes in their new dims), then all-gathers the extra cuts.
            changed = tuple(dict.fromkeys(a for s, t in zip(src, dst) if t != s[: len(t)] for a in t))
            permute: _Moved = ("collective-permute", src, changed)
            return [permute, *_coarsen(src, dst, dropped, axis_size)]
        comms: list[_Moved] = []
        kept = list(src)  # axes dropped from the minor ends of their dims
        for d in reversed(range(len(src))):
            gone = tuple(a for a in src[d] if a in dropped)
            if gone:
                kept[d] = tuple(a for a in src[d] if a not in dropped)
                comms.append(("all-gather", tuple(kept), gone))
        return comms
    swaps = _all_to_alls(src, dst, axis_size) if not dropped and set(where_dst) == set(where_src) else None
    if swaps is None:  # `stages` makes no other step
        raise AssertionError(f"jshard.cost: {src} -> {dst} is no step of `stages`; price it with `redistribution`")
    return swaps


def _all_to_alls(src: Spec, dst: Spec, axis_size) -> list[_Moved] | None:
    """Between layouts of the same axes: one all-to-all per step of `_walk`, then a
    collective-permute where the axes stand otherwise than in `dst`; None where the walk does not
    reach `dst`'s cuts."""
    walk = _walk(src, dst, axis_size)
    if walk is None:
        return None
    comms: list[_Moved] = [("all-to-all", src, group) for _, group in walk]
    cur = walk[-1][0] if walk else src
    if cur != tuple(dst):
        changed = tuple(dict.fromkeys(a for c, d in zip(cur, dst) if c != d for a in (*c, *d)))
        comms.append(("collective-permute", src, changed))
    return comms


def _walk(src: Spec, dst: Spec, axis_size) -> list[tuple[Spec, tuple[str, ...]]] | None:
    """XLA's SPMD partitioner's all-to-alls between layouts of the same total cut: each moves the
    minor axes of a dim cut more than `dst` cuts it to the minor end of a dim cut less. The layout
    after each step and the axes it moves; None where the walk does not reach `dst`'s cuts."""
    cut = lambda axes: math.prod(axis_size[a] for a in axes)
    cur, steps = [list(axes) for axes in src], []
    while True:
        s = next((d for d in range(len(cur)) if cut(cur[d]) > cut(dst[d])), None)
        t = next((d for d in range(len(cur)) if cut(cur[d]) < cut(dst[d])), None)
        if s is None or t is None:
            break
        group = []
        while cur[s] and cut(cur[s]) > cut(dst[s]) and cut(cur[t]) * cut(group) < cut(dst[t]):
            group.insert(0, cur[s].pop())
        if not group:
            return None
        cur[t] += group
        if cut(cur[t]) > cut(dst[t]):  # the move overshoots `dst`'s cut (axes of unequal sizes): not this walk
            return None
        steps.append((tuple(map(tuple, cur)), tuple(group)))
    if any(cut(c) != cut(d) for c, d in zip(cur, dst)):
        return None
    return steps


def _coarsen(src: Spec, dst: Spec, dropped, axis_size) -> list[_Moved]:
    """The all-gathers from `src` down to `dst`, whose every dim's cut divides `src`'s: one dim at a
    time, the minor dim first, each over the dropped axes (else `src`'s own) that make up its ratio."""
    cut = lambda axes: math.prod(axis_size[a] for a in axes)
    free, comms, kept = list(dropped), [], list(src)
    for d in reversed(range(len(src))):
        ratio = cut(src[d]) // cut(dst[d])
        if ratio == 1:
            continue
        group = []
        for a in [*free, *(a for a in src[d] if a not in dst[d])]:
            if cut(group) < ratio and ratio % (cut(group) * axis_size[a]) == 0 and a not in group:
                group.append(a)
        free = [a for a in free if a not in group]
        kept[d] = dst[d]
        comms.append(("all-gather", tuple(kept), tuple(group)))
    return comms


def gathered_layout(src: Spec, dst: Spec) -> Spec | None:
    """`src` with the axes all-gathered that change dim between `src` and `dst` (or, where a dim
    keeps its axes in another order, every axis both keep): the layout a move goes through when
    all-to-alls are off. None where no axis moves."""
    where_src = {a: d for d, axes in enumerate(src) for a in axes}
    where_dst = {a: d for d, axes in enumerate(dst) for a in axes}
    moved = {a for a, d in where_src.items() if a in where_dst and where_dst[a] != d}
    if not moved and any(tuple(a for a in s if a in where_dst and where_dst[a] == d) != tuple(a for a in t if a in where_src)
                         for d, (s, t) in enumerate(zip(src, dst))):
        moved = {a for a in where_src if a in where_dst}
    if not moved:
        return None
    return tuple(tuple(a for a in axes if a not in moved) for axes in src)


def _without_all_to_all(src: Spec, dst: Spec, axis_size: Mapping[str, int]) -> Spec | None:
    """Where the move from `src` to `dst` takes an all-to-all: the gathered layout to go through
    instead (`gathered_layout`); else None. (The route does not depend on the value's shape.)"""
    mid = gathered_layout(src, dst)
    if mid is None or mid == src:
        return None
    return mid if _takes_all_to_all(src, dst, tuple(axis_size.items())) else None


@functools.lru_cache(maxsize=4096)
def _takes_all_to_all(src: Spec, dst: Spec, sizes: tuple[tuple[str, int], ...]) -> bool:
    """Whether the move from `src` to `dst` (all-to-alls on) has an all-to-all, priced once per
    pair and mesh: the route is the same for every shape."""
    return any(kind == "all-to-all" for kind, _, _ in _route(src, dst, sizes, True))


def stages(src: Spec, dst: Spec, axis_size: Mapping[str, int], alltoall: bool = True) -> list[Spec]:
    """The layouts that take a value from `src` to `dst`, each one step `redistribution` prices as
    XLA moves it: the axes `dst` drops all-gathered (`src` without them), then the axes both keep
    moved to `dst`'s places (one stage per all-to-all of `_walk`, then a permute; through their
    common leading axes, gathered and sliced, where no walk reaches them), then the local slice (or
    permute) by the axes `dst` adds. Constrained as one step, XLA's SPMD partitioner takes a route of its own where axes are
    dropped or added as others move: often it gathers the whole value first (its "involuntary
    full rematerialization"), sometimes all-to-alls and permutes, which no model of one step
    predicts. Without `alltoall`, where the move would take an all-to-all, `gathered_layout` comes
    first.
    """
    if src == dst:
        return []
    mid = None if alltoall else _without_all_to_all(src, dst, axis_size)
    if mid is not None:
        return [mid, *stages(mid, dst, axis_size, alltoall=False)]
    if _finer(src, dst, axis_size):
        return [dst]
    have = {a for axes in src for a in axes}
    want = {a for axes in dst for a in axes}
    if want <= have and _finer(dst, src, axis_size):  # coarser: a permute where axes move, the all-gathers
        return [dst]
    kept = tuple(tuple(a for a in axes if a in want) for axes in src)
    placed = tuple(tuple(a for a in axes if a in have) for axes in dst)
    route = [kept]
    if not _finer(kept, placed, axis_size):
        walk = _walk(kept, placed, axis_size)
        if walk is None:
            route.append(tuple(_common(k, p) for k, p in zip(kept, placed)))
        else:
            route += [layout for layout, _ in walk]
    route += [placed, dst]
    out = []
    for stage in route:
        if stage != (out[-1] if out else src):
            out.append(stage)
    return out


def _common(a: tuple, b: tuple) -> tuple:
    """The leading axes `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
