"""``structattn.export(..., window=W)``: a model with certified windows (a ``tol`` on a
distance prior) exported with the windows' width as the program's runtime input.

Each program is compared with the layer under structattn: at the width the layer certified
for an input (its trace's ``truncation``; the compiled kernels off, so that one width serves
every head, as in the program) the outputs agree to float64 rounding; at a width holding the
whole past they equal the same layer without ``tol`` (the exact reading). A width too narrow
for an input fails the program's certificate, by its own message."""

import pytest
import torch

import structattn as sa

f64 = torch.float64

def _steep(alibi):
    """ALiBi with slopes 1 and 1/2 (the defaults, down to 2^-8, certify all of the past)."""
    alibi.slopes.copy_(torch.tensor([1.0, 0.5], dtype=f64))
    return alibi


#: each certified configuration, built with a given tol (None: its exact twin); the
#: parameters make the certified windows shorter than the past at these lengths
CERTIFIED = {
    "FoX": lambda tol: sa.models.forgetting_attention(8, heads=2, gate_bias=-1.0, tol=tol,
                                                      dtype=f64),
    "ALiBi": lambda tol: _steep(sa.models.alibi_attention(8, heads=2, tol=tol, dtype=f64)),
    "BAM": lambda tol: sa.models.generalised_gaussian_attention(8, heads=2, width=2.0, tol=tol,
                                                                dtype=f64),
    "expanding exact": lambda tol: sa.models.expanding_attention(
        8, heads=2, inference=None, a=1.0, b=8.0, tol=tol, dtype=f64),
}

#: (batch, length) at run time: other than the example's, across one block (64; 32 for
#: expanding attention) and two, down to a single pair
CALLS = [(1, 2), (3, 9), (2, 64), (2, 65), (1, 150), (2, 300), (1, 520)]

_PROGRAMS: dict = {}


def _exported(name):
    """``(layer, program, exact)``: the certified layer, its program exported at a batch of 2
    and 150 tokens (width 24) with every size dynamic, and the layer without ``tol``."""
    if name not in _PROGRAMS:
        torch.manual_seed(0)
        model = CERTIFIED[name](1e-3)
        exact = CERTIFIED[name](None)
        exact.load_state_dict(model.state_dict())
        program = sa.export(model, torch.randn(2, 150, 8, dtype=f64), dynamic=True, window=24)
        _PROGRAMS[name] = (sa.compile(model), program.module(), sa.compile(exact))
    return _PROGRAMS[name]


@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_the_program_reads_the_width_it_is_given(name):
    layer, program, exact = _exported(name)
    narrower = 0
    for batch, n in CALLS:
        torch.manual_seed(n)
        x = torch.randn(batch, n, 8, dtype=f64)
        with sa.kernels.disabled():
            want, trace = layer(x, return_trace=True)
        width = next(iter(trace.truncation.values())).width
        narrower += width < n - 1
        torch.testing.assert_close(program(x, width), want, rtol=1e-12, atol=1e-12)
        # a width holding the whole past (or more) is the exact reading
        torch.testing.assert_close(program(x, n + 7), exact(x), rtol=1e-12, atol=1e-12)
    assert narrower >= 2  # the band, not only the whole past, was compared


@pytest.mark.parametrize("name", sorted(CERTIFIED))
def test_a_width_too_narrow_for_the_input_fails_its_certificate(name):
    layer, program, _ = _exported(name)
    x = torch.randn(2, 300, 8, dtype=f64)
    with sa.kernels.disabled():
        _, trace = layer(x, return_trace=True)
    assert next(iter(trace.truncation.values())).width > 2
    with pytest.raises(RuntimeError, match=r"structattn certificate failed: \w+'s certified "
                                           r"window at the width given .* call it with a wider "
                                           r"width"):
        program(x, 2)


def test_the_program_saves_and_loads_with_its_width_input(tmp_path):
    model = CERTIFIED["FoX"](1e-3)
    x = torch.randn(1, 100, 8, dtype=f64)
    program = sa.export(model, x, window=32)  # static shapes: only the width varies
    torch.export.save(program, tmp_path / "fox.pt2")
    loaded = torch.export.load(tmp_path / "fox.pt2").module()
    for width in (40, 99):
        torch.testing.assert_close(loaded(x, width), program.module()(x, width), rtol=0, atol=0)


@pytest.mark.parametrize("window, message", [
    (1, "an int ≥ 2"), (True, "an int ≥ 2"), (2.5, "an int ≥ 2"), ("8", "an int ≥ 2")])
def test_a_bad_window_is_refused_by_name(window, message):
    with pytest.raises(ValueError, match=r"^structattn.export: window \(the certified windows' "
                                         r"width.*" + message):
        sa.export(CERTIFIED["ALiBi"](1e-3), torch.randn(1, 40, 8, dtype=f64), window=window)


def test_a_window_for_a_model_without_certified_windows_is_refused():
    for model in (sa.models.self_attention(8, heads=2, causal=True),
                  sa.models.alibi_attention(8, heads=2)):
        with pytest.raises(ValueError, match=r"window=16 is the width of certified windows .* "
                                             r"has none; export it without window"):
            sa.export(model, torch.randn(1, 40, 8), window=16)


def test_without_a_window_the_refusal_says_how_to_export_it():
    with pytest.raises(ValueError, match=r"cannot be exported as it is: edge family 'attn' has "
                                         r"a certified window \(tol=0.001\) .* export it with "
                                         r"window=W \(the program then takes the width as its "
                                         r"last input"):
        sa.export(CERTIFIED["FoX"](1e-3), torch.randn(1, 40, 8, dtype=f64))


def test_the_program_returns_the_posterior_at_its_width():
    torch.manual_seed(1)
    layer = sa.compile(CERTIFIED["ALiBi"](1e-3))
    program = sa.export(layer, torch.randn(2, 150, 8, dtype=f64), dynamic=True, window=24,
                        return_posterior=True).module()
    x = torch.randn(2, 300, 8, dtype=f64)
    with sa.kernels.disabled():
        want, post, trace = layer(x, return_posterior=True, return_trace=True)
    width = next(iter(trace.truncation.values())).width
    assert width < 299
    got, got_post = program(x, width)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_post, post, rtol=1e-12, atol=1e-12)
