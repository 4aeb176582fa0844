"""mkdocs hooks: the guide pages take their text from README.md, the notebooks ride along.

A line `<!-- readme: SECTION -->` in a page becomes the body of README.md's `## SECTION`;
`<!-- readme: SECTION > ITEM -->` only that section's bullet that starts `- **ITEM**`;
`<!-- file: PATH -->` the whole repository file PATH less its title; `<!-- api: MODULE -->` one
mkdocstrings entry (`::: MODULE.NAME`) per public name of the package MODULE (its `__all__`, else the
names its `__init__.py` re-exports as `from ... import NAME as NAME`), so the reference follows the
packages as names are added. README.md stays the one
source (its Python blocks run in tests/test_readme.py); a section or item that is not there stops
the build. Links to README.md and ARCHITECTURE.md become links to their pages, and
`notebooks/*.ipynb` are copied into the site so that the notebooks page can link to them.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parents[1]
DIRECTIVE = re.compile(r"^<!-- (readme|file|api): (.+?) -->$", re.M)
PAGES = {"README.md": "index.md", "ARCHITECTURE.md": "architecture.md"}
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
    if kind == "file":
        body = (ROOT / what).read_text()
        return body.split("\n", 1)[1] if body.startswith("# ") else body
    section, _, item = (part.strip() for part in what.partition(" > "))
    body = _section((ROOT / "README.md").read_text(), section, where)
    return _item(body, section, item, where) if item else body


def public_names(module: str) -> list[str]:
    """The public names of package `module`, read from its `__init__.py` without importing it."""
    tree = ast.parse((ROOT.joinpath(*module.split(".")) / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return [a.name for node in tree.body if isinstance(node, ast.ImportFrom)
            for a in node.names if a.asname == a.name and not a.name.startswith("_")]


def _section(readme: str, name: str, where: str) -> str:
    match = re.search(rf"^## {re.escape(name)}\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    if match is None:
        raise PluginError(f"{where}: README.md has no section '## {name}'")
    return match.group(1).strip("\n") + "\n"


def _item(body: str, section: str, item: str, where: str) -> str:
    match = re.search(rf"^- \*\*{re.escape(item)}\*\*.*?(?=^- |^\S|\Z)", body, re.M | re.S)
    if match is None:
        raise PluginError(f"{where}: README.md's section '## {section}' has no item '- **{item}**'")
    return match.group(0).rstrip("\n") + "\n"


def _relink(text: str, where: str) -> str:
    here = os.path.dirname(where)
    for name, page in PAGES.items():
        text = text.replace(f"]({name})", f"]({os.path.relpath(page, here or '.')})")
    return text
