"""MkDocs hooks for the structattn site (named in ``mkdocs.yml``; not a page).

- The committed gallery pictures (``gallery/results/*.png``) and benchmark records
  (``benchmarks/results/*.json``) live outside ``docs/``; they are added to the site as
  ``assets/gallery/…`` and ``assets/benchmarks/…``, so pages can show and link them.
- ``api/models.md`` is written from the catalogue's registry (``structattn.models.CATALOGUE``),
  so a model added to the catalogue gets its reference section without editing a page.
- A page holding ``<!-- benchmark-results -->`` gets a table of the benchmark records in
  place of that line.
"""

from __future__ import annotations

import json
from pathlib import Path

from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
GALLERY = ROOT / "gallery" / "results"
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_MARK = "<!-- benchmark-results -->"


def _models_page() -> str:
    import structattn.models as models

    lines = [
        "# The catalogue (`structattn.models`)",
        "",
        "One section per model in `structattn.models.REGISTRY`: its factory, then its",
        "declaration class. The [catalogue guide](../guide/catalogue.md) has the table of priors,",
        "potentials and values, and how to add a model.",
        "",
    ]
    for name in sorted(models.CATALOGUE):
        entry = models.CATALOGUE[name]
        module = entry.factory.__module__
        lines += [
            f"## `{name}`",
            "",
            f"::: {module}.{entry.factory.__name__}",
            "    options:",
            "      heading_level: 3",
            "",
            f"::: {entry.declaration.__module__}.{entry.declaration.__name__}",
            "    options:",
            "      heading_level: 3",
            "",
        ]
    return "\n".join(lines)


def on_files(files, config):
    for png in sorted(GALLERY.glob("*.png")):
        files.append(File.generated(config, f"assets/gallery/{png.name}", abs_src_path=str(png)))
    for record in sorted(RESULTS.glob("*.json")):
        files.append(File.generated(config, f"assets/benchmarks/{record.name}", abs_src_path=str(record)))
    files.append(File.generated(config, "api/models.md", content=_models_page()))
    return files


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ") if value is not None else "—"


def _results_table() -> str:
    records = sorted(RESULTS.glob("*.json"))
    if not records:
        return "No benchmark records are committed."
    rows = [
        "| file | benchmark | device | torch | what it holds |",
        "|---|---|---|---|---|",
    ]
    for record in records:
        data = json.loads(record.read_text())
        provenance = data.get("provenance", {}) if isinstance(data, dict) else {}
        results = data.get("results", {}) if isinstance(data, dict) else {}
        device = provenance.get("device") or provenance.get("machine")
        holds = ", ".join(f"`{key}`" for key in results) if isinstance(results, dict) else ""
        link = f"[{record.name}](../assets/benchmarks/{record.name})"
        script = f"`bench_{record.stem}.py`"
        rows.append(f"| {link} | {script} | {_cell(device)} | {_cell(provenance.get('torch'))} | {holds} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    if RESULTS_MARK in markdown:
        markdown = markdown.replace(RESULTS_MARK, _results_table())
    return markdown
