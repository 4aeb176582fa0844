"""Smoke test of the benchmark harness on the quick MLP: its rows, its numeric check, its report.

No timing is asserted: the figures are measured by `python -m benchmarks`, not here.
"""

import dataclasses
import re

import numpy as np
import pytest
from _tolerance import assert_close, step_terms, tolerance

from benchmarks import _abstract, _compiled, _llama, _report, _scale, _search
from benchmarks._models import model_table, workload
from benchmarks._plans import PLANS
from benchmarks._table import Table
from jshard.audit import MemoryFigures


def _mlp():
    return next(m for m in model_table() if m.name == "MLP")


@pytest.fixture(scope="module")
def mlp_rows():
    return _compiled.measure(workload(_mlp(), "quick"), 8)


def test_mlp_quick_rows_equal_one_device_and_render(tmp_path, mlp_rows):
    mlp = _mlp()
    rows = mlp_rows

    assert [(r.model, r.plan) for r in rows] == [("MLP", plan) for plan in PLANS]
    for r in rows:
        assert r.error == "" and r.audit is not None, r.error
        assert r.loss_ok, f"{r.plan}: loss {r.loss} vs one device {r.reference}"
        assert r.audit.memory.argument_bytes > 0
    ours = rows[PLANS.index("jshard")]
    assert ours.audit.bytes() > 0 and ours.predicted is not None and ours.predicted > 0
    assert all(r.predicted is None for r in rows if r.plan != "jshard")

    figures = _compiled.figures_table(rows, 8)
    targets = _compiled.targets_table(rows)
    assert [row[1] for row in figures.rows] == list(PLANS)
    assert len(targets.rows) == 1 and targets.rows[0][0] == "MLP"
    assert all(cell in ("meets", "misses") for cell in (targets.rows[0][3], targets.rows[0][6], targets.rows[0][9]))

    planned = _abstract.abstract_table([workload(mlp, "wide")], counts=(64,))
    assert len(planned.rows) == 1 and planned.rows[0][-1] == "planned"

    out = tmp_path / "BENCHMARKS.md"
    out.write_text(_report.document([figures, targets, planned], "python -m benchmarks --quick", 1.0, (0.5, 0.5)))
    text = out.read_text()
    assert "python -m benchmarks --quick" in text and "cores" in text and "jax " in text
    assert text.count("| MLP | ") == len(PLANS) + 2


def test_default_batch_table_holds_jshard_to_shardy_and_the_expert_with_the_batch_left_default():
    """Table 15b on the quick MLP: the step with no `in_strategy` compiles under both propagations and
    equals one device; its verdicts are computed, not written."""
    table = _compiled.default_batch_table([workload(_mlp(), "quick")], 8)
    (row,) = table.rows
    assert row[0] == "MLP" and not row[1].startswith("failed")
    assert row[3] in ("meets", "misses") and row[6] in ("meets", "misses")
    assert row[-1].endswith(" equal"), row[-1]


def test_gpu_section_renders_from_results_json(tmp_path):
    import json

    import jax.numpy as jnp

    from benchmarks import _gpu, _gpu_profile

    assert _gpu.gpu_section(tmp_path / "missing.json") == ""
    assert _gpu.dot_flops(lambda a, b: (a @ b).sum(), jnp.ones((4, 8)), jnp.ones((8, 2))) == {"float32 x float32": 128.0}
    program = {"step_ms": 80.0, "tokens_per_s": 102400.0, "model_tflops": 128.0, "mfu": 0.26, "first_call_s": 12.0,
               "loss_first_step": 10.5, "xla_flops_compiled": 9e11}
    run = {"dtype": "float32", "matmul_precision": "TF32", "peak_tflops": 494.7, "error": "",
           "dot_flops": {"float32 x float32": 1e13}, "programs": {"jshard": program, "jax.jit": {**program, "step_ms": 79.0}},
           "ratio": 80 / 79, "ratio_rounds": 1.01, "loss_rel_diff": 0.0, "loss_tolerance": 1e-3, "loss_ok": True,
           "breakdown_ms": {"forward": 26.0, "forward+backward": 75.0, "step": 79.0}, "peak_memory_bytes": 2**34}
    results = {"command": "python -m benchmarks._gpu --out x.json", "date": "2026-01-01 00:00 UTC",
               "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2", "jaxlib": "0.11.2", "jshard_commit": "abc1234",
               "config": {"vocab": 32768, "seq_len": 1024, "d_model": 1024, "n_heads": 16, "n_layers": 12, "d_ff": 4096,
                          "scan": False, "batch": 8},
               "params": 219203584, "flop_params": 184600576, "tokens_per_step": 8192, "model_flops_per_step": 1.031e13,
               "flops_formula": _gpu.FLOPS_FORMULA,
               "matmul": {"float32_default_rel_err": 3e-4, "float32_default": "TF32", "jax_default_matmul_precision": "None",
                          "ceiling_tflops_float32": 360.0, "ceiling_tflops_bfloat16": 700.0, "ceiling_size": 8192},
               "runs": [run]}
    path = tmp_path / "gpu_results.json"
    path.write_text(json.dumps(results))
    text = _gpu.gpu_section(path)
    assert text.startswith("## GPU: reference GPT train step (H100)")
    assert "| float32 (TF32) | base | jshard | 80.00 ms | - | 102,400 | 128.0 | 26.0% | 1.013 (rounds: 1.010) |" in text
    run.update(variant="offload", predicted={"cost_model": "H100", "compute_ms": 60.0, "comm_ms": 0.0, "flops": 6e13,
                                             "host_link_ms": 4.0, "step_ms": 64.0})
    path.write_text(json.dumps(results))
    text = _gpu.gpu_section(path)
    assert "| offload | jshard | 80.00 ms | 64.00 ms (1.25× measured/predicted) |" in text
    assert "| base | jax.jit | 79.00 ms | - |" in text  # the offload run's hand-written side is the base step
    assert "compute 60.00 ms (60.00 TFLOP), collectives 0.00 ms, host link 4.00 ms" in text
    assert "python -m benchmarks._gpu --out x.json" in text and "2026-01-01" in text and "jax 0.11.2" in text
    assert "6·N·T + 12·L·d·S·T" in text
    assert "where the step's kernels go" not in text  # no gpu_profile.json beside it
    profile = {"command": "python -m benchmarks._gpu_profile --out d", "device": "NVIDIA H100 80GB HBM3", "jax": "0.11.2",
               "attention": "cudnn", "fence_grads": False, "step_ms_unprofiled": 81.0,
               **_gpu_profile.summary({"nvjet_gemm_a": (100_000.0, 20), "loop_add_fusion": (30_000.0, 40),
                                       "cudnn_sdpa_fprop": (10_000.0, 2)}, steps=2)}
    assert profile["kernel_ms_per_step"] == 70.0 and profile["by_kind_ms"] == {"matmul": 50.0, "elementwise fusion": 15.0,
                                                                              "attention": 5.0}
    (tmp_path / "gpu_profile.json").write_text(json.dumps(profile))
    assert ("70.0 ms of kernels per step (81.0 ms unprofiled), by kind, ms: matmul 50.0, elementwise fusion 15.0, "
            "attention 5.0; largest kernel nvjet_gemm_a") in _gpu.gpu_section(path)


def test_gpu_profile_sums_the_device_kernels_of_a_chrome_trace():
    from benchmarks import _gpu_profile

    trace = {"traceEvents": [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/host:CPU"}},
        {"ph": "X", "pid": 1, "name": "fusion_12", "dur": 5.0}, {"ph": "X", "pid": 1, "name": "fusion_12", "dur": 7.0},
        {"ph": "X", "pid": 1, "name": "sm90_xmma_gemm_bf16", "dur": 20.0},
        {"ph": "X", "pid": 2, "name": "PjRtStreamExecutorLoadedExecutable::Execute", "dur": 99.0}]}
    assert _gpu_profile.kernels(trace, "/device:GPU") == {"fusion_12": (12.0, 2), "sm90_xmma_gemm_bf16": (20.0, 1)}
    assert [_gpu_profile.kind(n) for n in ("cudnn_generated_fort_native_sdpa", "input_reduce_fusion_2",
                                           "input_scatter_fusion", "memcpy128", "loop_add_fusion_12", "nccl")] == \
        ["attention", "reduction fusion", "scatter / gather", "copy / transpose", "elementwise fusion", "other"]


def test_search_rows_fit_their_budgets_and_render(mlp_rows):
    w = workload(_mlp(), "quick")
    cases = _search.measure_quality(w, mlp_rows, 8, time_limit=5.0, searches=("recursive",))
    budgets = _search.budgets(mlp_rows)
    data_peak = next(r.audit.memory.peak_bytes for r in mlp_rows if r.plan == "data")
    assert budgets["fits"] == data_peak and budgets["tight"] < data_peak
    assert [(c.budget_name, c.search) for c in cases] == [("fits", "recursive"), ("tight", "recursive")]
    for c in cases:
        assert c.error == "", c.error
        assert c.audit.memory.peak_bytes <= c.budget  # the compiled program fits
        assert_close(c.loss, c.reference, dtype=np.float32, terms=step_terms(w.params, w.batch, backward=False))
        assert c.expert is not None and c.expert[2] <= c.budget  # the expert it is held to fits too
    table = _search.quality_table(cases, 8)
    assert len(table.rows) == 2 and all(row[-1] in ("meets", "misses") for row in table.rows)

    rows = _search.planning_rows(depths=(2,), counts=(8,), big=False, time_limit=5.0)
    assert len(rows) == 1 and rows[0][2] == "recursive" and not rows[0][-1].startswith("failed")
    assert "7. Strategy search: planning time" in _search.planning_table(rows).markdown()


def test_search_peak_cell_is_the_device_peak_with_host_memory_beside_it():
    """Table 5's peak is the device's; what an offloading plan keeps in host memory shows beside it."""
    device = MemoryFigures(3 * 2**20, 2**20, 0, 0, 0)
    assert _search._peak(device) == "4.00 MiB"
    offloaded = dataclasses.replace(device, host_argument_bytes=2**20, host_output_bytes=2**20)
    assert _search._peak(offloaded) == "4.00 MiB + 2.00 MiB host"


def test_accumulation_rows_equal_the_full_batch_and_render():
    from benchmarks import _accumulation
    from jshard import models

    table = _accumulation.accumulation_table(models.GPTConfig(n_layers=1), ks=(1, 2))
    assert [row[:3] for row in table.rows] == [
        ("1", "64", "none (full batch)"), ("2", "32", "as the gradients"),
        ("1", "64", "none (full batch), optimizer=1"), ("2", "32", "as the gradients, optimizer=1"),
        ("2", "32", "cut, optimizer=1")]
    cfg = models.GPTConfig(n_layers=1)
    params, _, batches = _accumulation._problem(cfg)
    # the losses are at most log(vocab): cross-entropy from (near) uniform logits at the start
    tol = tolerance(np.float32(np.log(cfg.vocab)), terms=_accumulation.STEPS * step_terms(params, batches[0]))
    assert all(float(row[-1]) <= tol for row in table.rows)
    assert "## 11. Gradient accumulation" in table.markdown()


def test_only_sections_replace_their_tables_in_place_and_add_new_ones_before_the_gpu_section():
    old = "# jshard benchmarks\n\nhead\n\n## 8. Old\n\n| a |\n| --- |\n| 1 |\n\n## 9. Kept\n\ntext\n\n## GPU: H100\n\ngpu\n"
    new = [Table("8. Old", "", ("a",), (("2",),), ("how",)), Table("11. New", "", ("b",), (("3",),), ("why",))]
    text = _report.replace_sections(old, new, "Regenerated alone by `python -m benchmarks --only memory`")
    titles = [line for line in text.splitlines() if line.startswith("## ")]
    assert titles == ["## 8. Old", "## 9. Kept", "## 11. New", "## GPU: H100"]
    assert "| 2 |" in text and "| 1 |" not in text and "head" in text and "gpu" in text
    assert text.count("- Regenerated alone by `python -m benchmarks --only memory`") == 2


def test_search_rows_of_some_models_replace_theirs_and_keep_the_others():
    """`python -m benchmarks --only search --model NAME`: NAME's rows are new, the other models' stay,
    in table 5's model order, with the notes of the runs that made them."""
    columns = ("model", "budget", "bytes")
    old = Table("5. Search", "", columns, (("MLP", "fits", "1 KiB"), ("GPT scan", "fits", "9 KiB"),
                                           ("linen_lm", "fits", "3 KiB")), ("how",))
    text = _report.replace_sections("# jshard benchmarks\n", [old], "Regenerated alone by `first`")
    new = Table("5. Search", "", columns, (("GPT scan", "fits", "2 KiB"), ("GPT scan", "tight", "2 KiB")), ("how",))
    merged = _report.keep_other_rows(text, new, ("GPT scan",), ("MLP", "GPT scan", "linen_lm"))
    assert merged.rows == (("MLP", "fits", "1 KiB"), ("GPT scan", "fits", "2 KiB"), ("GPT scan", "tight", "2 KiB"),
                           ("linen_lm", "fits", "3 KiB"))
    assert merged.notes == ("how", "Regenerated alone by `first`")
    assert _report.keep_other_rows("", new, ("GPT scan",), ("GPT scan",)).rows == new.rows


def test_search_rows_keep_the_notes_of_runs_whose_rows_remain():
    """A `--model` run's note stays while a row it made does, and goes once each of its models has
    been searched again."""
    columns = ("model", "budget")
    rows = (("MLP", "fits"), ("GPT scan", "fits"), ("linen_lm", "fits"))
    notes = ("how", "Rows of MLP, GPT scan regenerated by `one`", "Rows of linen_lm regenerated by `two`")
    text = _report.replace_sections("# jshard benchmarks\n", [Table("5. Search", "", columns, rows, notes)],
                                    "Regenerated alone by `first`")
    order = ("MLP", "GPT scan", "linen_lm")
    again = _report.keep_other_rows(text, Table("5. Search", "", columns, (("GPT scan", "fits"),), ("how",)),
                                    ("GPT scan",), order)
    first = "Regenerated alone by `first`"
    assert again.notes == ("how", "Rows of MLP, GPT scan regenerated by `one`", "Rows of linen_lm regenerated by `two`",
                           first)
    both = _report.keep_other_rows(text, Table("5. Search", "", columns, (("MLP", "fits"), ("GPT scan", "fits")),
                                               ("how",)), ("MLP", "GPT scan"), order)
    assert both.notes == ("how", "Rows of linen_lm regenerated by `two`", first)


def test_predicted_section_plans_the_measured_step_from_shapes(tmp_path):
    import json

    from benchmarks import _predicted

    assert _predicted.predicted_section(tmp_path / "missing.json") == ""
    config = {"vocab": 64, "seq_len": 16, "d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "scan": False,
              "batch": 4}
    runs = [{"dtype": "bfloat16", "variant": v, "programs": {"jshard": {"step_ms": ms}}, "predicted": {"step_ms": 0.5}}
            for v, ms in (("base", 1.0), ("recompute", 1.2), ("offload", 1.5))]
    figures = _predicted.predict({"device": "NVIDIA H100 80GB HBM3", "config": config, "runs": runs})
    assert [r["variant"] for r in figures["runs"]] == ["base", "recompute"]  # offload's host link: not this section
    for r in figures["runs"]:
        assert r["comm_ms"] == 0.0 and r["step_ms"] == pytest.approx(r["compute_ms"])  # one device
        # the parts are priced on `jax.make_jaxpr`'s trace, the plan on its own (under its mesh): within 1%
        assert r["step_ms"] == pytest.approx(r["dots_ms"] + r["other_ms"], rel=1e-2)
        assert 0 < r["traffic_gb"] and r["unfused_other_gb"] > 0
    assert figures["runs"][1]["dots_ms"] > figures["runs"][0]["dots_ms"]  # the recomputed forward's dots
    path = tmp_path / "predicted_results.json"
    path.write_text(json.dumps(figures))
    text = _predicted.predicted_section(path)
    base = figures["runs"][0]
    assert text.startswith(_predicted.HEADING)
    assert (f"| bfloat16 | base | 1.0 ms | {base['step_ms']:.1f} ms | {base['step_ms']:.2f}× | 0.5 ms (0.50×) |"
            in text)


def test_scale_table_plans_jshard_and_the_published_configurations_beside_their_sources():
    """Table 20 at a tiny size on 16 abstract devices: jshard's auto plan and each published
    configuration jshard can express are planned (the Llama's 2048 tokens, past one attention tile,
    with the sequence cut the search weighs for its attention: context parallel), their degrees read
    back; the others name why not."""
    small = dict(vocab=64, d_model=32, n_heads=4, n_kv_heads=2, d_ff=64, n_layers=2)
    cases = (_scale.Case(_llama.Decoder(_scale.MIXTRAL.name, seq_len=16, n_experts=4, **small), lambda n: 2 * n, "2"),
             _scale.Case(_llama.Decoder(_scale.LLAMA_8B.name, seq_len=2048, **small), lambda n: n // 4, "1/4"))
    table = _scale.scale_table(cases, counts=(16,))
    mine = [r for r in table.rows if r[2] == "jshard auto"]
    assert [r[0] for r in mine] == [_scale.MIXTRAL.name, _scale.LLAMA_8B.name]
    for row in mine:
        assert row[-1] == "meets", row
        cuts = [int(part.split()[1]) for part in row[3].split(" · ")]
        assert all(16 % c == 0 for c in cuts), row[3]
    peers = [r for r in table.rows if r[2] != "jshard auto"]
    assert len(peers) == sum(p.model in (c.cfg.name for c in cases) for p in _scale.PUBLISHED)
    source, step = table.columns.index("status / source"), table.columns.index("predicted step")
    assert all(" @ " in r[source] for r in peers)  # every published row names its source's commit
    planned = [r for r in peers if "not planned" not in r[3]]
    assert len(planned) == sum(p.plan is not None and p.model in (c.cfg.name for c in cases) for p in _scale.PUBLISHED)
    llama = next(r for r in mine if r[0] == _scale.LLAMA_8B.name)
    cut = re.search(r"sequence (\d+) \(", llama[3])  # run context parallel, its form named
    assert cut and int(cut[1]) in (4, 8, 16), llama[3]  # the search's cut: at least the 4 that leaves no device idle
    assert f"sequence {cut[1]} chosen by the search of 1, " in llama[source], llama
    assert all(r[step].endswith(" s") for r in planned)
    assert "## 20. Plans at scale" in table.markdown()


def test_scale_target_names_the_arguments_a_missing_plan_stores_otherwise():
    """Table 20's miss mark says by how much jshard's plan is slower than the published plan and
    which argument leaves it stores cut otherwise (cuts per dim, whatever the mesh axes' names)."""
    assert _scale._spec_cuts((("d0", "d1"), None, "d2"), {"d0": 2, "d1": 2, "d2": 2}) == (4, 1, 2)
    mine = _scale.Planned("-", 2.0, 1.0, None, 0.0, "", (("[0]['embed']", (2, 4)), ("[0]['head']", (8, 1))))
    theirs = _scale.Planned("-", 1.0, 1.0, None, 0.0, "", (("[0]['embed']", (1, 8)), ("[0]['head']", (8, 1))))
    assert _scale._target(mine, [theirs]) == (
        "🔴 misses (2.0000x the published plan's step: +1000000.0 us; stored otherwise: [0]['embed'] 2x4 vs 1x8)")
    assert _scale._target(theirs, [mine]) == "meets"


def test_plan_time_row_shows_the_seconds_to_a_refusal_and_judges_them():
    """Table 2b: a setting that ends in "no plan fits" shows the seconds the user waited for the
    refusal and their ratio to the jit compile, and the verdict reads that ratio too."""
    from benchmarks import _plan_time

    kept = _plan_time.KEPT
    rounds = [(2.0, 0.2, 0.4, 0.6, 8.0), (2.0, 0.2, 0.4, 0.6, 9.0)]
    timing = _plan_time.Timing("m", rounds, failed={kept: "no plan fits 1.00 KiB"})
    row = _plan_time._row(timing)
    assert row[2 + 2 * kept] == "8.50 s: no plan fits 1.00 KiB" and row[3 + 2 * kept] == "4.25"
    assert row[-3:] == ("-", "-", "misses")
    quick = _plan_time.Timing("m", [(2.0, 0.2, 0.4, 0.6, 1.0)], failed={kept: "no plan fits 1.00 KiB"})
    assert _plan_time._row(quick)[-1] == "meets"
