"""Group the package's top-level modules by job, so that ``structattn/`` shows its architecture:
its top level holds the public entry points, and each group of internal modules is a folder.

Run from the repository's root, on a clean checkout: ``python scripts/regroup.py``. It moves the
modules and their tests with ``git mv`` and rewrites every reference to them: imports (absolute
``structattn.x``, relative ``from .x`` / ``from ..x``, ``from . import x``), dotted names in
strings and documents (``"structattn.certified.window_bound"``, ``::: structattn.trace``),
``sa.x`` attribute paths, file paths (``structattn/replay.py``, ``tests/test_replay.py``) and
the layout blocks of the README, the development guide and DESIGN.md; then it sorts the
imports it touched (``ruff check --fix --select I``). It is idempotent: run again (after
merging branches that still use the old names), it moves what is left and rewrites what still
names a module where it was; on a regrouped tree it changes nothing. ``--dry-run`` lists what
it would do. Bare mentions of a moved file's name (``replay.py`` without its folder) are
listed at the end for a reader to check; they are not rewritten.

The grouping (each group a subpackage whose ``__init__.py`` holds only its docstring, so that
importing a module of a group runs nothing else and the import graph gains no edge):

- top level, the public entry points: ``__init__`` and ``_links`` (the clone's guard, first
  on import); the declaration language ``nodes``, ``family`` (edges, potential, value),
  ``latent`` (latent, infer, iteration), ``energy``, ``declaration``, ``heads``; ``compiler``
  (compile) and ``export``; ``cli`` (the console script); and the modules the package
  exports as modules, ``reading``, ``checks``, ``kernels``, ``block_sparse``. Subpackages
  unchanged: ``kinds``, ``priors``, ``potentials``, ``values``, ``readers``, ``plans``,
  ``windows``, ``decoding``, ``measures``, ``drawing``, ``triton_kernels``, ``csrc``, and the
  linked ``models`` and ``inference``.
- ``certificates/``: certified truncation and the bounds it rests on: ``certified`` (certified
  windows), ``certified_read`` (a band certified from the band kernel's own log-sums),
  ``ceilings`` (score upper bounds), ``block_choice`` (the key blocks a certified block-sparse
  reading reads), ``credible`` (credible context lengths under the geometric–Beta prior),
  ``beta`` (the Beta tails and quantiles behind the geometric–Beta prior's bounds).
- ``operators/``: the attention operators in torch that a kind or a scheme reads through:
  ``band`` (blocked banded attention), ``segment`` and ``segment_checks`` (graph attention
  over an edge list, and its argument checks), ``_eager`` (an operator's
  ``torch.compiler.disable`` on first call).
- ``iterative/``: the iterative engine: ``iterate`` (the latents' loop and update rules),
  ``divergence`` (the watch on gradient steps), ``scheme`` (the contract of an inference
  scheme the compiled reader iterates).
- ``compiling/``: what a compiled module does per call: ``lowering`` (a family → its
  operator, or its scheme's), ``replay`` (plans per input signature; the plans' parts stay in
  ``plans/``), ``trace`` (what a call reports).
- ``checking/``: the value and argument checks shared by every module: ``_validation``
  (switchable value checks), ``verdicts`` (checks queued on a GPU), ``output_batch`` (the
  output's batch dims), ``renamed`` (arguments no longer taken, refused in one line).

The tests follow: tests of a moved module go to ``tests/<group>/`` (``tests/iterate/`` becomes
``tests/iterative/``). Public names are unchanged: everything ``structattn/__init__.py``
exports, and the modules ``structattn.reading``, ``.checks``, ``.kernels``, ``.block_sparse``,
``.models``, ``.inference``.
"""

from __future__ import annotations

import argparse
import ast
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: group → (its docstring, the top-level modules it takes)
GROUPS = {
    "certificates": ("Certified truncation and the bounds it rests on: certified windows "
                     "(``certified``), a band\ncertified from the band kernel's own log-sums "
                     "(``certified_read``), score ceilings\n(``ceilings``), the key blocks a "
                     "certified block-sparse reading reads\n(``block_choice``), credible context "
                     "lengths (``credible``) and the Beta tails and quantiles\nbehind the "
                     "geometric–Beta prior's bounds (``beta``).",
                     ["certified", "certified_read", "ceilings", "block_choice", "credible", "beta"]),
    "operators": ("The attention operators in torch that a support kind or a scheme reads "
                  "through: blocked\nbanded attention (``band``), graph attention over an edge "
                  "list (``segment``) and its\nargument checks (``segment_checks``), and an "
                  "operator's ``torch.compiler.disable`` on first call\n(``_eager``).",
                  ["band", "segment", "segment_checks", "_eager"]),
    "iterative": ("The iterative engine: the latents' loop and its update rules (``iterate``), "
                  "the watch on\ngradient steps (``divergence``) and the contract of an "
                  "inference scheme the compiled reader\niterates (``scheme``).",
                  ["iterate", "divergence", "scheme"]),
    "compiling": ("What a compiled module does per call: a family's operator (``lowering``), "
                  "its plans per\ninput signature (``replay``; the plans' parts are "
                  "``structattn.plans``) and what a call\nreports (``trace``).",
                  ["lowering", "replay", "trace"]),
    "checking": ("The value and argument checks every module shares: switchable value checks "
                 "(``_validation``),\nchecks queued on a GPU (``verdicts``), the output's batch "
                 "dims (``output_batch``) and the\narguments no longer taken, refused in one line "
                 "(``renamed``).",
                 ["_validation", "verdicts", "output_batch", "renamed"]),
}

#: test files (or folders) → the folder they move into
TESTS = {
    "tests/priors/test_block_choice.py": "tests/certificates",
    "tests/priors/test_credible_context.py": "tests/certificates",
    "tests/priors/test_certified_truncation.py": "tests/certificates",
    "tests/priors/test_certified_distance_priors.py": "tests/certificates",
    "tests/test_segment.py": "tests/operators",
    "tests/test_lowering.py": "tests/compiling",
    "tests/test_replay.py": "tests/compiling",
    "tests/test_replay_safety.py": "tests/compiling",
    "tests/test_verdicts.py": "tests/checking",
    "tests/test_renamed.py": "tests/checking",
    "tests/test_output_batch.py": "tests/checking",
    "tests/iterate": "tests",  # the folder itself, renamed below
}
RENAMED_FOLDERS = {"tests/iterate": "tests/iterative"}

#: the folders at the repository's top that the package reaches through its links
LINKED = {"models": "structattn.models", "inference": "structattn.inference"}

#: text files whose references are rewritten (besides every tracked .py file)
TEXT_SUFFIXES = (".py", ".md", ".toml", ".yml", ".yaml", ".cfg", ".txt", ".sh", ".rst", ".ini")
#: never rewritten: measurements and the pictures' records
SKIP = ("benchmarks/results/", "gallery/results/")

#: exact replacements in prose (the layout blocks), applied where the old text is found
PROSE = [
    ("README.md",
     """              shares no code with it); lowering, scheme, windows/ (expanding attention's
              mean-field scheme); band, certified, ceilings, block_sparse, block_choice
              (certified truncation); kernels + csrc/ (C++ CPU kernels), triton_kernels/
              (the GPU's); iterate (latents' loop); replay + plans/ (compile once per input
              signature); decoding/ (the cache); export; measures/; drawing/; cli
""",
     """              shares no code with it); windows/ (expanding attention's mean-field scheme);
              block_sparse + certificates/ (certified truncation); operators/ (banded and
              graph attention); kernels + csrc/ (C++ CPU kernels), triton_kernels/ (the
              GPU's); iterative/ (latents' loop); compiling/ + plans/ (compile once per input
              signature); checking/; decoding/ (the cache); export; measures/; drawing/; cli
"""),
    ("docs/development.md",
     """              ReadingContext holding the modes), readers/ (the compiled reading Marginalise,
              and the oracle's TraceStructure, which shares no code with it), lowering """
     """(a family → its operator, or its
              inference scheme's), scheme (the InferenceScheme contract), windows/ (the
              geometric–Beta prior's mean-field scheme: options, window rules, band scores,
              the Python loop, the kernel's typed interface), band (blocked banded SDPA),
              beta (Beta tails and quantiles), certified + ceilings (certified windows and
              the score bounds they rest on), block_sparse + block_choice (certified key """
     """blocks; which to read), kernels +
""",
     """              ReadingContext holding the modes), readers/ (the compiled reading Marginalise,
              and the oracle's TraceStructure, which shares no code with it), windows/ (the
              geometric–Beta prior's mean-field scheme: options, window rules, band scores,
              the Python loop, the kernel's typed interface), certificates/ (certified
              windows, the score ceilings they rest on, credible context lengths, Beta tails
              and quantiles), block_sparse + certificates/block_choice (certified key
              blocks; which to read), operators/ (blocked banded SDPA, graph attention over
              an edge list), kernels +
"""),
    ("docs/development.md",
     """              prior and expanding attention's mean field in Triton), iterate (the latents' """
     """loop and its update rules), trace
              (what a call reports), compiler, replay + plans/ (one plan per input
              signature: record once, replay the tensor work), verdicts (checks queued on a
              GPU), export (torch.export programs that need no structattn), measures/
""",
     """              prior and expanding attention's mean field in Triton), iterative/ (the
              latents' loop and its update rules, the InferenceScheme contract), compiler,
              compiling/ (lowering: a family → its operator, or its inference scheme's;
              replay + plans/: one plan per input signature, record once, replay the tensor
              work; trace: what a call reports), checking/ (value checks, checks queued on
              a GPU, refused arguments), export (torch.export programs that need no
              structattn), measures/
"""),
]

#: lines the longer names make too long (ruff's E501), rewrapped after the rewrite
FIXUPS = [
    ("models/alibi_attention.py",
     "    (``structattn.certificates.certified``); ``block_size``: that band's block of tokens; "
     "``certificate=\"blocks\"``: read\n",
     "    (``structattn.certificates.certified``); ``block_size``: that band's block of tokens;\n"
     "    ``certificate=\"blocks\"``: read\n"),
    ("tests/priors/test_tables.py",
     "    check, kernel_check = structattn.priors.tables.check_edge_index, "
     "structattn.operators.segment_checks._check_values\n",
     "    check = structattn.priors.tables.check_edge_index\n"
     "    kernel_check = structattn.operators.segment_checks._check_values\n"),
    ("tests/priors/test_tables.py",
     "    monkeypatch.setattr(structattn.operators.segment_checks, \"_check_values\", "
     "counting(\"kernel\", kernel_check))\n",
     "    monkeypatch.setattr(structattn.operators.segment_checks, \"_check_values\",\n"
     "                        counting(\"kernel\", kernel_check))\n"),
]

CHANGELOG_LINE = (
    "- The package's internal modules are grouped by job in subpackages (`certificates/`, "
    "`operators/`,\n  `iterative/`, `compiling/`, `checking/`); the top level holds the public "
    "entry points. Public\n  names are unchanged; code that imported an internal module by its "
    "old path (`structattn.certified`,\n  `structattn.replay`, …) imports it from its group "
    "(`structattn.certificates.certified`, …).\n")


def moves() -> tuple[dict[str, str], dict[str, str]]:
    """(old dotted module → new, old path → new path) for the package's modules and the tests."""
    modules, paths = {}, {}
    for group, (_doc, names) in GROUPS.items():
        for name in names:
            modules[f"structattn.{name}"] = f"structattn.{group}.{name}"
            paths[f"structattn/{name}.py"] = f"structattn/{group}/{name}.py"
    for old, folder in TESTS.items():
        new = RENAMED_FOLDERS.get(old, f"{folder}/{pathlib.PurePosixPath(old).name}")
        paths[old] = new
        modules[_dotted(old)] = _dotted(new)
    return modules, paths


def _dotted(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def module_of(path: str) -> tuple[str, bool] | None:
    """The dotted module a tracked .py file is, and whether it is a package's ``__init__``;
    None outside a package."""
    parts = list(pathlib.PurePosixPath(path).with_suffix("").parts)
    if parts[0] in LINKED:
        parts = LINKED[parts[0]].split(".") + parts[1:]
    elif parts[0] not in ("structattn", "tests"):
        return None
    init = parts[-1] == "__init__"
    return ".".join(parts[:-1] if init else parts), init


def remap(name: str, modules: dict[str, str]) -> str:
    """``name`` after the moves (a moved module, or anything under a renamed folder)."""
    for old, new in modules.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old):]
    return name


def render(package: list[str], target: str, relative: bool) -> str:
    """The ``from`` part naming ``target`` from a module in ``package``: relative where the
    original was and both lie in one top-level package."""
    parts = target.split(".")
    if not relative or not package or parts[0] != package[0]:
        return target
    common = 0
    while common < min(len(package), len(parts)) and package[common] == parts[common]:
        common += 1
    return "." * (len(package) - common + 1) + ".".join(parts[common:])


def rewrite_imports(path: str, text: str, modules: dict[str, str], new_path: str) -> str:
    """Every ``from … import …`` of ``text`` (the file at ``path``, to be at ``new_path``),
    naming each module where it will be."""
    here = module_of(path)
    if here is None:  # a script outside the packages: its imports are absolute
        package = new_package = []
    else:
        name, init = here
        package = name.split(".") if init else name.split(".")[:-1]
        new_name, _ = module_of(new_path)
        new_package = new_name.split(".") if init else new_name.split(".")[:-1]
    lines = text.splitlines(keepends=True)
    offsets = [0]
    for line in lines:
        offsets.append(offsets[-1] + len(line))
    edits = []
    for node in ast.walk(ast.parse(text, filename=path)):
        if not isinstance(node, ast.ImportFrom):
            continue
        if node.level:
            base = package[:len(package) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module
        relative = node.level > 0
        new_target = remap(target, modules)
        # names that are moved modules: ``from . import certified``
        groups: dict[str, list[ast.alias]] = {}
        for alias in node.names:
            full = f"{target}.{alias.name}"
            moved = remap(full, modules)
            parent = moved.rpartition(".")[0] if moved != full else new_target
            groups.setdefault(parent, []).append(alias)
        old_from = ("." * node.level) + (node.module or "")
        start = offsets[node.lineno - 1] + node.col_offset
        end = offsets[node.end_lineno - 1] + node.end_col_offset
        segment = text[start:end]
        if len(groups) == 1:
            (parent,) = groups
            new_from = render(new_package, parent, relative)
            if new_from == old_from:
                continue
            head = re.match(r"from\s+(\S+)\s+import", segment)
            assert head and head.group(1) == old_from, (path, segment)
            edits.append((start + head.start(1), start + head.end(1), new_from))
            continue
        indent = " " * node.col_offset
        statements = []
        for parent, aliases in groups.items():
            names = ", ".join(a.name + (f" as {a.asname}" if a.asname else "") for a in aliases)
            statements.append(f"from {render(new_package, parent, relative)} import {names}")
        edits.append((start, end, f"\n{indent}".join(statements)))
    for start, end, new in sorted(edits, reverse=True):
        text = text[:start] + new + text[end:]
    return text


def rewrite_text(path: str, text: str, modules: dict[str, str], paths: dict[str, str]) -> str:
    """Dotted names, ``sa.`` attribute paths and file paths of moved modules, in any text."""
    package_moves = {o: n for o, n in modules.items() if o.startswith("structattn.")}
    for old, new in package_moves.items():
        text = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, text)
        if path.endswith((".py", ".md")):
            short, new_short = old.removeprefix("structattn."), new.removeprefix("structattn.")
            text = re.sub(rf"(?<![\w.])sa\.{re.escape(short)}\b", f"sa.{new_short}", text)
    for old, new in paths.items():
        text = re.sub(rf"(?<![\w./]){re.escape(old)}(?![\w])", new, text)
    for old, new in modules.items():  # the tests' dotted names (tests.iterate.test_engine)
        if old.startswith("tests."):
            text = re.sub(rf"(?<![\w.]){re.escape(old)}\b", new, text)
    return text


def deeper(path: str, new_path: str, text: str) -> str:
    """A test moved one folder deeper: ``Path(__file__)…parents[N]`` gains the level."""
    shift = new_path.count("/") - path.count("/")
    if not shift or "__file__" not in text:
        return text
    text, n = re.subn(r"(Path\(__file__\)\.resolve\(\)\.parents\[)(\d+)\]",
                      lambda m: f"{m.group(1)}{int(m.group(2)) + shift}]", text)
    if text.count("__file__") > n:
        print(f"check by hand: {new_path} uses __file__ in a way not rewritten", file=sys.stderr)
    return text


def tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (ROOT / p).is_file()
            and not (ROOT / p).is_symlink()]


def new_location(path: str, paths: dict[str, str]) -> str:
    for old, new in paths.items():
        if path == old or path.startswith(old + "/"):
            return new + path[len(old):]
    return path


DESIGN_SECTION = """## The package's folders: public entry points at the top, the rest by job

**Decision.** The modules at the top of `structattn/` are the public entry points: the
declaration language (`nodes`, `family`, `latent`, `energy`, `declaration`, `heads`),
`compiler` and `export`, `cli`, and the modules the package exports as modules (`reading`,
`checks`, `kernels`, `block_sparse`), with `_links` (the clone's guard). Every other module
belongs to a folder named for its job: `certificates/` (certified truncation and its bounds),
`operators/` (banded and graph attention in torch), `iterative/` (the latents' loop, its
divergence watch, the scheme contract), `compiling/` (a family's operator, the plans per
signature, what a call reports) and `checking/` (the checks every module shares), beside the
subpackages that were folders already (`kinds/`, `priors/`, `potentials/`, `values/`,
`readers/`, `plans/`, `windows/`, `decoding/`, `measures/`, `drawing/`, `triton_kernels/`).
The tests follow the package (`tests/certificates/`, …).

**Why.** A reader looking for the certificates, or for what runs per call, finds a folder,
not a name among thirty. Each group's `__init__.py` holds only its docstring: importing a
module of a group runs nothing else, so no import order changed and the import graph
(`tests/test_imports.py`) has no new edge. The public names did not move: what
`structattn/__init__.py` exports, and the modules it exports as modules, keep their paths.

"""


def design(text: str) -> str:
    """DESIGN.md with the folders' section, once, before the reading stack's, and its bare
    names of moved files (`` `replay.py` ``, which all name the package's top) with their
    folder."""
    for group, (_doc, names) in GROUPS.items():
        for name in names:
            text = re.sub(rf"`{re.escape(name)}\.py\b", f"`{group}/{name}.py", text)
    if "## The package's folders" in text:
        return text
    mark = "## One reading stack"
    return text.replace(mark, DESIGN_SECTION + mark, 1) if mark in text else text + "\n" + DESIGN_SECTION


def changelog(text: str) -> str:
    """The Unreleased section rewritten, the released ones as they were; the line added once."""
    head, sep, rest = text.partition("## Unreleased\n")
    if not sep:
        return text
    body, nxt, tail = rest.partition("\n## ")
    if "grouped by job in subpackages" not in body:
        if body.startswith("\n**Changed.**\n"):
            body = "\n**Changed.**\n" + CHANGELOG_LINE + body.removeprefix("\n**Changed.**\n")
        else:
            body = f"\n**Changed.**\n{CHANGELOG_LINE}" + body
    return head + sep + body + nxt + tail


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="list what would change")
    parser.add_argument("--allow-dirty", action="store_true", help="run on uncommitted changes")
    args = parser.parse_args()
    status = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True,
                            text=True, check=True).stdout
    if status.strip() and not (args.allow_dirty or args.dry_run):
        print("regroup: the working tree has uncommitted changes; commit them first "
              "(or --allow-dirty)", file=sys.stderr)
        return 2
    modules, paths = moves()
    # what moves: each old file that is still there (a second run finds none, or the files a
    # merge brought back at their old places)
    moving = {}
    for path in tracked():
        new = new_location(path, paths)
        if new != path:
            if (ROOT / new).exists():
                print(f"regroup: both {path} and {new} exist; merge them by hand", file=sys.stderr)
                return 2
            moving[path] = new
    changed = []
    for path in tracked():
        if not path.endswith(TEXT_SUFFIXES) or path.startswith(SKIP) or path == "scripts/regroup.py":
            continue
        file = ROOT / path
        text = file.read_text()
        new_path = moving.get(path, path)
        new = rewrite_imports(path, text, modules, new_path) if path.endswith(".py") else text
        if path == "CHANGELOG.md":  # the released sections say what was true then
            head, sep, rest = new.partition("## Unreleased\n")
            body, nxt, tail = rest.partition("\n## ")
            new = changelog(head + sep + rewrite_text(path, body, modules, paths) + nxt + tail)
        else:
            new = rewrite_text(path, new, modules, paths)
        if path == "DESIGN.md":
            new = design(new)
        if path in moving:
            new = deeper(path, new_path, new)
        for where, old, replacement in PROSE + FIXUPS:
            if where == path and old in new:
                new = new.replace(old, replacement)
        if new != text:
            changed.append(new_path)
            if not args.dry_run:
                file.write_text(new)
    for where, _old, replacement in PROSE:
        if not args.dry_run and replacement not in (ROOT / where).read_text():
            print(f"check by hand: the layout text in {where} was not found to rewrite",
                  file=sys.stderr)
    for path, new in sorted(moving.items()):
        print(f"move {path} -> {new}")
        if not args.dry_run:
            (ROOT / new).parent.mkdir(parents=True, exist_ok=True)
            subprocess.run(["git", "mv", path, new], cwd=ROOT, check=True)
    for group, (doc, _names) in GROUPS.items():
        for init, text in ((f"structattn/{group}/__init__.py", f'"""{doc}"""\n'),
                           (f"tests/{group}/__init__.py", "")):
            if not (ROOT / init).exists() and (ROOT / init).parent.exists() and not args.dry_run:
                (ROOT / init).write_text(text)
                subprocess.run(["git", "add", init], cwd=ROOT, check=True)
                changed.append(init)
    for path in changed:
        print(f"rewrite {path}")
    python = [p for p in changed if p.endswith(".py") and (ROOT / p).exists()]
    if python and not args.dry_run:
        ruff = subprocess.run([sys.executable, "-m", "ruff", "check", "--fix", "--select", "I",
                               "--quiet", *python], cwd=ROOT)
        if ruff.returncode:
            print("check by hand: ruff could not sort every import", file=sys.stderr)
        subprocess.run(["git", "add", "-A", *python], cwd=ROOT, check=True)
        long = subprocess.run([sys.executable, "-m", "ruff", "check", "--select", "E501",
                               "--output-format", "concise", "--quiet", *python],
                              cwd=ROOT, capture_output=True, text=True).stdout
        for line in long.splitlines():
            print(f"check by hand: {line}", file=sys.stderr)
    # bare mentions of a moved file's name, for a reader to check
    bare = re.compile(r"(?<![\w/.])(" + "|".join(
        re.escape(pathlib.PurePosixPath(o).name) for o in paths if o.endswith(".py")) + r")\b")
    for path in tracked():
        if path.endswith((".md", ".py")) and not path.startswith(SKIP) and path != "scripts/regroup.py":
            for n, line in enumerate((ROOT / path).read_text().splitlines(), 1):
                if bare.search(line) and path != "CHANGELOG.md":
                    print(f"mention {path}:{n}: {line.strip()[:100]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
