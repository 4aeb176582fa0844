"""mypy finds no type error in `jshard/` beyond those `.ci/mypy-baseline.txt` accepts
(`.ci/mypy_baseline.py`, which `.ci/run` runs too)."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.skipif(importlib.util.find_spec("mypy") is None, reason="mypy is not installed")
def test_mypy_finds_no_error_beyond_the_baseline():
    run = subprocess.run([sys.executable, str(ROOT / ".ci" / "mypy_baseline.py")], capture_output=True, text=True,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
