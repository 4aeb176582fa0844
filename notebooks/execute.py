"""Runs notebooks top to bottom in a fresh kernel and stores them with their outputs, so that they read
without running (GitHub, a docs site). `tests/test_notebooks.py` checks that the stored outputs name
no machine paths.

    python notebooks/execute.py                      # every notebook here
    python notebooks/execute.py notebooks/pipeline.ipynb
"""

import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent


def execute(path: pathlib.Path) -> float:
    """Runs the notebook at `path` in place (its folder as the working directory); the seconds it took."""
    nb = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(nb, path)
    return time.perf_counter() - start


if __name__ == "__main__":
    for arg in sys.argv[1:] or sorted(HERE.glob("*.ipynb")):
        print(f"{arg}: {execute(pathlib.Path(arg)):.1f} s", flush=True)
