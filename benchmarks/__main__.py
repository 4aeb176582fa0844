"""`python -m benchmarks [--quick] [--only SECTION [--model NAME]] [--out PATH]`: measure, print the tables,
write them."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from pathlib import Path

import jshard
from benchmarks import _report
from benchmarks._settings import DEVICES, FULL, QUICK

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "BENCHMARKS.md"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="jshard's benchmarks on 8 simulated CPU devices: collective bytes and memory against Shardy "
        "and expert plans, planning time, compile time and step time against plain jax.jit.",
    )
    parser.add_argument("--quick", action="store_true", help="small models and few repetitions: a smoke test")
    parser.add_argument("--only", action="append", choices=_report.SECTIONS, default=None,
                        help="regenerate only this section (repeatable), replacing its tables in --out")
    parser.add_argument("--model", action="append", default=None,
                        help="with --only search: search only this model (repeatable: table 5's names, e.g. "
                        "'GPT scan', linen_lm), keeping the other models' rows of tables 5 and 6 in --out")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write the report (default {DEFAULT_OUT})")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    jshard.simulate_devices(DEVICES)  # before anything starts JAX's backend
    start, load = time.perf_counter(), os.getloadavg()[0]
    settings = QUICK if args.quick else FULL
    if args.model and args.only != ["search"]:
        _parser().error("--model goes with --only search alone")
    if args.model:
        unknown = sorted(set(args.model) - set(settings.search_models))
        if unknown:
            _parser().error(f"--model {unknown}: table 5's models are {list(settings.search_models)}")
        settings = dataclasses.replace(settings, search_models=tuple(m for m in settings.search_models if m in args.model))
    if args.only:
        tables = _report.sections(args.only, settings, echo=print)
        what = f"Rows of {', '.join(settings.search_models)} regenerated" if args.model else "Regenerated alone"
        note = (f"{what} by `{_report.command_line(argv)}` at jshard commit {_report.commit()} in "
                f"{(time.perf_counter() - start) / 60:.1f} min, load average {load:.1f} at the start and "
                f"{os.getloadavg()[0]:.1f} at the end; the rest of this file comes from the run named at the top.")
        old = args.out.read_text() if args.out.exists() else ""
        if args.model:
            tables = [_report.keep_other_rows(old, t, settings.search_models, FULL.search_models) for t in tables]
        args.out.write_text(_report.replace_sections(old, tables, note))
        print(f"replaced {len(tables)} table(s) in {args.out}")
        return 0
    tables = _report.run(settings, echo=print)
    took = time.perf_counter() - start
    args.out.write_text(_report.document(tables, _report.command_line(argv), took, (load, os.getloadavg()[0])))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
