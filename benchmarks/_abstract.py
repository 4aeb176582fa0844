"""Table 1c: jshard's plan on more devices than the machine has (an abstract mesh), planning only."""

from __future__ import annotations

from collections.abc import Sequence

from benchmarks._compiled import error_line
from benchmarks._models import Workload
from benchmarks._plans import parallelized
from benchmarks._table import Table, size
from benchmarks._timing import timed
from jshard import models

COUNTS = (64, 512)


def abstract_table(workloads: Sequence[Workload], counts: Sequence[int] = COUNTS) -> Table:
    """Plans each workload (abstract arguments) on each device count from the 2-D preset's anchors."""
    cells = []
    for devices in counts:
        preset = models.preset("2d", devices)
        where = f"{devices} (dp {preset.dp} x mp {preset.mp})"
        for w in workloads:
            step = parallelized(w, devices)
            try:
                took, plan = timed(lambda: step.plan(*w.abstract_args()))
            except Exception as e:  # a model this preset cannot cut so finely is a row, not the end of the run
                cells.append((w.name, where, "-", "-", "-", "-", f"failed: {error_line(e)}"))
                continue
            cells.append((w.name, where, f"{took:.2f} s", str(len(plan.ops)), size(plan.predicted_bytes()), f"{plan.coverage:.1%}", "planned"))
    return Table(
        "1c. Planning only, on an abstract mesh of more devices than exist",
        "",
        ("model", "devices", "plan time", "operators", "predicted bytes/step", "coverage", "status"),
        tuple(cells),
        (
            "The train step of each model's `wide` size (parameters as `jax.ShapeDtypeStruct`s; dims the 2-D preset "
            "cuts divisible by n/2) from the anchors of `preset('2d', n)`; nothing is compiled.",
        ),
    )
