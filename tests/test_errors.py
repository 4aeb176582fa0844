"""Every error a user can act on: its type, and a message naming the call, operator, shape, strategy,
device count and fix."""

import os
import pathlib
import re
import subprocess
import sys
import traceback

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, PartitionSpec

import jshard as js
from jshard.layouts import FineMesh

LAY = js.Layout((2, 2, 2), ("dp", "sp", "mp"))


def parts(*texts: str) -> str:
    """A regex matching `texts` literally, in order, anything between them."""
    return "(?s)" + ".*".join(map(re.escape, texts))


def plan_matmul(strategy, x_shape, w_shape, devices=8):
    """Plans (traces, no compile) a function whose one operator is `shard(jnp.matmul, strategy)`."""

    def step(x, w):
        return js.shard(jnp.matmul, strategy)(x, w)

    return js.parallelize(step, devices=devices).plan(jnp.zeros(x_shape), jnp.zeros(w_shape))


# --- Strategy tuples on an operator -------------------------------------------------------------


@pytest.mark.parametrize(
    "strategy, matrix, used",
    [(((3, 1), (1, 1)), [3, 1, 1], 3), (((2, 3), (3, 1)), [2, 3, 1], 6)],
    ids=["3-on-8", "6-on-8"],
)
def test_device_matrix_not_dividing_device_count(strategy, matrix, used):
    with pytest.raises(js.ShardingError, match=parts(
        "jshard.shard(matmul): in_strategy=", str(strategy), "gives matmul at test_errors.py:",
        f"the device matrix {matrix} ({used} devices), but {used} does not divide the device count 8",
        "divisor of 8 (1, 2, 4, 8)",
    )):
        plan_matmul(strategy, (12, 12), (12, 12))


def test_device_matrix_over_more_devices_than_the_program_has():
    with pytest.raises(js.ShardingError, match=parts(
        "jshard.shard(matmul): in_strategy=((4, 2), (2, 2)) gives matmul at test_errors.py:",
        "the device matrix [4, 2, 2] (16 devices), but the program has 8 device(s). On a laptop or any CPU, call "
        "jshard.simulate_devices(16) first thing", "or pass jshard.parallelize(..., devices=16) or a mesh of 16 devices",
    )):
        plan_matmul(((4, 2), (2, 2)), (12, 12), (12, 12))


SIMULATE_FORGOTTEN = """
import jax.numpy as jnp, numpy as np
import jshard as js
step = js.parallelize(lambda x, w: js.shard(jnp.matmul, ((2, 1), (1, 4)))(x, w))
step(np.ones((8, 16), np.float32), np.ones((16, 32), np.float32))
"""


def test_simulate_devices_forgotten_on_a_one_device_machine(tmp_path):
    # was: "... does not divide the device count 1. Choose strategies whose device matrix multiplies to a divisor of 1"
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_NUM_CPU_DEVICES")}
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(pathlib.Path(js.__file__).parent.parent))
    (tmp_path / "laptop.py").write_text(SIMULATE_FORGOTTEN)
    done = subprocess.run([sys.executable, "laptop.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert re.search(parts("jshard.ShardingError: jshard.shard(matmul)", "but the program has 1 device(s)",
                           "call jshard.simulate_devices(8) first thing"), done.stderr), done.stderr[-2000:]


def test_cut_not_dividing_a_dim():
    with pytest.raises(js.ShardingError, match=parts(
        "jshard.shard(matmul): in_strategy[1]=(1, 4) cuts dim 1 of f32[784,62] into 4, but 4 does not "
        "divide 62. Pad the dim or choose a divisor of 62 (1, 2, 31, 62).",
    )):
        plan_matmul(((1, 1), (1, 4)), (8, 784), (784, 62))


def test_cut_not_dividing_lists_at_most_twelve_divisors():
    def step(x):
        return js.shard(jnp.tanh, ((8, 1),))(x)

    with pytest.raises(js.ShardingError, match=parts(
        "jshard.shard(tanh): in_strategy[0]=(8, 1) cuts dim 0 of f32[180,8] into 8, but 8 does not divide 180",
        "(1, 2, 3, 4, 5, 6, 9, 10, 12, 15, 18, 20, ...)",
    )):
        js.parallelize(step, devices=8).plan(jnp.zeros((180, 8)))


@pytest.mark.parametrize(
    "strategy, message",
    [
        (((2, 2), (1, 4)), ("contracts dim 1 of in_strategy[0]=(2, 2) with dim 0 of in_strategy[1]=(1, 4)",
                            "(2 vs 1)", "as in MatMul's ((a, b), (b, c)): e.g. in_strategy[1]=(2, 4)")),
        (((2, 1), (2, 4)), ("contracts dim 1 of in_strategy[0]=(2, 1) with dim 0 of in_strategy[1]=(2, 4)",
                            "(1 vs 2)", "e.g. in_strategy[1]=(1, 4)")),
    ],
    ids=["((2,2),(1,4))", "((2,1),(2,4))"],
)
def test_contracted_dims_disagree(strategy, message):
    with pytest.raises(js.ShardingError, match=parts("jshard.shard(matmul): matmul at test_errors.py:", *message)):
        plan_matmul(strategy, (8, 8), (8, 8))


def test_batch_dims_disagree():
    def step(a, b):
        return js.shard(lambda a, b: jnp.einsum("bij,bjk->bik", a, b), ((2, 1, 1), (4, 1, 1)))(a, b)

    with pytest.raises(js.ShardingError, match=parts(
        "batches dim 0 of in_strategy[0]=(2, 1, 1) with dim 0 of in_strategy[1]=(4, 1, 1)",
        "Batch dims must be cut alike",
    )):
        js.parallelize(step, devices=8).plan(jnp.zeros((8, 4, 4)), jnp.zeros((8, 4, 4)))


@pytest.mark.parametrize(
    "strategy, which, entries",
    [(((2, 1, 1), (1, 4)), 0, "(2, 1, 1) has 3"), (((2, 1), (4,)), 1, "(4,) has 1")],
    ids=["lhs-rank-3", "rhs-rank-1"],
)
def test_wrong_rank(strategy, which, entries):
    with pytest.raises(js.ShardingError, match=parts(
        f"jshard.shard(matmul): in_strategy[{which}]={entries} entries, but the tensor it cuts (matmul at "
        "test_errors.py:", ") is f32[8,8] with 2 dims. Give one entry per dim.",
    )):
        plan_matmul(strategy, (8, 8), (8, 8))


@pytest.mark.parametrize("strategy", [((2, 1),), ((2, 1), (1, 4), (1, 1))], ids=["1-entry", "3-entries"])
def test_wrong_number_of_inputs(strategy):
    with pytest.raises(js.ShardingError, match=parts(
        f"jshard.shard(matmul): in_strategy has {len(strategy)} entries but matmul at test_errors.py:",
        "was called with 2 positional inputs (f32[8,8], f32[8,8]). Give one entry per input",
    )):
        plan_matmul(strategy, (8, 8), (8, 8))


@pytest.mark.parametrize(
    "strategy, what, entry",
    [(((0, 1), (1, 4)), "in_strategy[0]=(0, 1)", 0), (((2, 1), (1, -4)), "in_strategy[1]=(1, -4)", -4)],
    ids=["zero", "negative"],
)
def test_non_positive_entries(strategy, what, entry):
    # Checked where the strategy is given, before any trace.
    with pytest.raises(js.ShardingError, match=parts(
        f"jshard.shard(matmul): {what} has entry {entry}; every entry is the number of slices",
        "must be a positive int (1 leaves the dim whole)",
    )):
        js.shard(jnp.matmul, strategy)


@pytest.mark.parametrize(
    "strategy, message",
    [
        ("ab", "in_strategy must be a tuple with one entry per tensor, e.g. in_strategy=((2, 1), (1, 4)); got 'ab'"),
        (("ab", (1, 4)), "in_strategy[0] must be a tuple of ints such as (2, 1), got 'ab'"),
        (((2.0, 1), (1, 4)), "in_strategy[0]=(2.0, 1) must hold only ints"),
        (((True, 1), (1, 4)), "in_strategy[0]=(True, 1) must hold only ints"),
        ((LAY, None), "in_strategy[0] is the Layout Layout((2, 2, 2), ('dp', 'sp', 'mp')) itself; call it"),
    ],
    ids=["string", "string-entry", "float", "bool", "layout-uncalled"],
)
def test_wrong_kinds_are_type_errors(strategy, message):
    with pytest.raises(TypeError, match=parts("jshard.shard(matmul): " + message)):
        js.shard(jnp.matmul, strategy)


def test_tuple_for_a_non_array_input():
    def step(p, x):
        return js.shard(lambda p, x: x @ p["w"], ((1, 4), (2, 1)))(p, x)

    with pytest.raises(TypeError, match=parts("in_strategy[0] is a tuple but input 0 is dict, not an array")):
        js.parallelize(step, devices=8).plan({"w": jnp.zeros((8, 8))}, jnp.zeros((8, 8)))


@pytest.mark.parametrize(
    "b_strategy, where, message",
    [
        (
            (1, 2),
            "<lambda> at test_errors.py:",
            "in_strategy[1]=(2, 4) and in_strategy[2]=(1, 2) cut dim 1 of i32[8,8] and dim 1 of i32[1,8], "
            "which line up from the right, differently (4 vs 2)",
        ),
        ((2, 4), "", "in_strategy[2]=(2, 4) cuts dim 0 of i32[1,8] into 2, but 2 does not divide 1"),
    ],
    ids=["cut-differently", "broadcast-dim-cut"],
)
def test_operands_that_line_up(b_strategy, where, message):
    def step(scale, a, b):
        return js.shard(lambda s, a, b: s * (a + b), (None, (2, 4), b_strategy))(scale, a, b)

    with pytest.raises(js.ShardingError, match=parts("jshard.shard(<lambda>): " + where, message)):
        js.parallelize(step, devices=8).plan(jnp.int32(2), jnp.zeros((8, 8), jnp.int32), jnp.zeros((1, 8), jnp.int32))


def test_out_strategy_count():
    def step(x):
        return js.shard(lambda a: (a, a * 2), ((2,),), out_strategy=((2,),))(x)

    with pytest.raises(js.ShardingError, match=parts(
        "out_strategy has 1 entries but <lambda> at test_errors.py:",
        "returned 2 arrays",
    )):
        js.parallelize(step, devices=8).plan(jnp.zeros(8))


# --- Layout -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dims, message",
    [
        (("xx", "dp"), "alias 'xx' is not one of ('dp', 'sp', 'mp') (or \"None\" for a whole dim)"),
        (("dp", ("sp", "dp")), "alias 'dp' is used twice; each alias cuts at most one dim"),
        ((("mp", "mp"),), "alias 'mp' is used twice"),
    ],
    ids=["unknown", "repeated", "repeated-in-one-dim"],
)
def test_layout_alias_errors(dims, message):
    with pytest.raises(js.ShardingError, match=parts("Layout((2, 2, 2), ('dp', 'sp', 'mp'))", message)):
        LAY(*dims)


@pytest.mark.parametrize(
    "matrix, names, error, message",
    [
        ((2, 0), ("a", "b"), js.ShardingError, "device_matrix=(2, 0) must hold positive ints"),
        ((2, 2), ("a",), js.ShardingError, "device_matrix=(2, 2) has 2 axes but alias_name=('a',) has 1 names"),
        ((2, 2), ("a", "a"), js.ShardingError, "alias_name=('a', 'a') must be distinct names"),
        ((2, 2), ("a", "None"), js.ShardingError, "alias_name=('a', 'None') must be distinct names, none of them"),
        ((2, 2), ("a", 3), TypeError, "alias_name=('a', 3) must hold strings"),
    ],
    ids=["zero-axis", "names-count", "duplicate-names", "None-name", "non-string"],
)
def test_layout_constructor_errors(matrix, names, error, message):
    with pytest.raises(error, match=parts("jshard.Layout: " + message)):
        js.Layout(matrix, names)


@pytest.mark.parametrize("matrix", [(2, 2), (2, 2, 2, 2)], ids=["4-on-8", "16-on-8"])
def test_layout_product_not_device_count(matrix):
    lay = js.Layout(matrix, tuple("abcd"[: len(matrix)]))

    def step(x):
        return js.shard(jnp.tanh, (lay("a", "b"),))(x)

    count = int(np.prod(matrix))
    with pytest.raises(js.ShardingError, match=parts(
        'jshard.shard(tanh): in_strategy[0]=("a", "b") comes from a Layout whose device matrix',
        f"{list(matrix)} holds {count} devices, but the program runs on 8",
        "A Layout's device matrix must multiply to the device count",
    )):
        js.parallelize(step, devices=8).plan(jnp.zeros((8, 8)))


# --- One mesh: strategies that cannot share a device order -------------------------------------------


def test_fine_mesh_conflict_direct():
    with pytest.raises(js.LayoutConflictError, match=parts(
        "jshard.parallelize: op A uses device matrix [3, 4] and op B uses [4, 3] on 12 devices",
        "no single device order (one JAX mesh) serves both", "jshard.Layout",
    )):
        FineMesh.refining(12, [(3, 4), (4, 3)], ["op A", "op B"])


def test_fine_mesh_conflict_unnamed():
    with pytest.raises(js.LayoutConflictError, match=parts(
        "strategy 0 uses device matrix [3, 4] and strategy 1 uses [2, 6]",
    )):
        FineMesh.refining(12, [(3, 4), (2, 6)])


def _two_matmuls(x, w):
    y = js.shard(jnp.matmul, ((2, 1), (1, 3)))(x, w)
    return js.shard(jnp.matmul, ((3, 1), (1, 2)))(y, w)


_FIRST_LINE = _two_matmuls.__code__.co_firstlineno + 1


def test_conflict_between_two_operators_on_6_devices():
    with pytest.raises(js.LayoutConflictError, match=parts(
        "jshard.parallelize(_two_matmuls): ",
        f"matmul at test_errors.py:{_FIRST_LINE} uses device matrix [2, 1, 3]",
        f"matmul at test_errors.py:{_FIRST_LINE + 1} uses [3, 1, 2] on 6 devices",
        "Give both a jshard.Layout over one device matrix",
    )):
        js.parallelize(_two_matmuls, devices=6).plan(jnp.zeros((6, 6)), jnp.zeros((6, 6)))


def test_conflict_between_boundary_and_operator():
    def step(x, w):
        return js.shard(jnp.matmul, ((3, 1), (1, 2)))(x, w)

    lay = js.Layout((2, 3), ("a", "b"))
    with pytest.raises(js.LayoutConflictError, match=parts(
        "in_strategy[0] uses device matrix [2, 3] and matmul at test_errors.py:", "uses [3, 1, 2] on 6 devices",
    )):
        js.parallelize(step, devices=6, in_strategy=(lay("a", "b"), None)).plan(jnp.zeros((6, 6)), jnp.zeros((6, 6)))


# --- Devices ------------------------------------------------------------------------------------


def test_simulate_devices_after_backend_started():
    assert len(js.simulate_devices(8)) == 8  # the same count is harmless
    with pytest.raises(js.DeviceCountError, match=parts(
        "jshard.simulate_devices(4): JAX's backend has already started with 8 CPU device(s)",
        "Call jshard.simulate_devices(4) before creating any array",
        "XLA_FLAGS=--xla_force_host_platform_device_count=4",
    )):
        js.simulate_devices(4)


@pytest.mark.parametrize("n", [0, -2, 2.0, True], ids=["zero", "negative", "float", "bool"])
def test_simulate_devices_wrong_kind(n):
    with pytest.raises(TypeError, match=parts("jshard.simulate_devices: n must be a positive int")):
        js.simulate_devices(n)


def test_more_devices_than_present():
    with pytest.raises(js.DeviceCountError, match=parts(
        "jshard.parallelize(step): devices=16, but only 8 device(s) are present (cpu)",
        "such a plan can be made (.plan) but not run", "jshard.simulate_devices(16)",
    )):
        def step(x):
            return x

        js.parallelize(step, devices=16)(jnp.zeros(16))


def test_devices_and_mesh_disagree():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))
    with pytest.raises(js.ShardingError, match=parts("devices=4 but mesh has 8 devices")):
        js.parallelize(lambda x: x, devices=4, mesh=mesh)


# --- parallelize configuration --------------------------------------------------------------------


def test_mode_unknown():
    with pytest.raises(js.ShardingError, match=parts("mode='autp' is not one of ('data', 'semi_auto', 'auto', 'manual')")):
        js.parallelize(lambda x: x, mode="autp")


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mode": "fast"}, "mode='fast' is not one of ('data', 'semi_auto', 'auto', 'manual')"),
        ({"mode": "manual"}, "mode='manual' takes PartitionSpecs over your mesh; pass mesh=... too"),
        ({"dataset_strategy": "shuffled"}, "dataset_strategy='shuffled' is not one of ('data_parallel', 'full_batch')"),
    ],
    ids=["unknown-mode", "manual-without-mesh", "unknown-dataset-strategy"],
)
def test_bad_configuration(kwargs, message):
    with pytest.raises(js.ShardingError, match=parts("jshard.parallelize(<lambda>): " + message)):
        js.parallelize(lambda x: x, **kwargs)


def test_parameter_plan_matching_nothing():
    def step(p, x):
        return js.shard(lambda p, x: x @ p["w"], (None, (2, 1)), parameter_plan={"kernel": (1, 4)})(p, x)

    with pytest.raises(js.ShardingError, match=parts(
        "jshard.shard(<lambda>): parameter_plan pattern 'kernel' matches no parameter of <lambda> at test_errors.py:",
        "Its parameters are: w. Fix the pattern",
    )):
        js.parallelize(step, devices=8).plan({"w": jnp.zeros((8, 8))}, jnp.zeros((8, 8)))


@pytest.mark.parametrize(
    "strategy, message",
    [
        ((1, 4), "parameter_plan['kernel']=(1, 4) cuts dim 1 of f32[16,6] into 4, but 4 does not divide 6"),
        ((1, 3), "parameter_plan['kernel']=(1, 3) gives parameter kernel the device matrix [1, 3] (3 devices)"),
        ((1, 2, 1), "parameter_plan['kernel']=(1, 2, 1) has 3 entries, but the tensor it cuts (parameter kernel) "
                    "is f32[16,6] with 2 dims"),
    ],
    ids=["not-dividing", "3-on-8", "wrong-rank"],
)
def test_parameter_plan_strategy_errors(strategy, message):
    def step(p, x):
        return js.shard(lambda p, x: x @ p["kernel"], (None, (2, 1)), parameter_plan={"kernel": strategy})(p, x)

    with pytest.raises(js.ShardingError, match=parts("jshard.shard(<lambda>): " + message)):
        js.parallelize(step, devices=8).plan({"kernel": jnp.zeros((16, 6))}, jnp.zeros((8, 16)))


def test_parameter_plan_wrong_kinds():
    with pytest.raises(TypeError, match=parts("parameter_plan must map path regexes to strategies")):
        js.shard(jnp.matmul, ((2, 1), (1, 4)), parameter_plan=[("kernel", (1, 4))])
    with pytest.raises(TypeError, match=parts("parameter_plan['kernel'] must be a tuple of ints", "got 'ab'")):
        js.shard(jnp.matmul, ((2, 1), (1, 4)), parameter_plan={"kernel": "ab"})


def test_layout_strategy_shown_with_its_aliases():
    def step(x, w):
        return js.shard(jnp.matmul, ((2, 1), (1, 4)), out_strategy=(LAY(("dp", "sp", "mp"), "None"),))(x, w)

    with pytest.raises(js.ShardingError, match=parts(
        'jshard.shard(matmul): out_strategy[0]=(("dp", "sp", "mp"), "None") cuts dim 0 of f32[4,8] into 8',
    )):
        js.parallelize(step, devices=8).plan(jnp.zeros((4, 16)), jnp.zeros((16, 8)))


@pytest.mark.parametrize(
    "in_strategy, message",
    [
        (({"w": (1, 4), "c": (4,)}, None), "in_strategy[0] is not a pytree prefix of the value it describes"),
        (([(1, 4), (4,)], None), "in_strategy[0] is not a pytree prefix of the value it describes"),
        (((1, 4),), "in_strategy has 1 entries but the function was called with 2 positional arguments"),
        (({"w": None, "b": (None,)}, None), "in_strategy[0]['b']=(None,) holds None for a dim; a strategy tuple takes "
                                             "an integer per dim (1: the dim whole). Write (1,), or None alone"),
    ],
    ids=["dict-keys", "list-for-dict", "too-few-entries", "none-for-a-dim"],
)
def test_in_strategy_not_a_prefix(in_strategy, message):
    params = {"w": jnp.zeros((8, 8)), "b": jnp.zeros(8)}
    with pytest.raises(js.ShardingError, match=parts("jshard.parallelize(<lambda>): " + message)):
        js.parallelize(lambda p, x: x, in_strategy=in_strategy).plan(params, jnp.zeros((8, 8)))


def test_lone_strategy_as_in_strategy_gets_a_hint():
    with pytest.raises(js.ShardingError, match=parts(
        "in_strategy=(2, 1) looks like one strategy; for one argument write in_strategy=((2, 1),)",
    )):
        js.parallelize(lambda x: x, in_strategy=(2, 1)).plan(jnp.zeros((8, 8)))


def test_boundary_strategy_errors_name_the_argument():
    params = {"w": jnp.zeros((8, 6))}
    with pytest.raises(js.ShardingError, match=parts(
        "jshard.parallelize(<lambda>): in_strategy[0]['w']=(1, 4) cuts dim 1 of f32[8,6] into 4,",
        "but 4 does not divide 6",
    )):
        js.parallelize(lambda p: p["w"], in_strategy=({"w": (1, 4)},)).plan(params)
    with pytest.raises(js.ShardingError, match=parts(
        "out_strategy[1]=(3,) gives the function boundary the device matrix [3] (3 devices), but 3 does not divide",
    )):
        js.parallelize(lambda x: (x, x), out_strategy=(None, (3,)), dataset_strategy="full_batch").plan(jnp.zeros(6))


def test_partition_spec_outside_manual_mode():
    with pytest.raises(js.ShardingError, match=parts(
        "in_strategy[0]=P('d0',) is a PartitionSpec; use a strategy tuple or a Layout",
    )):
        js.parallelize(lambda x: x, in_strategy=(PartitionSpec("d0"),)).plan(jnp.zeros(8))


def test_batch_not_divisible_by_device_count():
    with pytest.raises(js.ShardingError, match=parts(
        "dataset_strategy='data_parallel' cuts dim 0 of the batch input args[1]['x'] (shape [6, 4]) over 8 devices, "
        "but 8 does not divide 6", "dataset_strategy='full_batch'",
    )):
        js.parallelize(lambda w, b: b["x"] @ w, mode="data").plan(jnp.zeros((4, 4)), {"x": jnp.zeros((6, 4))})


def test_argument_constrained_two_ways():
    def step(x):
        a = js.shard(jnp.tanh, ((2, 1),))(x)
        b = js.shard(jnp.tanh, ((1, 2),))(x)
        return a + b

    with pytest.raises(js.ShardingError, match=parts(
        "one argument (float32[8,8]) is constrained two ways",
        "Configure one strategy",
    )):
        js.parallelize(step, devices=8).plan(jnp.zeros((8, 8)))


def test_manual_mode_shard_not_lining_up_with_the_mesh():
    mesh = Mesh(np.asarray(jax.devices()).reshape(2, 4), ("data", "model"))

    def step(w, x):
        return js.shard(jnp.matmul, ((2, 1), (1, 2)))(x, w)

    with pytest.raises(js.ShardingError, match=parts(
        "jshard.parallelize(step): matmul at test_errors.py:", "uses device matrix [2, 1, 2, 2], whose axes do not "
        "line up with the axes of your mesh {'data': 2, 'model': 4}", "Layout((2, 4), ('data', 'model'))",
    )):
        js.parallelize(step, mode="manual", mesh=mesh).plan(jnp.zeros((4, 4)), jnp.zeros((8, 4)))


def test_keyword_arguments_the_function_does_not_take_are_type_errors_as_under_jax_jit():
    def step(x):
        return x

    with pytest.raises(TypeError, match=parts("step() got an unexpected keyword argument 'y'")):
        js.parallelize(step).plan(jnp.zeros(8), y=jnp.zeros(8))


# --- Tracebacks: jshard's frames hidden, as JAX hides its own -----------------------------------

JSHARD_DIR = str(pathlib.Path(js.__file__).parent)


def _bad_matmul(x, w):
    return js.shard(jnp.matmul, ((2, 1), (1, 3)))(x, w)


def _load_a_cut_plan(tmp):
    (tmp / "plan.json").write_text("{")
    js.Plan.load(tmp / "plan.json")


RAISING = {
    "a call traced under parallelize": lambda tmp: js.parallelize(_bad_matmul, devices=8)(np.ones((8, 16)), np.ones((16, 64))),
    "parallelize's options": lambda tmp: js.parallelize(_bad_matmul, mode="sideways"),
    "Plan.load": _load_a_cut_plan,
    "checkpoint.restore": lambda tmp: js.checkpoint.restore(tmp, {}),  # js.checkpoint: imported on first use
}


@pytest.mark.parametrize("where", RAISING)
def test_tracebacks_show_the_users_frames_not_jshards(where, tmp_path):
    with pytest.raises(js.ShardingError) as info:
        RAISING[where](tmp_path)
    files = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
    assert files and all(f == __file__ for f in files), files  # this test's lines only: no jshard, no JAX
    assert "JAX has removed its internal frames" in info.value.__notes__[-1]
    assert type(info.value).__module__ == "jshard"  # printed as jshard.ShardingError


def test_traceback_filtering_off_keeps_every_frame(tmp_path):
    before = jax.config.jax_traceback_filtering
    jax.config.update("jax_traceback_filtering", "off")
    try:
        with pytest.raises(js.ShardingError) as info:
            RAISING["a call traced under parallelize"](tmp_path)
    finally:
        jax.config.update("jax_traceback_filtering", before)
    files = [frame.filename for frame in traceback.extract_tb(info.value.__traceback__)]
    assert any(f.startswith(JSHARD_DIR) for f in files)


@pytest.mark.parametrize("how", ["eagerly", "under jax.jit"])
def test_shard_outside_parallelize_warns_once_that_its_strategy_is_not_applied(how):
    # was: the plain function ran, unsharded, without a word
    mm = js.shard(jnp.matmul, ((2, 1), (1, 4)))
    run = mm if how == "eagerly" else jax.jit(lambda x, w: mm(x, w))
    with pytest.warns(js.ShardNotAppliedWarning, match=parts(
        "jshard.shard(matmul) at test_errors.py:", "ran outside jshard.parallelize (eagerly or under a plain jax.jit), "
        "so its strategy was not applied", "Call it inside the function you give jshard.parallelize",
        "warnings.simplefilter('ignore', jshard.ShardNotAppliedWarning)",
    )) as caught:
        run(jnp.ones((4, 8)), jnp.ones((8, 16)))
        run(jnp.ones((4, 8)), jnp.ones((8, 16)) * 2)
    assert len([w for w in caught if w.category is js.ShardNotAppliedWarning]) == 1
