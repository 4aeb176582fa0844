"""mkdocs hooks: the reference follows the packages, repository files render as pages, the notebooks ride along.

`<!-- file: PATH -->` in a page becomes the whole repository file PATH less its title (ARCHITECTURE.md,
BENCHMARKS.md, CHANGELOG.md each have a page so); `<!-- api: MODULE -->` one mkdocstrings entry
(`::: MODULE.NAME`) per public name of the package MODULE (its `__all__`, else the names its
`__init__.py` re-exports as `from ... import NAME as NAME`), so the reference follows the packages as
names are added. Links to those repository files become links to their pages, and
`notebooks/*.ipynb` are copied into the site so that the notebooks page can link to them. The other
pages are written for the site (their Python blocks run in tests/test_readme.py).
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^<!-- (file|api): (.+?) -->$", re.M)
PAGES = {"README.md": "index.md", "ARCHITECTURE.md": "architecture.md", "BENCHMARKS.md": "benchmarks.md",
         "CHANGELOG.md": "changelog.md"}
"""Repository files with a page of their own: a link to the file becomes a link to the page."""


def on_files(files, config):
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        files.append(File.generated(config, f"notebooks/{notebook.name}", abs_src_path=str(notebook)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    where = page.file.src_uri
    text = DIRECTIVE.sub(lambda m: _expand(m.group(1), m.group(2), where), markdown)
    return _relink(text, where)


def _expand(kind: str, what: str, where: str) -> str:
    if kind == "api":
        return "\n".join(f"::: {what}.{name}\n" for name in public_names(what))
    path = ROOT / what
    if not path.is_file():
        raise PluginError(f"{where}: <!-- file: {what} --> names no file of the repository")
    body = path.read_text()
    return body.split("\n", 1)[1] if body.startswith("# ") else body


def public_names(module: str) -> list[str]:
    """The public names of package `module`, read from its `__init__.py` without importing it."""
    tree = ast.parse((ROOT.joinpath(*module.split(".")) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return [a.name for node in tree.body if isinstance(node, ast.ImportFrom)
            for a in node.names if a.asname == a.name and not a.name.startswith("_")]


def _relink(text: str, where: str) -> str:
    here = os.path.dirname(where)
    for name, page in PAGES.items():
        text = text.replace(f"]({name})", f"]({os.path.relpath(page, here or '.')})")
    return text
