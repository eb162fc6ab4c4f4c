"""MkDocs hooks for the structattn site (named in ``mkdocs.yml``; not a page).

- The committed gallery pictures (``gallery/results/*.png``) and benchmark records
  (``benchmarks/results/*.json``) live outside ``docs/``; they are added to the site as
  ``assets/gallery/…`` and ``assets/benchmarks/…``, so pages can show and link them.
- ``api/models.md`` is written from the catalogue's registry (``structattn.models.CATALOGUE``),
  so a model added to the catalogue gets its reference section without editing a page.
- A page holding ``<!-- benchmark-results -->`` gets a table of the benchmark records in
  place of that line.
- The gallery's script pages (``gallery/scripts/``, written by mkdocs-gallery from
  ``gallery/plot_*.py`` without running them) get the pictures named in ``PICTURES`` before
  their code: committed pictures of full runs. Where ``extra.gallery_run`` in ``mkdocs.yml``
  (the environment variable ``STRUCTATTN_GALLERY_RUN``) is a regular expression, the scripts
  whose names it matches are run at their default sizes, one process each, and their pages
  show every picture the run wrote instead. The scripts' index is ``gallery/README.md`` with
  its links into ``docs/`` made site links, its table's script names linked to their pages
  and the thumbnails where it says ``<!-- gallery-thumbnails -->``; the notebook downloads go
  (the scripts run from a shell, with their options).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

ROOT = Path(__file__).resolve().parent.parent
GALLERY = ROOT / "gallery" / "results"
RESULTS = ROOT / "benchmarks" / "results"
RESULTS_MARK = "<!-- benchmark-results -->"
SCRIPTS = "gallery/scripts/"  # mkdocs-gallery's gallery_dirs, under docs/

# Each gallery script's committed pictures (paths in the site: gallery/results/NAME is
# assets/gallery/NAME) with their captions, in the order its page shows them; the page that
# reports the full run's numbers and settings, where there is one. A script's thumbnail
# (``# mkdocs_gallery_thumbnail_path`` in the script) is one of these.
PICTURES = {
    "plot_quickstart": [
        ("assets/self_attention_declared.png", "causal self attention, declared: the prior over edges"),
        ("assets/self_attention_inferred.png",
         "the same, inferred on random inputs: the posterior over edges, each child's MAP parent bold"),
        ("assets/gallery/long_sequence_attention.png",
         "ALiBi's two heads on 2,000 random tokens, plotted as statistics rather than drawn as a graph"),
    ],
    "plot_catalogue": [
        ("assets/gallery/block_slot_attention_inferred.png",
         "one of the catalogue's models (block-slot attention), inferred: both edge families"),
    ],
    "plot_structures": [
        ("assets/gallery/structures_dynamics.png",
         "structure that moves: expanding attention's windows per iteration, slot attention's "
         "assignments at steps 0 and 3, multihop's P and P²"),
        ("assets/gallery/long_sequence_expanding.png",
         "expanding attention on 2,000 tokens of the copy task, plotted by sa.plot_attention"),
    ],
    "plot_distance_priors": [
        ("assets/gallery/distance_priors.png",
         "five priors over distance (top) and the last token's posterior under each (bottom)"),
    ],
    "plot_hopfield": [
        ("assets/gallery/hopfield_retrieval.png",
         "six queries, the state after each update, the stored pattern"),
        ("assets/gallery/hopfield_energy.png", "Ramsauer's energy per update, every query"),
        ("assets/gallery/hopfield_beta.png", "retrieval against β"),
    ],
    "plot_slots": [
        ("assets/gallery/slots_scene0.png",
         "one scene: every recipe's soft assignment per iteration, and the true blobs"),
        ("assets/gallery/slots_free_energy.png", "the free energy per iteration, every scene and recipe"),
    ],
    "plot_block_slots": [
        ("assets/gallery/block_slots_scene0.png",
         "one scene: the assignment per iteration, then each slot's binding posterior over "
         "the position and colour prototypes"),
        ("assets/gallery/block_slots_free_energy.png", "the free energy per iteration, every scene"),
    ],
    "plot_ground_truth": [
        ("assets/gallery/ground_truth_density.png",
         "the exact posterior density with NUTS draws, the SVI Normal, SVI's MAP and the compiled "
         "fixed point"),
        ("assets/gallery/ground_truth_edges.png",
         "the edge posterior p(φ = j | x): exact, NUTS, SVI, and the compiled one at the mode"),
    ],
    "plot_multihop": [
        ("assets/gallery/multihop_learning_curves.png",
         "test MSE against steps, median and quartiles over seeds"),
    ],
    "plot_expanding": [
        ("assets/gallery/expanding_evidence_windows.png",
         "the query's window per mean-field iteration (the savings run: --window-rule evidence)"),
        ("assets/gallery/expanding_evidence_cost.png", "cost relative to full attention, the same run"),
    ],
    "plot_predictive_coding": [
        ("assets/gallery/pc_learning_curves.png",
         "test accuracy and training free energy per epoch, every seed"),
        ("assets/gallery/pc_block_posterior.png",
         "the block networks' posterior over the hidden blocks, per class"),
        ("assets/gallery/pc_choice.png", "the authors' network: its posteriors over its predictors"),
        ("assets/gallery/pc_learning_curves_authors_optimiser.png",
         "the authors' network with their recipe and their optimiser (Adam 1e-4, weight decay 1)"),
    ],
    "plot_expfamily_dynamics": [
        ("assets/gallery/expfamily_gaussianity.png",
         "the distance to Gaussian per iteration and renormalisation, against the noise floor"),
    ],
}
RESULT_PAGES = {
    "plot_multihop": "multihop.md",
    "plot_expanding": "expanding-toy.md",
    "plot_predictive_coding": "predictive-coding.md",
    "plot_expfamily_dynamics": "exponential-family.md",
}
_RUN: dict[str, list[str]] = {}  # script name -> site paths of the pictures this build's run wrote
_RUN_DIR: list[Path] = []


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


def _run_scripts(pattern: str, files, config) -> None:
    """Run the gallery scripts whose names match ``pattern``; add their pictures to the site."""
    _RUN.clear()
    if not pattern:
        return
    out = Path(tempfile.mkdtemp(prefix="structattn-gallery-"))
    _RUN_DIR.append(out)
    # this checkout's structattn, whatever the environment has installed
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    for script in sorted(GALLERY.parent.glob("plot_*.py")):
        if not re.search(pattern, script.stem):
            continue
        run = subprocess.run([sys.executable, str(script), "--out", str(out / script.stem)],
                             cwd=ROOT, env=env, capture_output=True, text=True)
        if run.returncode:
            on_post_build(config)
            raise PluginError(f"gallery/{script.name} failed:\n{run.stderr[-3000:]}")
        _RUN[script.stem] = []
        for png in sorted((out / script.stem).glob("*.png")):
            uri = f"assets/gallery/run/{script.stem}/{png.name}"
            files.append(File.generated(config, uri, abs_src_path=str(png)))
            _RUN[script.stem].append(uri)


def on_post_build(config):
    while _RUN_DIR:
        shutil.rmtree(_RUN_DIR.pop(), ignore_errors=True)


def on_files(files, config):
    _run_scripts(str(config["extra"].get("gallery_run") or ""), files, config)
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


_NOTE = re.compile(r"^!!! note\n\n    Click \[here\]\(#download_links\)\n.*?\n\n", re.M | re.S)
_NOTEBOOK = re.compile(r"^\[:fontawesome-solid-download: Download (all examples in )?Jupyter notebooks?:.*\n",
                       re.M)
_CODE = "<!-- GENERATED FROM PYTHON SOURCE LINES"
_THUMBNAILS = re.compile(r'<div class="mkd-glr-thumbcontainer".*<div class="mkd-glr-clear"></div>\n', re.S)
THUMBNAILS_MARK = "<!-- gallery-thumbnails -->"  # where gallery/README.md wants them on the site


def _pictures(name: str) -> str:
    """A script page's pictures section, put before its code (links relative to gallery/scripts/)."""
    if name in _RUN:
        pictures = [(uri, Path(uri).name) for uri in _RUN[name]]
        where = f"Written by this build's run of `python gallery/{name}.py` (its default sizes):"
    elif name in PICTURES:
        pictures = PICTURES[name]
        run = (f"the full run that [its results page](../{RESULT_PAGES[name]}) reports"
               if name in RESULT_PAGES else f"a run of `python gallery/{name}.py` (its default sizes)")
        where = f"Committed pictures of {run}:"
    else:
        return ""
    lines = ["## Pictures", "", where, ""]
    lines += [f"![{caption}](../../{uri})\n\n*{caption}*\n" for uri, caption in pictures]
    return "\n".join(lines) + "\n## The script\n\n"


def on_page_markdown(markdown, page, config, files):
    if RESULTS_MARK in markdown:
        markdown = markdown.replace(RESULTS_MARK, _results_table())
    uri = page.file.src_uri
    if uri.startswith(SCRIPTS):
        markdown = _NOTEBOOK.sub("", _NOTE.sub("", markdown))
        name = uri[len(SCRIPTS):].removesuffix(".md")
        if name == "index":  # gallery/README.md, then the thumbnails
            markdown = markdown.replace("](../docs/", "](../../")  # its links into docs/
            markdown = re.sub(r"^\| `(plot_\w+)\.py` \|", r"| [`\1.py`](\1.md) |", markdown, flags=re.M)
            grid = _THUMBNAILS.search(markdown)
            if grid and THUMBNAILS_MARK in markdown:
                markdown = markdown.replace(grid.group(0), "").replace(THUMBNAILS_MARK, grid.group(0))
        elif _CODE in markdown:
            markdown = markdown.replace(_CODE, _pictures(name) + _CODE, 1)
    return markdown
