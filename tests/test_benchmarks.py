"""Smoke test of the benchmark harness on the quick MLP: its rows, its numeric check, its report.

No timing is asserted: the figures are measured by `python -m benchmarks`, not here.
"""

from benchmarks import _abstract, _compiled, _report
from benchmarks._models import model_table, workload
from benchmarks._plans import PLANS


def _mlp():
    return next(m for m in model_table() if m.name == "MLP")


def test_mlp_quick_rows_equal_one_device_and_render(tmp_path):
    mlp = _mlp()
    rows = _compiled.measure(workload(mlp, "quick"), 8)

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
