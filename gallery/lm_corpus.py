"""The byte-level language model's corpus (``train_lm.py``): the standard library's source split
by file, one fixed corpus identified by its hash, written to a file that any machine reads.

**Built** (``stdlib_corpus``): the ``.py`` files under ``sysconfig.get_paths()["stdlib"]`` (no
site-packages, no caches), sorted by path; every 20th file (from the first) validates, so the
split is by file; each part is its files' bytes with a 0 byte after each file (0 never occurs
in source). A manifest lists each file's path, size and SHA-256 and one hash of them all.

**Identified** (``corpus_sha256``): sha256 of the two parts' sha256 digests, train then
validation — the bytes a model trains and is read on, whatever machine built them. The
standard library differs between Pythons (3.11's holds 1.5 MB of validation bytes, 3.12's
435 KB), so the corpus the LM table used (``gallery/results/lm_table/``) is named here by its
hash, ``CORPUS_SHA256``: Python 3.11.7's standard library, 1,790 files.

**Carried** (``write_corpus`` / ``read_corpus``): one gzip file, a JSON header line (the
format, the hash, both parts' lengths, the manifest) then the train and validation bytes;
``train_lm.py --write-corpus [PATH]`` writes the corpus built here (default ``CORPUS_FILE``,
a path git ignores, ~6 MB), ``train_lm.py --corpus [PATH]`` trains on it, and the scripts
that read a trained model (``lm_probes``, ``lm_anchors``, ``passkey_probe``, ``generate_lm``)
read it with the same ``--corpus [PATH]`` (``add_corpus_argument``, ``corpus_of``). Reading
checks the bytes against the header's hash.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import pathlib
import sysconfig

import torch

#: the corpus the LM table was trained and read on: Python 3.11.7's standard library, 1,790
#: files, 30,012,231 train and 1,514,783 validation bytes
CORPUS_SHA256 = "84316cc5817cc1dfd66aa4ae42a5836b4f8e3ca1ceb11965b7761f67f881d70d"
#: the same corpus's manifest hash (of its files' hashes), which every table record carries
CORPUS_MANIFEST_SHA256 = "76667ce0ce982c205016f94e852fff0ba246582bb464f27afd7c5b023b0dc779"
#: where ``--write-corpus`` and ``--corpus`` without a path write and read (git ignores it)
CORPUS_FILE = pathlib.Path(__file__).resolve().parent / "corpus" / "stdlib.corpus.gz"
FORMAT = "structattn byte-LM corpus 1"


def stdlib_files(root: str | None = None) -> list[pathlib.Path]:
    """The standard library's ``.py`` files, sorted (no site-packages, no caches)."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    skip = {"site-packages", "dist-packages", "__pycache__"}
    return sorted(p for p in base.rglob("*.py") if not skip & set(p.relative_to(base).parts))


def corpus_sha256(train: torch.Tensor, val: torch.Tensor) -> str:
    """The corpus's identity: sha256 of sha256(train bytes) ‖ sha256(validation bytes)."""
    digests = b"".join(hashlib.sha256(t.numpy().tobytes()).digest() for t in (train, val))
    return hashlib.sha256(digests).hexdigest()


def stdlib_corpus(root: str | None = None, max_files: int | None = None):
    """``(train, validation, manifest)``: uint8 tensors and the manifest (every 20th file
    validates; ``max_files``: the first so many files only, for tiny runs)."""
    base = pathlib.Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(str(base))[:max_files]
    if not files:
        raise FileNotFoundError(f"no .py files under {base}")
    parts = {"train": [], "validation": []}
    entries = []
    for k, path in enumerate(files):
        data = path.read_bytes()
        split = "validation" if k % 20 == 0 else "train"
        parts[split].append(data)
        entries.append({"path": str(path.relative_to(base)), "bytes": len(data),
                        "sha256": hashlib.sha256(data).hexdigest(), "split": split})
    whole = hashlib.sha256("".join(e["sha256"] for e in entries).encode()).hexdigest()
    manifest = {"root": str(base), "files": len(entries), "sha256": whole,
                "train_bytes": sum(len(d) + 1 for d in parts["train"]),
                "validation_bytes": sum(len(d) + 1 for d in parts["validation"]),
                "entries": entries}
    train, val = (torch.frombuffer(bytearray(b"\0".join(parts[s]) + b"\0"), dtype=torch.uint8)
                  for s in ("train", "validation"))
    manifest["corpus_sha256"] = corpus_sha256(train, val)
    return train, val, manifest


def text_corpus(path: str):
    """Any text file: its first 95% trains, the rest validates."""
    data = pathlib.Path(path).read_bytes()
    cut = int(len(data) * 0.95)
    manifest = {"root": str(path), "files": 1, "sha256": hashlib.sha256(data).hexdigest(),
                "train_bytes": cut, "validation_bytes": len(data) - cut}
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    train, val = whole[:cut].clone(), whole[cut:].clone()
    manifest["corpus_sha256"] = corpus_sha256(train, val)
    return train, val, manifest


def write_corpus(path, train: torch.Tensor, val: torch.Tensor, manifest: dict) -> str:
    """Write the corpus to ``path`` (gzip: a JSON header line, then the train and validation
    bytes); the same corpus gives the same file. Returns its hash."""
    digest = corpus_sha256(train, val)
    header = {"format": FORMAT, "corpus_sha256": digest, "train_bytes": len(train),
              "validation_bytes": len(val), "manifest": dict(manifest, corpus_sha256=digest)}
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as f:
        f.write(json.dumps(header).encode() + b"\n")
        f.write(train.numpy().tobytes())
        f.write(val.numpy().tobytes())
    part.replace(path)
    return digest


def read_corpus(path):
    """``(train, validation, manifest)`` from a file ``write_corpus`` wrote, its bytes checked
    against the hash its header states."""
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"--corpus: {path} does not exist (train_lm.py --write-corpus "
                                f"{path} writes it where the corpus can be built)")
    with gzip.open(path, "rb") as f:
        try:
            header = json.loads(f.readline())
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("format") != FORMAT:
            raise ValueError(f"--corpus: {path} is not a corpus file (expected a header line "
                             f"of format {FORMAT!r})")
        n_train, n_val = header["train_bytes"], header["validation_bytes"]
        data = f.read()
    if len(data) != n_train + n_val:
        raise ValueError(f"--corpus: {path} holds {len(data):,} bytes after its header; its "
                         f"header states {n_train + n_val:,}")
    whole = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    train, val = whole[:n_train].clone(), whole[n_train:].clone()
    digest = corpus_sha256(train, val)
    if digest != header["corpus_sha256"]:
        raise ValueError(f"--corpus: {path}'s bytes hash to {digest[:16]}…, not the "
                         f"{header['corpus_sha256'][:16]}… its header states (a damaged file)")
    return train, val, dict(header["manifest"], corpus_file=str(path))


def add_corpus_argument(parser) -> None:
    """``--corpus [PATH]`` on a script's ``parser``: the corpus file instead of this Python's
    standard library (``corpus_of``)."""
    parser.add_argument("--corpus", nargs="?", const=str(CORPUS_FILE), metavar="PATH",
                        help="read the corpus file train_lm.py --write-corpus wrote (default "
                             "path: gallery/corpus/stdlib.corpus.gz) instead of building it "
                             "from this Python's standard library")


def corpus_of(args, who: str):
    """``(train, validation, manifest)`` a script reads: ``args.corpus``'s file where given,
    else this Python's standard library (its first ``args.max_files`` files where given);
    both at once refused in one line naming ``who``."""
    path, max_files = getattr(args, "corpus", None), getattr(args, "max_files", None)
    if path and max_files:
        raise SystemExit(f"{who}: --corpus reads a whole corpus file and --max-files builds a "
                         f"smaller one from this Python's library; give one of them")
    return read_corpus(path) if path else stdlib_corpus(max_files=max_files)


def corpus_arguments(args) -> list:
    """The ``train_lm.py`` arguments that train on the corpus a script reads: ``--corpus``'s
    file, or the first N files (another corpus than the LM table's, by choice)."""
    if getattr(args, "corpus", None):
        return ["--corpus", str(args.corpus)]
    if getattr(args, "max_files", None):
        return ["--max-files", str(args.max_files), "--any-corpus"]
    return []
