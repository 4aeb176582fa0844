"""A budgeted planning compiles each distinct program once (`compile._program.Compiles`), keyed by
what determines the executable (`program_key`), and a refused planning names the least compiled
peak it met (issue 32: planning in compile time)."""

import functools
import types

import jax
import jax.numpy as jnp
import pytest
from clients import nnx_gqa

import jshard as js
from jshard.compile._program import Compiles, alike_key, program_key


def _lowered(fn, *shapes):
    return jax.jit(fn).lower(*shapes)


def test_the_key_tells_apart_programs_that_print_alike_but_read_other_arguments():
    """jax drops the arguments a program does not read, so `a * 2` of `(a, b)` and `b * 2` of
    `(a, b)` print the same module; they are different executables (each is called with both
    arguments and reads its own), and their keys differ."""
    x = jax.ShapeDtypeStruct((4,), jnp.float32)
    first, second = _lowered(lambda a, b: a * 2, x, x), _lowered(lambda a, b: b * 2, x, x)
    assert first.as_text() == second.as_text()
    assert program_key(first, None, ()) != program_key(second, None, ())


def test_the_key_is_the_same_for_one_program_jitted_twice_and_differs_by_donation_and_options():
    x = jax.ShapeDtypeStruct((4,), jnp.float32)

    def doubled():
        def double(a):  # named alike: jax names the module after the function
            return a * 2

        return double

    double = doubled()
    key = program_key(_lowered(double, x), None, ())
    assert program_key(_lowered(doubled(), x), None, ()) == key  # another function, the same program
    assert program_key(jax.jit(double, donate_argnums=0).lower(x), None, ()) != key
    assert program_key(_lowered(double, x), None, (("xla_disable_hlo_passes", "x"),)) != key
    assert program_key(_lowered(double, jax.ShapeDtypeStruct((4,), jnp.float32, weak_type=True)), None, ()) != key


@functools.cache
def _gqa():
    mesh = nnx_gqa.make_mesh(jax.devices())
    with jax.set_mesh(mesh):
        graphdef, state, batch = nnx_gqa.create_state(mesh)
        free = js.parallelize(functools.partial(nnx_gqa.train_step, graphdef), mode="auto").plan(state, batch)
    return mesh, functools.partial(nnx_gqa.train_step, graphdef), (state, batch), free.search.peak_bytes


def test_a_refused_planning_compiles_each_program_once_and_names_the_least_compiled_peak(monkeypatch):
    """The NNX GQA block at 0.8 of its unbudgeted estimated peak fits no plan once compiled; its
    weighings (offload, optimizer level) and the search asked again under a tighter estimate meet
    the same programs again: each is compiled once (counted at `Lowered.compile`, each compile's
    `program_key` new), and the error says what budget the least of them needs. No time limit to
    speak of: what the weighings weigh does not hang on the machine's load."""
    mesh, step, args, peak = _gqa()
    compiled, checked = [], []
    compile_, key = jax.stages.Lowered.compile, program_key

    def counted(lowered, *a, **k):
        compiled.append(lowered)
        return compile_(lowered, *a, **k)

    def keyed(lowered, *a):
        checked.append(key(lowered, *a))
        return checked[-1]

    monkeypatch.setattr(jax.stages.Lowered, "compile", counted)
    monkeypatch.setattr("jshard.compile._program.program_key", keyed)
    with (
        jax.set_mesh(mesh),
        pytest.raises(
            js.MemoryBudgetError,
            match=r"raise memory_budget to at least \d+ bytes "
            r"for the least of them to fit\.",
        ) as e,
    ):
        js.parallelize(step, mode="auto", search=js.Search(memory_budget=0.8 * peak, time_limit=1e4)).plan(*args)
    assert None not in checked
    assert len(compiled) == len(set(checked)) < len(checked), (len(compiled), len(set(checked)), len(checked))
    assert f"({len(compiled)} distinct programs)" in str(e.value)


def _counted_step(count_sharding):
    """A step updating a vector and its 0-d count: the count laid out replicated, or (None) left to XLA."""
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    vector = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    count = None if count_sharding is None else jax.sharding.NamedSharding(mesh, count_sharding)
    step = jax.jit(lambda v, n: (v * 2, n + 1), in_shardings=(vector, whole), out_shardings=(vector, count))
    x, n = jax.ShapeDtypeStruct((16,), jnp.float32), jax.ShapeDtypeStruct((), jnp.int32)
    return step, (x, n)


def test_programs_alike_but_for_a_replicated_0d_result_share_their_peak_not_their_key():
    """An optimizer level lays out the updated step count as the argument it updates, the program
    without it leaves it to XLA: two keys (two executables), one `alike_key` (one buffer
    assignment). A ranked result laid out or left to XLA stays apart."""
    replicated, free = (_counted_step(c) for c in (jax.sharding.PartitionSpec(), None))
    lowered = [step.lower(*args) for step, args in (replicated, free)]
    keys = [program_key(low, None, ()) for low in lowered]
    assert keys[0] != keys[1]
    assert alike_key(keys[0]) == alike_key(keys[1]) is not None
    mesh = jax.sharding.Mesh(jax.devices(), ("x",))
    laid = jax.jit(lambda v: v * 2, out_shardings=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x")))
    x = jax.ShapeDtypeStruct(
        (16,), jnp.float32, sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    )
    ranked = [program_key(f.lower(x), None, ()) for f in (laid, jax.jit(lambda v: v * 2))]
    assert alike_key(ranked[0]) != alike_key(ranked[1])


def test_a_program_alike_to_one_over_the_budget_is_not_compiled():
    """`Compiles.check` with a budget: the alike program's peak over it answers (no executable, no
    compile); under a budget it fits, or with none, the program is compiled for its executable."""
    checks = Compiles()
    programs = []
    for sharding in (jax.sharding.PartitionSpec(), None):
        step, args = _counted_step(sharding)
        plan = types.SimpleNamespace(offload=None, communication=None)
        programs.append((types.SimpleNamespace(jitted=step, in_shardings=None, plan=plan), args))
    first = checks.check(*programs[0])
    assert checks.compiled == 1 and first.executable is not None
    skipped = checks.check(*programs[1], first.peak - 1)
    assert (checks.compiled, skipped.peak, skipped.executable) == (1, first.peak, None)
    fitting = checks.check(*programs[1], first.peak)
    assert checks.compiled == 2 and fitting.executable is not None and fitting.peak == first.peak
