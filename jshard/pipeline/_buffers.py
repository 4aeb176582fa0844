"""Values of differing shapes packed into flat buffers, one per dtype or layout class (`Flat`), as a
cut step's stages hold and send them (`_staged.py`): a dtype's buffer whole on the stage's devices,
a cut class's (`float32@d0`) cut over its axes; the layouts a tick's switch ends its buffers in
(`whole_on_stage`, `laid`), and the rows of slotted buffers (`zero_buffers`, `slot`, `row_at`, `put_row`,
`receive`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jshard.pipeline._cut import spec_axes
from jshard.pipeline._inner import from_rows, to_rows

Buffers = dict[str, jax.Array]
"""One 1-D (or `[..., width]`) array per dtype name."""


@dataclasses.dataclass(frozen=True)
class Flat:
    """Arrays of given shapes packed into one 1-D buffer per layout class, in order.

    An array whole on the stage's devices goes into its dtype's buffer (named by the dtype) as its
    elements. One a stage's strategies cut (`specs`, over the stage's automatic axes) goes into the
    buffer of its dtype and axes (named as a `CutClass`: `float32@d0`), of `n` blocks, `n` the
    devices those axes hold: block `i` holds shard `i` of each of its arrays (`to_rows`), and the
    buffer is laid out cut over those axes (`laid`), so each device stores and sends its shards only.

    Attributes:
      avals: the arrays' shapes and dtypes.
      offsets: each array's start in its buffer's block.
      sizes: per buffer name, the elements its arrays take (all blocks).
      specs: per array, its `PartitionSpec` inside the stage (None: whole).
      axis_sizes: the mesh's axes and their sizes, in mesh order.

    Examples:
      >>> f = Flat.of([jnp.ones((2, 2)), jnp.zeros(3, jnp.int32)])
      >>> packed = f.pack([jnp.ones((2, 2)), jnp.arange(3)], {"float32": 6, "int32": 3})
      >>> packed["float32"].tolist(), [a.tolist() for a in f.unpack(packed)][1]
      ([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], [0, 1, 2])
      >>> cut = Flat.of([jnp.zeros((2, 4))], [P(None, "a")], {"a": 2})  # columns cut in two
      >>> cut.pack([jnp.arange(8.0).reshape(2, 4)], cut.sizes)["float32@a"].tolist()
      [0.0, 1.0, 4.0, 5.0, 2.0, 3.0, 6.0, 7.0]
    """

    avals: tuple[jax.ShapeDtypeStruct, ...]
    offsets: tuple[int, ...]
    sizes: dict[str, int]
    specs: tuple[P | None, ...] = ()
    axis_sizes: tuple[tuple[str, int], ...] = ()

    @classmethod
    def of(
        cls, avals: Sequence[Any], specs: Sequence[P | None] | None = None, axis_sizes: dict[str, int] | None = None
    ) -> Flat:
        specs = tuple(specs) if specs is not None else (None,) * len(avals)
        order = list(axis_sizes or {})
        blocks: dict[str, int] = {}
        offsets = []
        for a, spec in zip(avals, specs):
            name = _name(a.dtype, spec, order)
            offsets.append(blocks.get(name, 0))
            blocks[name] = offsets[-1] + int(np.prod(a.shape)) // _blocks(name, axis_sizes)
        sizes = {name: used * _blocks(name, axis_sizes) for name, used in blocks.items()}
        return cls(
            tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals),
            tuple(offsets),
            sizes,
            specs,
            tuple((axis_sizes or {}).items()),
        )

    def _where(self, a, spec) -> tuple[str, tuple[str, ...], int]:
        """An array's buffer name, the axes cutting it, and the buffer's blocks."""
        name = _name(a.dtype, spec, [axis for axis, _ in self.axis_sizes])
        return name, _axes(name), _blocks(name, dict(self.axis_sizes))

    def pack(self, arrays: Sequence[jax.Array], widths: dict[str, int]) -> Buffers:
        """The arrays as one buffer per name of `widths`, each block zero-padded to its width."""
        parts: dict[str, list] = {name: [] for name in widths}
        sizes = dict(self.axis_sizes)
        for a, spec, x in zip(self.avals, self.specs, arrays):
            name, axes, n = self._where(a, spec)
            x = jnp.asarray(x).astype(a.dtype)
            parts[name].append(to_rows(x, cast(P, spec), axes, sizes) if axes else jnp.ravel(x))
        out = {}
        for name, width in widths.items():
            n, used = _blocks(name, sizes), self.sizes.get(name, 0)
            lead = (n,) if _axes(name) else ()
            pad = [jnp.zeros((*lead, (width - used) // n), _dtype(name))] if width > used else []
            out[name] = (
                jnp.concatenate(parts[name] + pad, axis=-1).reshape(-1)
                if parts[name] or pad
                else jnp.zeros((0,), _dtype(name))
            )
        return out

    def unpack(self, buffers: Buffers) -> list[jax.Array]:
        """The arrays read back from `buffers`, each laid out as its spec says (whole on the
        stage's devices where it has none: `whole_on_stage`)."""
        out, sizes = [], dict(self.axis_sizes)
        for a, spec, o in zip(self.avals, self.specs, self.offsets):
            name, axes, n = self._where(a, spec)
            local = int(np.prod(a.shape)) // n
            if not axes:
                out.append(whole_on_stage(jax.lax.dynamic_slice_in_dim(buffers[name], o, local).reshape(a.shape)))
                continue
            block = buffers[name].reshape(n, -1)[:, o : o + local]
            cut = cast(P, spec)  # axes cut it: it has a spec
            out.append(_cut(from_rows(block, cut, axes, sizes, a.shape), cut))
        return out


def _name(dtype, spec: P | None, order: Sequence[str]) -> str:
    """The buffer of an array of `dtype` laid out as `spec`: its dtype's name, with the axes that
    cut it in mesh `order` (`CutClass.key`)."""
    axes = sorted(spec_axes(spec), key=order.index) if spec is not None else []
    return np.dtype(dtype).name + (f"@{'.'.join(axes)}" if axes else "")


def _axes(name: str) -> tuple[str, ...]:
    """The axes buffer `name` is cut over (`_name`)."""
    return tuple(name.split("@")[1].split(".")) if "@" in name else ()


def _dtype(name: str) -> str:
    return name.split("@")[0]


def _blocks(name: str, axis_sizes: dict[str, int] | None) -> int:
    """The blocks of buffer `name`: how many devices its axes hold."""
    return int(np.prod([(axis_sizes or {})[a] for a in _axes(name)]))


def widths(flats: Sequence[Flat]) -> dict[str, int]:
    """Per dtype, the largest size over `flats` (the width their shared buffer needs)."""
    out: dict[str, int] = {}
    for f in flats:
        for name, size in f.sizes.items():
            out[name] = max(out.get(name, 0), size)
    return dict(sorted(out.items()))


def has_automatic_axes() -> bool:
    """Whether the mesh in context has automatic axes (a stage's, inside the pipeline's `shard_map`)."""
    mesh = jax.sharding.get_abstract_mesh()
    return bool(set(mesh.axis_names) - set(mesh.manual_axes))


def whole_on_stage(tree):
    """`tree` whole on each device of a stage whose axes are automatic (`jshard.shard` strategies
    inside the stages): every branch of a tick's switch ends with its buffers in this one layout,
    so the packed buffers are read by local slices, and no collective runs in one stage's branch
    that another stage's devices would have to join."""
    if not has_automatic_axes():
        return tree
    return jax.tree.map(lambda x: jax.lax.with_sharding_constraint(x, P()), tree)


def _cut(x: jax.Array, spec: P) -> jax.Array:
    """`x` laid out as `spec` over the stage's automatic axes (as is, with none)."""
    return jax.lax.with_sharding_constraint(x, spec) if has_automatic_axes() else x


def laid(tree: dict) -> dict:
    """A tick's values (buffers by name, the loss) in the one layout every branch of its switch ends
    with: a dtype's buffer whole on each of the stage's devices (`whole_on_stage`), a cut class's
    (`float32@d0`, `Flat`) cut over its axes along its last dim, so the packed buffers are read
    and written by local slices, and no collective runs in one stage's branch that another
    stage's devices would have to join."""
    if not has_automatic_axes():
        return tree

    def one(path, x):
        axes = _axes(str(getattr(path[-1], "key", ""))) if path else ()
        return jax.lax.with_sharding_constraint(x, P(*[None] * (x.ndim - 1), axes) if axes else P())

    return jax.tree_util.tree_map_with_path(one, tree)


def slot(c, i, slots: int):
    """The row of chunk `c`'s slot of micro-batch `i` in a buffer of `slots` rows per chunk."""
    return c * slots + i % slots


def zero_buffers(slots: int | None, w: dict[str, int]) -> Buffers:
    lead = () if slots is None else (slots,)
    return {name: jnp.zeros((*lead, width), _dtype(name)) for name, width in w.items()}


def row_at(buffers: Buffers, i) -> Buffers:
    return {name: b[i % b.shape[0]] for name, b in buffers.items()}


def put_row(buffers: Buffers, i, values: Buffers) -> Buffers:
    return {
        name: jax.lax.dynamic_update_index_in_dim(b, values[name], i % b.shape[0], 0) for name, b in buffers.items()
    }


def receive(buffers: Buffers, values: Buffers, valid, i) -> Buffers:
    """`values` written into row `i` (`slot`) where this stage received something this tick."""
    kept = row_at(buffers, i)
    return put_row(buffers, i, {name: jnp.where(valid > 0, values[name], kept[name]) for name in buffers})
