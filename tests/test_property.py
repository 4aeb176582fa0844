"""Properties: any MatMul strategy, and any small random program (tests/_programs.py: chains of
elementwise, dot, reshape, transpose, reduce, gather and scan steps under random anchors), either
runs, equals the single-device run and moves the collective bytes its plan predicts (within 2%), or
is refused with a `ShardingError`; it never fails some other way, and never silently drops a cut. Any
pair of layouts over a mesh of 8 devices is priced per kind as XLA compiles the stages the engine
constrains. A seeded sample here; `tests/sweep_property.py` runs thousands and lists each mismatch."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _programs import Program, Step, programs
from _tolerance import assert_close
from hypothesis import example, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard.cost import redistribution, stages

DIMS = [1, 2, 3, 4, 6, 8, 12, 16]
CUTS = [1, 2, 3, 4, 8]


def _cut(draw, dim):
    """A cut for `dim`: often one that divides it, so that many cases run; any cut otherwise."""
    return draw(st.one_of(st.sampled_from([c for c in CUTS if dim % c == 0]), st.sampled_from(CUTS)))


@st.composite
def matmul_cases(draw):
    m, k, n = (draw(st.sampled_from(DIMS)) for _ in range(3))
    a, b, d = _cut(draw, m), _cut(draw, k), _cut(draw, n)
    # Mostly agreeing contracted cuts; sometimes not, so that some cases are refused for it.
    c = draw(st.one_of(st.just(b), st.sampled_from(CUTS)))
    return (m, k, n), ((a, b), (c, d))


@functools.lru_cache(maxsize=None)
def _step(strategy):
    """One `Parallelized` per strategy: it compiles once per shape, so repeated cases reuse it."""

    def step(x, w):
        return js.shard(jnp.matmul, strategy)(x, w)

    return js.parallelize(step, devices=8)


# The derandomized draws follow the test's source text; these two always reach the comparison with a
# contraction cut (partial sums all-reduced), whatever the draws.
@settings(max_examples=30, deadline=None, derandomize=True)
@given(matmul_cases())
@example(((12, 16, 8), ((1, 8), (8, 1))))
@example(((8, 16, 12), ((2, 4), (4, 1))))
def test_matmul_strategy_runs_correctly_or_is_refused(case):
    (m, k, n), strategy = case
    rng = np.random.default_rng(m * 10_000 + k * 100 + n)
    x = rng.standard_normal((m, k), dtype=np.float32)
    w = rng.standard_normal((k, n), dtype=np.float32)
    try:
        out = _step(strategy)(jnp.asarray(x), jnp.asarray(w))
    except js.ShardingError:
        return
    # k terms each side, of at most |x| @ |w| in magnitude (tests/_tolerance.py)
    assert_close(out, x @ w, terms=k, scale=float(np.max(np.abs(x) @ np.abs(w))))
    (a, _), (_, d) = strategy
    assert out.sharding.shard_shape(out.shape) == (m // a, n // d)


@st.composite
def layout_cases(draw):
    """A Layout over device matrix [2, 2, 2] and a map of its aliases onto the two dims of a tensor."""
    aliases = draw(st.permutations(["dp", "sp", "mp"]))
    dims = ([], [])
    for alias in aliases:
        where = draw(st.sampled_from([0, 1, None]))
        if where is not None:
            dims[where].append(alias)
    return tuple(tuple(d) if len(d) != 1 else d[0] for d in dims)


@settings(max_examples=30, deadline=None, derandomize=True)
@given(layout_cases())
def test_layout_places_each_block_on_its_ranks(tensor_map):
    """Rank r is (dp, sp, mp) = digits of r in base 2; dim i's block is its aliases' digits, major first."""
    lay = js.Layout((2, 2, 2), ("dp", "sp", "mp"))
    shape = (8, 8)
    step = js.parallelize(lambda t: t + 1.0, devices=8, in_strategy=(lay(*(m or "None" for m in tensor_map)),))
    (sharding,) = step.plan(jnp.zeros(shape)).in_shardings
    for device, block in sharding.devices_indices_map(shape).items():
        rank = device.id
        digits = {"dp": rank // 4, "sp": rank // 2 % 2, "mp": rank % 2}
        for dim, aliases in enumerate(tensor_map):
            aliases = (aliases,) if isinstance(aliases, str) else aliases
            index = functools.reduce(lambda acc, alias: acc * 2 + digits[alias], aliases, 0)
            size = shape[dim] // 2 ** len(aliases)
            assert (block[dim].start or 0, block[dim].stop or shape[dim]) == (index * size, (index + 1) * size)


def check_program(program: Program) -> None:
    """Runs `program` on 8 devices: a `ShardingError`, or the single-device values and, per kind of
    collective, the bytes the plan predicts, within 2% of what XLA compiled."""
    args = [jnp.asarray(a) for a in program.arguments()]
    step = program.parallelized()
    try:
        out = step(*args)
    except js.ShardingError:
        return
    terms, scale = program.bound(args)
    assert_close(out, jax.jit(program.fn)(*args), terms=terms, scale=scale)
    plan = step.plan(*args)
    report = js.audit(step.lower(*args).compile())
    predicted, compiled = plan.predicted(), {k: b for k, (_, b) in report.by_kind().items()}
    for kind in set(predicted) | set(compiled):
        p, c = predicted.get(kind, 0.0), compiled.get(kind, 0.0)
        assert abs(p - c) <= 0.02 * max(p, c), f"{kind}: predicted {p:g} B, compiled {c:g} B\n{plan.compare(report)}"


# Regressions, each an engine bug the property found (fixed at the root in jshard/):
@settings(max_examples=80, deadline=None, derandomize=True)
@given(programs())
# a carry laid out in the body, not as its loop guessed on entry (no gather charged)
@example(Program(shape=(3, 2, 3), steps=(Step(kind='reshape', param=(3, 6), extras=(), strategy=((1, 2, 1),)), Step(kind='unary', param='tanh', extras=(), strategy=None), Step(kind='scan', param='tanh', extras=(((6,), False),), strategy=((1, 2), None))), mode='semi_auto', dataset='full_batch', in_strategy=None))
# an axis moving to a dim with a new minor axis: the all-to-all, then the slice (not a full gather)
@example(Program(shape=(16, 2, 3), steps=(Step(kind='unary', param='neg', extras=(), strategy=None), Step(kind='unary', param='neg', extras=(), strategy=((2, 2, 1),)), Step(kind='unary', param='neg', extras=(), strategy=None), Step(kind='binary', param='add', extras=(((16, 2, 3), False),), strategy=(None, None))), mode='semi_auto', dataset='data_parallel', in_strategy=None))
# the same slices on other devices: a collective-permute
@example(Program(shape=(8,), steps=(Step(kind='unary', param='neg', extras=(), strategy=None), Step(kind='unary', param='abs', extras=(), strategy=(None,)), Step(kind='reshape', param=(4, 2), extras=(), strategy=((8,),)), Step(kind='binary', param='max', extras=(((1, 2), False),), strategy=(None, (1, 2)))), mode='semi_auto', dataset='full_batch', in_strategy=None))
# in_strategy against a shard call's strategy: the argument's gather is predicted
@example(Program(shape=(2,), steps=(Step(kind='reshape', param=(2,), extras=(), strategy=(None,)), Step(kind='binary', param='mul', extras=(((1,), False),), strategy=((1,), None)), Step(kind='gather', param=(0, 2), extras=(((16,), True),), strategy=None), Step(kind='binary', param='mul', extras=(((1,), False),), strategy=(None, None))), mode='semi_auto', dataset='full_batch', in_strategy=((2,), None, None, (1,))))
# axes dropped on two dims: gathered one dim at a time, minor dim first
@example(Program(shape=(8, 16), steps=(Step(kind='reshape', param=(8, 4, 4), extras=(), strategy=((1, 8),)), Step(kind='unary', param='neg', extras=(), strategy=None), Step(kind='unary', param='abs', extras=(), strategy=((1, 1, 1),)), Step(kind='binary', param='mul', extras=(((1, 4, 4), False),), strategy=(None, (1, 2, 1)))), mode='semi_auto', dataset='full_batch', in_strategy=None))
# a reshape merging a cut minor dim under an uncut major one: the engine gathers it, and says so
@example(Program(shape=(2, 4, 4), steps=(Step(kind='gather', param=(0, 2), extras=(((16,), True),), strategy=(None, (2,))), Step(kind='reshape', param=(16, 16), extras=(), strategy=((1, 1, 4),)), Step(kind='reduce', param=('sum', (0,)), extras=(), strategy=((4, 1),))), mode='semi_auto', dataset='data_parallel', in_strategy=None))
# a loop-invariant weight gathered inside a scan body: XLA hoists it, priced once per loop
@example(Program(shape=(8, 4, 3), steps=(Step(kind='reshape', param=(4, 2, 4, 3), extras=(), strategy=(None,)), Step(kind='dot', param=8, extras=(((3, 8), False),), strategy=(None, None)), Step(kind='scan', param='dot', extras=(((8, 8), False),), strategy=None)), mode='semi_auto', dataset='data_parallel', in_strategy=(None, None, None)))
@example(Program(shape=(8, 8, 16), steps=(Step(kind='gather', param=(1, 8), extras=(((8,), True),), strategy=None), Step(kind='scan', param='dot', extras=(((16, 16), False),), strategy=((2, 4, 1), None)), Step(kind='unary', param='tanh', extras=(), strategy=(None,))), mode='semi_auto', dataset='data_parallel', in_strategy=None))
# one shard call's output into the next one's input on other devices: the permute is predicted
@example(Program(shape=(4, 2, 4), steps=(Step(kind='reduce', param=('max', (0, 2)), extras=(), strategy=((1, 1, 1),)), Step(kind='dot', param=2, extras=(((2, 2), False),), strategy=((2,), (2, 2))), Step(kind='dot', param=2, extras=(((2, 2), False),), strategy=((2,), (2, 2))), Step(kind='unary', param='tanh', extras=(), strategy=None)), mode='semi_auto', dataset='data_parallel', in_strategy=None))
# a coarser cut of every dim with an axis moved: a collective-permute, then the all-gathers
@example(Program(shape=(8, 3, 8), steps=(Step(kind='reshape', param=(24, 8), extras=(), strategy=(None,)), Step(kind='reshape', param=(192,), extras=(), strategy=(None,)), Step(kind='gather', param=(0, 192), extras=(((4, 4), True),), strategy=((1,), (4, 2))), Step(kind='unary', param='neg', extras=(), strategy=((1, 2),))), mode='semi_auto', dataset='data_parallel', in_strategy=((4, 1, 2), None)))
# a transposed layout into one of the same axes, two moved: priced as two all-to-alls and a permute
@example(Program(shape=(16, 4, 4), steps=(Step(kind='transpose', param=(2, 1, 0), extras=(), strategy=((2, 4, 1),)), Step(kind='reshape', param=(16, 16), extras=(), strategy=((4, 2, 1),)), Step(kind='scan', param='tanh', extras=(((16,), False),), strategy=None), Step(kind='binary', param='max', extras=(((16, 16), False),), strategy=((2, 2), None))), mode='semi_auto', dataset='full_batch', in_strategy=None))
# a reduce over two cut dims: XLA all-reduces each dim's partial results on its own (two all-reduces)
@example(Program(shape=(2, 4, 8), steps=(Step(kind='reshape', param=(2, 4, 4, 2), extras=(), strategy=((2, 1, 2),)), Step(kind='reduce', param=('max', (0, 2, 3)), extras=(), strategy=None), Step(kind='unary', param='abs', extras=(), strategy=None)), mode='semi_auto', dataset='data_parallel', in_strategy=None))
# a shard call's input in another layout, an axis moved and one added: reached through the stages
@example(Program(shape=(16,), steps=(Step(kind='binary', param='mul', extras=(((16,), False),), strategy=((4,), (4,))), Step(kind='dot', param=16, extras=(((16, 16), False),), strategy=None), Step(kind='reshape', param=(4, 4), extras=(), strategy=((4,),)), Step(kind='transpose', param=(0, 1), extras=(), strategy=((2, 4),))), mode='semi_auto', dataset='full_batch', in_strategy=(None, (1,), None)))
@example(Program(shape=(16, 2, 8), steps=(Step(kind='scan', param='tanh', extras=(((2, 8), False),), strategy=(None, None)), Step(kind='reshape', param=(16, 16), extras=(), strategy=((4, 1, 2),))), mode='semi_auto', dataset='full_batch', in_strategy=(None, (2, 1))))
# a shard call with no operator of its own (a reshape to the same shape) gathering an argument: the
# next operator pays
@example(Program(shape=(2,), steps=(Step(kind='reshape', param=(2,), extras=(), strategy=((1,),)), Step(kind='unary', param='abs', extras=(), strategy=((1,),)), Step(kind='unary', param='abs', extras=(), strategy=None)), mode='semi_auto', dataset='full_batch', in_strategy=((2,),)))
def test_random_program_semi_auto(program):
    check_program(program)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(programs(modes=("auto", "data")))
# a gather's lined-up strategies fix no rule for its output (was an indivisible cut)
@example(Program(shape=(3, 16), steps=(Step(kind='transpose', param=(1, 0), extras=(), strategy=None), Step(kind='unary', param='tanh', extras=(), strategy=(None,)), Step(kind='batch_dot', param=2, extras=(((16, 3, 2), False),), strategy=None), Step(kind='gather', param=(0, 16), extras=(((2,), True),), strategy=((4, 1), (1,)))), mode='auto', dataset='data_parallel', in_strategy=(None, None, None)))
# a gather's looked-up dim and its indices' batch dim on other axes (XLA gathered the table)
@example(Program(shape=(4,), steps=(Step(kind='gather', param=(0, 4), extras=(((8,), True),), strategy=None),), mode='auto', dataset='data_parallel', in_strategy=None))
# jnp.take twice: one cached jaxpr, its values kept apart
@example(Program(shape=(16, 16, 3), steps=(Step(kind='gather', param=(0, 16), extras=(((2,), True),), strategy=((1, 1, 1), None)), Step(kind='unary', param='abs', extras=(), strategy=(None,)), Step(kind='gather', param=(0, 2), extras=(((2,), True),), strategy=((1, 1, 1), None))), mode='auto', dataset='full_batch', in_strategy=(None, (1,), (1,))))
# a finer layout on other devices: a local slice and a collective-permute
@example(Program(shape=(16, 16, 2), steps=(Step(kind='reshape', param=(256, 2), extras=(), strategy=((2, 2, 1),)),), mode='auto', dataset='data_parallel', in_strategy=((1, 2, 1),)))
# axes swapped between dims of a coarser layout: a collective-permute, then the all-gathers
@example(Program(shape=(4, 3, 2), steps=(Step(kind='reshape', param=(12, 2), extras=(), strategy=((1, 1, 2),)), Step(kind='reshape', param=(24,), extras=(), strategy=((1, 1),))), mode='auto', dataset='full_batch', in_strategy=((2, 1, 2),)))
@example(Program(shape=(4,), steps=(Step(kind='reshape', param=(2, 2), extras=(), strategy=None), Step(kind='unary', param='sin', extras=(), strategy=((2, 2),)), Step(kind='reduce', param=('max', (0,)), extras=(), strategy=(None,)), Step(kind='binary', param='add', extras=(((2,), False),), strategy=None)), mode='auto', dataset='data_parallel', in_strategy=None))
# an axis moved where another leaves: the all-to-all, then a collective-permute
@example(Program(shape=(2,), steps=(Step(kind='dot', param=12, extras=(((2, 12), False),), strategy=((1,), None)),), mode='auto', dataset='full_batch', in_strategy=(None, (2, 2))))
# jnp.take's index normalized by three operators taking it replicated: XLA gathers it once
@example(Program(shape=(4,), steps=(Step(kind='gather', param=(0, 4), extras=(((8, 16), True),), strategy=None), Step(kind='reshape', param=(128,), extras=(), strategy=(None,))), mode='auto', dataset='data_parallel', in_strategy=((1,), (1, 8))))
def test_random_program_auto_and_data(program):
    check_program(program)


# Layout pairs (mesh d0, d1, d2 = 2, 2, 2) where XLA's resharding differs from one all-to-all:
# src, dst, and the collectives it emits, each kind's bytes per device.
RESHARDS = [
    # a coarser cut with an axis moved: the slices permuted, then gathered
    ((4, 3, 2), (("d0",), (), ("d1",)), ((), (), ("d0",)), {"collective-permute": 24, "all-gather": 48}),
    # a major axis dropped: the minor one's slices permuted first
    ((8, 8), (("d0", "d1"), ()), (("d1",), ()), {"collective-permute": 64, "all-gather": 128}),
    # the same axes, one moved and one renamed: the all-to-all, then the permute
    ((8, 8, 8), (("d1", "d0"), (), ("d2",)), (("d2",), ("d1",), ("d0",)), {"all-to-all": 256, "collective-permute": 256}),
    # two axes moved from one dim, as one block: one all-to-all, no permute
    ((8, 8, 8), ((), ("d2", "d0", "d1"), ()), (("d0", "d1"), ("d2",), ()), {"all-to-all": 256}),
    # two dims' cuts swapped over three dims: two all-to-alls, then the permute
    ((4, 4, 16), ((), ("d1", "d2"), ("d0",)), (("d0", "d1"), ("d2",), ()), {"all-to-all": 256, "collective-permute": 128}),
    # mixed axis orders across dims (issue 15: "which XLA reshards by full rematerialization"): the
    # two dims' axes swapped is one permute of the local slice, no gather to whole
    ((16, 16), (("d0",), ("d1",)), (("d1",), ("d0",)), {"collective-permute": 256}),
    # ... a major axis and a minor pair swapped: one all-to-all, then the permute
    ((16, 16), (("d0",), ("d1", "d2")), (("d1", "d2"), ("d0",)), {"all-to-all": 128, "collective-permute": 128}),
]


MESHES = ({"d0": 2, "d1": 2, "d2": 2}, {"d0": 4, "d1": 2}, {"d0": 2, "d1": 4})


def compiled_and_priced(shape, src, dst, sizes) -> tuple[dict, dict]:
    """`(compiled, predicted)`: each kind's bytes per device of `src` -> `dst` over a mesh of `sizes`,
    compiled through the `stages` the engine constrains, and as `redistribution` prices them."""
    mesh = jax.make_mesh(tuple(sizes.values()), tuple(sizes), axis_types=(jax.sharding.AxisType.Auto,) * len(sizes))
    spec = lambda s: jax.sharding.NamedSharding(mesh, P(*(a or None for a in s)))

    def reshard(x):
        for stage in stages(src, dst, sizes):
            x = jax.lax.with_sharding_constraint(x, spec(stage))
        return x

    compiled = jax.jit(reshard, in_shardings=spec(src), out_shardings=spec(dst)).lower(jnp.zeros(shape)).compile()
    got = {k: b for k, (_, b) in js.audit(compiled).by_kind().items()}
    predicted = {}
    for comm in redistribution(shape, 4, src, dst, sizes):
        predicted[comm.kind] = predicted.get(comm.kind, 0.0) + comm.bytes
    return got, predicted


@pytest.mark.parametrize("shape, src, dst, want", RESHARDS)
def test_redistribution_is_what_xla_emits(shape, src, dst, want):
    """`redistribution` prices each kind as the compiled resharding moves it, through the `stages`
    the engine constrains."""
    got, predicted = compiled_and_priced(shape, src, dst, MESHES[0])
    assert got == want
    assert predicted == want


@st.composite
def layout_pairs(draw):
    """`(shape, src, dst, mesh)`: two layouts of one value over a mesh of `MESHES`, each mesh axis on
    some dim or none, in any order, the dims sized so both cuts divide."""
    sizes = draw(st.sampled_from(MESHES))
    rank = draw(st.integers(1, 3))

    def spec():
        dims = [[] for _ in range(rank)]
        for axis in draw(st.permutations(sorted(sizes))):
            where = draw(st.integers(-1, rank - 1))
            if where >= 0:
                dims[where].append(axis)
        return tuple(map(tuple, dims))

    src, dst = spec(), spec()
    cut = lambda axes: math.prod(sizes[a] for a in axes)
    shape = tuple(max(cut(a), cut(b)) * draw(st.sampled_from([1, 2])) for a, b in zip(src, dst))
    return shape, src, dst, sizes


# Layout pairs XLA moves by a route of its own when asked in one step (often a full gather, its
# "involuntary full rematerialization"); through the stages, each priced step is what it compiles.
@settings(max_examples=60, deadline=None, derandomize=True)
@given(layout_pairs())
@example(((8, 8, 8), ((), ("d2", "d1"), ()), (("d2",), ("d0",), ("d1",)), MESHES[0]))
@example(((16, 8, 4), (("d0",), (), ("d1",)), (("d2",), ("d0", "d1"), ()), MESHES[0]))
@example(((4, 16, 16), (("d0",), ("d1",), ()), (("d1",), (), ()), MESHES[2]))
@example(((4, 4, 8), ((), ("d0",), ("d1",)), ((), ("d1",), ("d0",)), MESHES[2]))
def test_any_layout_pair_is_priced_as_compiled(pair):
    shape, src, dst, sizes = pair
    got, predicted = compiled_and_priced(shape, src, dst, sizes)
    assert got == predicted, f"{src} -> {dst} through {stages(src, dst, sizes)}"
