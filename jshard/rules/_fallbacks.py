"""The primitives of `jax.extend.core.primitives` no sharding rule covers, each with what jshard does
instead. A plan names the fallback on the operator's record (`OpRecord.ruled` is False) and
`Plan.explain` prints its reason: no primitive is laid out silently.
"""

from __future__ import annotations

_MANUAL = "a collective of a manual region (shard_map): the region's body is laid out by its own specs, not by jshard"
_STATE = "a stateful reference operation (Pallas, jax.experimental refs): its operands stay whole"

FALLBACKS: dict[str, str] = {
    "sharding_constraint": "a sharding constraint: the anchor the engine propagates from, not an operator",
    "jit": "a call: its body is inlined and each operator in it planned",
    "call": "a call: its body is inlined and each operator in it planned",
    "closed_call": "a call: its body is inlined and each operator in it planned",
    "custom_jvp_call": "a call: its body is inlined and each operator in it planned",
    "custom_vjp_call": "a call: its body is inlined and each operator in it planned",
    "remat2": "a jax.checkpoint region: its body is inlined and each operator in it planned",
    "custom_lin": "JAX's internal linearization marker: gone from every traced program",
    "custom_linear_solve": "a linear solve with user-given solvers: its operands stay whole (left replicated)",
    "after_all": "a token: nothing to cut",
    "create_token": "a token: nothing to cut",
    "name": "a name for a value (no computation): its operand stays whole",
    "empty2": "an uninitialised buffer: left replicated",
    "get": _STATE,
    "swap": _STATE,
    "psum": _MANUAL,
    "pmax": _MANUAL,
    "pmin": _MANUAL,
    "ppermute": _MANUAL,
    "all_gather": _MANUAL,
    "all_to_all": _MANUAL,
    "ragged_all_to_all": _MANUAL,
    "axis_index": _MANUAL,
}
"""Primitive name -> what jshard does with an operator of it, in words."""
