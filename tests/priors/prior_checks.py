"""The generic checks every registered prior is held to (``structattn.priors.REGISTRY``;
tests/priors/test_registry.py), written once so that a throw-away prior in a test is held to
the same ones."""

import numpy as np
import pytest
import torch

import structattn as sa
from structattn.priors.declared import declared_log_prior

F64 = torch.float64


def program_for(prior, heads=2):
    """A family under ``prior`` between the last C of P tokens and the P tokens, dot-product
    scores, identity values."""
    def program(xc, xp):
        c, p = sa.nodes("c", xc), sa.nodes("p", xp)
        phi = sa.edges("f", c, p, prior, heads=heads)
        sa.potential(phi, sa.potentials.DotProduct(heads=heads))
        return sa.value(phi, sa.values.Identity(heads=heads))
    return program


def tokens(C, P, g):
    xp = torch.randn(2, P, 4, generator=g, dtype=F64)
    return xp[..., P - C:, :], xp


def check_tables(prior, C, P, g):
    """Pyro's reading (the prior's pointwise statement) equals the compiled tables on the
    support, the supports agree, and the operator's posterior is zero off it."""
    fam = sa.trace_structure(program_for(prior), *tokens(C, P, g)).families["f"]
    pyro_lp, has_parent = declared_log_prior(fam)  # (…, C, P) pointwise
    tables = fam.tables
    compiled = tables.log_prob_table(F64)
    mask = tables.full_mask()
    mask = torch.ones(C, P, dtype=torch.bool) if mask is None else mask
    pyro_lp, compiled, mask = torch.broadcast_tensors(pyro_lp, compiled, mask)
    support = torch.isfinite(pyro_lp)
    assert torch.equal(support, mask & has_parent[..., None].expand_as(mask)), prior.describe()
    torch.testing.assert_close(pyro_lp[support], compiled[support], atol=1e-12, rtol=0,
                               msg=prior.describe())
    post = sa.compiling.lowering.posterior(fam)  # the operator's dense posterior: zero off the support
    post, support = torch.broadcast_tensors(post, support)
    assert bool((post[~support] == 0).all()), prior.describe()


def check_formula(entry, prior, C, P, g):
    """Pyro's reading equals the entry's formula, written in numpy, normalised per child."""
    fam = sa.trace_structure(program_for(prior), *tokens(C, P, g)).families["f"]
    pyro_lp, has_parent = declared_log_prior(fam)
    w = entry.formula(prior, C, P)  # (H|1, C, P), −∞ off the support
    with np.errstate(divide="ignore", invalid="ignore"):
        top = np.max(w, -1, keepdims=True)
        top = np.where(np.isfinite(top), top, 0.0)
        norm = np.log(np.exp(w - top).sum(-1, keepdims=True)) + top
        want = np.where(np.isfinite(w), w - norm, -np.inf)
    want, got = torch.broadcast_tensors(torch.from_numpy(want), pyro_lp.to(F64))
    assert torch.equal(torch.isfinite(want), torch.isfinite(got)), prior.describe()
    on = torch.isfinite(want)
    torch.testing.assert_close(got[on], want[on], atol=1e-10, rtol=0, msg=prior.describe())


def check_bad(entry):
    """Each bad construction is refused with its message."""
    assert entry.bad, f"{entry.name}: no bad parameters listed"
    for pattern, build in entry.bad.items():
        with pytest.raises(ValueError, match=pattern):
            build()


def check_gradients(entry, g):
    """Gradients reach the prior's parameters through the compiled layer (gradcheck)."""
    tensors, build = entry.parameters(g)
    x = torch.randn(1, 5, 4, generator=g, dtype=F64)

    def output(*t):
        return sa.compile(program_for(build(*t)), replay=False)(x, x)
    assert torch.autograd.gradcheck(output, [t.clone().requires_grad_() for t in tensors])


def check_certificate(prior, g, n=48, spread=2.0):
    """The certified window's bound holds against Pyro's whole past: each child's posterior
    within its reported bound of the exact one in total variation (tokens N(0, spread²))."""
    x = torch.randn(1, n, 4, generator=g, dtype=F64) * spread

    def program(x):
        t = sa.nodes("t", x)
        phi = sa.edges("f", t, t, prior, heads=2)
        sa.potential(phi, sa.potentials.DotProduct(heads=2))
        return sa.value(phi, sa.values.Identity(heads=2))
    _, post, trace = sa.compile(program)(x, return_posterior=True, return_trace=True)
    cut = trace.truncation["f"]
    exact = sa.inference.exact(program, x).marginals["f"]
    tv = 0.5 * (post - exact).abs().sum(-1)  # (1, H, N)
    assert cut.certified and bool((tv <= cut.bound.expand_as(tv) + 1e-12).all()), \
        (float((tv - cut.bound).max()), cut.width)
    return cut
