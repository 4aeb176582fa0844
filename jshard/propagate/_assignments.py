"""Reading factor assignments from operands' layouts for the engine's candidates: several operands
read together (`read_together`), several reads merged into one (`merge_reads`), and whether an
operator taking a `shard` call's value keeps the user's cut (`keeps_cut`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from jshard.layouts import Spec
from jshard.rules import read_assignment


def keeps_cut(want: Spec, spec: Spec, outside: bool) -> bool:
    """Whether an operator taking a `shard` call's value laid out as `spec` in layout `want` keeps
    the user's cut: the same layout, or (an operator outside the call, `outside`) each dim cut by the
    user's axes first, then by more: a slice each device takes of what it holds, nothing moved."""
    if want == spec:
        return True
    return outside and len(want) == len(spec) and all(w[: len(u)] == u for w, u in zip(want, spec))


def merge_reads(reads: Sequence[dict], together: Mapping, partial: bool) -> dict:
    """One assignment from several operands' reads, earlier reads first: a factor whose axes another
    factor on one of its operands took already is left out, or with `partial` keeps the axes left."""
    merged: dict = {}
    for a in reads:
        for fac, axes in a.items():
            taken = {x for g in together[fac] for x in merged.get(g, ())}
            left = tuple(x for x in axes if x not in taken)
            if fac not in merged and (left == tuple(axes) or (partial and left)):
                merged[fac] = left
    return merged


def read_together(dims: Sequence, specs: Sequence[Spec], sizes: Sequence[int], axis_size: Mapping[str, int]):
    """The factor axes operands `dims` laid out as `specs` imply together; None where one cannot be
    read so, or two read one factor otherwise."""
    found: dict = {}
    for d, spec in zip(dims, specs):
        read = read_assignment(d, spec, sizes, axis_size)
        if read is None or any(found.get(g, axes) != axes for g, axes in read.items()):
            return None
        found.update(read)
    return found
