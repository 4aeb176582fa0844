"""Expert strategy presets for the reference models, written as MindSpore strategies.

A preset is a data-parallel degree `dp` and a tensor-parallel (Megatron) degree `mp` with
`dp * mp` = the device count. Column-parallel matmuls cut the weight's output dim
(`((dp, 1, 1), (1, mp))`), row-parallel ones its input dim (`((dp, 1, mp), (mp, 1))`), as in
Megatron-LM; parameters and optimizer state are laid out with a `Layout((dp, mp), ("dp", "mp"))`
so that they sit exactly where the matmuls use them.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from jshard._errors import ShardingError
from jshard._shard import shard
from jshard.layouts import Layout, TensorLayout

PRESETS = ("data", "tensor", "2d")


@dataclasses.dataclass(frozen=True, slots=True)
class Preset:
    """A data × tensor parallel split of the devices.

    Attributes:
      name: `"data"`, `"tensor"` or `"2d"`.
      dp: data-parallel degree (the batch is cut `dp` ways).
      mp: tensor-parallel degree (weights are cut `mp` ways).
    """

    name: str
    dp: int
    mp: int

    @property
    def layout(self) -> Layout:
        return Layout((self.dp, self.mp), ("dp", "mp"))

    def column(self, rank: int) -> tuple[tuple[int, ...], tuple[int, int]]:
        """MindSpore in_strategy of `x @ w` cutting the batch `dp` ways and w's columns `mp` ways."""
        return (self.dp,) + (1,) * (rank - 1), (1, self.mp)

    def row(self, rank: int) -> tuple[tuple[int, ...], tuple[int, int]]:
        """MindSpore in_strategy of `x @ w` contracting over the dim cut `mp` ways (partial sums)."""
        return (self.dp,) + (1,) * (rank - 2) + (self.mp,), (self.mp, 1)

    def matmul(self, kind: str, rank: int):
        """`jnp.matmul` sharded column- or row-parallel."""
        return shard(jnp.matmul, self.column(rank) if kind == "column" else self.row(rank))

    def batch(self, rank: int) -> TensorLayout:
        return self.layout("dp", *(["None"] * (rank - 1)))

    def parameters(self, params, rules: Mapping[str, str]):
        """A `TensorLayout` per parameter: `rules` maps a path regex to `"column"` or `"row"`."""

        def one(path, leaf):
            name = jax.tree_util.keystr(path, simple=True, separator="/")
            kind = next((k for pattern, k in rules.items() if re.search(pattern, name)), None)
            dims = ["None"] * leaf.ndim
            if kind == "column":
                dims[-1] = "mp"
            elif kind == "row":
                dims[-2] = "mp"
            return self.layout(*dims)

        return jax.tree_util.tree_map_with_path(one, params)


def preset(name: str, devices: int) -> Preset:
    """The named preset on `devices` devices: `data` (dp=n), `tensor` (mp=n) or `2d` (dp=2, mp=n/2).

    Examples:
      >>> preset("2d", 8)
      Preset(name='2d', dp=2, mp=4)
    """
    if name == "data":
        return Preset(name, devices, 1)
    if name == "tensor":
        return Preset(name, 1, devices)
    if name == "2d":
        if devices % 2 or devices < 4:
            raise ShardingError(f"jshard.models.preset('2d', {devices}): needs an even device count of at least 4.")
        return Preset(name, 2, devices // 2)
    raise ShardingError(f"jshard.models.preset({name!r}, {devices}): the presets are {PRESETS}.")
