"""Every Python block of README.md and of the documentation pages (`docs/**/*.md`) runs as written, on 8
simulated CPU devices with warnings as errors. A page's blocks run in one fresh process, one after
another, each in a namespace of its own (so each must stand alone, as a reader copies it); a block
right after the line `<!-- fragment -->` is a deliberate piece of a larger program and is skipped
(README.md says so where it explains the convention). The user-facing pages also stay short and
speak only public API: README.md at most 300 lines, and neither it nor a guide page names a private
name (`_engine`, `Engine._x`) or tells history ("(was ...)"): that goes to CHANGELOG.md, internals
to ARCHITECTURE.md, figures to BENCHMARKS.md."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
FRAGMENT = "<!-- fragment -->"
README_LINES = 300

USER_PAGES = ["README.md"] + sorted(
    str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*.md")
    if p.parent.name != "api" and "<!-- file: " not in p.read_text()
)
"""README.md and the site's own pages; the API reference (docstrings) and the pages that render
ARCHITECTURE.md, BENCHMARKS.md and CHANGELOG.md (a directive each) are for readers of internals."""

PRIVATE = re.compile(r"`[^`\n]*?(?<![\w.])_[A-Za-z]\w*[^`\n]*?`|\w\._[A-Za-z]\w*")
HISTORY = re.compile(r"\(was\b")


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


BLOCKS = {page: python_blocks((REPO / page).read_text()) for page in USER_PAGES}
RUNNER = """
import json, sys
for name, code in json.load(open(sys.argv[1])):
    print(f"--- block: {name}", flush=True)
    exec(compile(code, f"<{name}>", "exec"), {"__name__": "__main__"})
"""


def test_the_pages_have_python_blocks_and_the_extractor_honours_fragments():
    assert len(BLOCKS["README.md"]) >= 3
    assert sum(map(len, BLOCKS.values())) >= 20
    text = f"# A\n```python\nx = 1\n```\n{FRAGMENT}\n```python\ny\n```\n# B\n```python\nz = 2\n```\n"
    assert python_blocks(text) == [("A", "x = 1\n"), ("B", "z = 2\n")]


@pytest.mark.parametrize("page", [page for page in USER_PAGES if BLOCKS[page]])
def test_page_blocks_run_as_written(page, tmp_path):
    (tmp_path / "blocks.json").write_text(json.dumps(BLOCKS[page]))
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="8")
    run = subprocess.run([sys.executable, "-W", "error", "-c", RUNNER, "blocks.json"], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"stdout:\n{run.stdout[-3000:]}\nstderr:\n{run.stderr[-3000:]}"


def test_the_readme_is_short():
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_LINES, f"README.md has {lines} lines; keep it to {README_LINES} and move the rest to docs/"


@pytest.mark.parametrize("page", USER_PAGES)
def test_user_pages_name_public_api_only_and_tell_no_history(page):
    text = (REPO / page).read_text()
    private = sorted({m.group(0) for m in PRIVATE.finditer(text)})
    assert not private, f"{page} names private names (move them to ARCHITECTURE.md): {private}"
    history = [line.strip() for line in text.splitlines() if HISTORY.search(line)]
    assert not history, f"{page} tells history (move it to CHANGELOG.md): {history}"


@pytest.mark.parametrize(
    "text, found",
    [("see `Engine._paid`", True), ("`jshard/_worker.py`", True), ("`_Level`", True), ("x._seeded", True),
     ("`__init__`", False), ("`jax_num_cpu_devices`", False), ("`for _ in range(3)`", False), ("a_b", False)],
)
def test_the_private_name_check(text, found):
    assert bool(PRIVATE.search(text)) is found
