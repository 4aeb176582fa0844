"""`jshard demo` and `jshard plan`, run in-process on the suite's 8 simulated devices."""

import dataclasses
import io
import logging
import os
import pathlib
import re
import subprocess
import sys

import jax
import numpy as np
import pytest

import jshard as js
from jshard import models
from jshard._cli import main, search_progress
from jshard._examples import MODEL_NAMES, build, moe_shapes, resnet_shapes


def test_demo_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--devices", "--steps", "--preset", "data", "tensor", "2d"):
        assert option in out


def test_demo_trains_and_shows_the_plan(capsys):
    assert main(["demo", "--steps", "40", "--layers", "1", "--preset", "tensor"]) == 0
    out = capsys.readouterr().out
    assert "mesh (mp_0=2, mp_1=2, mp_2=2)" in out  # the preset Layout's axis mp, over three mesh axes
    assert "((1, 1, 1), (1, 8))" in out  # the column-parallel strategy, as a MindSpore tuple
    assert "all-reduce" in out and "memory per device" in out
    first, last = map(float, re.search(r"loss fell from ([\d.]+) to ([\d.]+)", out).groups())
    assert last < 0.5 * first


# `jshard plan`: the strategy search from the command line, on shapes only.

SMALL_GPT = ["--layers", "1", "--d-model", "32", "--heads", "4", "--d-ff", "64", "--seq-len", "8", "--vocab", "32",
             "--batch", "8"]
EXAMPLE = str(pathlib.Path(__file__).with_name("_cli_example.py"))


def test_plan_help_documents_targets_and_the_user_function_convention(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for text in ("gpt-scan", "MODULE:FUNCTION", "(fn, args)", "ShapeDtypeStruct", "--memory-budget", "--search",
                 "--d-model", "--heads", "--save", "--explain", "--time-limit", "abstract mesh"):
        assert text in out


def test_plan_gpt_with_the_recursive_search(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", "gpt", "--devices", "8", "--search", "recursive", *SMALL_GPT,
                 "--save", str(path), "--explain", "1"]) == 0
    out = capsys.readouterr().out
    assert "GPT train step (1 layers, d_model 32" in out and "batch 8" in out
    assert "Plan: 8 devices, mode=auto" in out and " searched" in out and "search=recursive" in out
    assert re.search(r"planned in [\d.]+ s", out)
    assert re.search(r"estimated peak memory per device: [\d.]+ \w+, no memory budget", out)  # CPU: none
    assert "predicted collectives per device per call:" in out
    assert "chosen by the strategy search" in out  # --explain 1
    assert js.Plan.load(str(path)).device_count == 8
    assert "searching" not in capsys.readouterr().err  # stderr is not a terminal: no progress line


def test_plan_with_and_without_the_replay_of_repeated_layers(capsys, tmp_path):
    """`--no-replay` (Search(replay=False)) weighs every operator of the 6 unrolled layers on its own;
    the default replays the interior ones and plans the same here."""
    six = [*SMALL_GPT[2:], "--layers", "6", "--devices", "8", "--quiet"]
    assert main(["plan", "gpt", *six, "--no-replay", "--save", str(tmp_path / "full.json")]) == 0
    assert main(["plan", "gpt", *six, "--save", str(tmp_path / "replayed.json")]) == 0
    full, replayed = (js.Plan.load(str(tmp_path / name)) for name in ("full.json", "replayed.json"))
    assert replayed.ops == full.ops and replayed.in_specs == full.in_specs
    assert "search=recursive" in capsys.readouterr().out


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plan_shows_the_search_progress_on_a_terminal(monkeypatch):
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(["plan", "gpt", "--devices", "8", *SMALL_GPT]) == 0
    lines = terminal.getvalue().split("\r")
    shown = [re.fullmatch(r"searching: level (\d) of 3 \(mesh axes (d\d)\), \d+ units(, memory weight \S+ s/byte "
                          r"\(run \d\))?\x1b\[K", line) for line in lines[1:-1]]
    levels = [("1", "d0"), ("2", "d1"), ("3", "d2")]
    # one line per level, in place; the run at a memory weight (`search/_recursive.solve`) shows its weight
    assert [m.groups()[:2] for m in shown] == levels * (len(shown) // 3) and len(shown) in (3, 6)
    assert all(m.group(3) is None for m in shown[:3]) and all(m.group(3) for m in shown[3:])
    assert lines[0] == "" and lines[-1] == "\x1b[K"  # ... erased once planned


@pytest.mark.parametrize("quiet", [False, True], ids=["shown", "quiet"])
def test_plan_progress_only_on_a_terminal_and_not_quiet(quiet):
    streams = {"terminal": _Terminal(), "file": io.StringIO()}
    for stream in streams.values():
        with search_progress(stream, quiet=quiet):
            logging.getLogger("jshard.search").info("searching: level 1 of 1")
    assert streams["file"].getvalue() == ""
    assert streams["terminal"].getvalue() == ("" if quiet else "\rsearching: level 1 of 1\x1b[K\r\x1b[K")


def test_plan_a_user_function_by_module_name(capsys, monkeypatch):
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).parent))
    assert main(["plan", "_cli_example:example", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    assert "mlp_step from _cli_example:example" in out
    assert "Plan: 8 devices, mode=auto" in out and "search=recursive" in out and "_cli_example.py:" in out


def test_plan_for_more_devices_than_present_uses_an_abstract_mesh(capsys):
    assert main(["plan", f"{EXAMPLE}:example", "--devices", "64", "--memory-budget", "16GiB"]) == 0
    out = capsys.readouterr().out
    assert "abstract mesh" in out and "Plan: 64 devices" in out
    assert "budget 16 GiB (fits)" in out


def test_plan_for_a_device_kind_holds_the_plan_to_its_memory(capsys):
    assert main(["plan", "mlp", "--devices", "64", "--device", "H100"]) == 0
    assert "budget 80 GiB (the memory of one H100, no memory_budget given) (fits)" in capsys.readouterr().out


def test_plan_for_a_cluster_with_no_budget_is_held_to_a_default_devices_memory(capsys):
    # was: no memory budget, and a plan holding 137B parameters' Adam state in 128 GiB per device printed as a result
    big = ["--layers", "3", "--d-in", "262144", "--d-hidden", "262144", "--quiet"]
    assert main(["plan", "mlp", "--devices", "16", *big]) == 1
    captured = capsys.readouterr()
    assert "no --memory-budget or --device: planned for H100 devices, each holding 80 GiB" in captured.out
    assert "jshard plan: no plan" in captured.err and "memory_budget=80 GiB per device cannot be met" in captured.err
    assert "Plan:" not in captured.out  # nothing shown as a result
    assert main(["plan", "mlp", "--devices", "16", "--quiet"]) == 0  # a model that fits plans as before, held to it
    assert "budget 80 GiB (the memory of one H100, no memory_budget given) (fits)" in capsys.readouterr().out


def test_plan_with_a_budget_nothing_can_meet_exits_1(capsys):
    assert main(["plan", f"{EXAMPLE}:example", "--devices", "8", "--memory-budget", "1KiB"]) == 1
    captured = capsys.readouterr()
    assert "cannot be met" in captured.err and "Traceback" not in captured.err + captured.out


@pytest.mark.parametrize(
    "argv, message",
    [
        (["gtp"], "unknown target 'gtp': name a reference model (gpt, gpt-scan, mlp, resnet, moe)"),
        (["no_such_module_xyz:example"], "cannot import 'no_such_module_xyz'"),
        ([f"{EXAMPLE}:missing"], "has no attribute 'missing'"),
        ([f"{os.path.dirname(EXAMPLE)}{os.sep}conftest.txt:example"], "no such file"),
        ([f"{pathlib.Path(EXAMPLE).parent.parent / 'pyproject.toml'}:example"], "pyproject.toml: not a Python file"),
        ([f"{EXAMPLE}:not_a_pair"], "must return (fn, args) or (fn, args, options); it returned int"),
        (["mlp", "--heads", "4"], "--heads does not apply to mlp"),
        ([f"{EXAMPLE}:example", "--layers", "2"], "--layers size a reference model"),
        (["gpt", "--d-model", "30", "--heads", "4"], "--heads 4 must divide --d-model 30"),
        (["gpt", "--memory-budget", "lots"], "--memory-budget 'lots' is not a size"),
        (["gpt", "--device", "Z80"], "--device 'Z80' is no known device kind; the known kinds are H100, H200, A100, GH200."),
        (["gpt", "--mode", "semi_auto", "--search", "ilp"], "search='ilp' applies to the strategy search, mode='auto' (this call has mode='semi_auto')"),
    ],
)
def test_plan_bad_targets_exit_2(capsys, argv, message):
    assert main(["plan", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reference_targets_are_shapes_only(name):
    example = build(name, {}, None)
    leaves = jax.tree.leaves(example.args)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert example.options == {"donate_argnums": (0, 1)}
    jax.eval_shape(example.fn, *example.args)  # the step traces on them


def test_written_out_shapes_match_the_host_initialisers():
    """ResNet and MoE draw their weights with NumPy, so their shapes are written out: keep them in step."""
    shapes = lambda tree: jax.tree.map(lambda x: (np.shape(x), np.dtype(x.dtype)), tree)
    for config in (models.ResNetConfig(), models.ResNetConfig(image_size=16, channels=1, widths=(8, 16))):
        assert shapes(resnet_shapes(config)) == shapes(models.init_resnet(config, jax.random.key(0)))
    for config in (models.MoEConfig(), models.MoEConfig(n_layers=2, n_experts=2, d_ff=16)):
        assert shapes(moe_shapes(config)) == shapes(models.init_moe(config, jax.random.key(0)))


# First contact: --version, errors as one paragraph, a demo that fits the device count or says what would.


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"jshard {js.__version__} (jax {jax.__version__})"


def test_demo_on_a_device_count_no_preset_fits_names_the_options_that_would(capsys):
    assert main(["demo", "--devices", "6"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1  # one paragraph
    assert captured.err.startswith("jshard demo: error: the demo's GPT (d_model 64, d_ff 256, vocab 32) and a batch of "
                                   "16 do not split over 6 devices with any preset (--preset 2d: tensor parallel 3 does "
                                   "not divide d_model 64, d_ff 256, vocab 32;")
    assert captured.err.endswith("These options would run: --preset data --batch 18; --devices 4; --devices 8.\n")


def test_demo_without_a_preset_takes_the_first_that_fits(capsys):
    assert main(["demo", "--batch", "9", "--steps", "2", "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "preset tensor: data parallel 1 x tensor parallel 8 (2d does not fit 8 devices: data parallel 2 does not " \
           "divide the batch of 9)" in " ".join(out.split())


def test_a_sharding_error_is_one_paragraph_and_exit_1(capsys):
    assert main(["demo", "--devices", "4", "--steps", "1"]) == 1  # the suite's backend already has 8 devices
    captured = capsys.readouterr()
    assert captured.err.startswith("jshard demo: error: jshard.simulate_devices(4): JAX's backend has already started "
                                   "with 8 CPU device(s)")
    assert captured.err.count("\n") == 1 and "Traceback" not in captured.err


def test_an_unwritable_save_path_is_one_line(capsys, tmp_path):
    path = tmp_path / "missing" / "plan.json"
    assert main(["plan", "gpt", *SMALL_GPT, "--save", str(path)]) == 1
    assert capsys.readouterr().err == f"jshard plan: error: cannot write the plan to {path}: No such file or directory.\n"


def test_the_command_prints_no_traceback(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-m", "jshard", "demo", "--devices", "6"], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=120)
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.startswith("jshard demo: error: ") and run.stderr.count("\n") == 1, run.stderr


def test_plan_where_nothing_is_cut_says_so_beside_the_data_parallel_plan(capsys):
    assert main(["plan", "mlp"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the summary wraps at 120 columns
    assert ("nothing is cut: each of the 8 devices does 100% of the single-device work; the data-parallel plan would "
            "take ") in out
    assert "the cost model says the step is too small to cut" in out


def test_plan_over_its_budget_is_no_success(capsys, monkeypatch, tmp_path):
    """A search answer over the budget (the searches raise rather than return one; faked here) is
    printed as over, not saved, and exits 1."""
    parallelize = js.parallelize

    class Over:
        def __init__(self, fn, **options):
            self.inner = parallelize(fn, **options)

        def plan(self, *args):
            plan = self.inner.plan(*args)
            search = dataclasses.replace(plan.search, peak_bytes=2 * plan.search.budget,
                                         compiled_peak_bytes=2 * plan.search.budget)
            return dataclasses.replace(plan, search=search)

    monkeypatch.setattr(js, "parallelize", Over)
    path = tmp_path / "plan.json"
    assert main(["plan", "mlp", "--memory-budget", "1MiB", "--save", str(path)]) == 1
    captured = capsys.readouterr()
    out = " ".join(captured.out.split())
    assert "budget 1 MiB (over: the plan does not fit)" in out and "(fits)" not in out
    assert "estimated peak memory per device: 2 MiB, budget 1 MiB (over: the plan does not fit)" in out
    assert "no plan" in captured.err and "holds more than the budget of 1 MiB per device" in captured.err
    assert not path.exists()
