"""Every Python block in README.md runs as written, each in a fresh process on 8 simulated CPU devices,
with warnings as errors. A block right after the line `<!-- fragment -->` is a deliberate piece of a
larger program and is skipped (README.md says so where it explains the convention)."""

import os
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FRAGMENT = "<!-- fragment -->"


def python_blocks(text: str) -> list[tuple[str, str]]:
    """`(id, code)` for each ```python block not marked a fragment; the id names its section."""
    blocks, heading, seen = [], "top", {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        if line.strip() == "```python":
            end = lines.index("```", i + 1)
            marked = i > 0 and lines[i - 1].strip() == FRAGMENT
            if not marked:
                seen[heading] = seen.get(heading, 0) + 1
                name = heading if seen[heading] == 1 else f"{heading} ({seen[heading]})"
                blocks.append((name, "\n".join(lines[i + 1 : end]) + "\n"))
            i = end
        i += 1
    return blocks


BLOCKS = python_blocks((REPO / "README.md").read_text())


def test_the_readme_has_python_blocks_and_the_extractor_honours_fragments():
    assert len(BLOCKS) >= 5
    text = f"# A\n```python\nx = 1\n```\n{FRAGMENT}\n```python\ny\n```\n# B\n```python\nz = 2\n```\n"
    assert python_blocks(text) == [("A", "x = 1\n"), ("B", "z = 2\n")]


@pytest.mark.parametrize("code", [code for _, code in BLOCKS], ids=[name for name, _ in BLOCKS])
def test_block_runs_as_written(code, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    run = subprocess.run([sys.executable, "-W", "error", "-c", code], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"
