"""MindSpore layout semantics, pinned by which rank holds which slice, through the public API."""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

import jshard as js
from jshard.layouts import FineMesh

LAY = js.Layout((2, 2, 2), ("dp", "sp", "mp"))


def _rand(shape, seed=0):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape, dtype=np.float32))


def _is_matmul(got, x, w):
    """`got` is `x @ w` up to the rounding of its sums: as many terms as `w` has rows, of at most
    |x| @ |w| in magnitude (tests/_tolerance.py)."""
    assert_close(got, x @ w, terms=w.shape[0], scale=float(jnp.max(jnp.abs(x) @ jnp.abs(w))))


def holders(sharding, shape):
    """Block → the ranks holding it, a block being `((start, stop), ...)` per dim."""
    array = jax.device_put(np.arange(math.prod(shape), dtype=np.float32).reshape(shape), sharding)
    found = {}
    for shard in array.addressable_shards:
        block = tuple((s.start or 0, dim if s.stop is None else s.stop) for s, dim in zip(shard.index, shape))
        found.setdefault(block, set()).add(shard.device.id)
    return found


def rows(sharding, shape, k, n):
    """The ranks holding row block `k` of `n` (all columns)."""
    step = shape[0] // n
    return holders(sharding, shape)[((k * step, (k + 1) * step), *((0, d) for d in shape[1:]))]


def cols(sharding, shape, k, n):
    """The ranks holding column block `k` of `n` of a 2-D array (all rows)."""
    step = shape[1] // n
    return holders(sharding, shape)[((0, shape[0]), (k * step, (k + 1) * step))]


def matmul_step(strategy):
    def step(x, w):
        return js.shard(jnp.matmul, strategy)(x, w)

    return step


# --- MatMul device matrices -------------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, matrix, x_rows, w_cols",
    [
        # X row block i on ranks x_rows[i]; W column block j on ranks w_cols[j].
        (((2, 1), (1, 4)), (2, 1, 4), [{0, 1, 2, 3}, {4, 5, 6, 7}], [{0, 4}, {1, 5}, {2, 6}, {3, 7}]),
        (((2, 1), (1, 2)), (2, 1, 2, 2), [{0, 1, 2, 3}, {4, 5, 6, 7}], [{0, 1, 4, 5}, {2, 3, 6, 7}]),
    ],
    ids=["((2,1),(1,4))", "((2,1),(1,2))-repeated"],
)
def test_matmul_ranks_on_8(strategy, matrix, x_rows, w_cols):
    x, w = _rand((4, 8)), _rand((8, 16), 1)
    step = js.parallelize(matmul_step(strategy), devices=8)
    (x_sh, w_sh), _ = step.lower(x, w).compile().input_shardings
    for i, ranks in enumerate(x_rows):
        assert rows(x_sh, x.shape, i, len(x_rows)) == ranks
    for j, ranks in enumerate(w_cols):
        assert cols(w_sh, w.shape, j, len(w_cols)) == ranks
    assert step.plan(x, w).annotations[0].in_layouts[1].device_matrix == matrix
    out = step(x, w)
    _is_matmul(out, x, w)
    # The output (a, c) lives where MatMul's device matrix puts it: block (i, j) on x_rows[i] ∩ w_cols[j].
    got = holders(out.sharding, out.shape)
    for i, xr in enumerate(x_rows):
        for j, wc in enumerate(w_cols):
            r, c = out.shape[0] // len(x_rows), out.shape[1] // len(w_cols)
            assert got[((i * r, (i + 1) * r), (j * c, (j + 1) * c))] == xr & wc


@pytest.mark.parametrize("where", ["in_strategy", "shard"])
def test_layout_worked_example(where):
    """`layout("mp", ("sp", "dp"))` on a = [[a0..a3], [a4..a7]]: a0, a1, a2, a3 on ranks 0, 4, 2, 6."""
    a = jnp.arange(8.0).reshape(2, 4)
    tensor_layout = LAY("mp", ("sp", "dp"))
    if where == "in_strategy":
        step = js.parallelize(lambda t: t * 2, devices=8, in_strategy=(tensor_layout,))
    else:
        step = js.parallelize(lambda t: js.shard(lambda u: u * 2, (tensor_layout,))(t), devices=8)
    (sharding,) = step.plan(a).in_shardings
    placed = jax.device_put(a, sharding)
    on = {shard.device.id: np.asarray(shard.data).ravel().tolist() for shard in placed.addressable_shards}
    assert [on[r] for r in (0, 4, 2, 6)] == [[0.0], [1.0], [2.0], [3.0]]
    assert sharding.spec == PartitionSpec("mp", ("sp", "dp"))  # the plan speaks the Layout's axis names


@pytest.mark.parametrize(
    "tensor_layout, shape, blocks",
    [
        # rank = 4*dp + 2*sp + mp; ("dp", "sp") cuts rows 4-way, dp major.
        (LAY(("dp", "sp"), "None"), (8, 4), {((0, 2), (0, 4)): {0, 1}, ((2, 4), (0, 4)): {2, 3},
                                             ((6, 8), (0, 4)): {6, 7}}),
        # ("mp", "dp") cuts columns 4-way, mp major: block 1 is (mp=0, dp=1).
        (LAY("None", ("mp", "dp")), (4, 8), {((0, 4), (0, 2)): {0, 2}, ((0, 4), (2, 4)): {4, 6},
                                             ((0, 4), (4, 6)): {1, 3}}),
        (LAY("None", "None"), (4, 8), {((0, 4), (0, 8)): set(range(8))}),
    ],
    ids=["(dp,sp)-None", "None-(mp,dp)", "None-None"],
)
def test_layout_none_and_multi_axis(tensor_layout, shape, blocks):
    step = js.parallelize(lambda t: t + 1.0, devices=8, in_strategy=(tensor_layout,))
    (sharding,) = step.plan(jnp.zeros(shape)).in_shardings
    got = holders(sharding, shape)
    for block, ranks in blocks.items():
        assert got[block] == ranks


# --- Non-power-of-two device counts -----------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, fine, x_rows, w_cols",
    [
        (((2, 1), (1, 3)), (2, 3), [{0, 1, 2}, {3, 4, 5}], [{0, 3}, {1, 4}, {2, 5}]),
        (((3, 1), (1, 2)), (3, 2), [{0, 1}, {2, 3}, {4, 5}], [{0, 2, 4}, {1, 3, 5}]),
    ],
    ids=["((2,1),(1,3))", "((3,1),(1,2))"],
)
def test_matmul_on_6_devices(strategy, fine, x_rows, w_cols):
    x, w = _rand((6, 4)), _rand((4, 6), 1)
    step = js.parallelize(matmul_step(strategy), devices=6)
    plan = step.plan(x, w)
    assert plan.fine.sizes == fine
    assert plan.mesh.devices.size == 6
    x_sh, w_sh = plan.in_shardings
    for i, ranks in enumerate(x_rows):
        assert rows(x_sh, x.shape, i, len(x_rows)) == ranks
    for j, ranks in enumerate(w_cols):
        assert cols(w_sh, w.shape, j, len(w_cols)) == ranks
    _is_matmul(step(x, w), x, w)


@pytest.mark.parametrize(
    "n, matrices, sizes",
    [
        (8, [], (2, 2, 2)),
        (6, [], (3, 2)),
        (6, [(2, 1, 3)], (2, 3)),
        (6, [(3, 1, 2)], (3, 2)),
        (12, [(3, 4)], (3, 2, 2)),
        (12, [(4, 3)], (2, 2, 3)),
        (12, [(2, 6), (6, 2)], (2, 3, 2)),
        (8, [(2, 1, 4), (2, 1, 2, 2)], (2, 2, 2)),
    ],
    ids=lambda v: str(v).replace(" ", ""),
)
def test_fine_mesh_refining(n, matrices, sizes):
    fine = FineMesh.refining(n, matrices)
    assert fine.sizes == sizes
    assert all(fine.fits(m) for m in matrices)


def test_fine_mesh_default():
    assert FineMesh.for_devices(8).sizes == (2, 2, 2)
    assert FineMesh.for_devices(6).sizes == (3, 2)


def test_layout_on_6_devices():
    lay = js.Layout((2, 3), ("a", "b"))
    x = _rand((4, 6))
    step = js.parallelize(lambda t: js.shard(jnp.tanh, (lay("None", ("b", "a")),))(t), devices=6)
    (sharding,) = step.plan(x).in_shardings
    # ("b", "a") cuts columns 6-way, b major: block k = 2*b + a on rank 3*a + b.
    assert [cols(sharding, x.shape, k, 6) for k in range(6)] == [{0}, {3}, {1}, {4}, {2}, {5}]


# --- A Layout names the plan's mesh axes -----------------------------------------------------------

LAY_2_4 = js.Layout((2, 4), ("dp", "mp"))


def _row_parallel(x, w):
    return jnp.tanh(js.shard(jnp.matmul, (LAY_2_4("dp", "mp"), LAY_2_4("mp", "None")))(x, w))


def test_the_plan_speaks_the_layouts_axis_names():
    """No mesh given: the plan's mesh axes take the Layout's names, `mp` of 4 over two fine axes as
    `mp_0`, `mp_1` (major first), in the specs, the summary and explain."""
    x, w = _rand((8, 16)), _rand((16, 8), 1)
    step = js.parallelize(_row_parallel, devices=8)
    plan = step.plan(x, w)
    assert (plan.fine.names, plan.fine.sizes) == (("dp", "mp_0", "mp_1"), (2, 2, 2))
    assert plan.in_specs == (PartitionSpec("dp", ("mp_0", "mp_1")), PartitionSpec(("mp_0", "mp_1")))
    assert plan.out_specs == (PartitionSpec("dp"),)
    assert "mesh (dp=2, mp_0=2, mp_1=2)" in plan.summary()
    assert "all-reduce of 128 B over mp_0×mp_1" in plan.explain(plan.ops[0])
    assert_close(step(x, w), jax.jit(_row_parallel)(x, w), terms=16 + 4)  # x @ w, then tanh


def test_nested_layout_axes_take_the_innermost_names():
    """`x` of Layout((2, 4), ("dp", "x")) spans LAY's `sp` and `mp`: the mesh says `sp`, `mp`."""
    t = _rand((8, 16))
    inner = js.Layout((2, 4), ("dp", "x"))("dp", "x")
    step = js.parallelize(lambda t: js.shard(jnp.tanh, (inner,))(t), devices=8, in_strategy=(LAY("dp", ("sp", "mp")),))
    plan = step.plan(t)
    assert plan.fine.names == ("dp", "sp", "mp") and plan.in_specs == (PartitionSpec("dp", ("sp", "mp")),)


def test_layouts_naming_one_axis_twice_are_an_error():
    x, w = _rand((8, 16)), _rand((16, 8), 1)
    other = js.Layout((2, 4), ("batch", "model"))
    step = js.parallelize(_row_parallel, devices=8, in_strategy=(other("batch", "model"), None))
    with pytest.raises(js.ShardingError) as e:
        step.plan(x, w)
    assert str(e.value).startswith(
        "jshard.parallelize(_row_parallel): in_strategy[0] uses Layout((2, 4), ('batch', 'model')) and matmul at "
        "test_layouts.py:")
    assert ("uses Layout((2, 4), ('dp', 'mp')), which name the devices' axes differently: one axis of 2 devices "
            "(rank stride 4) is 'batch' in one and 'dp' in the other. The plan's mesh takes its axis names from "
            "your Layouts") in str(e.value)


# --- Function-level in_strategy / out_strategy --------------------------------------------------


def test_function_boundary_strategies():
    params = {"w": _rand((8, 16)), "b": _rand((1, 16), 1)}
    x = _rand((4, 8), 2)

    def dense(p, x):
        return x @ p["w"] + p["b"], jnp.sum(x)

    step = js.parallelize(
        dense,
        devices=8,
        in_strategy=({"w": (1, 4), "b": LAY("None", ("dp", "sp"))}, (2, 1)),
        out_strategy=(LAY("dp", ("sp", "mp")), None),
    )
    # x's rows and w's columns both land on dp, where the matmul takes them together.
    with pytest.warns(js.LayoutCollisionWarning, match=r"in_strategy\[1\]=\(2, 1\) and in_strategy\[0\]\['w'\]=\(1, 4\) .* "
                      r"both cut onto mesh axis dp"):
        compiled = step.lower(params, x).compile()
    (p_sh, x_sh), kwargs = compiled.input_shardings
    assert kwargs == {}
    # A lone tuple is its own device matrix (+ repeats): (1, 4) → [1, 4, 2]; (2, 1) → [2, 1, 4]. The
    # mesh's axes take LAY's names, tuples' specs too.
    assert p_sh["w"].spec == PartitionSpec(None, ("dp", "sp"))
    assert p_sh["b"].spec == PartitionSpec(None, ("dp", "sp"))
    assert x_sh.spec == PartitionSpec("dp")
    assert cols(p_sh["w"], (8, 16), 1, 4) == {2, 3}
    out_sh, sum_sh = compiled.output_shardings
    assert out_sh.spec == PartitionSpec("dp", ("sp", "mp"))
    assert sum_sh.spec == PartitionSpec()
    assert step.plan(params, x).in_shardings == ({"w": p_sh["w"], "b": p_sh["b"]}, x_sh)
    out, total = step(params, x)
    want_out, want_total = jax.jit(dense)(params, x)
    assert_close(out, want_out, terms=8 + 1)  # x @ w + b
    assert_close(total, want_total, terms=x.size, scale=float(jnp.sum(jnp.abs(x))))


def test_boundary_tuple_needing_a_refined_mesh():
    """A function-level tuple on 6 devices needs the (2, 3) mesh; no operator asks for it."""
    x = _rand((6, 6))
    step = js.parallelize(lambda t: t * 2, devices=6, in_strategy=((2, 1),), out_strategy=(2, 3))
    plan = step.plan(x)
    assert plan.fine.sizes == (2, 3)
    assert rows(plan.in_shardings[0], x.shape, 1, 2) == {3, 4, 5}
    assert holders(plan.out_shardings, x.shape)[((3, 6), (4, 6))] == {5}


# --- shard: outside and inside a trace, gradients, results ------------------------------------


def test_shard_outside_parallelize_is_plain():
    x, w = _rand((4, 8)), _rand((8, 16), 1)
    mm = js.shard(jnp.matmul, ((2, 1), (1, 4)))
    np.testing.assert_array_equal(mm(x, w), jnp.matmul(x, w))
    assert "sharding_constraint" not in str(jax.make_jaxpr(mm)(x, w))
    assert mm.in_strategy == ((2, 1), (1, 4))


def _loss(w, x):
    y = js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w)
    return jnp.sum(jnp.tanh(y) ** 2)


def test_constraints_survive_grad():
    w, x = _rand((16, 8)), _rand((8, 16), 1)
    grad = js.parallelize(jax.grad(_loss), devices=8, propagation="xla")  # only the user's constraints
    text = grad.lower(w, x).as_text()
    # Forward: x, w and the product; backward: the product's cotangent and w's gradient.
    assert text.count("sdy.sharding_constraint") == 5
    g = grad(w, x)
    # x @ w (16 terms), tanh (a few), then the gradient's x.T @ (...) over x's 8 rows
    assert_close(g, jax.jit(jax.grad(_loss))(w, x), terms=16 + 4 + 8)
    # The gradient of W is laid out as W: column block j on ranks {j, 4 + j}.
    assert [cols(g.sharding, g.shape, j, 4) for j in range(4)] == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]
    backward = [op for op in grad.plan(w, x).ops if op.backward]
    assert backward and all(op.origin == "default" for op in backward)


def _annotated(x, w):
    y = jnp.tanh(x)
    z = js.shard(jnp.matmul, ((2, 1), (1, 4)))(y, w)
    return z + 1.0


_ANNOTATED_LINE = _annotated.__code__.co_firstlineno + 2


def test_plan_ops_and_summary():
    plan = js.parallelize(_annotated, devices=8).plan(_rand((4, 8)), _rand((8, 16), 1))
    assert [op.primitive for op in plan.ops] == ["tanh", "dot_general", "add"]
    assert [op.index for op in plan.ops] == [0, 1, 2]
    tanh, dot, add = plan.ops
    assert dot.in_strategy == ((2, 1), (1, 4))
    assert dot.out_strategy == ((2, 4),)
    assert dot.origin == "user"
    assert dot.annotation == "matmul"
    assert dot.in_specs == (PartitionSpec("d0"), PartitionSpec(None, ("d1", "d2")))
    assert f"test_layouts.py:{_ANNOTATED_LINE}:" in dot.source
    # Propagated from the matmul's strategy: tanh makes its (2, 1)-cut input, the add keeps (2, 4).
    assert (tanh.origin, add.origin) == ("propagated", "propagated")
    assert tanh.in_strategy == ((2, 1),) and add.out_strategy == ((2, 4),)
    assert (tanh.via, add.via) == ("1", "1")  # a shard call's constraints stand for its matmul
    summary = plan.summary()
    assert "mesh (d0=2, d1=2, d2=2)" in summary
    assert "8 devices" in summary
    assert "((2, 1), (1, 4))" in summary and "((2, 4),)" in summary
    assert str(plan) == summary


def test_shard_inside_checkpoint_is_planned_and_anchors_arguments():
    x, w = _rand((8, 8)), _rand((8, 8), 1)

    def step(x, w):
        return jax.checkpoint(lambda x, w: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w))(x, w)

    plan = js.parallelize(step, devices=8, dataset_strategy="full_batch").plan(x, w)
    assert [(op.primitive, op.origin) for op in plan.ops] == [("dot_general", "user")]
    assert [s.spec for s in plan.in_shardings] == [PartitionSpec("d0"), PartitionSpec(None, ("d1", "d2"))]


def test_shard_inside_vmap():
    xs, w = _rand((3, 8, 8)), _rand((8, 8), 1)

    def step(xs, w):
        return jax.vmap(lambda x: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w))(xs)

    parallel = js.parallelize(step, devices=8, dataset_strategy="full_batch")
    # The vmapped dim is left to XLA inside; at the boundary it stays whole.
    assert parallel.plan(xs, w).in_shardings[0].spec == PartitionSpec(None, "d0", None)
    assert_close(parallel(xs, w), jax.jit(step)(xs, w), terms=8, scale=float(jnp.max(jnp.abs(xs) @ jnp.abs(w))))


def test_shard_inside_scan_refines_the_mesh():
    def step(x, w):
        def body(carry, _):
            return js.shard(jnp.matmul, ((2, 1), (1, 3)))(carry, w), None

        return jax.lax.scan(body, x, None, length=2)[0]

    plan = js.parallelize(step, devices=6).plan(_rand((6, 6)), _rand((6, 6), 1))
    assert plan.fine.sizes == (2, 3)
    (dot,) = [op for op in plan.ops if op.origin == "user"]
    assert dot.inside == "scan" and dot.in_strategy == ((2, 1), (1, 3))


# --- Which operands a contraction sees --------------------------------------------------------


def _out_strategy(fn, strategy, *args):
    step = js.parallelize(lambda *a: js.shard(fn, strategy)(*a), devices=8, dataset_strategy="full_batch")
    (ann,) = step.plan(*args).annotations
    return ann, None if ann.out_layouts[0] is None else ann.out_layouts[0].strategy


@pytest.mark.parametrize(
    "fn, strategy, shapes, matrix, out",
    [
        (lambda x, w: x @ w, ((2, 1), (1, 4)), ((8, 16), (16, 32)), (2, 1, 4), (2, 4)),
        (lambda w, x: x @ w, ((1, 4), (2, 1)), ((16, 32), (8, 16)), (2, 1, 4), (2, 4)),
        (lambda x, w: x @ w.T, ((2, 1), (4, 1)), ((8, 16), (32, 16)), (2, 1, 4), (2, 4)),
        (lambda x, w: jnp.einsum("ij,kj->ki", x, w), ((2, 1), (4, 1)), ((8, 16), (32, 16)), (4, 1, 2), (4, 2)),
        (lambda x, w: jax.nn.relu(x @ w), ((2, 1), (1, 4)), ((8, 16), (16, 32)), (2, 1, 4), (2, 4)),
        (lambda x, w: (x @ w).T, ((2, 1), (1, 4)), ((8, 16), (16, 32)), (2, 1, 4), None),
    ],
    ids=["x@w", "args-swapped", "x@w.T", "einsum-ij,kj->ki", "relu(x@w)", "(x@w).T-unruled"],
)
def test_contraction_operands(fn, strategy, shapes, matrix, out):
    args = [_rand(s, i) for i, s in enumerate(shapes)]
    ann, got = _out_strategy(fn, strategy, *args)
    assert ann.in_layouts[0].device_matrix == matrix
    assert tuple(lay.strategy for lay in ann.in_layouts) == strategy
    assert got == out


def test_extra_tuple_operand_is_constrained():
    """A third tuple (a bias) is never dropped: it is cut as its own device matrix."""
    x, w, b = _rand((8, 16)), _rand((16, 32), 1), _rand((1, 32), 2)
    ann, out = _out_strategy(lambda x, w, b: x @ w + b, ((2, 1), (1, 4), (1, 4)), x, w, b)
    assert ann.in_layouts[2] is not None and ann.in_layouts[2].strategy == (1, 4)
    assert out == (2, 4)


# --- parameter_plan: Flax NNX and Linen ----------------------------------------------------------


def test_parameter_plan_nnx():
    model = nnx.Linear(16, 8, kernel_init=lambda key, shape, dtype: _rand(shape, 5), rngs=nnx.Rngs(0))
    x = _rand((8, 16), 3)

    def forward(x):
        return js.shard(model, ((2, 1),), parameter_plan={"kernel": (1, 4)})(x)

    step = js.parallelize(forward, devices=8)
    (ann,) = step.plan(x).annotations
    assert [(path, lay.strategy) for path, lay in ann.params] == [("kernel", (1, 4))]
    assert_close(step(x), model(x), terms=16 + 1)  # x @ kernel + bias


def test_parameter_plan_linen():
    dense = nn.Dense(8)
    x = _rand((8, 16), 3)
    variables = {"params": {"kernel": _rand((16, 8), 5), "bias": _rand((8,), 6)}}

    def forward(variables, x):
        return js.shard(dense.apply, (None, (2, 1)), parameter_plan={"kernel": (1, 4)})(variables, x)

    step = js.parallelize(forward, devices=8, in_strategy=(None, (2, 1)))
    (ann,) = step.plan(variables, x).annotations
    assert [(path, lay.strategy) for path, lay in ann.params] == [("params/kernel", (1, 4))]
    assert ann.in_layouts[0] is None
    # The kernel argument flows straight into the constraint, so it arrives laid out that way.
    kernel_sh = step.lower(variables, x).compile().input_shardings[0][0]["params"]["kernel"]
    assert kernel_sh.spec == PartitionSpec(None, ("d0", "d1"))
    assert_close(step(variables, x), dense.apply(variables, x), terms=16 + 1)  # x @ kernel + bias


# --- Compiles once per input signature ----------------------------------------------------------


def test_traces_once_per_signature():
    traced = []

    def fn(x):
        traced.append(x.shape)
        return js.shard(jnp.sin, ((8,),))(x) * 2

    step = js.parallelize(fn, devices=8)
    a = step(jnp.ones(8))
    b = step(jnp.ones(8) * 2)
    assert traced == [(8,)]
    assert_close(b, 2 * jnp.sin(jnp.ones(8) * 2), terms=4)  # sin: a few ulps
    step.plan(jnp.ones(8))
    assert traced == [(8,)]
    step(jnp.ones(16))
    assert traced == [(8,), (16,)]
    assert_close(a, 2 * jnp.sin(jnp.ones(8)), terms=4)


# --- Modes --------------------------------------------------------------------------------------


def test_mode_data():
    """The batch (last argument) is cut on dim 0 over all devices, the rest replicated; shard ignored."""
    w, batch = _rand((4, 4)), _rand((16, 4), 1)
    step = js.parallelize(lambda w, x: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w), mode="data")
    compiled = step.lower(w, batch).compile()
    (w_sh, x_sh), _ = compiled.input_shardings
    assert holders(w_sh, w.shape) == {((0, 4), (0, 4)): set(range(8))}
    assert [rows(x_sh, batch.shape, r, 8) for r in range(8)] == [{r} for r in range(8)]
    plan = step.plan(w, batch)
    assert plan.annotations == () and [(op.origin, op.in_strategy) for op in plan.ops] == [("propagated", ((8, 1), (1, 1)))]
    _is_matmul(step(w, batch), batch, w)


def test_mode_manual():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
    w, x = _rand((4, 8)), _rand((16, 4), 1)
    step = js.parallelize(
        lambda w, x: x @ w,
        mode="manual",
        mesh=mesh,
        in_strategy=(PartitionSpec(None, "model"), PartitionSpec("data")),
        out_strategy=PartitionSpec("data", "model"),
    )
    compiled = step.lower(w, x).compile()
    (w_sh, x_sh), _ = compiled.input_shardings
    assert w_sh.mesh.axis_names == ("data", "model")
    assert (w_sh.spec, x_sh.spec) == (PartitionSpec(None, "model"), PartitionSpec("data"))
    assert compiled.output_shardings.spec == PartitionSpec("data", "model")
    assert cols(w_sh, w.shape, 1, 4) == {1, 5}
    _is_matmul(step(w, x), x, w)


def test_mode_manual_honours_shard_on_the_users_mesh():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
    w, x = _rand((4, 8)), _rand((16, 4), 1)
    step = js.parallelize(lambda w, x: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w), mode="manual", mesh=mesh)
    (ann,) = step.plan(w, x).annotations
    (dot,) = [op for op in step.plan(w, x).ops if op.origin == "user"]
    assert dot.in_specs == (PartitionSpec("data"), PartitionSpec(None, "model"))
    assert ann.in_layouts[1].device_matrix == (2, 1, 4)
