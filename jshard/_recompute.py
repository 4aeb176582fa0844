"""`jshard.recompute`: MindSpore's `Cell.recompute()` / `Primitive.recompute()` as `jax.checkpoint`.

A recomputed function keeps only its inputs (or, selectively, its matmul outputs) for the backward
pass and runs its forward again there. Inside `parallelize` the recompute survives planning: the
emitter rebuilds the remat equation with its sharding constraints inside (`jshard/propagate`).

A region that names no policy takes `parallelize`'s `recompute=` (MindSpore's parallel-wide
recompute default), else `"full"`. `policy="auto"` leaves the choice to the strategy search
(`mode="auto"`): it traces the step once per policy in `AUTO_POLICIES` (the same for every such
region), prices each region's memory and recompute from those traces, and gives each region its
own policy: the least recompute that fits the memory budget (`SearchReport.regions`).

`mp_comm_recompute=False` (MindSpore's `recompute(mp_comm_recompute=False)`) keeps the results of
the region's collectives: the policy becomes a `jshard.graph.KeepComm`, which also saves the values
emission names `COMM_NAME` (each value a collective makes inside the region), so the backward pass
recomputes the region's computation but does not communicate again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jshard import _context
from jshard._errors import ShardingError, api_boundary
from jshard.graph import AUTO_LABEL, COMM_KEPT_LABEL, RECOMPUTE_SCOPE, KeepComm
from jshard.hetero import HOST_POLICIES

Policy = str | Callable[..., bool]
"""`"full"`, `"selective"`, `"none"`, `"auto"`, the name of a `jax.checkpoint_policies` policy, or a
policy callable."""

AUTO_POLICIES = ("none", "selective", "full")
"""The policies the search weighs for `policy="auto"` regions, the fastest (and largest) first."""

_SHORTHANDS = {"full": None, "selective": "dots_saveable"}
"""MindSpore's names: full recompute (`jax.checkpoint`'s default, keeping nothing) and selective."""
_NAMED = ("nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
          "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")
"""The `jax.checkpoint_policies` attributes that are policies themselves (the others build one)."""


@api_boundary
def recompute(fn: Callable[..., Any] | None = None, *, policy: Policy | None = None,
              mp_comm_recompute: bool = True) -> Any:
    """`fn` recomputed in the backward pass instead of keeping its intermediate values; usable as a
    decorator, with or without arguments.

    Args:
      fn: the function (a layer, a block) whose forward pass to recompute.
      policy: what to keep: `"full"` (nothing but the inputs: MindSpore's `Cell.recompute()`),
        `"selective"` (the matmul outputs, `dot_general` results; the elementwise work between them
        is recomputed), `"none"` (everything: no recompute), `"offload"` (the matmul outputs without
        batch dims, kept in host memory: activation offload; `jshard.offload_names(...)` offloads
        named activations), the name of a `jax.checkpoint_policies` policy
        (`"dots_with_no_batch_dims_saveable"`), a policy callable
        (`jax.checkpoint_policies.save_only_these_names("attn")`), `"auto"` (under
        `parallelize(mode="auto")` the search picks one of `AUTO_POLICIES` by predicted step time
        and memory budget; elsewhere, with no search to decide, `"full"`), or None (the default:
        the enclosing `parallelize`'s `recompute=`, else `"full"`).
      mp_comm_recompute: MindSpore's flag of the same name. True (the default): the collectives
        inside the region (the all-gathers, all-reduces, all-to-alls the plan's layouts make there)
        run again with it in the backward pass. False: the region keeps their results (the
        gathered or reduced tensors) from the forward pass and recomputes only its computation:
        fewer collective bytes, more memory. It acts under `parallelize`, where jshard places the
        constraints that make those collectives (not under `mode="manual"` or
        `propagation="xla"`, nor in a `lax.scan` over layers, whose backward loop cannot reach the
        forward loop's values: those raise `ShardingError`), and means nothing for `policy="none"`.

    Returns:
      `jax.checkpoint(fn, policy=...)` for a fixed policy, a function choosing its policy when it is
      traced for None and `"auto"`; or a decorator making it when `fn` is None.

    Raises:
      ShardingError: `policy` names no policy.
      TypeError: `policy` is neither a string nor a callable, or `mp_comm_recompute` is no bool.

    Examples:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> layer = js.recompute(lambda w, x: jnp.tanh(x @ w), policy="selective")
      >>> jax.grad(lambda w, x: layer(w, x).sum())(jnp.eye(2), jnp.ones((1, 2))).shape
      (2, 2)
    """
    named = f"policy={policy!r}" if fn is None else getattr(fn, "__name__", type(fn).__name__)
    call = f"jshard.recompute({named})"
    if not isinstance(mp_comm_recompute, bool):
        raise TypeError(f"{call}: mp_comm_recompute must be True (the region's collectives run again in the "
                        f"backward pass) or False (their results are kept), not {mp_comm_recompute!r}.")
    keep = not mp_comm_recompute
    if policy is not None and policy != "auto":
        resolved, label = _policy(policy, call), _label(policy)
        if fn is None:
            return lambda f: _fixed(f, resolved, label, keep)
        return _fixed(fn, resolved, label, keep)
    if fn is None:
        return lambda f: _deferred(f, policy, call, keep)
    return _deferred(fn, policy, call, keep)


def _label(policy: Policy) -> str:
    return policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")


def _scoped(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """`fn` run in the name scope `RECOMPUTE_SCOPE + label` (how its `Plan` names the policy)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with jax.named_scope(RECOMPUTE_SCOPE + "".join(c if c.isalnum() else "_" for c in label)):
            return fn(*args, **kwargs)

    return run


_NONE = object()
"""`_policy`'s answer for `"none"`: no recompute."""


def _fixed(fn: Callable[..., Any], resolved: Any, label: str, keep: bool = False) -> Callable[..., Any]:
    """`fn` under `jax.checkpoint` with `resolved` (keeping fn's name and docstring), in its `label`'s
    name scope; with `keep`, the results of its collectives kept too (`KeepComm`)."""
    if resolved is _NONE:
        return fn
    if keep:
        return jax.checkpoint(_scoped(fn, label + COMM_KEPT_LABEL), policy=KeepComm(resolved))
    return jax.checkpoint(_scoped(fn, label), policy=resolved)


def _deferred(fn: Callable[..., Any], policy: str | None, call: str, keep: bool) -> Callable[..., Any]:
    """`fn` recomputed by the policy the trace it runs in gives it (see `recompute`)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        chosen, region = traced_policy(policy)
        if region is None:
            return _fixed(fn, _policy(chosen, call), _label(chosen), keep)(*args, **kwargs)
        label = f"{AUTO_LABEL}{region}_{chosen}"  # the plan tells the search's regions apart by it
        return (_scoped(fn, label) if chosen == "none" else _fixed(fn, _policy(chosen, call), label, keep))(*args, **kwargs)

    return run


def traced_policy(policy: str | None) -> tuple[Policy, int | None]:
    """The policy a region asking for `policy` (None or `"auto"`) gets in the current trace, and
    for a region left to the search its number (in the order the trace meets them), else None."""
    ctx = _context.current()
    if ctx is None:
        return "full", None
    if policy is None:
        policy = "full" if ctx.recompute is None else ctx.recompute
    if policy != "auto":
        return policy, None
    region = ctx.auto_regions
    ctx.auto_regions += 1
    choice = ctx.recompute_choice
    return (choice if isinstance(choice, str) else choice[region]), region


def check_policy(policy: Policy | None, call: str) -> None:
    """Raises `ShardingError` (`TypeError`) where `policy` (`parallelize`'s `recompute=`) names no policy."""
    if policy is not None and policy != "auto":
        _policy(policy, call, what="recompute")


def _policy(policy: Policy, call: str, what: str = "policy") -> Any:
    """The policy callable `policy` stands for (None: save nothing, as `jax.checkpoint`'s default;
    `_NONE`: no recompute)."""
    if callable(policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"{call}: {what} must be a string or a jax.checkpoint_policies callable, not "
                        f"{type(policy).__name__} ({policy!r}).")
    if policy == "full":
        return None
    if policy == "none":
        return _NONE
    if policy in HOST_POLICIES:
        return HOST_POLICIES[policy]()
    name = _SHORTHANDS.get(policy, policy)
    if name not in _NAMED or not hasattr(jax.checkpoint_policies, name):
        raise ShardingError(_policy_error(call, policy, what))
    return getattr(jax.checkpoint_policies, name)


def _policy_error(call: str, policy: str, what: str) -> str:
    own = ("none", "auto", *HOST_POLICIES)
    valid = ", ".join(repr(n) for n in (*_SHORTHANDS, *own, *_NAMED)
                      if n in _SHORTHANDS or n in own or hasattr(jax.checkpoint_policies, n))
    if callable(getattr(jax.checkpoint_policies, policy, None)):
        return (f"{call}: jax.checkpoint_policies.{policy} builds a policy from arguments; pass "
                f"{what}=jax.checkpoint_policies.{policy}(...), or one of the named policies: {valid}.")
    return f"{call}: {what}={policy!r} is no recompute policy. Use one of {valid}, or a policy callable."
