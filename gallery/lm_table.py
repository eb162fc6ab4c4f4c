"""The language-model table from the runs of ``gallery/run_lm_table.sh``: every variant at the
same training minutes, its seeds' spread, beside the compressors and Kneser–Ney anchors.

Reads ``gallery/results/lm_table/<variant>_seed<s>.json`` (``train_lm.py``'s results) and
``…_probes.json`` (``lm_probes.py``'s), and ``gallery/results/lm_anchors.json``. Writes to
``--out`` (default ``gallery/results``):

- ``lm_table.md``: per variant, bits/byte on every validation byte read in windows of 512
  (the training length), 2,048, 8,192 and 16,384 bytes — the seeds' mean and, with two or
  more, their range —, training tokens/s, peak RSS during training, minutes and steps; the
  anchors' rows first; then the certified windows' widths, the credible windows and the
  passkey probe;
- ``lm_table_extrapolation.png``: bits/byte against the evaluation length, one curve per
  variant (mean over seeds, the range as a band), the anchors as lines;
- ``lm_table_curves.png``: the training curves (sampled windows) against minutes;
- ``lm_table_windows.png``: certified widths and credible context lengths against length;
- ``lm_table_passkey.png``: the passkey's digits and the planted edge's posterior mass.

With ``--docs`` it also writes between the ``<!-- lm-table -->`` and ``<!-- /lm-table -->``
marks of the README and the gallery's README the main table, and of the gallery page
``docs/gallery/language-model.md`` all of it (``DOCS``). Run: ``python gallery/lm_table.py --docs``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
from collections import defaultdict

import lm_corpus

HERE = pathlib.Path(__file__).resolve().parent
RESULTS = HERE / "results"
# where ``--docs`` writes: the main table into the READMEs, everything into the gallery page
DOCS = {HERE.parent / "README.md": "main", HERE / "README.md": "main",
        HERE.parent / "docs" / "gallery" / "language-model.md": "all"}
MARKS = ("<!-- lm-table -->", "<!-- /lm-table -->")


def load(folder: pathlib.Path):
    """``({variant: [result, …]}, {variant: [probes, …]})``, seeds in order."""
    runs, probes = defaultdict(list), defaultdict(list)
    for path in sorted(folder.glob("*_seed*.json")):
        data = json.loads(path.read_text())
        (probes if path.stem.endswith("_probes") else runs)[data["variant"]].append(data)
    return dict(runs), dict(probes)


def corpus_of(result: dict) -> str:
    """The sha256 of the corpus a run trained on (``lm_corpus.corpus_sha256``); a record that
    names only its manifest is the table's corpus where that manifest is the table's."""
    if result.get("corpus_sha256"):
        return result["corpus_sha256"]
    if result["manifest_sha256"] == lm_corpus.CORPUS_MANIFEST_SHA256:
        return lm_corpus.CORPUS_SHA256
    return f"manifest {result['manifest_sha256']}"


def corpus_line(corpus: str) -> str:
    """What the table says of its corpus: its hash, and whether it is the one
    ``lm_corpus.CORPUS_SHA256`` names."""
    if corpus == lm_corpus.CORPUS_SHA256:
        return (f"corpus sha256 {corpus[:16]} (Python 3.11.7's standard library; "
                f"`train_lm.py --write-corpus` writes it, `--corpus` reads it).")
    return f"corpus {corpus[:24]}, not the LM table's ({lm_corpus.CORPUS_SHA256[:16]})."


def spread(values: list[float], digits: int = 3) -> str:
    """``mean`` for one value (or several equal at ``digits``), ``mean (min–max)`` for more."""
    if not values:
        return "—"
    mean = statistics.fmean(values)
    low, high = f"{min(values):.{digits}f}", f"{max(values):.{digits}f}"
    if low == high:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ({low}–{high})"


def at_length(result: dict, length: int) -> float | None:
    for e in result.get("by_length") or ():
        if e["context"] == length:
            return e["val_bpb"]
    if length == result["context"] and result.get("whole_validation"):
        return result["whole_validation"]["val_bpb"]
    return None


def table(runs: dict, anchors: dict | None, lengths: list[int]) -> list[str]:
    head = ("| variant | seeds | " + " | ".join(f"{n:,}" for n in lengths)
            + " | tokens/s | peak RSS MiB | minutes | steps |")
    trained = sorted({r["context"] for rs in runs.values() for r in rs})
    lines = [f"Bits per byte on every validation byte, read in windows of each length "
             f"(trained at {', '.join(map(str, trained))}); with two seeds or more: mean "
             f"(range).", "", head,
             "|" + "---|" * (len(lengths) + 6)]
    if anchors:
        for name, bpb in anchors.get("compressors", {}).items():
            lines.append(f"| {name} (compressor, the whole set as one stream) | — |"
                         + f" {bpb:.3f} |" * len(lengths) + " — |" * 4)
        for order, bpb in sorted(anchors.get("kneser_ney", {}).items()):
            lines.append(f"| Kneser–Ney {order}-gram ({int(order) - 1} bytes of context, "
                         f"trained on the training split) | — |"
                         + f" {bpb:.3f} |" * len(lengths) + " — |" * 4)

    def key(item):
        values = [at_length(r, r["context"]) for r in item[1]]
        return statistics.fmean(v for v in values if v is not None) if any(
            v is not None for v in values) else 9.0

    for variant, rs in sorted(runs.items(), key=key):
        cells = [spread([v for r in rs if (v := at_length(r, n)) is not None]) for n in lengths]
        lines.append(
            f"| {variant} | {len(rs)} | " + " | ".join(cells)
            + f" | {spread([r['tokens_per_second'] for r in rs], 0)}"
            + f" | {spread([r['peak_rss_mib'] for r in rs], 0)}"
            + f" | {spread([r['train_seconds'] / 60 for r in rs], 1)}"
            + f" | {spread([r['steps'] for r in rs], 0)} |")
    return lines


def _values(ps: list[dict], field: str, key: str, layer: int, length: int) -> list:
    """Every run's ``key`` lists at ``layer`` and ``length`` of the probes' ``field``."""
    return [r[key] for p in ps for r in p[field] if r["layer"] == layer and r["length"] == length]


def _per_layer_rows(found: dict, field: str, per_head: str, lengths: list[int],
                    digits: int) -> list[str]:
    """Rows ``| variant | layer | each head's figure per length |`` of the probes' ``field``:
    each run's heads sorted by ``per_head``, then at each rank the seeds' lower median."""
    rows = ["| variant | layer | " + " | ".join(f"{n:,}" for n in lengths) + " |",
            "|" + "---|" * (len(lengths) + 2)]
    for v, ps in sorted(found.items()):
        for layer in sorted({r["layer"] for p in ps for r in p[field]}):
            cells = []
            for n in lengths:
                at = [sorted(v) for v in _values(ps, field, per_head, layer, n)]
                if not at:
                    cells.append("—")
                    continue
                heads = [statistics.median_low(rank) for rank in zip(*at, strict=True)]
                cells.append(" / ".join(f"{w:,.{digits}f}" for w in heads))
            rows.append(f"| {v} | {layer} | " + " | ".join(cells) + " |")
    return rows


def windows_section(probes: dict, lengths: list[int]) -> list[str]:
    lines = []
    cert = {v: ps for v, ps in probes.items() if any(p.get("certified") for p in ps)}
    if cert:
        tol = next(p["args"]["tol"] for ps in cert.values() for p in ps)
        lines += ["", f"Certified windows (tol = {tol:g}): each head's width W beyond which "
                      f"every token's posterior mass is proved ≤ tol (the median over "
                      f"validation windows), heads sorted by width; with seeds, the lower median "
                      f"at each rank. A width of L − 1 is the whole past.", "",
                  *_per_layer_rows(cert, "certified", "median_width", lengths, 0)]
    cred = {v: ps for v, ps in probes.items() if any(p.get("credible") for p in ps)}
    if cred:
        lines += ["", "Credible windows (expanding attention): each head's median over tokens "
                      "of the upper end of the 90% credible context length, heads sorted; with "
                      "seeds, the lower median at each rank.", "",
                  *_per_layer_rows(cred, "credible", "median_length_high", lengths, 1)]
    return lines


def passkey_means(ps: list[dict]) -> dict:
    """``{distance: (accuracy, planted-edge mass, uniform mass)}``, the seeds' means."""
    by = defaultdict(list)
    for p in ps:
        for r in p["passkey"]:
            by[r["distance"]].append(r)
    return {d: tuple(statistics.fmean(r[k] for r in rows)
                     for k in ("accuracy", "planted_edge_mass", "uniform_mass"))
            for d, rows in sorted(by.items())}


def passkey_section(probes: dict) -> list[str]:
    distances = sorted({r["distance"] for ps in probes.values() for p in ps for r in p["passkey"]})
    if not distances:
        return []
    lines = ["", "Passkey: the share of the five digits predicted (teacher-forced), and the last "
                 "layer's posterior mass on the planted digits; the seeds' mean.", "",
             "| variant | " + " | ".join(f"{d:,}" for d in distances) + " |",
             "|" + "---|" * (len(distances) + 1)]
    uniform = {}
    for v, ps in sorted(probes.items()):
        means = passkey_means(ps)
        uniform.update({d: m[2] for d, m in means.items()})
        lines.append(f"| {v} | " + " | ".join(
            f"{means[d][0]:.2f}, {means[d][1]:.1e}" if d in means else "—" for d in distances)
            + " |")
    lines.append("| uniform causal posterior's mass | "
                 + " | ".join(f"{uniform[d]:.1e}" for d in distances) + " |")
    return lines


def figures(runs, probes, anchors, lengths, out: pathlib.Path) -> list[pathlib.Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []

    def save(fig, name):
        fig.tight_layout()
        written.append(out / name)
        fig.savefig(written[-1], dpi=110)
        plt.close(fig)

    colours = {v: f"C{k}" for k, v in enumerate(sorted(runs))}
    marks = [(f"Kneser–Ney {o}-gram", b) for o, b in (anchors or {}).get("kneser_ney", {}).items()]
    marks += [(n, b) for n, b in (anchors or {}).get("compressors", {}).items() if n.startswith("xz")]
    trained = min(r["context"] for rs in runs.values() for r in rs)
    # left: every figure; right: the band around the anchors, where the variants that hold
    # their level beyond the training length differ
    points = {v: [(n, xs) for n in lengths
                  if (xs := [x for r in rs if (x := at_length(r, n)) is not None])]
              for v, rs in runs.items()}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax in axes:
        for v, rs in sorted(runs.items()):
            pts = points[v]
            ns = [n for n, _ in pts]
            ax.plot(ns, [statistics.fmean(xs) for _, xs in pts], "o-", color=colours[v],
                    label=f"{v} ({len(rs)} seed{'s' if len(rs) > 1 else ''})")
            ax.fill_between(ns, [min(xs) for _, xs in pts], [max(xs) for _, xs in pts],
                            color=colours[v], alpha=0.2, lw=0)
        for (name, bpb), style in zip(marks, ["--", "-.", ":", (0, (1, 3))] * len(marks),
                                      strict=False):
            ax.axhline(bpb, color="grey", ls=style, lw=1, label=name)
        ax.axvline(trained, color="grey", lw=0.8, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.set_xlabel("evaluation window (bytes); dotted: the training length")
    axes[0].set_ylabel("bits per byte, every validation byte")
    axes[0].set_title("Reading beyond the training length")
    if marks:
        seen = [x for pts in points.values() for _, xs in pts for x in xs] + [b for _, b in marks]
        axes[1].set_ylim(min(seen) - 0.1, max(b for _, b in marks) + 0.3)
    axes[1].set_title("The same, near the anchors")
    axes[1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    fig.suptitle("Byte-level LM, every variant trained for the same minutes", fontsize=11)
    save(fig, "lm_table_extrapolation.png")

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for v, rs in sorted(runs.items()):
        for k, r in enumerate(rs):
            h = r["history"]
            ax.plot([e["seconds"] / 60 for e in h], [e["val_bpb"] for e in h],
                    color=colours[v], alpha=1.0 if k == 0 else 0.5,
                    label=v if k == 0 else None)
    ax.set_xlabel("training minutes")
    ax.set_ylabel("bits per byte, 16 sampled validation windows")
    ax.set_ylim(top=3.5)
    ax.set_title("Training curves (each seed a line)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    save(fig, "lm_table_curves.png")

    cert = {v: ps for v, ps in probes.items() if any(p.get("certified") for p in ps)}
    cred = {v: ps for v, ps in probes.items() if any(p.get("credible") for p in ps)}
    if cert or cred:
        fig, ax = plt.subplots(figsize=(7.5, 4.5))
        ax.plot(lengths, [n - 1 for n in lengths], "k:", lw=1, label="the whole past (L − 1)")
        for v, ps in sorted(cert.items()):
            for layer in sorted({r["layer"] for p in ps for r in p["certified"]}):
                rows = {n: sum(_values(ps, "certified", "median_width", layer, n), [])
                        for n in lengths}
                tops = {n: sum(_values(ps, "certified", "largest_width", layer, n), [])
                        for n in lengths}
                ns = [n for n in lengths if rows[n]]
                ax.plot(ns, [statistics.median_low(rows[n]) for n in ns], "o-",
                        color=colours.get(v, "k"), alpha=1.0 if layer == 0 else 0.55,
                        label=f"{v}, layer {layer}: certified width, median head")
                ax.plot(ns, [max(tops[n]) for n in ns], "^:", color=colours.get(v, "k"),
                        alpha=1.0 if layer == 0 else 0.55,
                        label=f"{v}, layer {layer}: the widest head")
        for v, ps in sorted(cred.items()):
            for layer in sorted({r["layer"] for p in ps for r in p["credible"]}):
                rows = {n: sum(_values(ps, "credible", "median_length_high", layer, n), [])
                        for n in lengths}
                ns = [n for n in lengths if rows[n]]
                ax.plot(ns, [statistics.median_low(rows[n]) for n in ns], "s--",
                        color=colours.get(v, "k"), alpha=1.0 if layer == 0 else 0.55,
                        label=f"{v}, layer {layer}: 90% credible context")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
        ax.set_xlabel("evaluation window L (bytes)")
        ax.set_ylabel("tokens back")
        ax.set_title("How far back the trained models read")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
        save(fig, "lm_table_windows.png")

    if probes:
        fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
        uniform = {}
        for v, ps in sorted(probes.items()):
            means = passkey_means(ps)
            ds = list(means)
            uniform.update({d: m[2] for d, m in means.items()})
            left.plot(ds, [means[d][0] for d in ds], "o-", color=colours.get(v, "k"), label=v)
            right.plot(ds, [max(means[d][1], 1e-12) for d in ds], "o-",
                       color=colours.get(v, "k"), label=v)
        ds = sorted(uniform)
        right.plot(ds, [uniform[d] for d in ds], "k--", label="uniform causal posterior")
        for ax in (left, right):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("distance back to the passkey (bytes)")
        left.set_ylim(-0.05, 1.05)
        left.set_ylabel("share of the 5 digits predicted")
        left.set_title("Passkey retrieval (teacher-forced)")
        right.set_yscale("log")
        right.set_ylim(bottom=1e-12)
        right.set_ylabel("last layer's posterior mass on the digits")
        right.set_title("Does the model look at it? (edge posterior; floor 1e-12)")
        right.legend(fontsize=7)
        save(fig, "lm_table_passkey.png")
    return written


def write_into(doc: pathlib.Path, block: list[str]) -> None:
    """Replace what lies between ``MARKS`` in ``doc`` with ``block``."""
    text = doc.read_text()
    start, end = text.find(MARKS[0]), text.find(MARKS[1])
    if start < 0 or end < start:
        raise SystemExit(f"lm_table: {doc} has no {MARKS[0]} … {MARKS[1]} block to write into")
    doc.write_text(text[:start + len(MARKS[0])] + "\n\n" + "\n".join(block) + "\n\n"
                   + text[end:])


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", default=str(RESULTS / "lm_table"))
    p.add_argument("--anchors", default=str(RESULTS / "lm_anchors.json"))
    p.add_argument("--out", default=str(RESULTS))
    p.add_argument("--docs", action="store_true",
                   help="also write the main table into the README, gallery README and page")
    args = p.parse_args(argv)
    runs, probes = load(pathlib.Path(args.runs))
    if not runs:
        raise SystemExit(f"lm_table: no runs under {args.runs} (gallery/run_lm_table.sh "
                         f"makes them)")
    anchors_path = pathlib.Path(args.anchors)
    anchors = json.loads(anchors_path.read_text()) if anchors_path.exists() else None
    hashes = {r["manifest_sha256"] for rs in runs.values() for r in rs}
    if anchors and hashes != {anchors["manifest_sha256"]}:
        raise SystemExit(f"lm_table: the runs' corpora {sorted(h[:16] for h in hashes)} are not "
                         f"the anchors' ({anchors['manifest_sha256'][:16]})")
    corpora = {corpus_of(r) for rs in runs.values() for r in rs}
    if len(corpora) > 1:
        raise SystemExit(f"lm_table: the runs were trained on different corpora "
                         f"{sorted(c[:16] for c in corpora)}")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    devices = sorted({r.get("device", "cpu") for rs in runs.values() for r in rs})
    dtypes = sorted({r.get("dtype", "float32") for rs in runs.values() for r in rs})
    if dtypes != ["float32"]:  # --dtype bfloat16: the forward under autocast
        devices = [f"{', '.join(devices)} ({', '.join(dtypes)}, autocast)"]
    lengths = sorted({e["context"] for rs in runs.values() for r in rs
                      for e in r.get("by_length") or ()} | {r["context"] for rs in runs.values()
                                                          for r in rs})
    main_table = table(runs, anchors, lengths)
    lines = [f"Device: {', '.join(devices)}; {corpus_line(corpora.pop())}", "",
             *main_table, *windows_section(probes, lengths), *passkey_section(probes)]
    (out / "lm_table.md").write_text("\n".join(lines) + "\n")
    if args.docs:
        for doc, part in DOCS.items():  # the READMEs: the rows, without the sentence above
            write_into(doc, main_table[2:] if part == "main" else lines)
    written = [out / "lm_table.md", *figures(runs, probes, anchors, lengths, out)]
    for path in written:
        print("wrote", path)
    return [str(p) for p in written]


if __name__ == "__main__":
    main()
