"""jshard's predicted step time of the reference GPT against the step measured on a GPU.

`python -m benchmarks._predicted` plans the train step that `benchmarks._gpu` measured (the same
model, batch and dtype, read from `benchmarks/gpu_results.json`), on this machine's CPU with one
device and the cost model of the GPU it ran on (`CostModel.for_device`), from the arguments' shapes
alone (`jax.ShapeDtypeStruct`: the 1.9 B parameters are never made), and writes the predicted
figures to `benchmarks/predicted_results.json` and its section into BENCHMARKS.md
(`predicted_section`, which `python -m benchmarks` also reads).
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "predicted_results.json"
HEADING = "## Predicted against measured: the reference GPT on one GPU"


def predict(gpu: dict[str, Any]) -> dict[str, Any]:
    """Per variant of the GPU run `gpu` (base, recompute): the plan's predicted compute, collective
    and step time, and the step measured there."""
    import jax
    import numpy as np
    import optax

    import jshard
    from benchmarks._gpu import gpt_step
    from benchmarks._report import commit
    from jshard import models

    c = gpu["config"]
    cfg = models.GPTConfig(vocab=c["vocab"], seq_len=c["seq_len"], d_model=c["d_model"], n_heads=c["n_heads"],
                           n_layers=c["n_layers"], d_ff=c["d_ff"], scan=c["scan"],
                           fence_grads=c.get("fence_grads", False))
    kind = next(k for k in ("H100", "H200", "A100", "GH200") if k in gpu["device"])
    cost = jshard.CostModel.for_device(kind)
    shapes = lambda tree: jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)
    out: dict[str, Any] = {"device": kind, "jshard_commit": commit(),
                           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "runs": []}
    for run in gpu["runs"]:
        measured = run["programs"].get("jshard", {}).get("step_ms")
        if run.get("variant", "base") not in ("base", "recompute") or measured is None:
            continue
        dtype = run["dtype"]
        params = jax.eval_shape(lambda: jax.tree.map(lambda x: x.astype(dtype), models.init_gpt(cfg, jax.random.key(0))))
        opt = jax.eval_shape(optax.adam(1e-4).init, params)
        batch = shapes(models.copy_task_batch(np.random.default_rng(0), cfg, c["batch"]))
        recompute = run.get("variant") == "recompute"
        step = gpt_step(dataclasses.replace(cfg, recompute="full") if recompute else cfg)
        par = jshard.parallelize(step, devices=1, mode="data", donate_argnums=(0, 1), cost_model=cost)
        work = par.plan(params, opt, batch).work
        out["runs"].append({"dtype": dtype, "variant": run.get("variant", "base"), "measured_ms": measured,
                            "compute_ms": work.compute_seconds * 1e3, "comm_ms": work.comm_seconds * 1e3,
                            "step_ms": work.seconds * 1e3, "old_predicted_ms": run.get("predicted", {}).get("step_ms"),
                            **_parts(step, cost, params, opt, batch)})
    return out


def _parts(step, cost, *args) -> dict[str, float]:
    """The step's operators on one device: the dots' time and the other operators' (each at its
    roofline), the memory traffic after fusion (`OpTable.traffic`) and every operator's inputs and
    outputs counted apart (no fusion)."""
    import jax
    from jax.extend import core as jcore

    from jshard.cost import value_bytes
    from jshard.graph import flatten
    from jshard.rules import OpTable

    closed = jax.make_jaxpr(step)(*args)
    nodes = flatten(closed.jaxpr)
    table = OpTable(nodes)
    moved = table.traffic(closed.jaxpr.outvars)
    dots = other = unfused = 0.0
    for i, node in enumerate(nodes):
        f = table.factors.get(i)
        if f is None:
            continue
        t = node.weight * cost.compute_seconds(f.flops, moved.get(i, 0.0), i in table.matmul)
        if i in table.matmul:
            dots += t
        else:
            other += t
            ins, outs = table.vars[i]
            unfused += node.weight * sum(value_bytes(v) for v in (*ins, *outs) if isinstance(v, jcore.Var))
    return {"dots_ms": dots * 1e3, "other_ms": other * 1e3, "traffic_gb": sum(moved.values()) / 1e9,
            "unfused_other_gb": unfused / 1e9}


def predicted_section(path: Path = RESULTS) -> str:
    """The `BENCHMARKS.md` section for the predictions in `path`; "" when there are none."""
    path = Path(path)
    if not path.exists():
        return ""
    r = json.loads(path.read_text())
    lines = [HEADING, "",
             f"Not measured by `python -m benchmarks`: written by `python -m benchmarks._predicted` on {r['date']}, "
             f"jshard commit {r['jshard_commit']}, from the GPU run above (`benchmarks/gpu_results.json`). The same "
             f"train step planned on a CPU, one device, `CostModel.for_device('{r['device']}')`, from the arguments' "
             "shapes alone; predicted: `Plan.work.seconds` (each operator's roofline, `CostModel.compute_seconds`: "
             "dots at the measured matmul ceiling, the rest at the memory bandwidth on the bytes left after fusion; "
             "one device, so no collectives). before: the prediction recorded at the GPU run (every operator's "
             "FLOPs at the dense peak).", "",
             "| dtype | variant | measured | predicted | predicted / measured | before |",
             "| --- | --- | --- | --- | --- | --- |"]
    notes = []
    for run in r["runs"]:
        old = run.get("old_predicted_ms")
        before = f"{old:.1f} ms ({old / run['measured_ms']:.2f}×)" if old else "-"
        lines.append(f"| {run['dtype']} | {run['variant']} | {run['measured_ms']:.1f} ms | {run['step_ms']:.1f} ms | "
                     f"{run['step_ms'] / run['measured_ms']:.2f}× | {before} |")
        if "dots_ms" in run:
            notes.append(f"- {run['dtype']} {run['variant']}: dots {run['dots_ms']:.1f} ms, the other operators "
                         f"{run['other_ms']:.1f} ms; memory traffic after fusion {run['traffic_gb']:.0f} GB (the "
                         f"operators other than dots counted unfused, every input and output: "
                         f"{run['unfused_other_gb']:.0f} GB)")
    notes.append("- the rates are the measured ceilings of the GPU run (`DeviceKind`: the matmul rate of one "
                 "8192³ bf16 product, the bandwidth of one elementwise pass), not fitted to these steps; the "
                 "fusion rule is XLA's general one (docs: concepts/cost-model); what it leaves out (a dot's "
                 "efficiency by shape, XLA's own fusion choices, its scheduling) is the rest of the ratio")
    return "\n".join(lines + [""] + notes) + "\n"


def write_section(text: str, path: Path = REPO / "BENCHMARKS.md") -> None:
    """Puts `text` into BENCHMARKS.md in place of its section, or after the GPU section, or at the end."""
    doc = path.read_text()
    if HEADING in doc:
        head, rest = doc.split(HEADING, 1)
        tail = rest[rest.find("\n## "):] if "\n## " in rest else ""
        doc = head + text + tail if tail else head + text
    elif "\n## Faults" in doc:
        head, tail = doc.split("\n## Faults", 1)
        doc = head.rstrip("\n") + "\n\n" + text + "\n## Faults" + tail
    else:
        doc = doc.rstrip("\n") + "\n\n" + text
    path.write_text(doc.rstrip("\n") + "\n")


def main() -> int:
    from benchmarks import _gpu

    figures = predict(json.loads(_gpu.RESULTS.read_text()))
    RESULTS.write_text(json.dumps(figures, indent=1) + "\n")
    text = predicted_section()
    write_section(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
