"""Imports: the subpackages import on their own; the catalogue imports the core from its
submodules, not through the package's top level, so it does not depend on the order of the
imports in structattn/__init__.py; the import graph of structattn/ (the catalogue and the
inference included; read as ``tests/import_graph.py`` says) has no cycle, and each of its
edges goes from a module to one of its own layer or a lower one, the layers being DESIGN.md's
table ("Layers: imports only downward").
"""

import subprocess
import sys
import textwrap

import pytest

from .import_graph import (
    PACKAGES,
    ROOT,
    describe,
    discover,
    import_cycles,
    import_graph,
    layer_name,
    layer_table,
    upward_edges,
)


def _run(code, tmp_path):
    """Run ``code`` in a fresh interpreter (outside the repository, so the installed package is
    imported); return (returncode, output)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("module", ["structattn.models", "structattn.inference"])
def test_subpackage_as_the_first_import(module, tmp_path):
    rc, out = _run(f"import {module}", tmp_path)
    assert rc == 0, out


CONVERTED = ["absolute_position_attention", "alibi_attention", "classification", "cross_attention",
             "graph_attention", "multihop_attention", "relative_position_attention", "self_attention"]


def test_catalogue_modules_import_before_the_package_is_initialised(tmp_path):
    """``structattn`` and ``structattn.models`` are registered but their ``__init__`` has not
    run (as when ``structattn/__init__.py`` imports the catalogue before the core): each
    catalogue module must still import, and self attention must still compile and run."""
    rc, out = _run(f"""
        import importlib, importlib.util, sys
        for pkg in ("structattn", "structattn.models"):
            sys.modules[pkg] = importlib.util.module_from_spec(importlib.util.find_spec(pkg))
        failed = []
        for name in {CONVERTED!r}:
            try:
                module = importlib.import_module("structattn.models." + name)
                assert callable(getattr(module, name))
            except Exception as e:
                failed.append(f"{{name}}: {{type(e).__name__}}: {{e}}")
        assert not failed, failed
        import torch
        from structattn.compiler import compile
        from structattn.models.self_attention import self_attention
        y = compile(self_attention(4, d_k=2, heads=2))(torch.randn(1, 3, 4))
        assert y.shape == (1, 3, 4)
    """, tmp_path)
    assert rc == 0, out

# -- the import graph ---------------------------------------------------------------------
def _write(root, files):
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(textwrap.dedent(text))


def test_the_import_graph_reader_sees_every_kind_of_import(tmp_path):
    """The reader itself, on a throw-away package: relative imports at any depth, ``from . import
    x`` of a submodule, imports inside functions, enclosing packages, self-imports."""
    _write(tmp_path, {
        "pkg/__init__.py": "from . import a as a\nfrom .sub import C as C\n",
        "pkg/a.py": "import os\n\ndef f():\n    from .sub.b import g\n    return g\n",
        "pkg/sub/__init__.py": "from .b import C as C\n",
        "pkg/sub/b.py": "import pkg\nfrom .. import a\n\nclass C:\n    pass\n",
        "pkg/own.py": "def f():\n    from pkg.own import f as g\n    return g\n",
        "pkg/leaf.py": "from pkg.sub import b\n",
        "other/__init__.py": "",
        "other/x.py": "from pkg.leaf import *\n",
    })
    graph = import_graph({"pkg": tmp_path / "pkg", "pkg.other": tmp_path / "other"})
    targets = {m: {w for w, *_ in e} for m, e in graph.items()}
    assert targets["pkg"] == {"pkg.a", "pkg.sub"}  # no self-edge for ``from . import a``
    assert targets["pkg.a"] == {"pkg.sub", "pkg.sub.b"}  # inside a function; os is not ours
    assert ("pkg.sub.b", 4, True) in graph["pkg.a"]
    assert targets["pkg.sub.b"] == {"pkg", "pkg.a"}  # named explicitly, though it encloses b
    assert targets["pkg.leaf"] == {"pkg.sub", "pkg.sub.b"}
    assert targets["pkg.other.x"] == {"pkg.leaf"}  # pkg encloses it: already initialising
    cycles = import_cycles(graph)
    assert ["pkg", "pkg.a", "pkg.sub", "pkg.sub.b"] in cycles
    assert ["pkg.own"] in cycles  # imports itself
    assert "pkg.a:4 → pkg.sub.b  (inside a function)" in describe(graph, cycles)


def test_the_catalogue_and_inference_are_in_no_import_cycle():
    graph = import_graph()
    ours = [c for c in import_cycles(graph)
            if any(m.startswith(("structattn.models", "structattn.inference")) for m in c)]
    assert not ours, describe(graph, ours)


def test_no_import_cycles():
    graph = import_graph()
    cycles = import_cycles(graph)
    assert not cycles, describe(graph, cycles)


# -- the layers ------------------------------------------------------------------------------
def test_the_layer_check_sees_an_upward_edge():
    """On a throw-away graph: an edge to the same layer or a lower one passes, an edge up —
    at the top of a module or inside a function — is reported with its line; the table's
    reader takes every name of a row, and refuses a name in two rows."""
    graph = {"p.low": [], "p.mid": [("p.low", 1, False), ("p.mid2", 2, False)],
             "p.mid2": [("p.top", 7, True)], "p.top": [("p.mid", 3, False)]}
    layer = {"p.low": 0, "p.mid": 1, "p.mid2": 1, "p.top": 2}
    assert upward_edges(graph, layer) == ["p.mid2:7 → p.top (layer 1 → 2)  (inside a function)"]
    text = ("## Layers\n\n| Layer | Modules | What |\n|---|---|---|\n"
            "| 0 | `a`, `b/` | `c` is not read |\n| 1 | `__init__` | top |\n\n## Next\n| 2 | `d` |")
    assert layer_table(text) == {"a": 0, "b/": 0, "__init__": 1}
    with pytest.raises(AssertionError, match="a is in layers 0 and 1"):
        layer_table(text.replace("`__init__`", "`a`"))


def test_every_import_goes_to_the_same_layer_or_a_lower_one():
    """DESIGN.md's layers hold with no exception: each module of structattn/ (the catalogue and
    the inference included) is in exactly one row of its table, each row names something
    that exists, and no import, at the top of a module or inside a function, goes up."""
    table = layer_table((ROOT / "DESIGN.md").read_text())
    modules = discover(PACKAGES)
    names = {module: layer_name(module, path) for module, path in modules.items()}
    unlisted = sorted({n for n in names.values() if n not in table})
    assert not unlisted, f"add these to a row of DESIGN.md's table of layers: {unlisted}"
    stale = sorted(set(table) - set(names.values()))
    assert not stale, f"DESIGN.md's table of layers names what is not in structattn/: {stale}"
    assert sorted(set(table.values())) == list(range(max(table.values()) + 1))
    up = upward_edges(import_graph(), {m: table[n] for m, n in names.items()})
    assert not up, ("imports that go up a layer (DESIGN.md: \"Layers: imports only downward\"):\n"
                    + "\n".join(up))


def test_import_loads_no_dynamo_nor_pyro_inference():
    """``import structattn`` stays light: torch._dynamo (over a second to import) loads only
    when torch.compile or a disabled function first runs (structattn.operators._eager)."""
    import subprocess
    import sys

    code = ("import sys, structattn; "
            "print(sorted(m for m in ('torch._dynamo', 'structattn.inference', "
            "'structattn.models') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# -- what `import structattn` imports ---------------------------------------------------------
#: libraries a feature of structattn uses, imported when that feature is first called
OPTIONAL = ("pyro", "networkx", "graphviz", "arviz", "matplotlib")


def _run_here(code):
    """Run ``code`` in a fresh interpreter from the repository's root (so this checkout's
    structattn is the one imported); return (returncode, output)."""
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def test_import_leaves_the_optional_libraries_unloaded():
    """``import structattn``, then compiling and calling a layer, imports none of Pyro,
    networkx, graphviz, ArviZ and matplotlib, and numpy only where torch itself does."""
    rc, out = _run_here(f"""
        import subprocess, sys
        import structattn as sa
        assert sa.__file__.startswith({str(ROOT)!r}), sa.__file__
        loaded = lambda: sorted(m for m in {OPTIONAL!r} if m in sys.modules)
        assert loaded() == [], loaded()
        torch_numpy = subprocess.run([sys.executable, "-c", "import sys, torch; "
                                      "print('numpy' in sys.modules)"], capture_output=True,
                                     text=True, check=True).stdout.strip() == "True"
        assert ("numpy" in sys.modules) == torch_numpy
        import torch
        layer = sa.compile(sa.models.self_attention(8, heads=2))
        for _ in range(3):  # read, record, replay
            layer(torch.randn(1, 4, 8))
        assert loaded() == [], loaded()
    """)
    assert rc == 0, out


def test_the_features_that_import_a_library_on_first_use_work():
    """In a fresh interpreter, after ``import structattn``: the drawings (networkx,
    graphviz), Pyro's reading through the inference (a model checked against enumeration,
    a raw Pyro site refused), a flat latent prior's Pyro site and a measure's Pyro
    distribution each import what they need and work."""
    rc, out = _run_here("""
        import sys
        import torch
        import structattn as sa

        def attention(x):
            tokens = sa.nodes("x", x)
            phi = sa.edges("attn", tokens, tokens, sa.priors.Uniform(causal=True))
            sa.potential(phi, sa.potentials.DotProduct())
            return sa.value(phi, sa.values.Identity())

        x = torch.randn(1, 4, 3, dtype=torch.float64)
        for name in ("networkx", "graphviz", "pyro"):
            assert name not in sys.modules, name
        from structattn import render, to_networkx  # module __getattr__: from-imports work
        G = to_networkx(attention, x)
        assert sorted(G.nodes) == [f"x[{i}]" for i in range(4)] and "networkx" in sys.modules
        assert callable(render) and sa.render is render
        assert issubclass(sa.RenderError, RuntimeError)
        assert type(sa.model_graph(attention, x)).__name__ == "Digraph"

        post = sa.inference.exact(attention, x)  # the structure's reading imported Pyro above
        torch.testing.assert_close(post.output, sa.compile(attention)(x), rtol=1e-6, atol=1e-8)

        import pyro
        def raw(x):
            n = sa.nodes("x", x)
            pyro.sample("noise", pyro.distributions.Normal(0.0, 1.0))
            return attention(x)
        try:
            sa.inference.exact(raw, x)
        except ValueError as e:
            assert "'noise' is a raw pyro.sample" in str(e), e
        else:
            raise AssertionError("a raw pyro.sample site was not refused")

        def flat(x, z):
            lat = sa.latent("z", z, scale=None)
            phi = sa.edges("f", lat, sa.nodes("x", x), sa.priors.Uniform())
            sa.potential(phi, sa.potentials.DotProduct())
            return lat
        z = torch.randn(1, 2, 3, dtype=torch.float64)
        given = pyro.poutine.condition(flat, data={"z": z[:, None]})  # (*batch, 1, n, d)
        site = pyro.poutine.trace(given).get_trace(x, z).nodes["z"]
        assert type(site["fn"]).__name__ == "_Flat"
        lp = site["fn"].log_prob(site["value"])
        assert lp.dtype == torch.float64 and not lp.any()

        points = torch.randn(5, 3, dtype=torch.float64)
        d = sa.measures.Empirical(points).distribution(torch.randn(2, 3, dtype=torch.float64))
        assert isinstance(d, pyro.distributions.MixtureSameFamily)

        assert {"render", "to_networkx", "drawing", "inference", "models"} <= set(dir(sa))
        try:
            sa.no_such_name
        except AttributeError as e:
            assert "no_such_name" in str(e)
        else:
            raise AssertionError("an unknown name did not raise AttributeError")
    """)
    assert rc == 0, out
