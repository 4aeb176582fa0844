"""Table 2b: planning time against `jax.jit`'s compile of the same step, per model (issue 32 item 3).

For every reference model, zoo model and client model (`tests/clients/`), in one run and
interleaved (caches cleared before each, the order rotating): plain `jax.jit` tracing, lowering and
compiling the step as its author runs it, against jshard's trace + plan (`Parallelized.plan`, nothing
compiled but where a budget's compiled check compiles) in four settings: `mode="semi_auto"`
(propagation from the model's anchors), `mode="auto"` with no budget, `mode="auto"` on the H100's
cost model, whose memory is the default budget (`CostModel.for_device("H100")`: the search weighs
its seeds and the data-parallel plan under 80 GiB), and `mode="auto"` under a `memory_budget` that
binds (`TIGHT`). Target: each at most the `jax.jit` compile (ratio <= 1); under the tight budget
planning without the compile of the plan kept (`SearchReport.compile_seconds`: its executable is
what the calls run, the compile `jax.jit` makes too), the inclusive figure shown beside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import jax

import jshard as js
from benchmarks import _zoo
from benchmarks._models import model_table, workload
from benchmarks._plans import parallelized, same_shardings
from benchmarks._table import Table, size, verdict
from benchmarks._timing import interleaved
from jshard.cost import CostModel

TARGET = 1.0
"""jshard's trace + plan over `jax.jit`'s trace + lower + compile, at most."""
H100 = CostModel.for_device("H100")
TIGHT = 0.8
"""The binding budget's share of the unbudgeted search's estimated peak (`auto, tight`)."""
SETTINGS = ("semi_auto", "auto", "auto, H100", "auto, tight")
"""The planning settings timed, each against the same `jax.jit` compile (`_options`)."""


def _options(setting: str, peak: float) -> dict:
    """`parallelize`'s options of `setting`; `peak`: the unbudgeted search's estimated peak."""
    return {"semi_auto": {"mode": "semi_auto"}, "auto": {"mode": "auto"},
            "auto, H100": {"mode": "auto", "cost_model": H100},
            "auto, tight": {"mode": "auto", "search": js.Search(memory_budget=TIGHT * peak)}}[setting]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: `plan(options)` traces and plans it with these `parallelize` options (a fresh
    `Parallelized`), `jit()` compiles it with plain `jax.jit`, both under `context`."""

    name: str
    context: Callable[[], contextlib.AbstractContextManager]
    plan: Callable[[dict], js.Plan]
    jit: Callable[[], object]


def cases(size: str, devices: int) -> list[Case]:
    """The reference models at `size`, the zoo's models, and the other client models."""
    out = [_reference(w, devices) for w in (workload(m, size) for m in model_table())]
    out += [_zoo_case(name) for name in _zoo.MODELS if name not in _zoo.VARIANTS]  # one per step: the Layout form
    out += _clients()
    return out


def _reference(w, devices: int) -> Case:
    args = w.args()
    plan = parallelized(w, devices).plan(*args)

    def planned(options):
        if options.get("mode") == "semi_auto":
            return parallelized(w, devices).plan(*args)
        return js.parallelize(w.step(None), devices=devices, **options).plan(*args)

    return Case(w.name, contextlib.nullcontext, planned,
                lambda: same_shardings(w, plan, devices).lower(*args).compile())


def _zoo_case(name: str) -> Case:
    c = _zoo.case(name)
    args, options = c.args["given"], c.options["given"]
    return Case(name, c.context, lambda o: js.parallelize(c.step, **{**options, **o}).plan(*args), c.expert)


def _clients() -> list[Case]:
    """The client models beyond the zoo's, each as its author jits it (hf_gpt2 where transformers is
    installed)."""
    tests = str(Path(__file__).resolve().parent.parent / "tests")
    if tests not in sys.path:  # linen_dropout and nnx_dropout read the suite's `_tolerance` helper, as pytest finds it
        sys.path.append(tests)
    from tests.clients import linen_dropout, linen_optax, nnx_dropout, nnx_fsdp

    out = []
    if importlib.util.find_spec("transformers") is not None:
        from tests.clients import hf_gpt2
        out.append(_plain("hf_gpt2", hf_gpt2.train_step, hf_gpt2.create(), {"batch_argnums": 1}))
    out.append(_plain("linen_optax", linen_optax.train_step, linen_optax.create(), {"batch_argnums": 1, "accumulation": 4},
                      jitted=linen_optax.reference_step))  # its js.accumulate needs parallelize's steps
    state, batch = linen_dropout.create_state()
    out.append(_plain("linen_dropout", linen_dropout.train_step, (state, batch, jax.random.key(0)),
                      {"batch_argnums": 1}))
    graphdef, state, batch = nnx_dropout.create_state()
    out.append(_plain("nnx_dropout", functools.partial(nnx_dropout.train_step, graphdef),
                      (state, jax.random.key(0), batch), {"batch_argnums": 2}))
    mesh = nnx_fsdp.make_mesh()
    with jax.set_mesh(mesh):
        graphdef, state, batch = nnx_fsdp.create_state()
    out.append(_plain("nnx_fsdp", functools.partial(nnx_fsdp.train_step, graphdef), (state, batch),
                      {"batch_argnums": 1}, functools.partial(jax.set_mesh, mesh)))
    return out


def _plain(name: str, step, args: tuple, options: dict, context=contextlib.nullcontext, jitted=None) -> Case:
    """A client whose author runs `jitted` (else `step`) under a plain `jax.jit`."""
    devices = {} if context is not contextlib.nullcontext else {"devices": 8}
    return Case(name, context, lambda o: js.parallelize(step, **devices, **options, **o).plan(*args),
                lambda: jax.jit(jitted or step).lower(*args).compile())


KEPT = SETTINGS.index("auto, tight")
"""The setting whose planning compiles the plan it keeps (the budget's compiled check)."""


@dataclasses.dataclass(frozen=True)
class Timing:
    """Seconds per round: `(jax.jit compile, then each of SETTINGS' trace + plan)`, or the error
    (`failed`: a setting's, by its index in `SETTINGS`); `kept`: per round, the seconds of the
    compile of the plan `KEPT`'s planning kept (`SearchReport.compile_seconds`, 0 for none)."""

    model: str
    rounds: list[tuple[float, ...]]
    error: str = ""
    failed: dict = dataclasses.field(default_factory=dict)
    kept: list[float] = dataclasses.field(default_factory=list)


def measure(case: Case, rounds: int, budget: float) -> Timing:
    """`rounds` interleaved rounds of the jit compile and each setting's planning (caches cleared)."""
    failed: dict[int, str] = {}
    kept: list[float] = []

    def guarded(i: int, options: dict) -> None:
        try:
            report = case.plan(options).search
        except js.MemoryBudgetError:  # nothing fits the tight budget: the cell says so
            failed[i] = f"no plan fits {size(options['search'].memory_budget)}"
            return
        if i == KEPT:
            kept.append(0.0 if report is None or report.compile_seconds is None else report.compile_seconds)

    try:
        with case.context():
            peak = case.plan({"mode": "auto"}).search.peak_bytes
            fns = [case.jit] + [functools.partial(guarded, i, _options(s, peak)) for i, s in enumerate(SETTINGS)]
            for fn in fns:  # warm: imports, first-use costs outside the timed rounds
                jax.clear_caches()
                fn()
            kept.clear()
            took, _ = interleaved(fns, rounds, budget, setup=jax.clear_caches)
    except Exception as e:  # a model that fails is a row of the report, not the end of the run
        return Timing(case.name, [], f"{type(e).__name__}: {str(e).splitlines()[0][:120]}")
    return Timing(case.name, took, failed=failed, kept=kept)


def plan_time_table(timings: list[Timing]) -> Table:
    cells = [_failed_row(t) if t.error else _row(t) for t in timings]
    columns = ["model", "jax.jit compile"]
    for name in SETTINGS:
        columns += [f"{name}: trace+plan", f"{name}: / jit"]
    columns += [f"{SETTINGS[KEPT]}: kept compile", f"{SETTINGS[KEPT]}: less it / jit"]
    return Table(
        "2b. Planning time against the jax.jit compile of the same step, 8 devices",
        f"trace + plan <= {TARGET:g}x the jax.jit trace + lower + compile of the same step, in every setting "
        f"(auto, tight: without the compile of the plan kept, which the first call would make)",
        (*columns, "target"),
        tuple(cells),
        (
            "jax.jit: a fresh `jax.jit` of the step traced, lowered and compiled as its author runs it: the reference "
            "models with the shardings jshard's plan gives `jax.jit` (table 3), the zoo's with their author's expert "
            "shardings (table 15), the other clients as created (linen_optax, linen_dropout, nnx_dropout, hf_gpt2: "
            "one device; nnx_fsdp on its mesh; linen_optax's step without its `jshard.accumulate`, which jshard "
            "runs with `accumulation=4`).",
            "trace+plan: a fresh `jshard.parallelize(step, ...).plan(*args)`: the trace, the planning and the plan's "
            "records, nothing compiled; semi_auto: propagation from the model's anchors; auto: the recursive search, "
            "no budget; auto, H100: the same on `CostModel.for_device('H100')`, whose 80 GiB are the default budget "
            "(the seeds, data parallel among them, weighed under it); auto, tight: `memory_budget` "
            f"{TIGHT:g}x the unbudgeted search's estimated peak, which binds: the weighings (recompute, optimizer "
            "levels, offload) and, the devices being present, the compiled checks of the plans against the budget "
            "(XLA compiles inside planning) are all in the figure. The check of the plan kept compiles the "
            "program its calls run (`Program.compiled`): the first call compiles nothing more, so that compile "
            "is the one `jax.jit` makes too, not extra work. Offload placements whose least seconds (the step's "
            "work split evenly over the devices plus their least streaming) cannot beat the plan on the device are "
            "not searched (`SearchReport.skipped` names them).",
            "no plan fits: the planning ended in `MemoryBudgetError` (the budget binds below every plan's compiled "
            "peak); its cells are the seconds to that refusal and their ratio, what the user waits for.",
            "kept compile: the seconds of that compile inside auto, tight's trace+plan (`SearchReport."
            "compile_seconds`); less it / jit: auto, tight's trace+plan without it over the jax.jit compile. The "
            "target reads this ratio for auto, tight (the compile is the one `jax.jit` makes, and the first call "
            "makes no other), the inclusive ratio beside it for every other setting.",
            "`jax.clear_caches()` before every measurement (untimed), after one untimed warm-up of each; rounds of "
            "one of each in rotating order; times: medians; ratios: median of the per-round ratios (taken side by "
            "side in one run: the machine is shared, so only the ratios compare).",
        ),
    )


def _row(t: Timing) -> tuple:
    """One model's cells: the jit compile, each setting's time and ratio, the kept compile and the
    tight ratio without it, and the verdict (the inclusive ratios, but the tight one without it)."""
    jit = statistics.median(r[0] for r in t.rounds)
    row, ratios = [t.model, f"{jit:.2f} s"], []
    for i in range(len(SETTINGS)):
        ratio = statistics.median(r[i + 1] / r[0] for r in t.rounds)
        ratios.append(ratio if i != KEPT or i in t.failed else _less_kept(t))
        took = f"{statistics.median(r[i + 1] for r in t.rounds):.2f} s"
        if i in t.failed:  # the seconds to the refusal: what the user waits for
            row += [f"{took}: {t.failed[i]}", f"{ratio:.2f}"]
            continue
        row += [took, f"{ratio:.2f}"]
    if KEPT in t.failed or not t.kept:
        row += ["-", "-"]
    else:
        row += [f"{statistics.median(t.kept):.2f} s", f"{_less_kept(t):.2f}"]
    return (*row, verdict(max(ratios) <= TARGET))


def _less_kept(t: Timing) -> float:
    """The median per round of `KEPT`'s trace+plan less its kept compile, over the jit compile."""
    return statistics.median((r[KEPT + 1] - k) / r[0] for r, k in zip(t.rounds, t.kept))


def _failed_row(t: Timing) -> tuple:
    return (t.model, "-", *(["-", "-"] * (len(SETTINGS) + 1)), f"failed: {t.error}")
