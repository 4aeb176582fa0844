"""Strategy tuples and the tensor layouts they denote.

A MindSpore *strategy* gives, for one tensor, how many equal slices each dimension is cut into:
`(2, 1)` cuts dim 0 in two and leaves dim 1 whole. On its own a strategy does not say *which*
devices hold which slice; that comes from the operator's device matrix (see `_device_matrix.py`).
The result is a `TensorLayout`: a device matrix plus, for each tensor dim, the device-matrix axes
that cut it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from jshard._errors import ShardingError
from jshard._format import shape_str

Strategy = tuple[int, ...]
"""One positive integer per tensor dimension: how many equal slices that dimension is cut into."""

TensorMap = tuple[tuple[int, ...], ...]
"""For each tensor dimension, the device-matrix axes (major to minor) that cut it; `()` = whole."""


@dataclasses.dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where each slice of a tensor lives: a device matrix and the axes that cut each dim.

    Devices (ranks `0..n-1`) fill `device_matrix` row-major, last axis fastest. Dimension `d` of the
    tensor is cut by the axes `tensor_map[d]`, the first of them major.

    Attributes:
      device_matrix: sizes of the device-matrix axes, major to minor; their product is the device
        count.
      tensor_map: per tensor dim, the device-matrix axis indices that cut it.
      axis_names: optional names of the device-matrix axes (from a `Layout`), for display.
    """

    device_matrix: tuple[int, ...]
    tensor_map: TensorMap
    axis_names: tuple[str, ...] | None = None

    def __post_init__(self):
        used = [a for axes in self.tensor_map for a in axes]
        if len(used) != len(set(used)):
            raise ShardingError(f"TensorLayout: a device-matrix axis cuts two dims in {self.tensor_map}.")
        if any(not 0 <= a < len(self.device_matrix) for a in used):
            raise ShardingError(
                f"TensorLayout: tensor_map {self.tensor_map} names an axis outside device matrix "
                f"{self.device_matrix}."
            )

    @property
    def rank(self) -> int:
        return len(self.tensor_map)

    @property
    def device_count(self) -> int:
        return math.prod(self.device_matrix)

    @property
    def strategy(self) -> Strategy:
        """The MindSpore strategy tuple: how many slices each dimension is cut into."""
        return tuple(math.prod(self.device_matrix[a] for a in axes) for axes in self.tensor_map)

    def describe(self) -> str:
        """`(2, 4)` for a plain strategy, or the alias form `("dp", ("sp", "mp"))` for a Layout."""
        if self.axis_names is None:
            return str(self.strategy)
        dims = []
        for axes in self.tensor_map:
            names = [self.axis_names[a] for a in axes]
            quoted = [f'"{n}"' for n in names]
            dims.append('"None"' if not names else quoted[0] if len(names) == 1 else f"({', '.join(quoted)})")
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"


def canonicalize_strategy(value: object, *, call: str, what: str) -> Strategy:
    """Turns a user's strategy (a tuple or list of ints) into a `Strategy`, checking every entry.

    Raises:
      TypeError: `value` is not a sequence of integers.
      ShardingError: an entry is zero or negative.
    """
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{call}: {what} must be a tuple of ints such as (2, 1), got {value!r}.")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        raise TypeError(f"{call}: {what}={tuple(value)!r} must hold only ints, one per tensor dim.")
    bad = [v for v in value if v <= 0]
    if bad:
        raise ShardingError(
            f"{call}: {what}={tuple(value)} has entry {bad[0]}; every entry is the number of slices "
            f"of one dim and must be a positive int (1 leaves the dim whole)."
        )
    return tuple(value)


def with_repeated_calculation(
    layout: TensorLayout, device_count: int, *, call: str, op: str, what: str
) -> TensorLayout:
    """Appends MindSpore's repeated-calculation axis when the device matrix covers too few devices.

    The remaining factor `device_count / prod(device_matrix)` becomes the *last* (fastest) axis; the
    devices along it hold replicas. `what` names the strategy in errors (`"in_strategy=((3, 1),)"`).

    Raises:
      ShardingError: the device matrix's product does not divide `device_count`.
    """
    used = layout.device_count
    if used == device_count:
        return layout
    if device_count % used:
        raise ShardingError(_device_count_error(call, op, what, layout, device_count))
    names = None if layout.axis_names is None else (*layout.axis_names, "repeat")
    return TensorLayout((*layout.device_matrix, device_count // used), layout.tensor_map, names)


def _device_count_error(call: str, op: str, what: str, layout: TensorLayout, device_count: int) -> str:
    used = layout.device_count
    divisors = [d for d in range(1, device_count + 1) if device_count % d == 0]
    if used > device_count:  # most often: simulated devices forgotten on a laptop
        return (
            f"{call}: {what} gives {op} the device matrix {list(layout.device_matrix)} ({used} devices), but "
            f"the program has {device_count} device(s). On a laptop or any CPU, call jshard.simulate_devices({used}) "
            f"first thing, before any array is made, to simulate {used} devices; or pass "
            f"jshard.parallelize(..., devices={used}) or a mesh of {used} devices (with fewer present, .plan() "
            f"plans on an abstract mesh). Or choose strategies whose device matrix multiplies to a divisor of "
            f"{device_count} ({', '.join(map(str, divisors))})."
        )
    return (
        f"{call}: {what} gives {op} the device matrix {list(layout.device_matrix)} ({used} devices), "
        f"but {used} does not divide the device count {device_count}. Choose strategies whose device "
        f"matrix multiplies to a divisor of {device_count} ({', '.join(map(str, divisors))})."
    )


def check_divides(
    layout: TensorLayout, shape: Sequence[int], *, call: str, op: str, what: str, dtype: object
) -> None:
    """Checks that every cut divides its dimension of a `dtype[shape]` tensor.

    Raises:
      ShardingError: naming the first dim whose size the cut does not divide, with the divisors.
    """
    if len(shape) != layout.rank:
        raise ShardingError(
            f"{call}: {what}={layout.describe()} has {layout.rank} entries, but the tensor it cuts "
            f"({op}) is {shape_str(dtype, shape)} with {len(shape)} dims. Give one entry per dim."
        )
    for dim, (size, cut) in enumerate(zip(shape, layout.strategy)):
        if size % cut:
            divisors = [d for d in range(1, size + 1) if size % d == 0]
            shown = ", ".join(map(str, divisors[:12])) + (", ..." if len(divisors) > 12 else "")
            raise ShardingError(
                f"{call}: {what}={layout.describe()} cuts dim {dim} of {shape_str(dtype, shape)} "
                f"into {cut}, but {cut} does not divide {size}. Pad the dim or choose a divisor of "
                f"{size} ({shown})."
            )
