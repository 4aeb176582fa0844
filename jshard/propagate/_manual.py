"""A manual region (`jax.shard_map`): its operands taken and its results made in its own specs, and
the collectives its body runs priced as written (what `jshard.attention`'s context-parallel forms
and any user's `shard_map` move), each weighted by the trip counts of the loops around it; its
body's matrix products are its compute (`manual_flops`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from jax.extend import core as jcore

from jshard.cost import Comm, CostModel, value_bytes
from jshard.graph import MANUAL as MANUAL  # the primitive this module prices, named where the graph is read
from jshard.layouts import Spec, spec_from_pspec
from jshard.rules import RULES, shape_of

_KINDS = {
    "ppermute": "collective-permute",
    "all_gather": "all-gather",
    "all_to_all": "all-to-all",
    "psum": "all-reduce",
    "psum_invariant": "all-reduce",
    "pmax": "all-reduce",
    "pmin": "all-reduce",
    "reduce_scatter": "reduce-scatter",
}
"""A body's collective primitive -> the kind of collective XLA emits for it (the audit's names)."""


def manual_specs(eqn: jcore.JaxprEqn) -> tuple[tuple[Spec, ...], tuple[Spec, ...]]:
    """The region's operands' and results' layouts, as its `in_specs` and `out_specs` say."""
    ins = tuple(spec_from_pspec(p, len(shape_of(v))) for p, v in zip(eqn.params["in_specs"], eqn.invars))
    outs = tuple(spec_from_pspec(p, len(shape_of(v))) for p, v in zip(eqn.params["out_specs"], eqn.outvars))
    return ins, outs


def manual_comms(eqn: jcore.JaxprEqn) -> tuple[Comm, ...]:
    """Each collective of the region's body, once per run of the region: payload bytes per device
    in the audit's convention (an all-gather's result, every other kind's operands)."""
    return tuple(_collectives(eqn.params["jaxpr"], 1))


def manual_flops(eqn: jcore.JaxprEqn) -> float:
    """The floating-point work of the region's matrix products per device, per run of the region:
    its body's `dot_general`s at their local shapes, each weighted by the trip counts of the loops
    inside the body (a branch: its costliest). Elementwise work is left out (a body's products
    dominate: attention's). A region manual over some of the mesh's axes only (`jshard.accumulate`'s
    micro-batch loop, a pipeline's stages) is 0, as before: its body's shapes are cut only over
    those, and XLA lays out the rest of its work inside, which jshard does not plan."""
    mesh, manual = eqn.params.get("mesh"), eqn.params.get("newly_manual_axes")
    if mesh is not None and manual is not None and any(n > 1 and a not in manual for a, n in mesh.shape.items()):
        return 0.0
    return _flops(eqn.params["jaxpr"])


def _flops(jaxpr: jcore.Jaxpr) -> float:
    total = 0.0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":  # its rule's FLOPs, at the body's local shapes
            total += float(RULES["dot_general"](eqn).flops)
            continue
        branches = eqn.params.get("branches", ())
        if branches:
            total += max(_flops(b.jaxpr if hasattr(b, "jaxpr") else b) for b in branches)
            continue
        times = eqn.params.get("length", 1) if eqn.primitive.name == "scan" else 1
        total += times * sum(_flops(sub) for sub in _bodies(eqn))
    return total


def manual_seconds(comms: tuple[Comm, ...], axis_size: Mapping[str, int], cost: CostModel) -> float:
    return sum(cost.time(c, axis_size) for c in comms)


def _collectives(jaxpr: jcore.Jaxpr, weight: int) -> Iterator[Comm]:
    for eqn in jaxpr.eqns:
        kind = _KINDS.get(eqn.primitive.name)
        if kind is not None:
            axes = eqn.params.get("axis_name", eqn.params.get("axes", ()))
            axes = (axes,) if isinstance(axes, str) else tuple(axes)
            moved = eqn.outvars if kind == "all-gather" else eqn.invars
            size = sum(value_bytes(v) for v in moved)
            for _ in range(weight):
                yield Comm(kind, float(size), axes)
            continue
        inner = weight * eqn.params.get("length", 1) if eqn.primitive.name == "scan" else weight
        for sub in _bodies(eqn):
            yield from _collectives(sub, inner)


def _bodies(eqn: jcore.JaxprEqn) -> list[jcore.Jaxpr]:
    """The sub-jaxprs of a call, loop or branch equation (a branch's collectives counted once: the
    region runs one of them)."""
    found = []
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr", "body_jaxpr"):
        sub = eqn.params.get(key)
        if sub is not None:
            found.append(sub.jaxpr if hasattr(sub, "jaxpr") else sub)
    branches = eqn.params.get("branches", ())
    if branches:
        found.append(branches[0].jaxpr if hasattr(branches[0], "jaxpr") else branches[0])
    return found
