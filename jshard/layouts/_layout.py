"""MindSpore's `Layout`: a named device matrix, called with one alias (or alias tuple) per dim."""

from __future__ import annotations

import math
from collections.abc import Sequence

from jshard._errors import ShardingError
from jshard.layouts._strategy import TensorLayout

NONE = "None"
"""The alias that leaves a tensor dimension whole, as in MindSpore."""

DimMap = str | tuple[str, ...]
"""What a `Layout` call takes per tensor dim: one alias, a tuple of aliases (major first), or "None"."""


class Layout:
    """A device matrix with named axes; calling it maps tensor dims to those axes.

    Devices fill the matrix row-major (last axis fastest), as for strategy tuples. The matrix's
    product must equal the device count of the program it is used in (checked where it is used).

    Args:
      device_matrix: axis sizes, major to minor.
      alias_name: one name per axis; `"None"` is reserved.

    Examples:
      >>> lay = Layout((2, 2, 2), ("dp", "sp", "mp"))
      >>> t = lay("mp", ("sp", "dp"))
      >>> t.strategy, t.tensor_map
      ((2, 4), ((2,), (1, 0)))
    """

    __slots__ = ("device_matrix", "alias_name")

    def __init__(self, device_matrix: Sequence[int], alias_name: Sequence[str]):
        matrix, names = tuple(device_matrix), tuple(alias_name)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in matrix):
            raise ShardingError(f"jshard.Layout: device_matrix={matrix} must hold positive ints.")
        if not all(isinstance(n, str) for n in names):
            raise TypeError(f"jshard.Layout: alias_name={names!r} must hold strings.")
        if len(names) != len(matrix):
            raise ShardingError(
                f"jshard.Layout: device_matrix={matrix} has {len(matrix)} axes but alias_name={names} "
                f"has {len(names)} names. Give one name per axis."
            )
        if len(set(names)) != len(names) or NONE in names:
            raise ShardingError(
                f"jshard.Layout: alias_name={names} must be distinct names, none of them \"None\" "
                f"(reserved for a dim left whole)."
            )
        self.device_matrix, self.alias_name = matrix, names

    @property
    def device_count(self) -> int:
        return math.prod(self.device_matrix)

    def __repr__(self) -> str:
        return f"Layout({self.device_matrix}, {self.alias_name})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Layout) and (self.device_matrix, self.alias_name) == (
            other.device_matrix,
            other.alias_name,
        )

    def __hash__(self) -> int:
        return hash((self.device_matrix, self.alias_name))

    def __call__(self, *tensor_map: DimMap) -> TensorLayout:
        """Maps each tensor dim to aliases; returns the `TensorLayout` a strategy slot accepts.

        Raises:
          ShardingError: an alias is unknown or used twice in one tensor.
        """
        dims, seen = [], []
        for dim in tensor_map:
            aliases = (dim,) if isinstance(dim, str) else tuple(dim)
            axes = []
            for alias in aliases:
                if alias == NONE:
                    continue
                if alias not in self.alias_name:
                    raise ShardingError(
                        f"{self!r}{tensor_map}: alias {alias!r} is not one of {self.alias_name} "
                        f"(or \"None\" for a whole dim)."
                    )
                if alias in seen:
                    raise ShardingError(
                        f"{self!r}{tensor_map}: alias {alias!r} is used twice; each alias cuts at most "
                        f"one dim of a tensor, once."
                    )
                seen.append(alias)
                axes.append(self.alias_name.index(alias))
            dims.append(tuple(axes))
        return TensorLayout(self.device_matrix, tuple(dims), self.alias_name)
