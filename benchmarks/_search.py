"""Tables 5-7: the strategy search (`jshard.parallelize(..., mode="auto")`) against the expert plans,
the two searches against each other, and the searches' planning time.

5. Quality, 8 devices: for each model, two memory budgets read from the expert plans' compiled
   programs (table 1): **fits** = the data-parallel plan's peak (data parallel fits), **tight** =
   midway between the smallest expert peak and data parallel's (data parallel does not fit). At
   each, the best expert plan that fits (fewest collective bytes) against the recursive search and
   the ILP: the searched plan compiled, its bytes and peak read by `jshard.audit`, its loss
   against one device. Target: bytes ≤ 1.05× the best fitting expert's, peak within the budget.
6. The gap between the two searches: their predicted seconds per step on the same cases.
7. Planning time: the recursive search on the unrolled GPT at growing depth and device count
   (abstract meshes), a GPT-3 175B-shaped step on 1024 devices (target ≤ 5 s), the ILP on a
   12-layer GPT-2-small-shaped step on 8 devices (target ≤ 60 s), and Alpa's GPT-39B on 64 GPUs
   (Alpa reported about 40 minutes of compilation for it).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import jshard as js
from benchmarks import _compiled, _zoo
from benchmarks._compiled import EXPERT_SLACK, Figures, error_line, loss_check
from benchmarks._models import Workload, model_table, workload
from benchmarks._table import Table, size, verdict
from jshard import models
from jshard.audit import MemoryFigures
from jshard.search import SearchReport
from tests.clients import loop_gpt, one_device

ZOO = ("linen_lm", "nnx_gqa", "eqx_vit", "linen_resnet")
"""The zoo's models (`benchmarks/_zoo.py`) searched under budgets besides loop_gpt (table 5)."""
ZOO_BATCH = {"linen_lm": (1,), "nnx_gqa": (1,), "eqx_vit": (2, 3), "linen_resnet": (1,)}
"""Which of each zoo step's arguments are the batch (the rest: its state, and linen_lm's dropout key)."""

SEARCHES = ("recursive", "ilp")
EXPERTS = ("data", "fsdp", "megatron", "2d")
GPT3_TARGET = 5.0
"""Seconds: the recursive search of the GPT-3-shaped step on 1024 devices (a 2-core machine)."""
ILP_TARGET = 60.0
"""Seconds: the ILP on the 12-layer GPT on 8 devices."""
ALPA_SECONDS = 40 * 60
"""Alpa's reported compilation time for GPT-39B on 64 GPUs (its paper's benchmark)."""


@dataclasses.dataclass(frozen=True)
class Searched:
    """One searched plan of one model at one budget, compiled and run one step.

    Attributes:
      model / budget_name / budget: which case (`fits` or `tight`, bytes per device).
      expert: the best expert plan that fits the budget: (name, collective bytes, peak), or None.
      search: `recursive` or `ilp`.
      audit: the compiled program's collectives and memory (None where it failed: see `error`).
      report: the plan's `SearchReport`.
      planning: seconds of `plan()` (trace, search, and with a budget the compiled memory check).
      loss / reference: its first step's loss and the single-device step's.
    """

    model: str
    budget_name: str
    budget: float
    expert: tuple[str, float, float] | None
    search: str
    audit: js.Audit | None = None
    report: SearchReport | None = None
    planning: float = 0.0
    loss: float = float("nan")
    reference: float = float("nan")
    error: str = ""

    @property
    def ratio(self) -> float | None:
        if self.audit is None or self.expert is None:
            return None
        return self.audit.bytes() / max(self.expert[1], 1.0)

    @property
    def meets(self) -> bool:
        ratio = self.ratio
        return (ratio is not None and ratio <= 1 + EXPERT_SLACK
                and self.audit.memory.peak_bytes <= self.budget)


def budgets(rows: Sequence[Figures]) -> dict[str, float]:
    """`fits` (the data-parallel plan's compiled peak) and `tight` (midway to the smallest expert
    peak) for one model, from its table-1 rows."""
    peaks = {r.plan: r.audit.memory.peak_bytes for r in rows if r.plan in EXPERTS and r.audit is not None}
    data = peaks["data"]
    return {"fits": float(data), "tight": (data + min(peaks.values())) / 2}


def measure_quality(w: Workload, rows: Sequence[Figures], devices: int, time_limit: float,
                    searches: Sequence[str] = SEARCHES) -> list[Searched]:
    """Both searches at both budgets for `w`; `rows` are its table-1 figures (the experts)."""
    reference = next(r.reference for r in rows)
    experts = [(r.plan, r.audit.bytes(), r.audit.memory.peak_bytes) for r in rows
               if r.plan in EXPERTS and r.audit is not None and r.loss_ok]
    out = []
    for name, budget in budgets(rows).items():
        fitting = [e for e in experts if e[2] <= budget]
        best = min(fitting, key=lambda e: e[1]) if fitting else None
        for how in searches:
            case = Searched(w.name, name, budget, best, how, reference=reference)
            out.append(_searched(case, w, devices, time_limit))
    return out


def quality_tables(settings, devices: int) -> list[Table]:
    """Tables 5 and 6 alone (`python -m benchmarks --only search`): the expert plans of
    `settings.search_models` compiled again for their budgets, then both searches."""
    cases = []
    for model in model_table():
        if model.name in settings.search_models:
            w = workload(model, settings.size)
            rows = _compiled.measure(w, devices, EXPERTS)
            cases += measure_quality(w, rows, devices, settings.search_time_limit)
    if "loop_gpt" in settings.search_models:
        cases += loop_gpt_quality(devices, settings.search_time_limit)
    for name in ZOO:
        if name in settings.search_models:
            cases += zoo_quality(name, settings.search_time_limit)
    return [quality_table(cases, devices), gap_table(cases)]


def _searched(case: Searched, w: Workload, devices: int, time_limit: float) -> Searched:
    return _searched_step(case, w.step(None), w.args(), 2, devices, time_limit)


def _searched_step(case: Searched, fn, args: tuple, loss_at: int, devices: int | None, time_limit: float,
                   **options) -> Searched:
    """`case` planned, compiled and run one step: `fn(*args)` returns its loss at `loss_at`; `options`:
    more `jshard.parallelize` options (the zoo's batch arguments)."""
    try:
        step = js.parallelize(fn, devices=devices, mode="auto", search=js.Search(case.search, memory_budget=case.budget, time_limit=time_limit),
                              **options)
        start = time.perf_counter()
        plan = step.plan(*args)
        planning = time.perf_counter() - start
        compiled = step.lower(*args).compile()
        loss = float(compiled(*jax.device_put(args, compiled.input_shardings[0]))[loss_at])
    except Exception as e:  # a search that fails is a row of the report, not the end of the run
        return dataclasses.replace(case, error=error_line(e))
    return dataclasses.replace(case, audit=js.audit(compiled), report=plan.search, planning=planning, loss=loss)


def loop_gpt_quality(devices: int, time_limit: float, searches: Sequence[str] = SEARCHES) -> list[Searched]:
    """Both searches on the zoo's GPT written by someone else (`tests/clients/loop_gpt.py`, 2 layers, d
    256, ff 1024, vocab 2048: its weights dominate, as issue 15's case), its `shard` tuples kept as the
    anchors, against its own experts under a plain `jax.jit`: `data` (parameters replicated, the
    tokens cut 8 ways) and `megatron` (`loop_gpt.expert_shardings`). Budgets: `fits` = the
    data-parallel plan's compiled peak, `least` = the smallest expert's (Megatron's)."""
    params, tokens = loop_gpt.create(layers=2, d=256, ff=1024, vocab=2048)
    mesh = loop_gpt.make_mesh(jax.devices()[:devices])
    megatron, batch = loop_gpt.expert_shardings(mesh, params)
    whole = jax.tree.map(lambda _: NamedSharding(mesh, P()), megatron)
    plans = {"data": (whole, NamedSharding(mesh, P(mesh.axis_names))), "megatron": (megatron, batch)}
    reference = float(one_device(loop_gpt.train_step, params, tokens)[1])
    experts = []
    for name, (shardings, rows) in plans.items():
        expert = jax.jit(loop_gpt.train_step, in_shardings=(shardings, rows), out_shardings=(shardings, None))
        found = js.audit(expert.lower(params, tokens).compile())
        experts.append((name, found.bytes(), found.memory.peak_bytes))
    return _at_budgets("loop_gpt", experts, searches, reference,
                       lambda case: _searched_step(case, loop_gpt.train_step, (params, tokens), 1, devices, time_limit))


def _at_budgets(model: str, experts: list, searches: Sequence[str], reference: float, run) -> list[Searched]:
    """`run(case)` for each search at two budgets: `fits` = the `data` expert's compiled peak,
    `least` = the smallest expert peak; each against the expert moving the fewest bytes within it
    (`experts`: `(name, bytes, peak)`)."""
    peaks = {name: peak for name, _, peak in experts}
    out = []
    for label, budget in {"fits": float(peaks["data"]), "least": float(min(peaks.values()))}.items():
        best = min((e for e in experts if e[2] <= budget), key=lambda e: e[1])
        out += [run(Searched(model, label, budget, best, how, reference=reference)) for how in searches]
    return out


def zoo_quality(name: str, time_limit: float, searches: Sequence[str] = SEARCHES) -> list[Searched]:
    """Both searches on the zoo model `name` (one of `ZOO`, at the zoo's size), its own anchors kept
    and its batch placed as its author places it, against its own experts under a plain `jax.jit`
    (the model's own constraints still hold inside the step): the author's plan (`_zoo`'s expert),
    `data` (the state whole, the batch as the author places it) and `fsdp` (each state array cut
    over the batch's mesh axes on its largest dim they divide, ZeRO-3 style; left out where the
    model's own typing rejects it: nnx_gqa's Explicit axes). Budgets: `fits` = data
    parallel's compiled peak, `least` = the smallest expert peak.

    Each search is given the arguments placed as the expert it is held to places them (the same
    anchors): `parallelize` keeps a committed argument's placement as an anchor, as `jax.jit`
    does, so given the author's placement of the state it cannot lay the state out whole as the
    data expert does (linen_lm at `fits`: 1.07x), and given the state whole it must find the
    author's layout alone (linen_lm at `least`: no plan fits)."""
    c = _zoo.case(name)
    args, options = c.args["given"], dict(c.options["given"])
    batch = ZOO_BATCH[name]
    leaf = jax.tree.leaves(args[batch[0]])[0]
    mesh, axes = leaf.sharding.mesh, leaf.sharding.spec[0]
    plans = {"data": lambda a: NamedSharding(mesh, P()), "fsdp": lambda a: NamedSharding(mesh, fsdp_spec(a, mesh, axes))}
    experts, inputs = [], {"author": args}
    with c.context():
        found = js.audit(c.expert())
        experts.append(("author", found.bytes(), found.memory.peak_bytes))
        for plan, sharding in plans.items():
            placed = tuple(a if i in batch else jax.tree.map(lambda x: jax.device_put(x, sharding(x)), a)
                           for i, a in enumerate(args))
            try:
                found = js.audit(jax.jit(c.step).lower(*placed).compile())
            except Exception:  # noqa: BLE001 -- a layout the model's own typing rejects is no expert of it
                continue
            experts.append((plan, found.bytes(), found.memory.peak_bytes))
            inputs[plan] = placed

    def run(case: Searched) -> Searched:
        with c.context():
            return _searched_step(case, c.step, inputs[case.expert[0]], -1, None, time_limit, **options)

    return _at_budgets(name, experts, searches, float(c.reference[-1]), run)


def fsdp_spec(x, mesh, axes) -> P:
    """`x` cut over the mesh `axes` (a name or a tuple of names) on its largest dim they divide, else whole."""
    n = math.prod(mesh.shape[a] for a in ((axes,) if isinstance(axes, str) else axes))
    dims = sorted((d for d in range(np.ndim(x)) if np.shape(x)[d] % n == 0), key=lambda d: -np.shape(x)[d])
    return P() if not dims else P(*(axes if d == dims[0] else None for d in range(np.ndim(x))))


def quality_table(cases: Sequence[Searched], devices: int) -> Table:
    cells = []
    for c in cases:
        expert = "none fits" if c.expert is None else f"{c.expert[0]}: {size(c.expert[1])}, peak {size(c.expert[2])}"
        if c.error:
            cells.append((c.model, f"{c.budget_name} {size(c.budget)}", expert, c.search, "-", "-", "-", "-", "-",
                          f"failed: {c.error}", "misses"))
            continue
        ratio = "-" if c.ratio is None else f"{c.ratio:.2f}x"
        cells.append((
            c.model, f"{c.budget_name} {size(c.budget)}", expert, c.search, size(c.audit.bytes()),
            _peak(c.audit.memory), ratio, f"{c.planning:.1f} s", f"{c.report.seconds * 1e6:.4g} us",
            loss_check(c.loss, c.reference), verdict(c.meets),
        ))
    return Table(
        f"5. Strategy search against the expert plans, {devices} devices",
        f"the searched plan's compiled collective bytes at most {1 + EXPERT_SLACK:.2f}x those of the best expert "
        "plan (data, fsdp, megatron, 2d) that fits the same memory budget, and its compiled peak within the budget, "
        "at two budgets per model.",
        ("model", "budget per device", "best expert that fits", "search", "bytes/step", "peak", "vs expert",
         "planning", "predicted", "loss vs 1 device", "target"),
        tuple(cells),
        (
            "`jshard.parallelize(step, devices=8, mode='auto', search=..., memory_budget=B)` on the unannotated "
            "train step (no `shard` calls, no `in_strategy`; the zoo's models keep their own anchors); bytes "
            "and peak read by `jshard.audit` from the compiled program, as in table 1 (peak = arguments + outputs "
            "+ temp - aliased, in device memory; `+ X host`: what the plan keeps in host memory, its offloaded "
            "state's arguments and results, off the device's peak).",
            "Budgets from table 1's expert rows: fits = the data-parallel plan's compiled peak; tight = midway "
            "between the smallest expert peak and data parallel's, so data parallel does not fit.",
            "loop_gpt: the zoo's GPT written by someone else (tests/clients/loop_gpt.py at 2 layers, d 256, ff 1024, "
            "vocab 2048) against its own experts under a plain `jax.jit`: data (parameters whole, tokens cut 8 ways) "
            "and megatron (`loop_gpt.expert_shardings`); fits = data's compiled peak, least = Megatron's own.",
            "linen_lm, nnx_gqa, eqx_vit, linen_resnet: the zoo's other models (table 15, at its sizes), their own "
            "anchors kept and the batch placed as their authors place it, against their own experts under a plain "
            "`jax.jit`: author (the author's plan), data (the state whole) and fsdp (each state array cut over the "
            "batch's mesh axes on its largest dim they divide; nnx_gqa's Explicit axes reject it); fits = data's "
            "compiled peak, least = the smallest expert peak. Their constraints hold inside every expert's step, and "
            "the search is given the arguments placed as the expert it is held to places them (a committed "
            "placement is an anchor to jshard, as to `jax.jit`): the same anchors.",
            "planning: `plan()`, including the trace and, with a budget, compiling the plan to check its memory "
            "(and searching again with a tighter estimate if XLA holds more). predicted: the search's own cost "
            "(alpha-beta collectives and compute, default GPU cost model).",
        ),
    )


def _peak(memory: MemoryFigures) -> str:
    """The device peak, and the host memory's bytes beside it where the plan keeps any there."""
    return size(memory.peak_bytes) + (f" + {size(memory.host_bytes)} host" if memory.host_bytes else "")


def gap_table(cases: Sequence[Searched]) -> Table:
    """The recursive search's predicted cost against the ILP's on the same (model, budget)."""
    by = {(c.model, c.budget_name, c.search): c for c in cases if not c.error}
    cells = []
    for c in cases:
        if c.search != "recursive" or c.error:
            continue
        other = by.get((c.model, c.budget_name, "ilp"))
        if other is None:
            continue
        rec, ilp = c.report.seconds, other.report.seconds
        cells.append((c.model, c.budget_name, f"{rec * 1e6:.4g} us", f"{ilp * 1e6:.4g} us ({other.report.status})",
                      f"{(rec - ilp) / ilp:+.1%}", size(c.audit.bytes()), size(other.audit.bytes()),
                      f"{c.report.planning_seconds:.1f} s", f"{other.report.planning_seconds:.1f} s"))
    return Table(
        "6. The two searches against each other",
        "",
        ("model", "budget", "recursive predicted", "ILP predicted", "gap", "recursive bytes", "ILP bytes",
         "recursive search", "ILP search"),
        tuple(cells),
        (
            "From table 5's cases. gap: (recursive - ILP) / ILP of the predicted seconds per step; the ILP is exact "
            "over a 2-D logical mesh (both 2-group splits of the 3 axes) unless its status says it hit the time limit. "
            "search: the search itself (`SearchReport.planning_seconds`), last round.",
        ),
    )


# -- planning time ----------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Shape:
    """A GPT train step to plan on shapes only."""

    name: str
    config: models.GPTConfig
    batch: int

    def args(self):
        params = jax.eval_shape(lambda: models.init_gpt(self.config, jax.random.key(0)))
        opt_state = jax.eval_shape(optax.adam(1e-3).init, params)
        tokens = jax.ShapeDtypeStruct((self.batch, self.config.seq_len), np.int32)
        mask = jax.ShapeDtypeStruct((self.batch, self.config.seq_len), np.float32)
        return params, opt_state, (tokens, tokens, mask)

    def step(self):
        cfg = self.config
        return models.make_train_step(lambda p, b: models.gpt_loss(p, b, cfg), optax.adam(1e-3))

    def describe(self) -> str:
        n = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(self.args()[0]))
        cfg = self.config
        return (f"{self.name}: {n / 1e9:.3g}B parameters ({cfg.n_layers} layers{' scanned' if cfg.scan else ''}, "
                f"d_model {cfg.d_model}, seq {cfg.seq_len}, batch {self.batch})")


GPT3 = Shape("GPT-3 175B", models.GPTConfig(vocab=50257, seq_len=2048, d_model=12288, n_heads=96, n_layers=96,
                                           d_ff=49152, scan=True), 1536)
GPT2_12 = Shape("GPT-2 small", models.GPTConfig(vocab=50257, seq_len=1024, d_model=768, n_heads=12, n_layers=12,
                                               d_ff=3072, scan=True), 8)
ALPA_39B = Shape("GPT-39B (Alpa)", models.GPTConfig(vocab=51200, seq_len=1024, d_model=8192, n_heads=64,
                                                   n_layers=48, d_ff=32768, scan=True), 1024)


def _plan(shape: Shape, devices: int, how: str, time_limit: float) -> tuple[float, float, js.Plan | None, str]:
    """(wall seconds, this process's CPU seconds, the plan or None, why not) of one `plan()` and the
    reading of its operator records (`Plan.ops`, made when first read: what `summary()` shows)."""
    step = js.parallelize(shape.step(), devices=devices, mode="auto", search=js.Search(how, time_limit=time_limit))
    args = shape.args()
    start, cpu = time.perf_counter(), time.process_time()
    try:
        plan = step.plan(*args)
        len(plan.ops)
    except Exception as e:  # a failed plan is a row, not the end of the run
        return time.perf_counter() - start, time.process_time() - cpu, None, error_line(e)
    return time.perf_counter() - start, time.process_time() - cpu, plan, ""


def planning_rows(depths: Sequence[int], counts: Sequence[int], big: bool, time_limit: float) -> list[tuple]:
    """One row per plan: the unrolled GPT at each depth on each device count, then (`big`) the GPT-3,
    12-layer GPT and Alpa GPT-39B shapes."""
    rows = []
    small = dict(vocab=64, seq_len=16, d_model=64, n_heads=8, d_ff=256, scan=False)
    for layers in depths:
        shape = Shape("GPT unrolled", models.GPTConfig(n_layers=layers, **small), 64)
        for devices in counts:
            rows.append(_row(f"{shape.name}, {layers} layers", shape, devices, "recursive", time_limit, None))
    if big:
        rows.append(_row(GPT3.describe(), GPT3, 1024, "recursive", time_limit, GPT3_TARGET))
        rows.append(_row(GPT2_12.describe(), GPT2_12, 8, "ilp", ILP_TARGET, ILP_TARGET))
        rows.append(_row(GPT2_12.describe(), GPT2_12, 8, "recursive", time_limit, None))
        rows.append(_row(ALPA_39B.describe(), ALPA_39B, 64, "recursive", time_limit, None))
        rows.append(_row(ALPA_39B.describe(), ALPA_39B, 64, "ilp", 2 * ILP_TARGET, None))
    return rows


def _row(case: str, shape: Shape, devices: int, how: str, time_limit: float, target: float | None) -> tuple:
    took, cpu, plan, error = _plan(shape, devices, how, time_limit)
    if plan is None:
        return (case, str(devices), how, f"{took:.2f} s", f"{cpu:.2f} s", "-", "-", "-", "-", f"failed: {error}")
    s = plan.search
    judged = "-" if target is None else f"{verdict(took <= target)} (CPU: {verdict(cpu <= target)})"
    return (case, str(devices), how, f"{took:.2f} s", f"{cpu:.2f} s", f"{s.planning_seconds:.2f} s", f"{s.units:,}",
            f"{s.seconds:.4g} s ({s.status})", size(s.peak_bytes), judged)


def planning_table(rows: Sequence[tuple]) -> Table:
    return Table(
        "7. Strategy search: planning time",
        f"the recursive search of the GPT-3 175B-shaped train step for 1024 devices in at most {GPT3_TARGET:g} s; the "
        f"ILP on the 12-layer GPT for 8 devices in at most {ILP_TARGET:g} s (a 2-core machine).",
        ("case", "devices", "search", "plan", "plan CPU", "search alone", "decisions", "predicted per step",
         "estimated peak", "target"),
        tuple(rows),
        (
            "`Parallelized.plan(...)` of the Adam train step with no annotations (`mode='auto'`, no memory budget) on "
            "shapes only (`jax.eval_shape` parameters and optimizer state): an abstract mesh where there are more "
            "devices than the 8 simulated ones; nothing is compiled. plan: trace + search + the plan's operator "
            "records (`Plan.ops`, made when first read: read here, as `summary()` does), wall clock; plan CPU: this process's CPU time over the same call (the machine is shared: on a loaded one "
            "the wall clock is the CPU time plus waiting); search alone: the search's own wall time. The target "
            "is judged on both.",
            "decisions: the search's units (an operator's independent factor groups, and the free arguments); a "
            "scanned step's body is one set of units whatever its depth, an unrolled one grows with the layers.",
            f"Alpa (OSDI '22) reported about {ALPA_SECONDS // 60} minutes of compilation for GPT-39B on 64 GPUs, "
            "its inter- and intra-operator search with profiling of the stages on the GPUs; jshard's figure is the "
            "intra-operator search alone on one CPU process, without pipeline stages or profiling, and XLA's "
            "compile of the step comes on top of it.",
            "The GPT-3 plan has no memory budget (an abstract mesh of no named device kind): its estimated peak "
            "is far above a GPU's. Under an 80 GiB budget, with its blocks marked for recompute, see table 8.",
        ),
    )
