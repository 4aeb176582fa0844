"""Where jshard accepts a cut MindSpore's own operator refuses: the note the plan's record of that
operator carries (the table of differences: docs/concepts/mindspore.md).

MindSpore's kernels run on each device's slice, so its operators refuse cuts they cannot compute
locally; XLA's partitioner inserts the communication such a cut needs instead, and the numbers are
the same. A note says where that happens, so a plan ported back to MindSpore does not meet the
refusal unawares.
"""

from __future__ import annotations

from collections.abc import Sequence

from jshard.layouts import Strategy

_CUMULATIVE = ("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")


def mindspore_note(primitive: str, params: dict, shapes: Sequence[Sequence[int]],
                   strategy: Sequence[Strategy | None] | None) -> str:
    """The difference from MindSpore an operator's input strategy makes, in words, or `""`."""
    cuts = strategy[0] if strategy else None
    if cuts is None or len(cuts) != len(shapes[0]) or all(c == 1 for c in cuts):
        return ""
    if primitive == "split" and cuts[params["axis"]] > 1:
        return _note(f"Split refuses a cut split axis (dim {params['axis']} cut {cuts[params['axis']]}-way)")
    if primitive == "slice":
        return _slice_note(params, shapes[0], cuts)
    if primitive == "top_k" and cuts[-1] > 1:
        return _note(f"TopK refuses its last dim cut ({cuts[-1]}-way)")
    if primitive == "tile" and any(c > 1 and r > 1 for c, r in zip(cuts, params["reps"])):
        d = next(d for d, (c, r) in enumerate(zip(cuts, params["reps"])) if c > 1 and r > 1)
        return _note(f"Tile refuses a cut dim it tiles (dim {d} cut {cuts[d]}-way, tiled {params['reps'][d]} times)")
    if primitive in ("argmax", "argmin") and any(cuts[a] > 1 for a in params["axes"]):
        a = next(a for a in params["axes"] if cuts[a] > 1)
        return _note(f"{'Argmax' if primitive == 'argmax' else 'Argmin'} takes its axis cut (dim {a} cut "
                     f"{cuts[a]}-way) but finds the index in each device's slice, warning that it may differ from "
                     "one device's; jshard gathers the axis, so the index is one device's")
    if primitive in _CUMULATIVE and cuts[params["axis"]] > 1:
        return _note(f"CumSum refuses its axis cut (dim {params['axis']} cut {cuts[params['axis']]}-way)")
    return ""


def _slice_note(params: dict, shape: Sequence[int], cuts: Strategy) -> str:
    strides = params.get("strides") or (1,) * len(shape)
    for d, (start, limit, stride, n, cut) in enumerate(zip(params["start_indices"], params["limit_indices"],
                                                          strides, shape, cuts)):
        if cut > 1 and stride != 1:
            return _note(f"StridedSlice refuses a stride on a cut dim (dim {d}: stride {stride}, cut {cut}-way)")
        if cut > 1 and (start, limit) != (0, n):
            return _note(f"Slice and StridedSlice refuse a slice that does not take the whole of a cut dim "
                         f"(dim {d}: [{start}:{limit}] of {n}, cut {cut}-way)")
    return ""


def _note(what: str) -> str:
    return f"MindSpore's {what}; XLA moves what the cut needs here (jshard accepts it: docs/concepts/mindspore.md)"
