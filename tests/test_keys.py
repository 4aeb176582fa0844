"""PRNG keys everywhere: typed (`jax.random.key`) and raw (`jax.random.PRNGKey`) keys as arguments
and results, dropout inside the step (Linen and NNX, as their users write it), in every mode,
equal to one device; the rules, the cost model and the plan read key arrays."""

import functools

import jax
import jax.numpy as jnp
import pytest
from _tolerance import assert_close
from clients import linen_dropout, nnx_dropout, one_device

import jshard as js
from jshard._format import shape_str
from jshard.cost import itemsize, value_bytes
from jshard.rules import RULES

MODES = {
    "data": {"mode": "data"},
    "semi_auto": {"mode": "semi_auto"},
    "auto": {"mode": "auto"},  # search="recursive"
    "xla": {"mode": "semi_auto", "propagation": "xla"},
}
KEYS = {"typed": lambda seed: jax.random.key(seed), "raw": lambda seed: jax.random.PRNGKey(seed)}


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("mode", MODES)
def test_linen_dropout_step_equals_one_device(mode, key):
    state, batch = linen_dropout.create_state()
    rng = KEYS[key](1)
    step = js.parallelize(linen_dropout.train_step, devices=8, batch_argnums=1, **MODES[mode])
    new_state, loss = step(state, batch, rng)
    assert_close((new_state, loss), one_device(linen_dropout.train_step, state, batch, rng), terms=linen_dropout.terms())
    assert new_state.step == 1


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("mode", MODES)
def test_nnx_dropout_step_equals_one_device(mode, key):
    graphdef, state, batch = nnx_dropout.create_state()
    train_step = functools.partial(nnx_dropout.train_step, graphdef)
    rng = KEYS[key](1)
    new_state, loss = js.parallelize(train_step, devices=8, **MODES[mode])(state, rng, batch)
    want_state, want_loss = one_device(train_step, state, rng, batch)
    assert_close((new_state, loss), (want_state, want_loss), terms=nnx_dropout.terms())
    assert int(new_state["dropout"]["rngs"]["count"][...]) == 1  # the stream moved on, as under jax.jit


def test_dropout_masks_differ_with_the_key_as_on_one_device():
    state, batch = linen_dropout.create_state()
    step = js.parallelize(linen_dropout.train_step, devices=8, batch_argnums=1)
    losses = {float(step(state, batch, jax.random.key(seed))[1]) for seed in range(3)}
    assert len(losses) == 3  # the key reaches the mask: three keys, three masks


NOISE_TERMS = 16 + 8
"""`x @ w` sums 16 terms; the normal draw (an inverse error function) is good to a few ulps."""


def per_example_noise(w, keys, x):
    """Per-example keys (a key array with a batch dim) drawing per-example noise, and fresh keys out."""
    noise = jax.vmap(lambda k: jax.random.normal(k, (w.shape[1],)))(keys)
    return x @ w + noise, jax.vmap(lambda k: jax.random.split(k)[0])(keys)


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("mode", ["data", "semi_auto", "auto"])
def test_key_arrays_cut_over_devices_draw_what_one_device_draws(mode, key):
    w, x = jnp.full((16, 4), 0.1), jnp.ones((8, 16))
    keys = jax.random.split(KEYS[key](0), 8)  # typed: key<fry>[8]; raw: u32[8, 2]
    strategy = (None, (8,) if key == "typed" else (8, 1), None)  # the key data's trailing dim stays whole
    step = js.parallelize(per_example_noise, devices=8, mode=mode, in_strategy=strategy)
    got = step(w, keys, x)
    assert_close(got, one_device(per_example_noise, w, keys, x), terms=NOISE_TERMS)
    assert step.plan(w, keys, x).in_specs[1] == jax.sharding.PartitionSpec(("d0", "d1", "d2"))


def test_the_plan_prints_saves_and_loads_key_arrays(tmp_path):
    w, x, keys = jnp.ones((16, 4)), jnp.ones((8, 16)), jax.random.split(jax.random.key(0), 8)
    plan = js.parallelize(per_example_noise, devices=8, in_strategy=(None, (8,), None)).plan(w, keys, x)
    plan.save(str(tmp_path / "plan.json"))
    again = js.parallelize(per_example_noise, devices=8, plan=js.Plan.load(str(tmp_path / "plan.json")))
    assert_close(again(w, keys, x), one_device(per_example_noise, w, keys, x), terms=NOISE_TERMS)
    bits = next(op for op in plan.ops if op.primitive == "random_bits")
    assert bits.in_shapes == ("key<fry>[8]",) and bits.out_shapes == ("u32[8,4]",)
    assert bits.in_strategy == ((8,),) and bits.out_strategy == ((8, 1),)  # the keys' cut leads the bits'
    assert "results (8, 1) ×2, (8,)" in plan.summary()  # the summary's rows read key strategies too (random_split)
    assert plan.explain(bits).startswith(f"op #{bits.index} random_bits")
    assert plan.coverage == 1.0


def test_key_dtypes_format_and_size():
    typed, raw = jax.random.key(0), jax.random.PRNGKey(0)
    assert shape_str(typed.dtype, (8,)) == "key<fry>[8]" and shape_str(typed.dtype, (8,), short=False) == "key<fry>[8]"
    assert shape_str(raw.dtype, raw.shape) == "u32[2]"
    assert itemsize(typed.dtype) == itemsize(raw.dtype) * raw.shape[0] == 8
    var = jax.make_jaxpr(lambda k: jax.random.split(k, 8))(typed).jaxpr.outvars[0]
    assert value_bytes(var) == 64.0


def _factors(fn, *args):
    eqn = next(e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name.startswith("random_"))
    return RULES[eqn.primitive.name](eqn)


def test_key_rules_cut_the_keys_dims_never_the_key_data():
    keys = jax.random.split(jax.random.key(0), 8)
    wrap = _factors(jax.random.wrap_key_data, jnp.zeros((8, 2), jnp.uint32))  # u32[8,2] -> key[8]
    assert wrap.inputs[0][1] == () and wrap.inputs[0][0] == wrap.outputs[0][0] != ()
    unwrap = _factors(jax.random.key_data, keys)  # key[8] -> u32[8,2]
    assert unwrap.outputs[0][1] == () and unwrap.inputs[0][0] == unwrap.outputs[0][0]
    bits = _factors(lambda k: jax.random.bits(k, (8, 3)), jax.random.key(0))  # key[] -> u32[8,3]: all free
    assert bits.inputs == ((),) and all(bits.outputs[0])
    split = _factors(lambda k: jax.random.split(k, 4), jax.random.key(0))  # key[] -> key[4]
    assert split.outputs[0][0] != ()
    fold = _factors(jax.vmap(lambda k: jax.random.fold_in(k, 3)), keys)  # key[8] -> key[8], one key per element
    assert fold.inputs[0] == fold.outputs[0]
