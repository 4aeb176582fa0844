"""`python -m benchmarks [--quick] [--out PATH]`: measure, print the tables, write them."""

from __future__ import annotations

import argparse
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
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"where to write the report (default {DEFAULT_OUT})")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(argv)
    jshard.simulate_devices(DEVICES)  # before anything starts JAX's backend
    start, load = time.perf_counter(), os.getloadavg()[0]
    if args.only:
        tables = _report.sections(args.only, QUICK if args.quick else FULL, echo=print)
        note = (f"Regenerated alone by `{_report.command_line(argv)}` at jshard commit {_report.commit()} in "
                f"{(time.perf_counter() - start) / 60:.1f} min, load average {load:.1f} at the start and "
                f"{os.getloadavg()[0]:.1f} at the end; the rest of this file comes from the run named at the top.")
        old = args.out.read_text() if args.out.exists() else ""
        args.out.write_text(_report.replace_sections(old, tables, note))
        print(f"replaced {len(tables)} table(s) in {args.out}")
        return 0
    tables = _report.run(QUICK if args.quick else FULL, echo=print)
    took = time.perf_counter() - start
    args.out.write_text(_report.document(tables, _report.command_line(argv), took, (load, os.getloadavg()[0])))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
