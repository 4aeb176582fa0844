"""The one fine mesh of a program, and layouts as `PartitionSpec`s over it.

A JAX computation has one mesh, while a MindSpore program has a device matrix per operator. Because
every device matrix numbers its devices the same way (row-major, last axis fastest), each of its
axes covers a contiguous range of *strides* of the rank: in `[2, 1, 4]` on 8 devices, axis 0 has
stride 4 and axis 2 stride 1. jshard builds one mesh whose axes split the rank at every stride
boundary any device matrix uses (for 2^k devices: k axes of size 2, major to minor). Each
device-matrix axis is then a run of consecutive fine axes, and each layout exactly a
`PartitionSpec` over the fine mesh.

Two device matrices whose boundaries do not nest (on 12 devices `[3, 4]` has a boundary at stride
4, `[4, 3]` at stride 3) cannot share one device order: that is a `LayoutConflictError`.

A `Layout` names its axes, and the fine mesh takes those names (`axis_names`, `FineMesh.named`): the
fine axis that is a named axis takes its name; the fine axes that split one (`mp` of 4 over two axes
of 2) take it with `_0`, `_1`, major first. The mesh keeps its shape, so naming changes no plan.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jshard._errors import LayoutConflictError, ShardingError
from jshard.layouts._strategy import TensorLayout


def _strides(matrix: Sequence[int]) -> tuple[int, ...]:
    return tuple(math.prod(matrix[i + 1 :]) for i in range(len(matrix)))


def _boundaries(matrix: Sequence[int]) -> set[int]:
    return {s for s, size in zip(_strides(matrix), matrix) if size > 1} | {
        s * size for s, size in zip(_strides(matrix), matrix) if size > 1
    }


def _prime_factors(n: int) -> list[int]:
    out, p = [], 2
    while n > 1:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out


class NotRefined(Exception):
    """Internal: a layout needs a mesh boundary the current fine mesh lacks (the caller refines).

    `who` names the operator or strategy that needs it; whoever knows sets it on the way up.
    """

    def __init__(self, matrix: tuple[int, ...], names: tuple[str, ...] | None = None):
        super().__init__(matrix)
        self.matrix, self.names = matrix, names  # `names`: a Layout's, which the mesh must take
        self.who = "an operator"


@dataclasses.dataclass(frozen=True, slots=True)
class FineMesh:
    """Axis sizes (major to minor) of the fine mesh over `device_count` ranks, and their names.

    Attributes:
      sizes: axis sizes, major to minor.
      axis_names: the axes' names; None names them `d0, d1, ...`. A user's mesh keeps its own.

    Examples:
      >>> FineMesh.for_devices(8).sizes
      (2, 2, 2)
      >>> FineMesh.refining(12, [(3, 4)]).sizes
      (3, 2, 2)
    """

    sizes: tuple[int, ...]
    axis_names: tuple[str, ...] | None = None

    @property
    def device_count(self) -> int:
        return math.prod(self.sizes)

    @property
    def names(self) -> tuple[str, ...]:
        if self.axis_names is not None:
            return self.axis_names
        return tuple(f"d{i}" for i in range(len(self.sizes)))

    @classmethod
    def of_mesh(cls, mesh: Mesh) -> "FineMesh":
        """A user's mesh as it is (`mode="manual"`): layouts must line up with its axes."""
        return cls(tuple(mesh.devices.shape), tuple(mesh.axis_names))

    @classmethod
    def for_devices(cls, n: int) -> "FineMesh":
        """The default: one axis per prime factor of `n`, largest first (2^k: k axes of 2)."""
        return cls(tuple(sorted(_prime_factors(n), reverse=True)) or (1,))

    @classmethod
    def refining(
        cls,
        n: int,
        matrices: Sequence[tuple[int, ...]],
        who: Sequence[str] | None = None,
        *,
        call: str = "jshard.parallelize",
    ) -> "FineMesh":
        """The coarsest prime-split mesh whose axes refine every matrix in `matrices`.

        Args:
          n: the device count.
          matrices: device matrices (each multiplying to `n`).
          who: for errors, what uses each matrix (an operator and its source line).
          call: for errors, the public call being made.

        Raises:
          LayoutConflictError: two matrices split the ranks at boundaries that do not nest.
        """
        cuts = _cuts(n, matrices)
        if cuts is None:
            who = list(who) if who is not None else [f"strategy {i}" for i in range(len(matrices))]
            raise LayoutConflictError(_conflict_message(call, n, matrices, who))
        sizes: list[int] = []
        for lo, hi in reversed(list(zip(cuts, cuts[1:]))):  # major segment first
            sizes += sorted(_prime_factors(hi // lo), reverse=True)
        return cls(tuple(sizes) or (1,))

    def named(self, names: Mapping[tuple[int, int], str], *, call: str = "jshard.parallelize") -> "FineMesh":
        """This mesh with the axes `names` gives (`(stride, size)` -> name, from `axis_names`) so
        named: the one mesh axis spanning a named axis takes its name, several take it with `_0`,
        `_1`, ... major first; inside named axes that nest, the innermost names. The other axes
        keep their names.

        Raises:
          ShardingError: a name would stand for two mesh axes (a `Layout` axis named like `d0`).
        """
        strides, out = _strides(self.sizes), list(self.names)
        for i, s in enumerate(strides):
            seg = min((g for g in names if g[0] <= s < g[0] * g[1]), key=lambda g: g[1], default=None)
            if seg is None:
                continue
            inside = [t for t in strides if seg[0] <= t < seg[0] * seg[1]]
            out[i] = names[seg] if len(inside) == 1 else f"{names[seg]}_{sum(t > s for t in inside)}"
        if len(set(out)) != len(out):
            raise ShardingError(
                f"{call}: the plan's mesh would name its axes {tuple(out)} (sizes {self.sizes}): your Layouts' "
                f"axis names and jshard's own (d0, d1, ...) meet. Rename the Layout axes (e.g. 'dp', 'mp').")
        return FineMesh(self.sizes, tuple(out))

    def fits(self, matrix: Sequence[int]) -> bool:
        mine = {s for s in _strides(self.sizes)} | {self.device_count}
        return _boundaries(matrix) <= mine

    def axes_of(self, matrix: Sequence[int]) -> list[tuple[str, ...]]:
        """For each axis of `matrix`, the fine axes that make it up (major to minor)."""
        if not self.fits(matrix):
            raise NotRefined(tuple(matrix))
        fine = list(zip(self.names, _strides(self.sizes)))
        out = []
        for stride, size in zip(_strides(matrix), matrix):
            out.append(tuple(name for name, s in fine if stride <= s < stride * size))
        return out

    def partition_spec(self, layout: TensorLayout) -> PartitionSpec:
        """The `PartitionSpec` over this mesh that puts every slice where `layout` says."""
        axes = self.axes_of(layout.device_matrix)
        entries = []
        for dim_axes in layout.tensor_map:
            names = tuple(n for a in dim_axes for n in axes[a])
            entries.append(None if not names else names[0] if len(names) == 1 else names)
        while entries and entries[-1] is None:
            entries.pop()
        return PartitionSpec(*entries)

    def jax_mesh(self, devices: Sequence[jax.Device]) -> Mesh:
        """A `jax.sharding.Mesh` placing rank `i` on `devices[i]`."""
        return Mesh(np.asarray(devices, dtype=object).reshape(self.sizes), self.names)


def named_sharding(mesh: Mesh, fine: FineMesh, layout: TensorLayout) -> NamedSharding:
    return NamedSharding(mesh, fine.partition_spec(layout))


def axis_names(named: Sequence[tuple[Sequence[int], Sequence[str], str]], call: str = "jshard.parallelize"
               ) -> dict[tuple[int, int], str]:
    """The names `Layout`s give the devices' axes: `(stride, size)` -> name, from each
    `(device matrix, alias names, who uses it)` (axes of size 1 span no devices and are left out).

    Raises:
      ShardingError: two Layouts name one axis differently, or give one name to two axes.
    """
    by_axis: dict = {}
    by_name: dict = {}
    for matrix, names, who in named:
        for stride, size, name in zip(_strides(matrix), matrix, names):
            if size == 1:
                continue
            here = (tuple(matrix), tuple(names), who)
            first = by_axis.setdefault((stride, size), (name, *here))
            if first[0] != name:
                why = f"one axis of {size} devices (rank stride {stride}) is {first[0]!r} in one and {name!r} in the other"
                raise ShardingError(_names_message(call, first[1:], here, why))
            first = by_name.setdefault(name, ((stride, size), *here))
            if first[0] != (stride, size):
                why = (f"{name!r} names an axis of {first[0][1]} devices at rank stride {first[0][0]} in one and of "
                       f"{size} at stride {stride} in the other")
                raise ShardingError(_names_message(call, first[1:], here, why))
    return {axis: found[0] for axis, found in by_axis.items()}


def _names_message(call: str, first, second, why: str) -> str:
    (ma, na, wa), (mb, nb, wb) = first, second
    return (
        f"{call}: {wa} uses Layout({ma}, {na}) and {wb} uses Layout({mb}, {nb}), which name the devices' axes "
        f"differently: {why}. The plan's mesh takes its axis names from your Layouts, so one axis of the devices "
        f"needs one name, and one name one axis. Build both from one Layout (lay = Layout({ma}, {na}), then "
        f"lay(...) for each tensor), or rename the axes so that they agree."
    )


def _cuts(n: int, matrices: Sequence[Sequence[int]]) -> list[int] | None:
    """Sorted stride boundaries of all `matrices`, or None where they do not form a divisor chain."""
    cuts = sorted({1, n}.union(*(_boundaries(m) for m in matrices)))
    return None if any(hi % lo for lo, hi in zip(cuts, cuts[1:])) else cuts


def _conflict_message(call, n, matrices, who) -> str:
    a, b = next(
        (i, j)
        for j in range(len(matrices))
        for i in range(j)
        if _cuts(n, [matrices[i], matrices[j]]) is None
    )
    return (
        f"{call}: {who[a]} uses device matrix {list(matrices[a])} and {who[b]} uses "
        f"{list(matrices[b])} on {n} devices; their axes split the ranks at strides that do not nest, "
        f"so no single device order (one JAX mesh) serves both. Give both a jshard.Layout over one "
        f"device matrix, e.g. Layout({tuple(matrices[a])}, ...), so they share one device order."
    )
