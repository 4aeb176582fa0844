"""The parameters outside a `Pipeline`'s stack, held where they are used (issue 17, item 3).

`first` runs on stage 0 and `last` (and `head`) on the last stage, so their parameters are packed
as the cut form packs a stage's (`_staged.Flat`): one `[S, width]` buffer per dtype cut over the
`stage` axis, row 0 the leaves `first` reads, row `S - 1` those `last` or `head` reads, the rows
between empty (zeros; the width is the larger of the two shares). A leaf both read (a tied
embedding) is in both rows, and its gradient, the sum of both stages', is in both copies. A device
thus holds its own stage's share of them, not all of them. Where strategies cut those leaves
inside the stages (`in_strategy`), whose layouts a packed row would lose, they stay on every stage
(`_engine.Replicated`). Both hold them behind one interface the program calls (`local`, `tree`, `row`,
`sum_tied`, `out`; `pack` and `unpack` outside it).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Var
from jax.sharding import PartitionSpec as P

from jshard.pipeline._buffers import Buffers, Flat, widths
from jshard.pipeline._engine import STAGE


@dataclasses.dataclass(frozen=True, eq=False)
class StageParams:
    """Which parameters outside the stack each end stage reads, and their packing.

    Attributes:
      avals: the leaves of the parameters outside the stack (flat, `jax.tree.leaves` order).
      treedef: their tree structure.
      first: indices of the leaves `first` reads (held on stage 0).
      last: indices of the leaves `last` or `head` reads (held on the last stage).
      stages: S.
    """

    avals: tuple[jax.ShapeDtypeStruct, ...]
    treedef: Any
    first: tuple[int, ...]
    last: tuple[int, ...]
    stages: int

    spec = P(STAGE)
    """The packed buffers' spec over the pipeline's mesh (and of their gradients)."""

    @classmethod
    def of(cls, pipe, rest, micro_batch, act, stages: int) -> StageParams:
        """Reads which leaves of `rest` `first` and `last` (and `head`) use, from their jaxprs."""
        leaves, treedef = jax.tree.flatten(rest)
        avals = tuple(jax.ShapeDtypeStruct(np.shape(a), a.dtype) for a in leaves)
        build = lambda xs: jax.tree.unflatten(treedef, xs)
        first = _read(lambda xs, x, mb: pipe.first(build(xs), mb), avals, act, micro_batch)
        last = _read(lambda xs, x, mb: pipe.last(build(xs), x, mb), avals, act, micro_batch)
        if pipe.head is not None:
            last = tuple(sorted(set(last) | set(_read(lambda xs, x, mb: pipe.head(build(xs), x), avals, act, micro_batch))))
        return cls(avals, treedef, first, last, stages)

    def _flat(self, which: str) -> Flat:
        return Flat.of([self.avals[j] for j in getattr(self, which)])

    @property
    def widths(self) -> dict[str, int]:
        return widths([self._flat("first"), self._flat("last")])

    def stage_bytes(self) -> tuple[int, ...]:
        """Bytes of each stage's own share (a tied leaf counts on both ends; middle stages none)."""
        size = lambda idx: sum(int(np.prod(self.avals[j].shape)) * np.dtype(self.avals[j].dtype).itemsize for j in idx)
        return (size(self.first), *([0] * (self.stages - 2)), size(self.last))

    def pack(self, rest: Any) -> Buffers:
        """`rest` as `[S, width]` buffers: row 0 `first`'s leaves, row `S - 1` `last`'s."""
        leaves = jax.tree.leaves(rest)
        w = self.widths
        ends = {0: self._row(leaves, "first"), self.stages - 1: self._row(leaves, "last")}
        empty = {name: jnp.zeros((width,), name) for name, width in w.items()}
        return {name: jnp.stack([ends.get(k, empty)[name] for k in range(self.stages)]) for name in w}

    def _row(self, leaves, which: str) -> Buffers:
        return self._flat(which).pack([leaves[j] for j in getattr(self, which)], self.widths)

    def unpack(self, packed: Buffers) -> Any:
        """The tree read back from `[S, width]` buffers (a leaf read by neither end: zeros)."""
        out: dict[int, jax.Array] = {}
        for which, k in (("last", self.stages - 1), ("first", 0)):
            row = {name: b[k] for name, b in packed.items()}
            out.update(zip(getattr(self, which), self._flat(which).unpack(row)))
        return jax.tree.unflatten(self.treedef, [out.get(j, jnp.zeros(a.shape, a.dtype)) for j, a in enumerate(self.avals)])

    @property
    def grad_specs(self) -> dict[str, P]:
        """Inside a stage: the gradient row's specs (whole on the stage's devices)."""
        return {name: P() for name in self.widths}

    def local(self, packed: Buffers) -> Buffers:
        """Inside the program: this stage's row of the `[1, width]` buffers it is handed."""
        return {name: b[0] for name, b in packed.items()}

    def out(self, row: Buffers) -> Buffers:
        """Inside the program: a gradient row as this stage's `[1, width]` block of the result."""
        return {name: b[None] for name, b in row.items()}

    def tree(self, row: Buffers, which: str) -> Any:
        """Inside the program: the tree `first` (`which="first"`) or `last` reads, from this
        stage's row (meaningful on that end's stage); the other leaves zeros, which it never reads."""
        got = dict(zip(getattr(self, which), self._flat(which).unpack(row)))
        return jax.tree.unflatten(self.treedef, [got.get(j, jnp.zeros(a.shape, a.dtype)) for j, a in enumerate(self.avals)])

    def row(self, grads: Any, which: str) -> Buffers:
        """Inside the program: `which` end's leaves of a gradient tree, as a row."""
        return self._row(jax.tree.leaves(grads), which)

    def sum_tied(self, row: Buffers, stage: jax.Array, axis: str) -> Buffers:
        """Each leaf read by both ends gets the sum of both stages' gradients, in both rows."""
        tied = sorted(set(self.first) & set(self.last))
        if not tied:
            return row
        flat = Flat.of([self.avals[j] for j in tied])
        w = widths([flat])

        def mine(which):
            leaves = dict(zip(getattr(self, which), self._flat(which).unpack(row)))
            return flat.pack([leaves[j] for j in tied], w)

        is_first, is_last = stage == 0, stage == self.stages - 1
        own = jax.tree.map(lambda a, b: jnp.where(is_first, a, jnp.where(is_last, b, jnp.zeros_like(a))),
                           mine("first"), mine("last"))
        summed = dict(zip(tied, flat.unpack(jax.lax.psum(own, axis))))

        def put_back(which):
            leaves = self._flat(which).unpack(row)
            return self._flat(which).pack([summed.get(j, x) for j, x in zip(getattr(self, which), leaves)], self.widths)

        return jax.tree.map(lambda a, b, c: jnp.where(is_first, a, jnp.where(is_last, b, c)),
                            put_back("first"), put_back("last"), row)


def _read(fn, avals, *rest) -> tuple[int, ...]:
    """The indices of the arrays `avals` that `fn(list_of_arrays, *rest)` reads (its jaxpr's used
    inputs)."""
    jaxpr = jax.make_jaxpr(fn)(list(avals), *rest).jaxpr
    used = {id(v) for eqn in jaxpr.eqns for v in eqn.invars if isinstance(v, Var)}
    used |= {id(v) for v in jaxpr.outvars if isinstance(v, Var)}
    return tuple(j for j, v in enumerate(jaxpr.invars[:len(avals)]) if id(v) in used)

