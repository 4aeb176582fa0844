"""A budgeted planning compiles each distinct program once (`compile._program.Compiles`), keyed by
what determines the executable (`program_key`), and a refused planning names the least compiled
peak it met (issue 32: planning in compile time)."""

import functools

import jax
import jax.numpy as jnp
import pytest
from clients import nnx_gqa

import jshard as js
from jshard.compile._program import program_key


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
