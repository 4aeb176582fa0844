"""Random small programs for the property tests: chains of elementwise, dot, reshape, transpose,
reduce, gather and scan steps over one running value, each step optionally wrapped in a
`jshard.shard` call with a random MindSpore strategy.

A `Program` is a plain, hashable value (hypothesis prints it as a failing case, and an `@example`
replays it): the input shape, its steps, the `parallelize` mode, dataset strategy and `in_strategy`.
`Program.fn` is the function of `(x, *extras)` it stands for; every step's extra operands (a weight,
a broadcast operand, an index array) are arguments of their own, so strategies can anchor them.

Each step also has a *mirror*: the same step on magnitudes, in float64 (`|x| @ |w|`, a sum of
`|x|`; a 1-Lipschitz unary passes its input's magnitude on). Its result bounds the magnitudes any
order of evaluation meets, so `terms * eps * max(mirror)` bounds the difference of two orders
(tests/_tolerance.py), `terms` summing the roundings of the chain.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np
from hypothesis import strategies as st
from jax import lax

import jshard as js

Shape = tuple[int, ...]

# name -> (jnp function, roundings it adds: a few ulps for a transcendental)
UNARY = {"tanh": (jnp.tanh, 4), "sin": (jnp.sin, 4), "neg": (jnp.negative, 0), "abs": (jnp.abs, 0)}
BINARY = {"add": (jnp.add, 1, np.add), "mul": (jnp.multiply, 1, np.multiply), "max": (jnp.maximum, 0, np.maximum)}
DIMS = (2, 4, 8, 16)
ODD_DIMS = (3, 6, 12)
CUTS = (1, 2, 4, 8)
MAX_ELEMENTS = 4096


@dataclasses.dataclass(frozen=True)
class Step:
    """One operation on the running value `x` and its `extras` (shapes, and whether integer).

    kind / param: `unary` (name), `binary` (name), `dot` (n), `batch_dot` (n), `reshape` (new shape),
    `transpose` (permutation), `reduce` ((name, axes)), `gather` ((axis, its size)), `scan` (body name).
    strategy: the `jshard.shard` in_strategy (one entry per input), or None for a plain call.
    """

    kind: str
    param: object
    extras: tuple[tuple[Shape, bool], ...] = ()
    strategy: tuple | None = None

    def fn(self):
        return _FUNCTIONS[self.kind](self.param)

    def mirror(self, x, *extras):
        """The step on magnitudes (float64): a bound of every intermediate any order computes."""
        return _MIRRORS[self.kind](self.param, x, *extras)

    def terms(self, shape: Shape) -> int:
        """Roundings this step adds on the running value of `shape`."""
        return _TERMS[self.kind](self.param, shape)


@dataclasses.dataclass(frozen=True)
class Program:
    shape: Shape
    steps: tuple[Step, ...]
    mode: str = "semi_auto"
    dataset: str = "full_batch"
    in_strategy: tuple | None = None  # one entry per argument (x first), or None

    def extras(self) -> list[tuple[Shape, bool]]:
        return [e for s in self.steps for e in s.extras]

    @functools.cached_property
    def fn(self):
        calls = []
        for step in self.steps:
            f = step.fn()
            calls.append((js.shard(f, step.strategy) if step.strategy is not None else f, len(step.extras)))

        def program(x, *extras):
            at = 0
            for call, n in calls:
                x = call(x, *extras[at : at + n])
                at += n
            return x

        return program

    def arguments(self, seed: int = 0) -> list[np.ndarray]:
        """x and the extras: floats in [-1, 1], indices in range for the dim they index."""
        rng = np.random.default_rng(seed)
        out = [rng.uniform(-1, 1, self.shape).astype(np.float32)]
        for step in self.steps:
            for shape, integer in step.extras:
                if integer:
                    out.append(rng.integers(0, step.param[1], shape).astype(np.int32))
                else:
                    out.append(rng.uniform(-1, 1, shape).astype(np.float32))
        return out

    def bound(self, args) -> tuple[int, float]:
        """`(terms, scale)` for `assert_close`: the chain's roundings and its largest magnitude."""
        x, rest = np.abs(args[0]).astype(np.float64), [np.abs(a).astype(np.float64) for a in args[1:]]
        terms, scale, at = 0, float(np.max(x)), 0
        for step in self.steps:
            terms += step.terms(x.shape)
            x = step.mirror(x, *rest[at : at + len(step.extras)])
            at += len(step.extras)
            scale = max(scale, float(np.max(x, initial=0.0)))
        return max(terms, 1), scale

    def parallelized(self):
        kwargs = {"devices": 8, "mode": self.mode, "dataset_strategy": self.dataset}
        if self.in_strategy is not None:
            kwargs["in_strategy"] = self.in_strategy
        return js.parallelize(self.fn, **kwargs)


# ---- the steps: function, mirror, terms ------------------------------------------------------------


def _unary(name):
    return UNARY[name][0]


def _binary(name):
    return BINARY[name][0]


def _dot(n):
    return lambda x, w: jnp.matmul(x, w)


def _batch_dot(n):
    def batch_dot(x, w):
        return lax.dot_general(x, w, (((x.ndim - 1,), (1,)), ((0,), (0,))))

    return batch_dot


def _reshape(shape):
    return lambda x: jnp.reshape(x, shape)


def _transpose(perm):
    return lambda x: jnp.transpose(x, perm)


def _reduce(param):
    name, axes = param
    return (lambda x: jnp.sum(x, axis=axes)) if name == "sum" else (lambda x: jnp.max(x, axis=axes))


def _gather(param):
    axis, _ = param
    return lambda x, idx: jnp.take(x, idx, axis=axis)


def _scan(body):
    if body == "tanh":
        def step(x, w):
            def f(c, xt):
                c = jnp.tanh(c + xt * w)
                return c, c

            return lax.scan(f, jnp.zeros_like(w), x)[1]
    else:
        def step(x, w):
            def f(c, xt):
                c = jnp.tanh(c + xt @ w)
                return c, c

            return lax.scan(f, jnp.zeros(x.shape[1:], x.dtype), x)[1]
    return step


_FUNCTIONS = {"unary": _unary, "binary": _binary, "dot": _dot, "batch_dot": _batch_dot, "reshape": _reshape,
              "transpose": _transpose, "reduce": _reduce, "gather": _gather, "scan": _scan}


def _scan_mirror(body, x, w):
    c = np.zeros(x.shape[1:])
    ys = []
    for xt in x:
        c = c + (xt * w if body == "tanh" else xt @ w)
        ys.append(c)
    return np.stack(ys)


_MIRRORS = {
    "unary": lambda p, x: x,
    "binary": lambda p, x, y: BINARY[p][2](x, y) if p != "add" else x + y,
    "dot": lambda p, x, w: x @ w,
    "batch_dot": lambda p, x, w: np.einsum("b...k,bkn->b...n", x, w),
    "reshape": lambda p, x: x.reshape(p),
    "transpose": lambda p, x: x.transpose(p),
    "reduce": lambda p, x: x.sum(axis=p[1]) if p[0] == "sum" else x.max(axis=p[1]),
    "gather": lambda p, x, idx: np.take(x, idx.astype(np.int64), axis=p[0]),
    "scan": _scan_mirror,
}

_TERMS = {
    "unary": lambda p, s: UNARY[p][1],
    "binary": lambda p, s: BINARY[p][1],
    "dot": lambda p, s: s[-1],
    "batch_dot": lambda p, s: s[-1],
    "reshape": lambda p, s: 0,
    "transpose": lambda p, s: 0,
    "reduce": lambda p, s: math.prod(s[a] for a in p[1]) if p[0] == "sum" else 0,
    "gather": lambda p, s: 0,
    "scan": lambda p, s: s[0] * (6 if p == "tanh" else s[-1] + 5),
}


# ---- hypothesis strategies ---------------------------------------------------------------------------


@st.composite
def strategy_tuple(draw, shape: Shape):
    """A cut per dim: mostly one that divides the dim (so many cases run), sometimes any."""
    cuts = []
    for d in shape:
        fits = [c for c in CUTS if d % c == 0]
        cuts.append(draw(st.one_of(st.sampled_from(fits), st.sampled_from(CUTS))) if draw(st.integers(0, 5)) else 1)
    return tuple(cuts)


@st.composite
def in_strategy(draw, shapes):
    """One entry per input: a strategy tuple or None (unconstrained)."""
    return tuple(draw(st.one_of(st.none(), strategy_tuple(s))) for s in shapes)


def _size(shape) -> int:
    return math.prod(shape)


@st.composite
def step_on(draw, shape: Shape) -> tuple[Step, Shape]:
    """One step that applies to a running value of `shape`, and the shape it leaves."""
    r = len(shape)
    kinds = ["unary", "binary", "dot"]
    if r >= 2:
        kinds += ["batch_dot", "transpose", "reduce", "reshape", "scan"]
    if r < 4:
        kinds += ["gather", "reshape"]
    kind = draw(st.sampled_from(kinds))
    if kind == "unary":
        step, out = Step("unary", draw(st.sampled_from(sorted(UNARY)))), shape
    elif kind == "binary":
        ones = draw(st.lists(st.booleans(), min_size=r, max_size=r))
        y = tuple(1 if o else d for o, d in zip(ones, shape))
        step, out = Step("binary", draw(st.sampled_from(sorted(BINARY))), ((y, False),)), shape
    elif kind == "dot":
        n = draw(st.sampled_from(DIMS + ODD_DIMS))
        step, out = Step("dot", n, (((shape[-1], n), False),)), shape[:-1] + (n,)
    elif kind == "batch_dot":
        n = draw(st.sampled_from(DIMS))
        step, out = Step("batch_dot", n, (((shape[0], shape[-1], n), False),)), shape[:-1] + (n,)
    elif kind == "transpose":
        perm = tuple(draw(st.permutations(range(r))))
        step, out = Step("transpose", perm), tuple(shape[p] for p in perm)
    elif kind == "reduce":
        axes = tuple(sorted(draw(st.sets(st.integers(0, r - 1), min_size=1, max_size=r - 1))))
        name = draw(st.sampled_from(["sum", "max"]))
        step, out = Step("reduce", (name, axes)), tuple(d for i, d in enumerate(shape) if i not in axes)
    elif kind == "reshape":
        out = draw(_reshaped(shape))
        step = Step("reshape", out)
    elif kind == "gather":
        axis = draw(st.integers(0, r - 1))
        idx = tuple(draw(st.lists(st.sampled_from(DIMS), min_size=1, max_size=2)))
        out = shape[:axis] + idx + shape[axis + 1 :]
        step = Step("gather", (axis, shape[axis]), ((idx, True),))
    else:
        body = draw(st.sampled_from(["tanh", "dot"]))
        w = shape[1:] if body == "tanh" else (shape[-1], shape[-1])
        step, out = Step("scan", body, ((w, False),)), shape
    if _size(out) > MAX_ELEMENTS or any(_size(s) > MAX_ELEMENTS for s, _ in step.extras):
        return Step("unary", "tanh"), shape
    if draw(st.integers(0, 2)):  # two steps in three are anchored
        step = dataclasses.replace(step, strategy=draw(in_strategy([shape] + [s for s, _ in step.extras])))
    return step, out


@st.composite
def _reshaped(draw, shape: Shape) -> Shape:
    """`shape` with one dim split in two (a factor pair of it) or two neighbouring dims merged."""
    splits = [(i, a) for i, d in enumerate(shape) for a in range(2, d) if d % a == 0] if len(shape) < 4 else []
    merges = list(range(len(shape) - 1))
    if splits and (not merges or draw(st.booleans())):
        i, a = draw(st.sampled_from(splits))
        return shape[:i] + (a, shape[i] // a) + shape[i + 1 :]
    if not merges:
        return shape
    i = draw(st.sampled_from(merges))
    return shape[:i] + (shape[i] * shape[i + 1],) + shape[i + 2 :]


@st.composite
def programs(draw, max_steps: int = 4, modes=("semi_auto",)):
    """A random `Program`: an input of rank 1-3, one to `max_steps` steps, optional anchors."""
    start = shape = tuple(draw(st.lists(st.sampled_from(DIMS + ODD_DIMS[:1]), min_size=1, max_size=3)))
    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        step, shape = draw(step_on(shape))
        steps.append(step)
    shapes = [start] + [s for step in steps for s, _ in step.extras]
    mode = draw(st.sampled_from(modes))
    dataset = draw(st.sampled_from(["full_batch", "data_parallel"]))
    strategy = draw(st.one_of(st.none(), in_strategy(shapes))) if mode != "data" else None
    return Program(start, tuple(steps), mode, dataset, strategy)
