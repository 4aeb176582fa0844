"""The whole run: every table in order, printed as it is done, then written with the machine."""

from __future__ import annotations

import dataclasses
import datetime
import os
import platform
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path

import jax
import jaxlib

from benchmarks import (
    _abstract,
    _accumulation,
    _against_jit,
    _comm_recompute,
    _compiled,
    _faults,
    _fusion,
    _gpu,
    _hetero,
    _memory,
    _pipeline,
    _pipeline_tagged,
    _plan_time,
    _planning,
    _predicted,
    _replay,
    _round_trip,
    _scale,
    _search,
    _zoo,
)
from benchmarks._models import model_table, workload
from benchmarks._settings import DEVICES, Settings
from benchmarks._table import Table, markdown_row


def run(settings: Settings, echo: Callable[[str], None] = print) -> list[Table]:
    """Measures everything on `DEVICES` devices; `echo` gets each table's Markdown as it is done."""
    table = model_table()
    workloads = [workload(m, settings.size) for m in table]
    tables: list[Table] = []

    def add(made: Table) -> None:
        tables.append(made)
        echo(made.markdown())

    add(Table("Models", "", ("model", "size"), tuple((w.name, w.describe()) for w in workloads)))
    figures = [f for w in workloads for f in _compiled.measure(w, DEVICES)]
    add(_compiled.figures_table(figures, DEVICES))
    add(_compiled.targets_table(figures))
    add(_abstract.abstract_table([workload(m, "wide") for m in table]))
    gpts = [m for m in table if m.name.startswith("GPT")]
    add(_planning.planning_table(gpts, settings.depths, DEVICES, settings.plan_runs, settings.plan_budget))
    timings = [_against_jit.measure(w, DEVICES, settings) for w in workloads]
    add(_against_jit.compile_table(timings, DEVICES))
    add(_against_jit.step_table(timings, DEVICES))
    cases = [c for w in workloads if w.name in settings.search_models
             for c in _search.measure_quality(w, [f for f in figures if f.model == w.name], DEVICES,
                                              settings.search_time_limit)]
    if "loop_gpt" in settings.search_models:
        cases += _search.loop_gpt_quality(DEVICES, settings.search_time_limit)
    cases += [c for name in _search.ZOO if name in settings.search_models
              for c in _search.zoo_quality(name, settings.search_time_limit)]
    add(_search.quality_table(cases, DEVICES))
    add(_search.gap_table(cases))
    add(_search.planning_table(_search.planning_rows(settings.search_depths, settings.search_counts,
                                                     settings.search_big, settings.search_time_limit)))
    for made in sections(list(SECTIONS), settings):
        add(made)
    return tables


SECTIONS = ("plan_time", "memory", "accumulation", "hetero", "search", "zoo", "replay", "pipeline", "round_trip", "fusion", "scale")
"""The sections `python -m benchmarks --only NAME` regenerates alone (the others need the whole run's
shared measurements)."""


_ALONE: dict[str, Callable[[], list[Table]]] = {
    "replay": lambda: [_replay.replay_table()],
    "round_trip": lambda: [_round_trip.round_trip_table()],
    "fusion": lambda: [_fusion.fusion_table(), _fusion.multi_copy_table()],
    "scale": lambda: [_scale.scale_table()],
}
"""The sections that take no settings: their tables."""


def sections(names: list[str], settings: Settings, echo: Callable[[str], None] | None = None) -> list[Table]:
    """The tables of the sections `names` (`SECTIONS`), each echoed as it is done."""
    tables = []
    for name in names:
        if name == "plan_time":
            made = [_plan_time.plan_time_table([_plan_time.measure(c, settings.compile_pairs, settings.compile_budget)
                                                for c in _plan_time.cases(settings.size, DEVICES)])]
        elif name == "memory":
            made = _memory.memory_tables(DEVICES, settings.step_rounds, settings.memory_step_budget)
        elif name == "accumulation":
            made = [_accumulation.accumulation_table(), _accumulation.comm_recompute_table(),
                    _comm_recompute.comm_recompute_table()]
        elif name == "hetero":
            made = [_hetero.hetero_table(DEVICES, settings.step_rounds, settings.step_budget)]
        elif name == "search":  # tables 5 and 6, with the expert plans of table 1 measured again
            made = _search.quality_tables(settings, DEVICES)
        elif name == "zoo":
            made = [_zoo.zoo_table(), _compiled.default_batch_table([workload(m, settings.size) for m in model_table()],
                                                                   DEVICES)]
        elif name == "pipeline":
            quick = (("gpipe", 2, 4), ("zb-h1", 2, 4))  # GPipe's row first: the temp ratio's reference
            made = [_pipeline.pipeline_table(DEVICES), _pipeline_tagged.pipeline_table(cells=quick if settings.size == "quick" else _pipeline_tagged.CELLS)]
        elif name in _ALONE:
            made = _ALONE[name]()
        else:
            raise ValueError(f"no section {name!r}; the sections are {SECTIONS}")
        for table in made:
            if echo is not None:
                echo(table.markdown())
            tables.append(table)
    return tables


def replace_sections(text: str, tables: list[Table], note: str) -> str:
    """`BENCHMARKS.md`'s `text` with each of `tables` in place of the section of the same title (a
    new one before the GPU section, else at the end), `note` added under each."""
    parts = _split(text)
    for table in tables:
        made = table.markdown().rstrip("\n") + f"\n- {note}\n"
        found = next((i for i, (title, _) in enumerate(parts) if title == table.title), None)
        if found is None:
            at = next((i for i, (title, _) in enumerate(parts) if title.startswith("GPU")), len(parts))
            parts.insert(at, (table.title, made))
        else:
            parts[found] = (table.title, made)
    return "\n".join(body.rstrip("\n") + "\n" for _, body in parts)


def keep_other_rows(text: str, table: Table, models: Sequence[str], order: Sequence[str]) -> Table:
    """`table` (rows of `models` only, each row's first cell its model) with the rows of the other
    models kept from the section of the same title in `text`, models in `order`, and that section's
    notes on which run made which rows kept under the new ones, but those of runs whose models
    are all among `models` (their rows are all replaced)."""
    lines = next((body for title, body in _split(text) if title == table.title), "").splitlines()
    header = markdown_row(table.columns)
    body = lines[lines.index(header) + 2:] if header in lines else []  # past the header and its --- line
    rows = [tuple(cell.strip() for cell in line[2:-2].split(" | ")) for line in body if line.startswith("| ")]
    kept = [r for r in rows if len(r) == len(table.columns) and r[0] not in models]
    rank = {m: i for i, m in enumerate(order)}
    merged = sorted([*kept, *table.rows], key=lambda r: rank.get(r[0], len(rank)))  # stable: each model's rows in order
    runs = tuple(line[2:] for line in lines if line.startswith("- Regenerated")
                 or line.startswith("- Rows of") and not set(_run_models(line)) <= set(models))
    return dataclasses.replace(table, rows=tuple(merged), notes=table.notes + runs)


def _run_models(note: str) -> list[str]:
    """The models a `- Rows of A, B regenerated by ...` note's run searched."""
    return note[len("- Rows of "):note.index(" regenerated")].split(", ")


def _split(text: str) -> list[tuple[str, str]]:
    """`text` as `(title, section)` pairs at its `## ` headings (the head before the first: title "")."""
    parts: list[tuple[str, list[str]]] = [("", [])]
    for line in text.splitlines():
        if line.startswith("## "):
            parts.append((line[3:].strip(), []))
        parts[-1][1].append(line)
    return [(title, "\n".join(lines) + "\n") for title, lines in parts]


def document(tables: list[Table], command: str, seconds: float, load: tuple[float, float]) -> str:
    """`BENCHMARKS.md`: the machine and command, then the tables, then the GPU run's section where
    `benchmarks/gpu_results.json` exists and the chaos run's where `benchmarks/faults_results.json` does."""
    head = [
        "# jshard benchmarks",
        "",
        f"Written by `{command}` on {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC} "
        f"in {seconds / 60:.1f} min. Every figure was measured in that run, beside what it is compared with"
        + (" (except the GPU and faults sections at the end: see their first lines)."
           if _gpu.RESULTS.exists() or _faults.RESULTS.exists() else "."),
        "",
        f"- machine: {_cpu_model()}, {os.cpu_count()} cores, {platform.system()} {platform.release()}; "
        f"load average {load[0]:.1f} at the start, {load[1]:.1f} at the end",
        f"- devices: {DEVICES} simulated CPU devices (`jshard.simulate_devices({DEVICES})`)",
        f"- software: Python {platform.python_version()}, jax {jax.__version__}, jaxlib {jaxlib.__version__}",
        f"- jshard: commit {commit()}",
        "",
        "",
    ]
    gpu = _gpu.gpu_section()  # from benchmarks/gpu_results.json, measured apart on a real GPU
    predicted = _predicted.predicted_section()  # from benchmarks/predicted_results.json, planned beside the GPU run
    faults = _faults.faults_section()  # from benchmarks/faults_results.json, the chaos script's run
    return "\n".join(head) + "\n".join(t.markdown() for t in tables) + "".join(
        "\n" + x for x in (gpu, predicted, faults) if x)


def command_line(argv: list[str]) -> str:
    return " ".join(["python -m benchmarks", *argv])


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else platform.processor() or "unknown CPU"


def commit() -> str:
    """The checkout's HEAD, marked when jshard/ or benchmarks/ differ from it."""
    root = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "jshard", "benchmarks"], cwd=root,
                               capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    return head.stdout.strip() + (" with uncommitted changes in jshard/ or benchmarks/" if dirty.stdout.strip() else "")
