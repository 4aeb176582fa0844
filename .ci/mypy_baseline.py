"""The type check CI runs: mypy over `jshard/` (configured in pyproject.toml), failing on any error
that `.ci/mypy-baseline.txt` does not list.

Each error is kept as `path: [code] message`, without its line number, so that an edit elsewhere
in a file does not break the check; the baseline is a multiset (an error listed twice may occur
twice). Errors that went away are reported so the baseline can shrink.

    python .ci/mypy_baseline.py            # check: exit 1 on an error the baseline lacks
    python .ci/mypy_baseline.py --update   # rewrite the baseline from today's errors
"""

from __future__ import annotations

import argparse
import collections
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
BASELINE = ROOT / ".ci" / "mypy-baseline.txt"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.pyi?)(?::\d+){0,2}: error: (?P<message>.*?)(?:  \[(?P<code>[a-z-]+)\])?$")


def normalize(line: str) -> str | None:
    """`path: [code] message` for one line of mypy's output, None for a line that is no error."""
    match = _ERROR.match(line)
    if match is None:
        return None
    message = re.sub(r"\bline \d+", "line N", match["message"])
    return f"{match['path']}: [{match['code'] or 'misc'}] {message}"


def run_mypy() -> tuple[list[str], str]:
    """Today's errors, normalized and sorted, and mypy's whole output."""
    run = subprocess.run([sys.executable, "-m", "mypy", "--no-pretty", "--show-error-codes", "--no-error-summary",
                          "--hide-error-context", "--no-color-output"], capture_output=True, text=True, cwd=ROOT)
    if run.returncode not in (0, 1):  # 2: mypy itself failed (a bad configuration, a crash)
        raise SystemExit(f"mypy failed (exit {run.returncode}):\n{run.stdout}{run.stderr}")
    errors = sorted(e for e in map(normalize, run.stdout.splitlines()) if e is not None)
    return errors, run.stdout


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--update", action="store_true", help="rewrite the baseline from today's errors")
    args = parser.parse_args(argv)
    errors, output = run_mypy()
    if args.update:
        BASELINE.write_text("".join(e + "\n" for e in errors))
        print(f"{BASELINE.relative_to(ROOT)}: {len(errors)} errors")
        return 0
    known = collections.Counter(BASELINE.read_text().splitlines() if BASELINE.exists() else [])
    today = collections.Counter(errors)
    new, gone = today - known, known - today
    if gone:
        print(f"{sum(gone.values())} error(s) of the baseline no longer occur; shrink it with "
              f"`python .ci/mypy_baseline.py --update`:")
        print("".join(f"  {e}\n" for e in sorted(gone.elements())), end="")
    if new:
        keys = set(new)
        print(f"mypy: {sum(new.values())} error(s) not in {BASELINE.relative_to(ROOT)} (fix them; `--update` "
              f"accepts them only where there is no fix):")
        print("".join(line + "\n" for line in output.splitlines() if normalize(line) in keys), end="")
        return 1
    print(f"mypy: {len(errors)} errors, all in the baseline ({sum(known.values())})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
