"""jit's argument options: static arguments, keyword arguments and donation by name, as `jax.jit`
has them.

`resolve` completes the options against the function's signature once, as `jax.jit` does: a
parameter made static (or donated) by name is also numbered, and by number also named. `bind`
turns one call `f(*args, **kwargs)` into what the core traces, a function of positional arguments
alone: a static argument leaves the traced arguments (a static positional one leaves None in its
place, so argument numbers keep their meaning for `in_strategy`, `batch_argnums` and
`donate_argnums`) and its value joins the cache key, hashed; the keyword arguments follow the
positional ones, in name order. Keyword arguments are never the batch and take no `in_strategy`:
they are laid out as any argument left without one.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from jshard._errors import ShardingError
from jshard.compile._options import Options, check_arguments
from jshard.layouts import canonicalize_in_strategy

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def resolve(fn: Callable[..., Any], options: Options, call: str) -> Options:
    """`options` with `static_argnums`/`static_argnames` and `donate_argnums`/`donate_argnames` each
    completed from the other through `fn`'s signature, and checked against it.

    Raises:
      ShardingError: a name that is no parameter of `fn` (or a positional-only one), or a number
        past its positional parameters.
    """
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature (a builtin): the options stay as given, as jax.jit's
        return options
    static = _infer(params, options.static_argnums, options.static_argnames)
    donate = _infer(params, options.donate_argnums, options.donate_argnames)
    for (nums, names), (nums_what, names_what) in ((static, ("static_argnums", "static_argnames")),
                                                    (donate, ("donate_argnums", "donate_argnames"))):
        _check_argnums(call, fn, params, nums, nums_what)
        _check_argnames(call, fn, params, names, names_what)
    resolved = dataclasses.replace(options, static_argnums=static[0], static_argnames=static[1],
                                   donate_argnums=donate[0], donate_argnames=donate[1])
    check_arguments(call, resolved)
    return resolved


def _infer(params, nums: tuple[int, ...], names: tuple[str, ...]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Numbers and names of the same parameters, each completed from the other where only one was
    given (positional-or-keyword parameters only, as `jax.jit`)."""
    if bool(nums) == bool(names):
        return nums, names
    either = [(i, k) for i, (k, p) in enumerate(params.items()) if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    if names:
        return tuple(i for i, k in either if k in names), names
    return nums, tuple(k for i, k in either if i in nums)


def _check_argnums(call: str, fn, params, nums: tuple[int, ...], what: str) -> None:
    if any(p.kind is inspect.Parameter.VAR_POSITIONAL for p in params.values()):
        return
    count = sum(p.kind in _POSITIONAL for p in params.values())
    bad = [i for i in nums if not -count <= i < count]
    if bad:
        raise ShardingError(
            f"{call}: {what}={nums} numbers argument {bad[0]}, but {_name(fn)}{_signature(params)} takes "
            f"{count} positional argument(s). Number them 0 to {count - 1} (or -1 to -{count}).")


def _check_argnames(call: str, fn, params, names: tuple[str, ...], what: str) -> None:
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    for k in names:
        if k in params and params[k].kind is inspect.Parameter.POSITIONAL_ONLY:
            raise ShardingError(f"{call}: {what}={names} names {k!r}, a positional-only parameter of "
                                f"{_name(fn)}{_signature(params)}; number it in {what.replace('names', 'nums')} instead.")
        if k not in params and not takes_any:
            valid = [p for p, v in params.items() if v.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                                 inspect.Parameter.KEYWORD_ONLY)]
            raise ShardingError(f"{call}: {what}={names} names {k!r}, which is not a parameter of "
                                f"{_name(fn)}{_signature(params)}. Name one of {valid}.")


def _name(fn) -> str:
    return getattr(fn, "__name__", type(fn).__name__)


def _signature(params) -> str:
    return str(inspect.Signature(list(params.values())))


@dataclasses.dataclass(frozen=True)
class Bound:
    """One call as the core traces it.

    Attributes:
      fn: the user function as a function of `args` alone (the static values bound in).
      args: the positional arguments (a static one as None), then the keyword arguments' values.
      keywords: the (non-static) keyword arguments' names, in the order `args` holds them.
      key: what the program depends on beyond `args`' shapes: the static values and `keywords`.
    """

    fn: Callable[..., Any]
    args: tuple
    keywords: tuple[str, ...]
    key: Hashable

    @property
    def positional(self) -> int:
        return len(self.args) - len(self.keywords)

    def options(self, options: Options, call: str) -> Options:
        """`options` as the core reads them for this call: argument numbers non-negative,
        `batch_argnums` by default `default_batch`'s, donated keyword
        arguments numbered after the positional ones, `in_strategy` None for keyword arguments."""
        n = self.positional
        static = tuple(sorted({i % n for i in options.static_argnums if -n <= i < n}))
        dynamic = [i for i in range(n) if i not in static]
        batch = (default_batch(self.args[:n], dynamic) if options.batch_argnums is None
                 else tuple(i % n for i in options.batch_argnums if -n <= i < n))
        donate = tuple(i % n for i in options.donate_argnums if -n <= i < n)
        donate += tuple(n + j for j, k in enumerate(self.keywords) if k in options.donate_argnames)
        strategy = options.in_strategy
        if strategy is not None and self.keywords:
            canonicalize_in_strategy(strategy, self.args[:n], call=call)  # one entry per positional argument
            strategy = tuple(strategy) + (None,) * len(self.keywords)
        resolved = dataclasses.replace(options, static_argnums=static, batch_argnums=batch, donate_argnums=donate,
                                       in_strategy=strategy)
        check_arguments(call, resolved)
        return resolved


def default_batch(args: tuple, dynamic: Sequence[int]) -> tuple[int, ...]:
    """The batch argument where `batch_argnums` is not given: the last of the positional arguments
    `dynamic` (the non-static ones) that holds an array with a leading dim that is not a PRNG key
    (a typed key array, or a raw `uint32[2]` `jax.random.PRNGKey`), so that `step(state, batch,
    key)` cuts the batch, not the key; the last of `dynamic` where none does; none where there is none.

    Examples:
      >>> import jax, jax.numpy as jnp
      >>> default_batch((jnp.ones(3), jnp.ones((8, 2)), jax.random.PRNGKey(0)), [0, 1, 2])
      (1,)
    """
    batchlike = [i for i in dynamic if any(np.ndim(x) > 0 and not _is_key(x) for x in jax.tree_util.tree_leaves(args[i]))]
    return tuple((batchlike or list(dynamic))[-1:])


def _is_key(x) -> bool:
    dtype = getattr(x, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return True
    return np.shape(x) == (2,) and dtype == np.uint32


def bind(fn: Callable[..., Any], options: Options, args: tuple, kwargs: dict[str, Any], call: str) -> Bound:
    """One call `fn(*args, **kwargs)` as a `Bound` (see the module docstring).

    Raises:
      TypeError: a static argument that cannot be hashed.
    """
    if not kwargs and not options.static_argnums:
        return Bound(fn, args, (), ())
    n = len(args)
    static = {i % n for i in options.static_argnums if -n <= i < n}
    static_kw = {k: v for k, v in kwargs.items() if k in options.static_argnames}
    keywords = tuple(sorted(k for k in kwargs if k not in static_kw))
    values = tuple((i, args[i]) for i in sorted(static)) + tuple(sorted(static_kw.items()))
    _check_hashable(call, values)
    fixed = {i: args[i] for i in static}

    def run(*flat):
        positional = [fixed[i] if i in fixed else flat[i] for i in range(n)]
        return fn(*positional, **static_kw, **dict(zip(keywords, flat[n:])))

    traced = tuple(None if i in static else a for i, a in enumerate(args)) + tuple(kwargs[k] for k in keywords)
    return Bound(run, traced, keywords, (values, keywords))


def _check_hashable(call: str, values: Sequence[tuple[Any, Any]]) -> None:
    for where, value in values:
        try:
            hash(value)
        except TypeError as e:
            what = f"argument {where}" if isinstance(where, int) else f"keyword argument {where!r}"
            raise TypeError(
                f"{call}: static {what} is a {type(value).__name__}, which cannot be hashed ({e}); static "
                f"arguments key the compiled programs, as jax.jit's do. Pass a hashable value (a tuple "
                f"for a list, a frozen dataclass), or leave it out of static_argnums/static_argnames."
            ) from None
