"""Every Python block of the how-to pages (`docs/howto/*.md`) runs as written, as README.md's do
(`tests/test_readme.py`: each in a fresh process on 8 simulated CPU devices, warnings as errors;
a block after `<!-- fragment -->` is skipped)."""

import pathlib

import pytest
from test_readme import REPO, python_blocks
from test_readme import test_block_runs_as_written as run_block

PAGES = sorted((REPO / "docs" / "howto").glob("*.md"))
BLOCKS = [(f"{page.stem}: {name}", code) for page in PAGES for name, code in python_blocks(page.read_text())]


def test_the_howto_pages_have_python_blocks():
    assert {pathlib.Path(p).stem for p in PAGES} >= {"mesh", "linen"} and len(BLOCKS) >= 4


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_howto_block_runs_as_written(code, tmp_path):
    run_block(code, tmp_path)
