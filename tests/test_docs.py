"""The documentation site builds with `mkdocs build --strict` (no broken link, no README section a
guide page names that is gone, no docstring the reference cannot render), and its reference holds
every public name. Skipped only where the `docs` extra is not installed; .ci/run installs it."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest

import jshard

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jshard", "jshard.checkpoint", "jshard.data", "jshard.models", "jshard.compile")

needs_mkdocs = pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("mkdocstrings_handlers") is None,
    reason='mkdocs and mkdocstrings[python] are not installed: pip install -e ".[docs]" (CI does)',
)


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site")
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
                           cwd=REPO, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr
    return out


@pytest.fixture(scope="module")
def hooks():
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import _hooks
    finally:
        sys.path.remove(str(REPO / "docs"))
    return _hooks


@needs_mkdocs
@pytest.mark.parametrize("package", PACKAGES)
def test_the_reference_holds_every_public_name(site, hooks, package):
    page = (site / "api" / ("jshard" if package == "jshard" else package.split(".")[1]) / "index.html").read_text()
    names = hooks.public_names(package)
    assert names
    missing = [name for name in names if f'id="{package}.{name}"' not in page]
    assert not missing, f"{package}: no reference entry for {missing}"
    if package == "jshard":
        assert names == jshard.__all__


@needs_mkdocs
def test_guide_pages_carry_the_readme_sections_and_the_notebooks_ride_along(site):
    search = (site / "guide" / "search" / "index.html").read_text()
    assert "search_time_limit" in search  # README's "Strategy search" section, not a copy of it
    assert "failure_&lt;rank&gt;.json" in (site / "guide" / "launching" / "index.html").read_text()
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.name).read_bytes() == notebook.read_bytes()
    assert "Troubleshooting" in (site / "troubleshooting" / "index.html").read_text()


@needs_mkdocs
@pytest.mark.parametrize(
    "directive, message",
    [
        ("<!-- readme: No Such Section -->", "README.md has no section '## No Such Section'"),
        ("<!-- readme: Modes > `nothing` -->", "README.md's section '## Modes' has no item '- **`nothing`**'"),
    ],
    ids=["section", "item"],
)
def test_a_readme_section_that_is_gone_stops_the_build(hooks, directive, message):
    from mkdocs.exceptions import PluginError

    page = type("Page", (), {"file": type("File", (), {"src_uri": "guide/x.md"})()})()
    with pytest.raises(PluginError, match=re.escape(f"guide/x.md: {message}")):
        hooks.on_page_markdown(f"# X\n\n{directive}\n", page, None, None)


def test_links_to_the_readme_and_architecture_become_links_to_their_pages(hooks):
    assert hooks._relink("see [ARCHITECTURE.md](ARCHITECTURE.md)", "guide/x.md") == "see [ARCHITECTURE.md](../architecture.md)"
    assert hooks._relink("[README](README.md)", "troubleshooting.md") == "[README](index.md)"
