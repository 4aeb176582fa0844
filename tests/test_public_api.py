"""The public surface: every exported name exists, and the exception hierarchy callers rely on."""

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
