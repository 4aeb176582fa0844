"""The public surface: every exported name exists, and the exception hierarchy callers rely on."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import jshard as js


@pytest.mark.parametrize("name", js.__all__)
def test_exported_name_exists_and_is_documented(name):
    value = getattr(js, name)
    assert value.__doc__, f"jshard.{name} has no docstring"


def test_all_has_no_duplicates():
    assert len(js.__all__) == len(set(js.__all__))


@pytest.mark.parametrize(
    "error", [js.ShardingError, js.LayoutConflictError, js.DeviceCountError], ids=lambda e: e.__name__
)
def test_errors_are_value_errors(error):
    assert issubclass(error, ValueError)
    assert issubclass(error, js.ShardingError)


def test_checkpoint_and_data_are_there_after_import_jshard_and_cost_nothing_up_front():
    code = """
import sys, jshard
assert "orbax" not in sys.modules and "jshard.checkpoint" not in sys.modules and "jshard.data" not in sys.modules
assert {"checkpoint", "data", "models"} <= set(dir(jshard))
assert callable(jshard.checkpoint.restore) and callable(jshard.data.shard_batch) and jshard.models.GPTConfig
assert "orbax" in sys.modules
try:
    jshard.checkpoints
except AttributeError as e:
    assert str(e) == "module 'jshard' has no attribute 'checkpoints'"
"""
    env = dict(os.environ, PYTHONPATH=str(pathlib.Path(__file__).resolve().parents[1]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert run.returncode == 0, run.stderr


def test_version_is_written_once():
    pyproject = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject and 'version = {attr = "jshard.__version__"}' in pyproject
    assert re.fullmatch(r"\d+\.\d+\.\d+", js.__version__)
