"""Sharding rules as *factors*, and the one registry every rule family writes to.

A rule describes an operator by the loops it runs, as Shardy's `OpShardingRule` does: every
tensor dimension is a product of factors (most dims are one factor; a reshape's merged dim is two),
and two dims that share a factor must be cut the same way. A factor that appears in the inputs but
in no output is *reduced* (a contraction, a sum) where the rule says so: cutting it leaves partial
results, summed by an all-reduce; otherwise a dim with no factor must be whole.

Values are laid out by a `Spec`: for each dimension, the mesh axes that cut it, major to minor.
A candidate strategy for an operator is an assignment of mesh axes to its factors (each axis used
once); every operand's `Spec` follows from it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from jax.extend import core as jcore

from jshard.layouts import Spec

DimFactors = tuple[int, ...]
"""The factors one dimension is made of, major to minor (`()`: the dim must be whole)."""

Assignment = Mapping[int, tuple[str, ...]]
"""Mesh axes per factor id."""


@dataclasses.dataclass(frozen=True, slots=True)
class Factors:
    """How an operator's operands share their dimensions.

    Attributes:
      inputs: per input operand, per dim, its factors.
      outputs: per result, per dim, its factors.
      sizes: the size of each factor (factor ids index this tuple).
      reduced: factors whose cut leaves partial results on the outputs (summed by an all-reduce).
      flops: the operator's floating-point work on one device holding everything.
    """

    inputs: tuple[tuple[DimFactors, ...], ...]
    outputs: tuple[tuple[DimFactors, ...], ...]
    sizes: tuple[int, ...]
    reduced: frozenset[int] = frozenset()
    flops: float = 0.0
    _hash: int | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    def __hash__(self) -> int:
        """The fields' hash, computed once: the searches key their tables by an operator's factors,
        shared by the same operator of every identical layer."""
        found = self._hash
        if found is None:
            found = hash((self.inputs, self.outputs, self.sizes, self.reduced, self.flops))
            object.__setattr__(self, "_hash", found)
        return found

    @property
    def operands(self) -> tuple[tuple[DimFactors, ...], ...]:
        return self.inputs + self.outputs

    @property
    def joined(self) -> tuple[frozenset[int], ...]:
        """Sets of factors no two of which may share a mesh axis: each operand's factors, and each
        output's with the reduced factors, whose partial sums land on it (a gather's looked-up dim
        and its indices' batch dim share no operand, yet one device cannot hold a slice of both
        along one axis)."""
        reduced = frozenset(self.reduced)
        sets = [frozenset(g for d in dims for g in d) for dims in self.inputs]
        sets += [frozenset(g for d in dims for g in d) | reduced for dims in self.outputs]
        return tuple(sets)


Rule = Callable[[jcore.JaxprEqn], Factors]
RULES: dict[str, Rule] = {}
"""Primitive name → its rule. Each rule family module registers itself with `rule`."""


def rule(*names: str) -> Callable[[Rule], Rule]:
    """Registers the decorated function as the rule of the primitives `names`."""

    def register(fn: Rule) -> Rule:
        for name in names:
            RULES[name] = fn
        return fn

    return register


class FactorBuilder:
    """Numbers factors while a rule describes an operator.

    Examples:
      >>> b = FactorBuilder()
      >>> i, j = b.new(4), b.new(8)
      >>> b.build([((i,), (j,))], [((i,), (j,))]).sizes
      (4, 8)
    """

    def __init__(self):
        self.sizes: list[int] = []

    def new(self, size: int) -> int:
        self.sizes.append(int(size))
        return len(self.sizes) - 1

    def dims(self, shape: Sequence[int]) -> tuple[DimFactors, ...]:
        """A fresh factor for every dim of `shape`."""
        return tuple((self.new(d),) for d in shape)

    def build(self, inputs, outputs, reduced: Iterable[int] = (), flops: float = 0.0) -> Factors:
        return Factors(
            tuple(tuple(d) for d in inputs), tuple(tuple(d) for d in outputs), tuple(self.sizes), frozenset(reduced),
            float(flops),
        )


def shape_of(v) -> tuple[int, ...]:
    return tuple(getattr(v.aval, "shape", ()))


def whole(v) -> tuple[DimFactors, ...]:
    """Every dim of `v` whole (a scalar literal, an operand the op needs in one piece)."""
    return tuple(() for _ in shape_of(v))


def read_assignment(dims: Sequence[DimFactors], spec: Spec, sizes: Sequence[int], axis_size: Mapping[str, int],
                    kept: bool = False):
    """The factor axes an operand laid out by `spec` implies; None where `spec` cannot be read so.

    A dim's axes go to its factors major first: a factor takes axes while their product divides its
    size, and only a factor cut completely lets the rest spill to the next (minor) one.

    With `kept`, a dim whose factors cannot take all its axes (a dim the operator needs whole, as a
    slice's sliced dim, arriving cut) keeps those they took and leaves the rest: the layout the
    operator takes the operand in by gathering that dim alone, every other dim's cut kept.
    """
    out: dict[int, tuple[str, ...]] = {}
    for factors, axes in zip(dims, spec):
        axes = list(axes)
        for k, f in enumerate(factors):
            taken: list[str] = []
            while axes and sizes[f] % (math.prod(axis_size[a] for a in taken) * axis_size[axes[0]]) == 0:
                taken.append(axes.pop(0))
            if taken:
                out[f] = tuple(taken)
            if axes and math.prod(axis_size[a] for a in taken) != sizes[f]:
                break
        if axes and not kept:
            return None
    return out


def expressible(f: Factors, assignment: Assignment, axis_size: Mapping[str, int], dims=None) -> bool:
    """Whether every operand can be laid out as `assignment` says: a minor factor of a merged dim
    (the `head_dim` of `[..., heads * head_dim]`) can be cut only under a major one cut completely,
    else its slices are not contiguous and `write_spec` drops its axes (a gather no cost sees).
    `dims`: the dims (factor tuples) to check, default every operand's."""
    checked = [factors for operand in f.operands for factors in operand] if dims is None else dims
    for factors in checked:
        complete = True
        for g in factors:
            mine = assignment.get(g, ())
            if mine and not complete:
                return False
            complete = complete and math.prod(axis_size[a] for a in mine) == f.sizes[g]
    return True


def write_spec(
    dims: Sequence[DimFactors], assignment: Assignment, sizes: Sequence[int], axis_size: Mapping[str, int]
) -> Spec:
    """The layout of an operand whose dims are `dims`, under `assignment`.

    A minor factor's axes count only when every factor before it in the dim is cut completely
    (otherwise the slices would not be contiguous); such axes are dropped from this operand.
    """
    spec = []
    for factors in dims:
        if len(factors) == 1:  # the common case: one factor, its axes as they are
            spec.append(tuple(assignment.get(factors[0], ())))
            continue
        axes: list[str] = []
        for f in factors:
            mine = assignment.get(f, ())
            axes += mine
            if math.prod(axis_size[a] for a in mine) != sizes[f]:
                break
        spec.append(tuple(axes))
    return tuple(spec)
