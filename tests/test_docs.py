"""The documentation site builds with `mkdocs build --strict` (no broken link, no repository file a
page renders that is gone, no docstring the reference cannot render), its reference holds every
public name, and the pages users look for are there. Skipped only where the `docs` extra is not installed; .ci/run installs it."""

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
def test_the_big_model_page_answers_does_not_fit_and_the_notebooks_ride_along(site):
    big = (site / "howto" / "big-model" / "index.html").read_text()
    table = big[big.index('id="which-tool"'):big.index('id="a-memory-budget"')]
    for tool in ("OptimizerParallel(1)", "optimizer=3", "js.recompute", "accumulation=4", "offload=",
                 "js.Pipelining", "memory_budget"):
        assert tool in table, tool
    for page in ("getting-started", "howto/nnx", "howto/linen", "howto/mesh", "howto/pipelines", "howto/multi-host",
                 "howto/checkpoints", "concepts/mindspore", "concepts/planning", "concepts/cost-model",
                 "reference/cli", "reference/plan-format", "troubleshooting"):
        assert (site / page / "index.html").is_file(), page
    assert "failure_&lt;rank&gt;.json" in (site / "howto" / "multi-host" / "index.html").read_text()
    for notebook in (REPO / "notebooks").glob("*.ipynb"):
        assert (site / "notebooks" / notebook.name).read_bytes() == notebook.read_bytes()


@needs_mkdocs
def test_the_repository_files_render_as_pages(site):
    assert "Where a new feature goes" in (site / "architecture" / "index.html").read_text()
    assert "DeprecationWarning" in (site / "changelog" / "index.html").read_text()
    assert "Strategy search against the expert plans" in (site / "benchmarks" / "index.html").read_text()


@needs_mkdocs
def test_a_repository_file_that_is_gone_stops_the_build(hooks):
    from mkdocs.exceptions import PluginError

    page = type("Page", (), {"file": type("File", (), {"src_uri": "x.md"})()})()
    with pytest.raises(PluginError, match=re.escape("x.md: <!-- file: NO_SUCH.md --> names no file of the repository")):
        hooks.on_page_markdown("# X\n\n<!-- file: NO_SUCH.md -->\n", page, None, None)


@needs_mkdocs
def test_links_to_the_readme_and_architecture_become_links_to_their_pages(hooks):
    assert hooks._relink("see [ARCHITECTURE.md](ARCHITECTURE.md)", "guide/x.md") == "see [ARCHITECTURE.md](../architecture.md)"
    assert hooks._relink("[README](README.md)", "troubleshooting.md") == "[README](index.md)"
    assert hooks._relink("[figures](BENCHMARKS.md)", "changelog.md") == "[figures](benchmarks.md)"
