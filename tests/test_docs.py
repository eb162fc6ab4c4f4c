"""The documentation site builds without a warning, covers every public name and every gallery
script, carries no dates, and its user guide's Python examples run as written."""

import ast
import html
import importlib.util
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

from .staging import once, stage

ROOT = pathlib.Path(__file__).resolve().parents[1]
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


def _build_site(where: pathlib.Path) -> None:
    """``mkdocs build --strict`` of a copy of the repository (mkdocs-gallery writes its pages
    into docs/gallery/scripts/ where it runs, and the clone is the rest of the suite's): the
    site in ``where/site``, its whole log in ``where/mkdocs.log``, its exit status beside."""
    source = stage(where / "repository")
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    env.pop("STRUCTATTN_GALLERY_RUN", None)
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(where / "site")],
        cwd=source, env=env, capture_output=True, text=True, timeout=300)
    (where / "mkdocs.log").write_text(result.stdout + result.stderr)
    (where / "mkdocs.returncode").write_text(str(result.returncode))


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The site as ``mkdocs build --strict`` builds it by default (no gallery script run), once
    per session for the tests that read it: its directory and the build's result."""
    for package in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python",
                    "mkdocs_gallery"):
        pytest.importorskip(package, reason="the docs packages come with the dev extra")
    where = once(tmp_path_factory, "docs", _build_site)
    log = (where / "mkdocs.log").read_text()
    result = subprocess.CompletedProcess(
        "mkdocs build", int((where / "mkdocs.returncode").read_text()), log, "")
    # the whole log: pytest shows it under a failed test's "Captured stdout setup" (a
    # failure's message shows its last lines)
    print(f"mkdocs build exited {result.returncode}; its log ({where / 'mkdocs.log'}):\n{log}")
    return where / "site", result


def test_mkdocs_build_strict(built):
    site, result = built
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (site / "index.html").exists() and (site / "api" / "models" / "index.html").exists()
    for png in (ROOT / "gallery" / "results").glob("*.png"):
        assert (site / "assets" / "gallery" / png.name).exists(), png.name


#: pages that must show typeset formulas: the home page, a guide page, the API reference's
#: catalogue (the models' docstrings) and building blocks (the priors' docstrings)
MATH_PAGES = ["index.html", "guide/declaring/index.html", "api/models/index.html",
              "api/building-blocks/index.html"]
#: what pymdownx.arithmatex (generic) makes of $...$ and $$...$$
FORMULA = re.compile(r'<(span|div) class="arithmatex">(.*?)</\1>', re.S)


def _formulas(site: pathlib.Path) -> list[tuple[str, str, bool]]:
    """Every formula of the built site: its page, its TeX, whether it is displayed."""
    found = []
    for page in sorted(site.rglob("*.html")):
        for _tag, body in FORMULA.findall(page.read_text()):
            tex = html.unescape(body).strip()
            assert tex[:2] in ("\\(", "\\[") and tex[-2:] in ("\\)", "\\]"), (page, tex)
            found.append((str(page.relative_to(site)), tex[2:-2], tex.startswith("\\[")))
    return found


def test_formulas_are_marked_up_and_their_renderer_ships_with_the_site(built):
    """The pages carry their formulas as arithmatex markup and load the vendored KaTeX
    (script, stylesheet and the woff2 fonts it names) and the script that typesets them,
    from the site itself: it renders offline."""
    site, result = built
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for page in MATH_PAGES:
        text = (site / page).read_text()
        assert FORMULA.search(text), f"{page}: no formula"
        up = "../" * page.count("/")
        assert f'href="{up}assets/katex/katex.min.css"' in text, page
        for script in ("assets/katex/katex.min.js", "assets/math.js"):
            assert f'<script src="{up}{script}"' in text, (page, script)
    for name in ("katex.min.js", "katex.min.css", "LICENSE"):
        assert (site / "assets" / "katex" / name).stat().st_size > 0, name
    css = (site / "assets" / "katex" / "katex.min.css").read_text()
    fonts = set(re.findall(r"url\((fonts/[^)]+\.woff2)\)", css))
    assert len(fonts) >= 20, fonts
    missing = sorted(f for f in fonts if not (site / "assets" / "katex" / f).exists())
    assert not missing, missing
    home = {tex for page, tex, _ in _formulas(site) if page == "index.html"}
    assert r"p(φ_i = j \mid x) ∝ p(φ_i = j)\, e^{ψ_{ij}}" in home, home
    models = {tex for page, tex, _ in _formulas(site) if page == "api/models/index.html"}
    assert r"ψ(x_j, x_i) = x_iᵀW_QᵀW_K x_j / τ" in models, models  # SelfAttention's docstring


_KATEX_CHECK = """
const katex = require(process.argv[1]);
const options = JSON.parse(process.argv[2]);
const bad = [];
for (const [page, tex, display] of JSON.parse(require("fs").readFileSync(0, "utf8"))) {
  const warnings = [];
  const strict = (code, message) => { warnings.push(code + ": " + message); return "ignore"; };
  try {
    katex.renderToString(tex, Object.assign({}, options, {displayMode: display, throwOnError: true, strict}));
  } catch (error) { warnings.push(error.message); }
  if (warnings.length) bad.push([page, tex, warnings]);
}
console.log(JSON.stringify(bad));
"""


def test_every_formula_typesets_without_an_error_or_a_warning(built):
    """Every formula on the site, through the vendored KaTeX with the site's options
    (docs/assets/math.js), parses, and needs none of KaTeX's leniency (the browser would
    show a red error, or silently set text): run with Node.js, where there is one."""
    site, result = built
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("needs Node.js to run KaTeX")
    options = re.search(r"^const KATEX_OPTIONS = (\{.*?^\});", (DOCS / "assets" / "math.js").read_text(),
                        re.S | re.M)
    assert options, "docs/assets/math.js: no KATEX_OPTIONS = {...}; JSON"
    formulas = _formulas(site)
    assert len(formulas) > 100, len(formulas)
    run = subprocess.run([node, "-e", _KATEX_CHECK, str(site / "assets" / "katex" / "katex.min.js"),
                          json.dumps(json.loads(options.group(1)))],
                         input=json.dumps(formulas), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    bad = json.loads(run.stdout)
    assert not bad, json.dumps(bad[:10], ensure_ascii=False, indent=1)


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
    if page == "transformers.md":  # the integration's page needs its extra
        pytest.importorskip("transformers", reason="the transformers extra is not installed")
    blocks = re.findall(r"```python\n(.*?)```", (DOCS / "guide" / page).read_text(), flags=re.S)
    monkeypatch.chdir(tmp_path)  # examples that write pictures or programs write them here
    ns = {}
    for block in blocks:
        exec(compile(block, str(DOCS / "guide" / page), "exec"), ns)
