"""The import graph of structattn/ for ``tests/test_imports.py``, and DESIGN.md's layers.

The import graph is read with ``ast`` (no module is executed): every ``import`` and ``from …
import`` anywhere in a module, at the top level or inside a function, is an edge to the module
it names; relative imports are resolved; ``from package import name`` is an edge to the
submodule ``package.name`` when there is one, else to the package (its ``__init__``, whose
re-exports are in turn its edges). Importing ``a.b.c`` also runs the packages ``a`` and ``a.b``:
those are edges too, except for the importing module's own enclosing packages, which are
already being initialised when it runs — unless it names one of them explicitly
(``import structattn`` inside ``structattn/models/x.py`` is an edge to ``structattn``). Imports by
``importlib.import_module`` are not read, with one exception stated here: the catalogue's
``register`` imports each listed model file, so ``structattn.models`` has an edge to each.
"""

import ast
import pathlib
import re

from .tree import files

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: dotted package → folder (the catalogue and the inference are subpackages of structattn/,
#: reached through its links structattn/models and structattn/inference)
PACKAGES = {"structattn": ROOT / "structattn"}


def discover(packages):
    """Dotted module name → path, for every ``.py`` file under the packages' folders."""
    modules = {}
    for package, folder in packages.items():
        for path in files(folder):  # the linked catalogue and inference included
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


def _enclosing(name):
    """The packages enclosing ``name``: ``a.b.c`` → ``[a, a.b]``."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_edges(name, path, modules):
    """``[(target, line, in_function)]``: the project modules that module ``name`` imports."""
    tree = ast.parse(path.read_text(), filename=str(path))
    in_function = set()
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(fn) if n is not fn)
    edges = []

    def edge(target, node, named):
        if target not in modules:
            return  # not ours (torch, pyro, …)
        if not named and (target == name or target in _enclosing(name)):
            return  # run implicitly, but already initialising when this module runs
        edges.append((target, node.lineno, id(node) in in_function))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                edge(alias.name, node, True)
                for package in _enclosing(alias.name):
                    edge(package, node, False)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from the module's package, one level up per extra dot
                package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
                package = package[:len(package) - (node.level - 1)]
                base = ".".join(package + ([node.module] if node.module else []))
            else:
                base = node.module
            for package in _enclosing(base):
                edge(package, node, False)
            names = [alias.name for alias in node.names]
            submodules = [n for n in names if f"{base}.{n}" in modules]
            for n in submodules:
                edge(f"{base}.{n}", node, True)
            # a name from the package's namespace needs its __init__; importing only
            # submodules runs it too (implicitly)
            edge(base, node, len(submodules) < len(names))
    return edges


def import_graph(packages=None):
    """Module → its import edges; for this project (``packages=None``) with the catalogue's
    ``register`` edges, structattn.models → each model file it lists."""
    modules = discover(PACKAGES if packages is None else packages)
    graph = {name: import_edges(name, path, modules) for name, path in modules.items()}
    if packages is None:
        import structattn.models

        graph["structattn.models"] += [(f"structattn.models.{name}", 0, False)
                                       for name in structattn.models.CATALOGUE]
    return graph


def import_cycles(graph):
    """Strongly connected components with more than one module, and modules that import
    themselves (Tarjan's algorithm), each as a sorted list of module names."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w, *_ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while not component or component[-1] != v:
                component.append(stack.pop())
                on_stack.discard(component[-1])
            if len(component) > 1 or any(w == v for w, *_ in graph[v]):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def describe(graph, cycles):
    """Each cycle with the imports (module:line → module) that close it."""
    lines = []
    for component in cycles:
        lines.append("cycle: " + ", ".join(component))
        for v in component:
            for w, line, in_function in sorted(set(graph[v])):
                if w in component:
                    lines.append(f"    {v}:{line} → {w}" + ("  (inside a function)" if in_function
                                                             else ""))
    return "\n".join(lines)


def layer_table(text):
    """``{name: layer}`` from the table of DESIGN.md's section "Layers": each row's number, and
    the names in backquotes of its second column (``kinds/`` a folder, ``family`` a module at
    the package's top, ``__init__`` the package's own). A name in two rows is an error."""
    section = re.search(r"^## Layers.*?(?=^## |\Z)", text, flags=re.M | re.S).group()
    table = {}
    for number, names in re.findall(r"^\| *(\d+) *\|([^|]*)\|", section, flags=re.M):
        for name in re.findall(r"`([^`]+)`", names):
            assert name not in table, f"{name} is in layers {table[name]} and {number}"
            table[name] = int(number)
    return table


def layer_name(module, path):
    """The name DESIGN.md's table gives the module's row: ``structattn`` → ``__init__``,
    ``structattn.family`` → ``family``, ``structattn.kinds`` and ``structattn.kinds.base`` →
    ``kinds/``."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    if len(parts) > 1 or path.name == "__init__.py":
        return parts[0] + "/"
    return parts[0]


def upward_edges(graph, layer):
    """Each edge that goes up, ``module:line → target (layer a → layer b)``; ``layer`` maps a
    module to its layer."""
    return [f"{v}:{line} → {w} (layer {layer[v]} → {layer[w]})"
            + ("  (inside a function)" if in_function else "")
            for v in sorted(graph) for w, line, in_function in sorted(set(graph[v]))
            if layer[w] > layer[v]]
