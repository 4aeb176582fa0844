"""The conformance harness: one `Case` per translated MindSpore test, and `check`, which holds jshard
to it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close

import jshard as js

MS_COMMIT = "a05ce58802d47fba782ecef8d971e05a078727c1"
"""The commit of `mindspore-ai/mindspore_test` whose `tests/ut/python/parallel/` the cases were read at
(2025-07-05)."""

PRESENT = 8
"""Simulated devices (conftest.py): more than these are planned on an abstract mesh, not run."""


@dataclasses.dataclass(frozen=True)
class Case:
    """One MindSpore parallel unit test, translated.

    Attributes:
      ref: `"<file>::<test>"` in MindSpore's `tests/ut/python/parallel/` (a suffix after `/` tells
        apart several cases read from one test).
      net: the network, a function of arrays built from `js.shard` calls.
      shapes: its inputs' shapes (float32), or `jax.ShapeDtypeStruct`s.
      devices: MindSpore's `device_num`.
      refuses: for a network MindSpore refuses, a regex the `ShardingError` must match.
      strategies: `{annotation: in_strategy}` MindSpore asserts (or the case pins) for a `shard`ed
        function's operator, read from `plan.ops`.
      propagated: `{primitive: strategy}` MindSpore's sharding propagation asserts for operators the
        network gives no strategy: every forward record of the primitive takes its first operand so.
      mode: `"semi_auto"` (MindSpore's semi-auto mode, and its sharding propagation from the
        strategies given) or `"auto"`.
      terms: the longest sum the network computes, for the one-device comparison's tolerance.
      marks: pytest marks: `xfail(strict=True)` where jshard disagrees with MindSpore, with why.
    """

    ref: str
    net: Callable
    shapes: tuple
    devices: int = 8
    refuses: str | None = None
    strategies: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    propagated: Mapping[str, tuple] = dataclasses.field(default_factory=dict)
    mode: str = "semi_auto"
    terms: int = 64
    marks: tuple = ()

    @property
    def id(self) -> str:
        return self.ref.replace(".py::", ".")


def params(cases):
    """`cases` as `pytest.param`s with their MindSpore test as id."""
    ids = [c.id for c in cases]
    assert len(set(ids)) == len(ids), sorted(i for i in ids if ids.count(i) > 1)
    return [pytest.param(c, id=c.id, marks=c.marks) for c in cases]


def _inputs(shapes):
    """Deterministic inputs of `shapes`: floats in [0.5, 1.5) (no division by zero, no log of a
    negative), integers in [0, 4) (indices valid in every table here), random booleans."""
    out = []
    for k, s in enumerate(shapes):
        spec = s if isinstance(s, jax.ShapeDtypeStruct) else jax.ShapeDtypeStruct(tuple(s), jnp.float32)
        rng = np.random.default_rng(k)
        if jnp.issubdtype(spec.dtype, jnp.integer):
            out.append(jnp.asarray(rng.integers(0, 4, size=spec.shape), spec.dtype))
        elif spec.dtype == jnp.bool_:
            out.append(jnp.asarray(rng.integers(0, 2, size=spec.shape).astype(bool)))
        else:
            out.append(jnp.asarray(rng.uniform(0.5, 1.5, size=spec.shape).astype(np.dtype(spec.dtype))))
    return out


def check(case: Case) -> js.Plan | None:
    """Holds jshard to `case`: raises where MindSpore refuses, else plans (and, on the present
    devices, runs and compares with one device) with the strategies MindSpore asserts.

    MindSpore's operators broadcast ranks (`[64, 64] + [64]`), so the networks run with NumPy's rank
    promotion allowed."""
    with jax.numpy_rank_promotion("allow"):
        return _check(case)


def _check(case: Case) -> js.Plan | None:
    # MindSpore's parallel tests run with dataset_strategy="full_batch": inputs whole unless a strategy cuts them
    step = js.parallelize(case.net, devices=case.devices, mode=case.mode, dataset_strategy="full_batch")
    args = _inputs(case.shapes)
    if case.refuses is not None:
        with pytest.raises(js.ShardingError, match=case.refuses):
            step.plan(*args)
        return None
    plan = step.plan(*args)
    for name, strategy in case.strategies.items():
        got = {_arrays(op.in_strategy) for op in plan.ops if op.annotation == name and op.origin == "user"}
        assert _arrays(strategy) in got, f"{name}: {strategy} not in {got}"
    for primitive, strategy in case.propagated.items():
        got = [op.in_strategy[0] for op in plan.ops if op.primitive == primitive and not op.backward]
        assert got and all(g == strategy for g in got), f"{primitive}: {got}, not {strategy}"
    if case.devices <= PRESENT:
        assert_close(step(*args), jax.jit(case.net)(*args), terms=case.terms)
    return plan


def _arrays(strategy) -> tuple:
    """`strategy` without the `()` of 0-d operands (MindSpore writes `()` for a scalar; JAX's
    `relu` is a `max` with a literal 0.0 that the call's strategy does not name)."""
    return tuple(s for s in strategy or () if s != ())


def named(fn: Callable, name: str) -> Callable:
    """`fn` under `name`, so a case can read its operator from `plan.ops` by annotation."""
    def wrapped(*args):
        return fn(*args)
    wrapped.__name__ = name
    return wrapped
