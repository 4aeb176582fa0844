"""The user's mesh adopted (issue 16, item 2): `mesh=` or `jax.set_mesh`, `Auto` or `Explicit`
axes, becomes the plan's mesh, in its axis names; the model's own constraints and types are
anchors (`origin="model"`); the errors a user can act on."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _tolerance import assert_close
from clients import one_device
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js


def parts(*texts: str) -> str:
    """A regex matching `texts` literally, in order, anything between them."""
    return "(?s)" + ".*".join(map(re.escape, texts))


def _mesh(kind=AxisType.Auto):
    return jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(kind, kind))


W, X = jnp.asarray(np.random.default_rng(0).normal(size=(16, 8)), jnp.float32), jnp.ones((8, 16), jnp.float32)


def constrained(w, x):
    """A model sharding its own activation, as a Flax user writes it (a PartitionSpec: the context mesh's axes)."""
    y = jax.lax.with_sharding_constraint(x @ w, P("fsdp", "tensor"))
    return jnp.tanh(y).sum()


def plain(w, x):
    """The reference: the same model without its own sharding, on one device."""
    return jnp.tanh(x @ w).sum()


def typed(w, x):
    """The same on Explicit axes: the einsum's `out_sharding` types its result."""
    y = jnp.einsum("ab,bc->ac", x, w, out_sharding=P("fsdp", "tensor"))
    return jnp.tanh(y).sum()


@pytest.mark.parametrize("how", ["mesh=", "jax.set_mesh"])
def test_a_models_own_partition_spec_constraint_runs_on_the_users_mesh(how):
    # was: "with_sharding_constraint requires a non-empty mesh in context" (mesh=) / KeyError 'fsdp' (set_mesh)
    mesh = _mesh()
    if how == "mesh=":
        step = js.parallelize(constrained, mesh=mesh)
        got, plan = step(W, X), step.plan(W, X)
    else:
        with jax.set_mesh(mesh):
            step = js.parallelize(constrained)
            got, plan = step(W, X), step.plan(W, X)
    assert_close(got, one_device(plain, W, X), terms=16 + 64)
    assert "mesh (fsdp=4, tensor=2)" in plan.summary()
    (dot,) = [op for op in plan.ops if op.primitive == "dot_general"]
    assert (dot.origin, dot.out_specs) == ("model", (P("fsdp", "tensor"),))
    assert "set by the model" in plan.explain(dot)
    tanh = next(op for op in plan.ops if op.primitive == "tanh")
    assert "a sharding constraint of the model's own" in plan.explain(tanh)


@pytest.mark.parametrize("mode", ["data", "semi_auto", "auto"])
def test_explicit_axes_and_out_sharding_run_under_jax_set_mesh(mode):
    # was: "context mesh AbstractMesh('fsdp': 4, 'tensor': 2, Explicit...) should match the aval mesh
    # AbstractMesh('d0': 2, 'd1': 2, 'd2': 2, Auto...)" inside jax.set_mesh, and "Using PartitionSpec when
    # you are not under a mesh context" with mesh=
    mesh = _mesh(AxisType.Explicit)
    with jax.set_mesh(mesh):
        w = jax.device_put(W, NamedSharding(mesh, P(None, "tensor")))
        step = js.parallelize(typed, mode=mode)
        got, plan = step(w, X), step.plan(w, X)
    assert_close(got, one_device(plain, W, X), terms=16 + 64)
    assert plan.in_specs[0] == P(None, "tensor")  # the argument keeps the layout its type carries
    if mode != "auto":  # the batch, not placed on the mesh, is typed with its dataset layout; auto searches it
        assert plan.in_specs[1] == P(("fsdp", "tensor"))
    (dot,) = [op for op in plan.ops if op.primitive == "dot_general"]
    assert (dot.origin, dot.out_specs) == ("model", (P("fsdp", "tensor"),))


def test_explicit_axes_with_mesh_keyword_outside_set_mesh():
    mesh = _mesh(AxisType.Explicit)
    assert_close(js.parallelize(typed, mesh=mesh)(W, X), one_device(plain, W, X), terms=16 + 64)


def test_the_context_mesh_is_part_of_the_signature():
    step = js.parallelize(lambda w, x: jnp.tanh(x @ w))
    outside = step.plan(W, X)
    with jax.set_mesh(_mesh()):
        inside = step.plan(W, X)
    assert outside.fine.names == ("d0", "d1", "d2") and inside.fine.names == ("fsdp", "tensor")


def test_a_placed_argument_is_an_anchor_as_under_jax_jit():
    mesh = _mesh()
    with jax.set_mesh(mesh):
        w = jax.device_put(W, NamedSharding(mesh, P("fsdp", "tensor")))
        plan = js.parallelize(lambda w, x: jnp.tanh(x @ w)).plan(w, X)
    assert plan.in_specs[0] == P("fsdp", "tensor")


def test_devices_disagreeing_with_the_context_mesh():
    with jax.set_mesh(_mesh()), pytest.raises(js.ShardingError, match=parts(
        "jshard.parallelize(<lambda>): devices=4, but the call runs under jax.set_mesh with a mesh of 8 devices "
        "{'fsdp': 4, 'tensor': 2}", "Drop devices=", "or call outside jax.set_mesh",
    )):
        js.parallelize(lambda x: x * 2, devices=4).plan(X)


def test_a_layout_axis_named_like_a_mesh_axis_must_be_that_axis():
    lay = js.Layout((2, 4), ("fsdp", "tensor"))
    with pytest.raises(js.ShardingError, match=parts(
        "jshard.parallelize(<lambda>): in_strategy[0] names its device-matrix axis 0 'fsdp' (size 2, device matrix "
        "[2, 4])", "'fsdp' is an axis of your mesh {'fsdp': 4, 'tensor': 2} that cuts the devices another way",
        "Rename the Layout's axis", "Layout((4, 2), ('fsdp', 'tensor'))",
    )):
        js.parallelize(lambda w, x: x @ w, mesh=_mesh(), in_strategy=(lay("fsdp", "None"), None)).plan(W, X)


def test_a_layout_on_the_meshs_own_axes_speaks_its_names():
    lay = js.Layout((4, 2), ("fsdp", "tensor"))
    plan = js.parallelize(lambda w, x: x @ w, mesh=_mesh(), in_strategy=(lay("fsdp", "tensor"), None)).plan(W, X)
    assert plan.in_specs[0] == P("fsdp", "tensor")


def test_a_strategy_not_lining_up_with_the_users_mesh():
    def step(w, x):
        return js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w)

    with pytest.raises(js.ShardingError, match=parts(
        "jshard.parallelize(step): matmul at test_user_mesh.py:", "uses device matrix [2, 1, 4], whose axes do not "
        "line up with the axes of your mesh {'fsdp': 4, 'tensor': 2}, and jshard plans on the mesh as given",
        "Layout((4, 2), ('fsdp', 'tensor'))", "or drop mesh= (and call outside jax.set_mesh)",
    )):
        js.parallelize(step, mesh=_mesh()).plan(W, X)


def test_linen_boxed_parameters_are_anchored_by_their_logical_names():
    """Linen keeps `nn.with_logical_partitioning`'s names beside the value (`nn.LogicallyPartitioned`);
    passed boxed, `apply` unboxes them through `nn.logical_axis_rules`, and those constraints anchor them."""
    import flax.linen as nn  # noqa: PLC0415

    rules = (("embed", None), ("mlp", "tensor"))
    model = nn.Dense(8, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
                     use_bias=False)
    params = model.init(jax.random.key(0), X)
    assert isinstance(params["params"]["kernel"], nn.LogicallyPartitioned)

    def loss(params, x):
        return jnp.tanh(model.apply(params, x)).sum()

    with jax.set_mesh(_mesh()), nn.logical_axis_rules(rules):
        step = js.parallelize(loss)
        got, plan = step(params, X), step.plan(params, X)
    assert_close(got, one_device(loss, nn.meta.unbox(params), X), terms=16 + 64)
    assert plan.in_specs[0] == P(None, "tensor")


def test_a_plan_on_the_users_mesh_saves_loads_and_runs_again(tmp_path):
    mesh = _mesh()
    js.parallelize(constrained, mesh=mesh).plan(W, X).save(tmp_path / "plan.json")
    loaded = js.Plan.load(tmp_path / "plan.json")
    assert "mesh (fsdp=4, tensor=2)" in loaded.summary() and loaded.ops[0].origin == "model"
    assert_close(js.parallelize(constrained, mesh=mesh, plan=loaded)(W, X), one_device(plain, W, X), terms=16 + 64)


def ffn(x, w1, w2):
    """The README's example: two `shard`ed matmuls, the second contracting the 4-way cut."""
    h = js.shard(jnp.matmul, in_strategy=((2, 1), (1, 4)))(x, w1)
    return js.shard(jnp.matmul, in_strategy=((2, 4), (4, 1)))(jax.nn.relu(h), w2).sum()


FFN_ARGS = tuple(jnp.asarray(np.random.default_rng(1).normal(size=s), jnp.float32) for s in ((8, 16), (16, 32), (32, 4)))
KINDS = {"explicit": (AxisType.Explicit,) * 2, "mixed": (AxisType.Explicit, AxisType.Auto),
         "mixed-minor": (AxisType.Auto, AxisType.Explicit), "auto": (AxisType.Auto,) * 2}


@pytest.mark.parametrize("how", ["mesh=", "jax.set_mesh"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["data", "semi_auto", "auto"])
def test_strategy_tuples_on_jax_make_mesh_axes_of_every_type(mode, kind, how):
    # was (Explicit axes, semi_auto and auto): "AssertionError: `with_sharding_constraint` acts as an assert
    # when all axes of mesh are of type `Explicit`"; on mixed meshes "can only refer to Auto axes"
    mesh = jax.make_mesh((2, 4), ("dp", "mp"), axis_types=KINDS[kind])
    grad = jax.value_and_grad(ffn, argnums=(1, 2))
    if how == "mesh=":
        got = js.parallelize(grad, mesh=mesh, mode=mode, in_strategy=((2, 1), None, None))(*FFN_ARGS)
    else:
        with jax.set_mesh(mesh):
            got = js.parallelize(grad, mode=mode, in_strategy=((2, 1), None, None))(*FFN_ARGS)
    assert_close(got, one_device(grad, *FFN_ARGS), terms=16 + 32 + 8)


def test_on_explicit_axes_a_weight_is_stored_as_the_shard_call_using_it_takes_it():
    mesh = jax.make_mesh((2, 4), ("dp", "mp"))  # Explicit axes
    plan = js.parallelize(ffn, mesh=mesh, in_strategy=((2, 1), None, None)).plan(*FFN_ARGS)
    assert plan.in_specs[:2] == (P("dp"), P(None, "mp"))  # W1 cut by columns, as on Auto axes
    (first, second) = [op for op in plan.ops if op.primitive == "dot_general"]
    assert (first.origin, first.in_strategy, "test_user_mesh.py" in first.source) == ("user", ((2, 1), (1, 4)), True)
    assert not [op for op in plan.ops if op.primitive == "reshard"]  # the shard calls' moves are not operators
