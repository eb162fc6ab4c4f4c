"""The documentation site builds without a warning, covers every public name and every gallery
script, carries no dates, and its user guide's Python examples run as written."""

import ast
import html
import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# one pytest-xdist worker for this module: its fixture builds the site once, and mkdocs-gallery
# writes its pages into docs/gallery/scripts/ — two builds at once raced there
pytestmark = pytest.mark.xdist_group("docs")
DOCS = ROOT / "docs"
DATE = re.compile(r"20[0-9][0-9]-[0-9][0-9]-[0-9][0-9]")


def _public_names():
    """The names ``structattn/__init__.py`` imports (``from … import x as x``), and those it
    loads lazily (``_LAZY``: the catalogue, the inference and the drawing functions; the
    drawing subpackage is documented by its functions)."""
    import structattn

    tree = ast.parse((ROOT / "structattn" / "__init__.py").read_text())
    names = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
             for alias in node.names} | (set(structattn._LAZY) - {"drawing"})
    return sorted(n for n in names if not n.startswith("_"))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site as ``mkdocs build --strict`` builds it by default (no gallery script run), once
    for the tests that read it: its directory and the build's output."""
    for package in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python",
                    "mkdocs_gallery"):
        pytest.importorskip(package, reason="the docs packages come with the dev extra")
    site = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env.pop("STRUCTATTN_GALLERY_RUN", None)
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    return site, result


def test_mkdocs_build_strict(built):
    site, result = built
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (site / "index.html").exists() and (site / "api" / "models" / "index.html").exists()
    for png in (ROOT / "gallery" / "results").glob("*.png"):
        assert (site / "assets" / "gallery" / png.name).exists(), png.name


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", DOCS / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_gallery_script_has_its_page_and_pictures(built):
    """mkdocs-gallery writes a page per ``gallery/plot_*.py`` (title: the docstring's first
    line), with the committed pictures that ``PICTURES`` in docs/hooks.py names for it; its
    thumbnail is one of them; and every committed gallery picture is on a gallery page, or
    named there."""
    site, result = built
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    pictures = _hooks().PICTURES
    scripts = sorted((ROOT / "gallery").glob("plot_*.py"))
    assert set(pictures) <= {s.stem for s in scripts}, "PICTURES names a script that is gone"
    index = (site / "gallery" / "scripts" / "index.html").read_text()
    for script in scripts:
        page = site / "gallery" / "scripts" / script.stem / "index.html"
        assert page.exists(), f"no page for {script.name}"
        text = page.read_text()
        title = ast.get_docstring(ast.parse(script.read_text())).splitlines()[0]
        h1 = re.search(r"<h1[^>]*>(.*?)<a class=\"headerlink\"", text, re.S)
        assert h1 and html.unescape(h1.group(1)).strip() == title, script.name
        assert (site / "gallery" / "scripts" / script.name).exists()  # the download
        assert f'href="{script.stem}"' in index  # its thumbnail on the index
        for uri, _ in pictures.get(script.stem, []):
            assert (site / uri).exists(), uri
            assert f'src="../../../{uri}"' in text, (script.name, uri)
        thumbnail = re.search(r'^# mkdocs_gallery_thumbnail_path = "(.*)"$', script.read_text(), re.M)
        if script.stem in pictures:
            assert thumbnail, f"{script.name}: name one of its pictures as its thumbnail"
        if thumbnail:
            uri = re.sub(r"^\.\./gallery/results/", "assets/gallery/", thumbnail.group(1))
            assert uri in [u for u, _ in pictures.get(script.stem, [])], script.name
    pages = "".join(page.read_text() for page in (site / "gallery").rglob("index.html"))
    unseen = sorted(p.name for p in (ROOT / "gallery" / "results").glob("*.png") if p.name not in pages)
    assert not unseen, f"committed pictures that no gallery page shows or names: {unseen}"


def test_every_public_name_has_a_reference_section():
    targets = set()
    for page in (DOCS / "api").glob("*.md"):
        targets |= set(re.findall(r"^::: (\S+)", page.read_text(), flags=re.M))
    documented = {t.split(".")[1] for t in targets if t.startswith("structattn.")}
    documented.add("models")  # docs/hooks.py writes api/models.md from the catalogue
    missing = [n for n in _public_names() if n not in documented]
    assert not missing, f"add a '::: structattn.NAME' section to a page in docs/api/ for {missing}"


def test_no_dates_in_readme_and_docs():
    pages = [ROOT / "README.md", ROOT / "DESIGN.md", ROOT / "benchmarks" / "README.md",
             ROOT / "gallery" / "README.md",
             *DOCS.rglob("*.md")]
    dated = {str(p.relative_to(ROOT)): DATE.findall(p.read_text()) for p in pages}
    assert not {p: d for p, d in dated.items() if d}, "dates belong in CHANGELOG.md and benchmarks/results/"


@pytest.mark.parametrize("page", sorted(p.name for p in (DOCS / "guide").glob("*.md")))
def test_guide_examples_run(page, tmp_path, monkeypatch):
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "guide" / page).read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)  # examples that write pictures or programs write them here
    ns = {}
    for block in blocks:
        exec(compile(block, str(DOCS / "guide" / page), "exec"), ns)
