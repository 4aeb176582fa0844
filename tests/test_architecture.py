"""The house stays as ARCHITECTURE.md draws it: ruff is clean, no module reaches into another
package's private modules or imports another module's private names, `jax._src` is imported in
`jshard/_compat.py` only, and the parts of `jshard` import each other without cycles."""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "jshard"


def _modules(top: str) -> dict[str, tuple[pathlib.Path, str]]:
    """Module name -> (file, the package its private modules belong to) for every file under `top`."""
    out = {}
    for path in sorted((ROOT / top).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
            home = ".".join(parts)
        else:
            home = ".".join(parts[:-1])
        out[".".join(parts)] = (path, home)
    return out


def _imports(path: pathlib.Path, module: str) -> list[tuple[str, list[str], int]]:
    """`(imported module, names, line)` for every import of a file, outside `if TYPE_CHECKING:`."""
    tree = ast.parse(path.read_text(), str(path))
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            found += [(a.name, [], node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(module.split(".")[: -node.level] + ([base] if base else []))
            found.append((base, [a.name for a in node.names], node.lineno))
    return found


def _is_module(name: str) -> bool:
    """Whether `name` is a module of this repository (a file or a package)."""
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _private_prefix(name: str) -> str | None:
    """The package a private module belongs to (`jshard.plan` for `jshard.plan._io`), or None."""
    parts = name.split(".")
    for k, part in enumerate(parts[1:], 1):
        if part.startswith("_") and not part.startswith("__"):
            return ".".join(parts[:k])
    return None


def _violations(top: str, *, private_modules: bool) -> list[str]:
    bad = []
    for module, (path, home) in _modules(top).items():
        where = f"{path.relative_to(ROOT)}"
        for name, names, line in _imports(path, module):
            if name.startswith("jax._src") and module != "jshard._compat":
                bad.append(f"{where}:{line}: imports {name}; JAX internals go through jshard/_compat.py")
                continue
            if name.startswith("jax._src"):
                continue
            submodules = [f"{name}.{n}" for n in names if _is_module(f"{name}.{n}")]
            private = [n for n in names if n.startswith("_") and not n.startswith("__") and f"{name}.{n}" not in submodules]
            if private and name != home:
                bad.append(f"{where}:{line}: imports the private name(s) {private} from {name}")
            for target in [name] + submodules:
                prefix = _private_prefix(target)
                if private_modules and prefix is not None and not (home == prefix or home.startswith(prefix + ".")):
                    bad.append(f"{where}:{line}: imports {target}, a private module of {prefix}; use {prefix}'s exports")
    return bad


@pytest.mark.parametrize("top", ["jshard", "benchmarks"])
def test_no_module_reaches_into_another_package(top):
    assert _violations(top, private_modules=True) == []


def test_tests_import_no_private_names():
    """Tests may import the package's private modules (white-box tests), never private names."""
    assert _violations("tests", private_modules=False) == []


def _part(name: str) -> str | None:
    """The part of the house a `jshard` module belongs to: its subpackage, or itself at top level."""
    parts = name.split(".")
    if parts[0] != "jshard":
        return None
    if len(parts) == 1:
        return "jshard"
    if (PACKAGE / parts[1]).is_dir():
        return f"jshard.{parts[1]}"
    return f"jshard.{parts[1]}"


def _import_graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for module, (path, _) in _modules("jshard").items():
        src = _part(module)
        for name, names, _ in _imports(path, module):
            targets = [name]
            if name == "jshard":  # `from jshard import _context` names a module, `import jshard` the API
                targets = [f"jshard.{n}" if (PACKAGE / f"{n}.py").exists() or (PACKAGE / n).is_dir() else "jshard"
                           for n in names] or ["jshard"]
            for target in targets:
                dst = _part(target)
                if dst is not None and dst != src:
                    graph.setdefault(src, set()).add(dst)
    return graph


def test_the_parts_of_jshard_import_each_other_without_cycles():
    graph = _import_graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(node, stack):
        state[node] = 1
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(" -> ".join(stack[stack.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt, stack + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert cycles == []


def test_the_compile_core_does_not_know_its_front_ends():
    graph = _import_graph()
    for front in ("jshard._parallelize", "jshard.pipeline", "jshard._cli", "jshard"):
        assert front not in graph.get("jshard.compile", set()), front


@pytest.mark.skipif(shutil.which("ruff") is None and subprocess.run(
    [sys.executable, "-m", "ruff", "--version"], capture_output=True).returncode != 0, reason="ruff is not installed")
def test_ruff_is_clean():
    run = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", str(ROOT)], capture_output=True, text=True,
                         cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
