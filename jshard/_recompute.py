"""`jshard.recompute`: MindSpore's `Cell.recompute()` / `Primitive.recompute()` as `jax.checkpoint`.

A recomputed function keeps only its inputs (or, selectively, its matmul outputs) for the backward
pass and runs its forward again there. Inside `parallelize` the recompute survives planning: the
emitter rebuilds the remat equation with its sharding constraints inside (`jshard/propagate`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

from jshard._errors import ShardingError, api_boundary
from jshard.graph import RECOMPUTE_SCOPE
from jshard.hetero import HOST_POLICIES

Policy = str | Callable[..., bool]
"""`"full"`, `"selective"`, the name of a `jax.checkpoint_policies` policy, or a policy callable."""

_SHORTHANDS = {"full": None, "selective": "dots_saveable"}
"""MindSpore's names: full recompute (`jax.checkpoint`'s default, keeping nothing) and selective."""
_NAMED = ("nothing_saveable", "everything_saveable", "dots_saveable", "dots_with_no_batch_dims_saveable",
          "checkpoint_dots", "checkpoint_dots_with_no_batch_dims")
"""The `jax.checkpoint_policies` attributes that are policies themselves (the others build one)."""


@api_boundary
def recompute(fn: Callable[..., Any] | None = None, *, policy: Policy = "full") -> Any:
    """`fn` recomputed in the backward pass instead of keeping its intermediate values; usable as a
    decorator, with or without arguments.

    Args:
      fn: the function (a layer, a block) whose forward pass to recompute.
      policy: what to keep: `"full"` (nothing but the inputs: MindSpore's `Cell.recompute()`),
        `"selective"` (the matmul outputs, `dot_general` results; the elementwise work between them
        is recomputed), `"offload"` (the matmul outputs without batch dims, kept in host memory:
        activation offload; `jshard.offload_names(...)` offloads named activations), the name of a
        `jax.checkpoint_policies` policy (`"dots_with_no_batch_dims_saveable"`),
        or a policy callable (`jax.checkpoint_policies.save_only_these_names("attn")`).

    Returns:
      `jax.checkpoint(fn, policy=...)`, or a decorator making it when `fn` is None.

    Raises:
      ShardingError: `policy` names no policy.
      TypeError: `policy` is neither a string nor a callable.

    Examples:
      >>> import jax, jax.numpy as jnp, jshard as js
      >>> layer = js.recompute(lambda w, x: jnp.tanh(x @ w), policy="selective")
      >>> jax.grad(lambda w, x: layer(w, x).sum())(jnp.eye(2), jnp.ones((1, 2))).shape
      (2, 2)
    """
    named = f"policy={policy!r}" if fn is None else getattr(fn, "__name__", type(fn).__name__)
    resolved = _policy(policy, f"jshard.recompute({named})")
    label = policy if isinstance(policy, str) else getattr(policy, "__name__", "custom")
    if fn is None:
        return lambda f: jax.checkpoint(_scoped(f, label), policy=resolved)
    return jax.checkpoint(_scoped(fn, label), policy=resolved)  # keeps fn's name and docstring


def _scoped(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
    """`fn` run in the name scope `RECOMPUTE_SCOPE + label` (how its `Plan` names the policy)."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with jax.named_scope(RECOMPUTE_SCOPE + "".join(c if c.isalnum() else "_" for c in label)):
            return fn(*args, **kwargs)

    return run


def _policy(policy: Policy, call: str) -> Callable[..., bool] | None:
    """The policy callable `policy` stands for (None: save nothing, as `jax.checkpoint`'s default)."""
    if callable(policy):
        return policy
    if not isinstance(policy, str):
        raise TypeError(f"{call}: policy must be a string or a jax.checkpoint_policies callable, not "
                        f"{type(policy).__name__} ({policy!r}).")
    if policy == "full":
        return None
    if policy in HOST_POLICIES:
        return HOST_POLICIES[policy]()
    name = _SHORTHANDS.get(policy, policy)
    if name not in _NAMED or not hasattr(jax.checkpoint_policies, name):
        raise ShardingError(_policy_error(call, policy))
    return getattr(jax.checkpoint_policies, name)


def _policy_error(call: str, policy: str) -> str:
    valid = ", ".join(repr(n) for n in (*_SHORTHANDS, *_NAMED, *HOST_POLICIES) if n in _SHORTHANDS or n in HOST_POLICIES or hasattr(jax.checkpoint_policies, n))
    if callable(getattr(jax.checkpoint_policies, policy, None)):
        return (f"{call}: jax.checkpoint_policies.{policy} builds a policy from arguments; pass "
                f"policy=jax.checkpoint_policies.{policy}(...), or one of the named policies: {valid}.")
    return f"{call}: policy={policy!r} is no recompute policy. Use one of {valid}, or a policy callable."
