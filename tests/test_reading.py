"""The reading stack (``structattn.reading``): one path from every primitive to the reading
in force, and one immutable ``ReadingContext`` holding every mode a reading depends on."""

import gc
import pathlib
import re
import threading

import pyro
import pyro.poutine as poutine
import pytest
import torch

import structattn as sa
from structattn import reading
from structattn.readers import Marginalise, TraceStructure

from .tree import files

PACKAGE = pathlib.Path(sa.__file__).parent


def program(x):
    n = sa.nodes("x", x)
    phi = sa.edges("attn", n, n, sa.priors.Uniform(causal=True))
    sa.potential(phi, sa.potentials.DotProduct())
    return sa.value(phi, sa.values.Identity())


def test_plain_pyro_is_the_reading_below_every_other():
    assert reading.current_reading() is reading.PYRO
    assert reading.readings() == ()
    with Marginalise() as outer:
        assert reading.current_reading() is outer
        with TraceStructure() as inner:
            assert reading.current_reading() is inner
            assert reading.readings() == (outer, inner)
            assert inner.context.readings == (outer, inner)
        assert reading.current_reading() is outer
    assert reading.current_reading() is reading.PYRO


def test_the_pyro_reading_emits_ordinary_pyro_sites():
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    trace = poutine.trace(program).get_trace(x)
    sites = {name: site for name, site in trace.nodes.items() if site["type"] == "sample"}
    assert "attn" in sites and isinstance(sites["attn"]["fn"], pyro.distributions.Categorical)
    assert sites["attn"]["infer"]["enumerate"] == "parallel"
    assert sites["attn"]["value"].shape[-1] == 4  # one parent index per child
    assert any(name.startswith("attn.potential") for name in sites)  # a pyro.factor


def test_a_reading_of_ones_own_answers_every_primitive():
    class Counting(reading.Reading):
        def __init__(self):
            self.calls = []

        def nodes(self, node_set):
            self.calls.append(("nodes", node_set.name))
            return node_set

        def edges(self, family):
            self.calls.append(("edges", family.name))
            return TraceStructure().edges(family)

    x = torch.randn(2, 5, 3)
    with Counting() as counting:
        y = program(x)
    assert counting.calls == [("nodes", "x"), ("edges", "attn")]
    assert y.shape == (2, 1, 5, 3) and not y.any()  # TraceStructure's handle: zeros


def test_a_compiled_module_reads_under_marginalise_in_the_context_in_force():
    seen = []

    def spy(x):
        seen.append(reading.current_reading())
        return program(x)

    layer = sa.compile(spy)
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    with sa.validation(False):
        layer(x)
    r = seen[0]
    assert isinstance(r, Marginalise) and r.context.readings == (r,)
    assert r.context.validate is False
    assert reading.current_reading() is reading.PYRO


def test_modes_are_fields_of_one_context_restored_on_exit_also_after_an_error():
    assert reading.context() is reading.DEFAULT
    with sa.validation(False):
        assert reading.context().validate is False and not sa.is_validating()
        with sa.iteration(steps=4), sa.iteration(tol=1e-3), sa.kernels.disabled():
            ctx = reading.context()
            assert ctx.iteration == {"steps": 4, "tol": 1e-3}
            assert ctx.kernels is False and ctx.validate is False
        with pytest.raises(RuntimeError), sa.iteration(steps=9):
            raise RuntimeError
        assert reading.context().iteration == {}
    assert reading.context() is reading.DEFAULT
    with pytest.raises(ValueError, match="inside a reading"), Marginalise():
        raise ValueError("inside a reading")
    assert reading.readings() == ()


def test_a_context_is_immutable():
    with pytest.raises(AttributeError):
        reading.context().validate = False


def test_each_thread_starts_from_the_defaults():
    seen = {}

    def other():
        seen["ctx"] = reading.context()
        seen["reading"] = reading.current_reading()

    with sa.validation(False), Marginalise():
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert seen["ctx"] is reading.DEFAULT and seen["reading"] is reading.PYRO


def test_no_other_thread_local_decides_what_a_reading_does():
    """The modes live on the one context; its per-thread slot is the only ``threading.local``."""
    found = [(p.relative_to(PACKAGE).as_posix(), n)
             for p in files(PACKAGE)
             for n, line in enumerate(p.read_text().splitlines(), 1)
             if "threading.local(" in line]
    assert found == [("reading.py", next(n for n, line in enumerate(
        (PACKAGE / "reading.py").read_text().splitlines(), 1) if "threading.local(" in line))]


def test_no_primitive_sends_a_pyro_message_of_its_own():
    """Pyro's reading emits Pyro's own sites; no ``effectful`` structattn message remains."""
    used = [p.relative_to(PACKAGE).as_posix() for p in files(PACKAGE)
            if re.search(r"\beffectful\b", p.read_text())]
    assert used == []


def test_a_mode_entered_on_every_call_keeps_one_context():
    """``with sa.validation(False): layer(x)`` on every call: the same context object each
    time (a plan's fast path compares it by identity); inside a reading, a fresh one."""
    with sa.validation(False):
        first = reading.context()
    with sa.validation(False):
        assert reading.context() is first
    with sa.kernels.disabled(), sa.validation(False):
        other = reading.context()
        assert other is not first and other.kernels is False and other.validate is False
    with Marginalise() as r, sa.validation(False):
        assert reading.context() is not first and reading.context().readings == (r,)
    with sa.iteration(steps=2):  # unhashable overrides: a new context, the same fields
        assert reading.context().iteration == {"steps": 2}


def test_a_call_frees_its_families_and_tables_when_it_returns():
    """A reading and the context it was entered in hold no reference cycle, so a compiled
    call's families and prior tables — a dense (heads, C, P) table per layer — go when the
    call returns, not when the cyclic collector next runs (layer on layer before that)."""
    layer = sa.compile(sa.models.generalised_gaussian_attention(8, heads=2, dtype=torch.float64),
                       replay=False)
    x = torch.randn(1, 6, 8, dtype=torch.float64)
    layer(x)
    gc.collect()
    gc.disable()
    try:
        layer(x)
        alive = [type(o).__name__ for o in gc.get_objects()
                 if type(o).__name__ in ("Marginalise", "EdgeFamily", "DistanceTables")]
    finally:
        gc.enable()
    assert alive == []
    with Marginalise() as r:  # the context is still there to read, after exit too
        assert r.context.readings == (r,)
    assert r.context.readings == (r,)
