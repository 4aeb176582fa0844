"""`jshard demo`: the README's first command, run in-process on the suite's 8 simulated devices."""

import re

import pytest

from jshard._cli import main


def test_demo_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--devices", "--steps", "--preset", "data", "tensor", "2d"):
        assert option in out


def test_demo_trains_and_shows_the_plan(capsys):
    assert main(["demo", "--steps", "40", "--layers", "1", "--preset", "tensor"]) == 0
    out = capsys.readouterr().out
    assert "mesh (d0=2, d1=2, d2=2)" in out
    assert "((1, 1, 1), (1, 8))" in out  # the column-parallel strategy, as a MindSpore tuple
    assert "all-reduce" in out and "memory per device" in out
    first, last = map(float, re.search(r"loss fell from ([\d.]+) to ([\d.]+)", out).groups())
    assert last < 0.5 * first
