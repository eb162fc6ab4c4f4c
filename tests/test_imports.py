"""Imports: the subpackages import on their own, and the catalogue imports the core from its
submodules, not through the package's top level, so it does not depend on the order of the
imports in structattn/__init__.py."""

import subprocess
import sys
import textwrap

import pytest


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


#: catalogue modules converted to submodule imports (the review's list); a module added to
#: models/ should import the core the same way and join this list
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
