"""The notebooks run top to bottom in a fresh kernel (their own assertions check the numbers), and are
stored with their outputs (`python notebooks/execute.py`), so they read without running: executed in
order, no machine's paths in what they show, and pictures where one reads better than text."""

import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
MACHINE_PATHS = re.compile(r"/work/|/root/|/tmp/|/home/|/Users/|[A-Z]:\\|site-packages|dist-packages|ipykernel_")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs(path):
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.output_type == "error"]
    assert not errors


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_is_stored_with_its_outputs_and_no_machine_paths(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "run it: python notebooks/execute.py"
    outputs = [o for c in code for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    for cell in code:
        for o in cell.outputs:
            shown = [o.get("text", "")] + [v for k, v in o.get("data", {}).items() if k != "image/png"]
            found = [m.group(0) for text in shown for m in MACHINE_PATHS.finditer(text if isinstance(text, str) else "")]
            assert not found, f"cell {cell.execution_count} shows machine paths {found}"


def test_notebooks_show_pictures():
    """Device grids (`js.visualize`, SVG) and figures (loss curve, memory by plan, schedules: PNG)."""
    kinds = {k for path in NOTEBOOKS for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"
             for o in c.outputs for k in o.get("data", {})}
    assert {"image/svg+xml", "image/png"} <= kinds
