"""Every public name of ``structattn`` documents itself in one convention (Google style, as
the API reference renders it): a function says its arguments under ``Args:`` and what it
returns under ``Returns:`` (``Yields:`` for a context manager; nothing where it returns
None); a class its constructor's arguments under ``Args:`` or, for a record the library
hands back, its fields under ``Attributes:``. Exceptions and warnings need only their
paragraph. The rule covers the top-level names and those of the subpackages below (their
``__all__``, or their public names defined in structattn), as ``"subpackage.Name"``."""

import inspect

import pytest

import structattn as sa

SUBPACKAGES = ["priors", "potentials", "values", "kinds", "windows", "measures", "inference",
               "drawing", "checks", "kernels", "triton_kernels", "readers", "reading",
               "block_sparse"]


def _public():
    for name in sorted(n for n in dir(sa) if not n.startswith("_")):
        obj = getattr(sa, name)
        if inspect.ismodule(obj) or not callable(obj):
            continue
        yield name, obj
    for sub in SUBPACKAGES:
        module = getattr(sa, sub)
        names = getattr(module, "__all__", None) or sorted(
            n for n in dir(module) if not n.startswith("_"))
        for name in names:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not callable(obj) \
                    or not getattr(obj, "__module__", "").startswith("structattn"):
                continue
            yield f"{sub}.{name}", obj


def _resolve(name):
    obj = sa
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _parameters(fn) -> list:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p for p in sig.parameters.values() if p.name not in ("self", "cls")]


@pytest.mark.parametrize("name", [n for n, _ in _public()])
def test_every_public_name_states_its_arguments_and_results(name):
    obj = _resolve(name)
    doc = inspect.getdoc(obj) or ""
    assert doc, f"structattn.{name} has no docstring"
    if inspect.isclass(obj):
        if issubclass(obj, (Exception, Warning)):
            return
        assert "Args:" in doc or "Attributes:" in doc, \
            f"structattn.{name}: a class documents its Args: (or a record its Attributes:)"
        return
    if _parameters(obj):
        assert "Args:" in doc, f"structattn.{name}: no Args: section"
    returns = inspect.signature(obj).return_annotation
    if returns not in (None, "None"):
        assert "Returns:" in doc or "Yields:" in doc, f"structattn.{name}: no Returns: section"


@pytest.mark.parametrize("name", sorted(sa.models.CATALOGUE))
def test_every_catalogue_model_states_its_arguments(name):
    """Each catalogue model's class documents its constructor under ``Args:`` (its factory
    passes everything through to it)."""
    declaration = sa.models.CATALOGUE[name].declaration
    doc = inspect.getdoc(declaration) or ""
    assert "Args:" in doc, f"structattn.models.{declaration.__name__}: no Args: section"
    own = [p.name for p in _parameters(declaration.__init__)
           if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    section = doc.split("Args:", 1)[1]
    missing = [p for p in own if f"{p} (" not in section and f"{p}:" not in section]
    assert not missing, f"structattn.models.{declaration.__name__}: Args lacks {missing}"
