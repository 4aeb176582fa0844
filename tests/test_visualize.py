"""What a new user reads: `jshard.visualize` (which device holds which slice, any rank), `Plan.slices`
(an operator's slices per rank), and a summary that fits 120 columns, points at the user's code and
shows as an HTML table in a notebook."""

import inspect
import io
import os
import re
import sys
import types
import xml.etree.ElementTree as ET

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rich.console
from clients import linen_dropout
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from jshard import models
from jshard._cli import main
from jshard._source import display_file, is_user_file
from jshard.models import _gpt as gpt_module

MESH = jax.make_mesh((2, 4), ("dp", "mp"))
CASES = {  # id: (shape, spec)
    "rank0": ((), P()),
    "rank1": ((16,), P("mp")),
    "rank2": ((8, 16), P("dp", "mp")),
    "rank2-replicated": ((8, 16), P(None, "dp")),
    "rank3": ((4, 2, 8), P("dp", None, "mp")),
    "rank4": ((2, 4, 2, 8), P("dp", "mp")),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_visualize_names_the_devices_jax_placed_each_slice_on(case):
    shape, spec = CASES[case]
    x = jax.device_put(jnp.arange(int(np.prod(shape)), dtype=jnp.float32).reshape(shape), NamedSharding(MESH, spec))
    v = js.visualize(x)
    placed = {}  # what JAX placed where, read from the array's own shards
    for shard in x.addressable_shards:
        bounds = tuple(s.indices(n)[:2] for s, n in zip(shard.index, shape))
        placed.setdefault(bounds, set()).add(shard.device.id)
    assert {b: set(d) for b, d in v.blocks} == placed
    text = str(v)
    assert text.splitlines()[0] == f"f32[{','.join(map(str, shape))}] sharded as NamedSharding({spec}, mesh (dp=2, mp=4))"
    leading = {b[: len(shape) - 2] for b in placed} if len(shape) > 2 else {()}
    assert len(v.grids()) == len(leading)  # one grid per block of the leading dims
    cells = sum(len(cells) for *_, cells in v.grids())
    assert cells == len(placed)
    svg = ET.fromstring(v._repr_svg_())
    rects = svg.findall("{http://www.w3.org/2000/svg}rect")
    assert len(rects) == cells and all(r.get("fill") != "white" for r in rects)
    labels = [t.text for t in svg.findall("{http://www.w3.org/2000/svg}text")]
    for devices in placed.values():
        assert _runs(sorted(devices)) in labels and _runs(sorted(devices)) in text


def _runs(devices):
    """The ranks as a grid cell writes them (consecutive ones as a range)."""
    out, start = [], devices[0]
    for a, b in zip(devices, devices[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(out)


def test_visualize_rank2_grid_reads_as_jax_draws_it():
    x = jax.device_put(jnp.zeros((8, 16)), NamedSharding(MESH, P("dp", "mp")))
    assert str(js.visualize(x)).splitlines()[1:] == [
        "┌─────┬─────┬─────┬──────┬───────┐",
        "│     │ 0:4 │ 4:8 │ 8:12 │ 12:16 │",
        "├─────┼─────┼─────┼──────┼───────┤",
        "│ 0:4 │  0  │  1  │  2   │   3   │",
        "├─────┼─────┼─────┼──────┼───────┤",
        "│ 4:8 │  4  │  5  │  6   │   7   │",
        "└─────┴─────┴─────┴──────┴───────┘",
    ]


def test_visualize_a_sharding_in_blocks_or_with_a_shape_and_bad_input():
    sharding = NamedSharding(MESH, P(None, ("dp", "mp")))
    blocks = js.visualize(sharding)
    assert blocks.shape == (1, 8) and blocks.in_blocks and "in blocks (no shape given): 1 × 8 blocks" in blocks.title
    assert [d for _, d in blocks.blocks] == [(i,) for i in range(8)]
    sized = js.visualize(sharding, shape=(4, 16))
    assert [b for b, _ in sized.blocks][:2] == [((0, 4), (0, 2)), ((0, 4), (2, 4))]
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    with pytest.raises(js.ShardingError, match=r"jshard.visualize\(SingleDeviceSharding\): a sharding other than a "
                       r"NamedSharding says nothing of the array's rank; pass its shape: "
                       r"jshard.visualize\(sharding, shape=x.shape\)"):
        js.visualize(single)
    assert [d for _, d in js.visualize(single, shape=(2, 2)).blocks] == [(0,)]
    with pytest.raises(TypeError, match="x must be a jax.Array, a jax.ShapeDtypeStruct with a sharding, or a "
                       "jax.sharding.Sharding, got ndarray"):
        js.visualize(np.zeros(3))


def _annotated(x, w):
    return js.shard(jnp.matmul, ((2, 1), (1, 4)))(jnp.tanh(x), w) + 1.0


def test_plan_slices_per_rank_match_the_compiled_placement(tmp_path):
    """MatMul ((2, 1), (1, 4)) on 8 devices: ranks 0-3 hold X's first row block, {0, 4} W's first
    column block (DESIGN.md); the table says so, and so do the compiled program's input shardings."""
    x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
    step = js.parallelize(_annotated, devices=8, in_strategy=((2, 1), None))
    plan = step.plan(x, w)
    dot = next(op for op in plan.ops if op.primitive == "dot_general")
    table = plan.slices(dot)
    assert table.headers == ("rank", "in[0] f32[8,16] (2, 1)", "in[1] f32[16,32] (1, 4)", "out[0] f32[8,32] (2, 4)")
    assert table.rows[0] == ("0", "0:4, :", ":, 0:8", "0:4, 0:8") and table.rows[4] == ("4", "4:8, :", ":, 0:8", "4:8, 0:8")
    compiled = step.lower(x, w).compile()
    for arg, column, shape in ((0, 1, x.shape), (1, 2, w.shape)):
        for device, index in compiled.input_shardings[0][arg].devices_indices_map(shape).items():
            want = ", ".join(":" if s.indices(n)[:2] == (0, n) else "{}:{}".format(*s.indices(n)[:2])
                             for s, n in zip(index, shape))
            assert table.rows[[int(r[0]) for r in table.rows].index(device.id)][column] == want
    assert plan.slices(dot.index) == table
    assert str(table).splitlines()[0].startswith(f"op #{dot.index} dot_general ((2, 1), (1, 4)) -> ((2, 4),) (user, ")
    assert "<table>" in table._repr_html_() and "0:4, 0:8" in table._repr_html_()
    tanh = next(op for op in plan.ops if op.primitive == "tanh")
    assert plan.slices(tanh).rows[5] == ("5", "4:8, :", "4:8, :")  # propagated: it makes the matmul's cut
    plan.save(tmp_path / "plan.json")  # a loaded plan has no mesh: ranks fill its fine mesh row-major
    assert js.Plan.load(tmp_path / "plan.json").slices(dot.index).rows == table.rows


@pytest.fixture(scope="module")
def gpt_plan():
    """The demo's plan: the reference GPT's Adam step with the 2-D preset, as `jshard demo` makes it."""
    cfg = models.GPTConfig(n_layers=2)
    params = models.init_gpt(cfg, jax.random.key(0))
    opt = optax.adam(3e-3)
    state = opt.init(params)
    batch = models.copy_task_batch(np.random.default_rng(0), cfg, 16)
    step = models.parallel_train_step(lambda p, b, pr: models.gpt_loss(p, b, cfg, pr), opt, params, state, batch,
                                      models.preset("2d", 8), models.GPT_RULES)
    return step.plan(params, state, batch)


@pytest.fixture(scope="module")
def linen_plan():
    state, batch = linen_dropout.create_state()
    return js.parallelize(linen_dropout.train_step, devices=8).plan(state, batch, jax.random.key(1))


LIBRARIES = ("site-packages", "dist-packages", f"{os.sep}optax{os.sep}", f"{os.sep}flax{os.sep}", f"{os.sep}jax{os.sep}",
             "ipykernel")


@pytest.mark.parametrize("which", ["gpt_plan", "linen_plan"])
def test_summary_fits_120_columns_and_points_at_the_users_code(which, request):
    plan = request.getfixturevalue(which)
    text = plan.summary()
    assert max(map(len, text.splitlines())) <= 120
    sources = {op.source for op in plan.ops if op.source}
    assert sources and not [s for s in sources if any(lib in s for lib in LIBRARIES)]
    home = "models" if which == "gpt_plan" else "linen_dropout.py"
    assert all(home in s for s in sources)
    coloured = io.StringIO()
    rich.console.Console(file=coloured, width=120, force_terminal=True).print(plan)  # rich.print(plan)
    assert "\x1b[" in coloured.getvalue() and "strategy" in coloured.getvalue()
    html = plan._repr_html_()
    assert html.count("<tr>") == 1 + len(re.findall(r"^\S.*\s(fwd|bwd)\s", text, re.M))  # a header, then the rows
    assert "<table>" in html and "<th style='text-align:left'>strategy</th>" in html


def test_the_strategy_column_says_what_a_group_does(gpt_plan):
    """A softmax line of many operators reads as the cuts of its results, not as one member's tuple."""
    softmax = next(i for i, line in enumerate(inspect.getsource(gpt_module).splitlines(), 1) if "jax.nn.softmax(" in line)
    rows = [line for line in gpt_plan.summary().splitlines() if re.match(rf"models/_gpt\.py:{softmax}:\d+\s+fwd", line)]
    assert any("results (2, 4, 1) ×26, (2, 4, 1, 1) ×20" in row and "46 propagated" in row for row in rows)
    narrow = gpt_plan.summary(width=80)
    assert max(map(len, narrow.splitlines())) <= 80


def test_user_frames_skip_installed_packages():
    venv = os.path.join(os.sep, "home", "u", ".venv", "lib", "python3.11")
    for library in ("optax/_src/alias.py", "flax/linen/linear.py", "jax/_src/numpy/lax_numpy.py"):
        assert not is_user_file(os.path.join(venv, "site-packages", *library.split("/")))
    assert not is_user_file(os.path.join(os.sep, "usr", "lib", "python3", "dist-packages", "numpy", "core.py"))
    assert is_user_file(__file__) and is_user_file(models.__file__)
    assert is_user_file(os.path.join(os.sep, "home", "u", "project", "train.py"))


def test_a_notebook_cell_is_named_as_ipython_names_it(monkeypatch):
    cells = {"/tmp/ipykernel_4242/1234567.py": 7}
    compiler = types.SimpleNamespace(format_code_name=lambda name: ("Cell", f"In[{cells[name]}]") if name in cells else None)
    shell = types.SimpleNamespace(compile=compiler)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert display_file("/tmp/ipykernel_4242/1234567.py") == "In[7]"
    assert display_file("/home/u/train.py") == "/home/u/train.py"


def test_demo_summary_fits_and_its_trailer_speaks_cli(capsys):
    assert main(["demo", "--steps", "2", "--layers", "1", "--preset", "tensor", "--summary-rows", "5"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^… \d+ more rows$", out, re.M) and "(the whole plan: jshard demo --summary-rows 0, with the same options)" in out
    assert "print(plan.summary())" not in out
    assert max(map(len, out.splitlines())) <= 120


def test_a_source_line_100_is_not_an_emoji_in_rich_output(tmp_path, monkeypatch):
    # was: rich read `model.py:100:` as the emoji code `:100:` and drew 💯 in the demo's table
    (tmp_path / "line100.py").write_text("\n" * 98 + "def step(w, x):\n    return (x @ w).sum()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import line100  # noqa: PLC0415

    plan = js.parallelize(line100.step, devices=8).plan(jnp.ones((4, 4)), jnp.ones((8, 4)))
    out = io.StringIO()
    console = rich.console.Console(file=out, width=160, color_system=None)  # rich's defaults: emoji and markup on
    console.print(plan)
    console.print(plan.slices(0))
    assert "line100.py:100:" in out.getvalue() and "💯" not in out.getvalue()
