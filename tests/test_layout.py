"""The package stays readable: small files and functions, priors read through declared hooks,
and nothing attached to a class from outside its definition."""

import ast
import pathlib
import re

import structattn

from .tree import files

PACKAGE = pathlib.Path(structattn.__file__).parent
SOURCES = files(PACKAGE)  # the linked catalogue and inference included
MAX_FILE_LINES, MAX_FUNCTION_LINES = 400, 80


def _rel(path):
    return path.relative_to(PACKAGE).as_posix()


def test_no_file_over_400_lines():
    long = {_rel(p): n for p in SOURCES if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


def test_no_function_over_80_lines():
    long = {}
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{_rel(path)}:{node.lineno} {node.name}"] = n
    assert long == {}


def test_a_prior_is_read_through_the_hooks_it_declares():
    """No ``getattr(prior, "name", default)``: a hook a caller reads is declared on ``Prior``
    (or ``DistancePrior``) with its default."""
    found = [f"{_rel(p)}:{i}" for p in SOURCES
             for i, line in enumerate(p.read_text().splitlines(), 1)
             if re.search(r"getattr\(.*prior", line)]
    assert found == []


def test_no_module_level_assignment_attaches_to_a_class():
    """Operators, methods and attributes are declared in the class body, not assigned onto a
    class after import (``SomeClass.attr = …`` at module level)."""
    found = []
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                    for a in n.names}
        for node in tree.body:
            targets = node.targets if isinstance(node, ast.Assign) else (
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else [])
            for t in targets:
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) \
                        and t.value.id[:1].isupper() and t.value.id in classes | imported:
                    found.append(f"{_rel(path)}:{node.lineno} {t.value.id}.{t.attr}")
    assert found == []


def test_the_layout_checks_see_what_they_look_for(tmp_path):
    """The checks above would find a long function and an attachment (they can fail)."""
    src = "class A:\n    pass\n\nA.op = 1\n\ndef f():\n" + "    x = 1\n" * 90
    tree = ast.parse(src)
    fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef))
    assert fn.end_lineno - fn.lineno + 1 > MAX_FUNCTION_LINES
    assign = next(n for n in tree.body if isinstance(n, ast.Assign))
    assert isinstance(assign.targets[0], ast.Attribute) and assign.targets[0].value.id == "A"
