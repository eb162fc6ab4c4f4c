"""Certified block-sparse reading (structattn/block_sparse.py), against the dense posterior in
float64 (softmax over j ≤ i of h_j + scale·⟨a_i, b_j⟩, written here from the formula):

- sound: the true posterior mass in the key blocks skipped never exceeds the reported bound,
  over priors (uniform causal, ALiBi slopes, forget gates), sizes, blocks, sharpness and a
  planted far match, in float64 and float32;
- exact where it reads: the output equals attention restricted to the blocks read, and is
  within 2·bound·max|v| of the whole past; gradients in a, b, v and h by gradcheck;
- it pays: sharp queries over slowly drifting activations with a match planted 3,000 tokens
  back skip most key blocks under ALiBi, a forget gate and the uniform prior, and read the
  match exactly; each head chooses its own blocks.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import structattn as sa
from structattn.block_sparse import block_sparse_attention, certify_blocks


def _dense_posterior(a, b, h, scale):
    """``(…, N, N)`` float64 posterior over j ≤ i, straight from the formula."""
    n = a.shape[-2]
    s = scale * a.double() @ b.double().transpose(-1, -2)
    if h is not None:
        s = s + h.double().unsqueeze(-2)
    causal = torch.ones(n, n, dtype=torch.bool, device=a.device).tril()
    return torch.softmax(s.masked_fill(~causal, float("-inf")), -1)


def _read_pairs(cert, n):
    """``(…, N, N)`` bool: the (child, parent) pairs inside the blocks each child reads."""
    blk = torch.arange(n) // cert.block
    return cert.read[..., blk, :][..., blk]


def _prior(kind, heads, n, gen):
    """The per-parent log term h of a prior, ``(heads, N)`` (None: uniform)."""
    pos = torch.arange(n, dtype=torch.float64)
    if kind == "uniform":
        return None
    if kind == "alibi":
        slopes = torch.tensor([2.0 ** (-8 * (h + 1) / heads) for h in range(heads)],
                              dtype=torch.float64) * 8
        return slopes[:, None] * pos
    log_f = -torch.rand(heads, n, generator=gen, dtype=torch.float64)  # forget gates
    return -log_f.cumsum(-1)  # h_j = −c_j


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 150), heads=st.integers(1, 3), k=st.integers(1, 6),
       block=st.integers(1, 40), kind=st.sampled_from(["uniform", "alibi", "forget"]),
       sharp=st.sampled_from([1.0, 10.0]), planted=st.booleans(),
       eps=st.sampled_from([0.3, 1e-2, 1e-4]), seed=st.integers(0, 10_000))
def test_the_true_mass_skipped_never_exceeds_the_bound(n, heads, k, block, kind, sharp,
                                                        planted, eps, seed):
    gen = torch.Generator().manual_seed(seed)
    a = sharp * torch.randn(heads, n, k, generator=gen, dtype=torch.float64)
    b = torch.randn(heads, n, k, generator=gen, dtype=torch.float64)
    if planted and n > 2:  # the last child's match, as far back as it goes
        b[:, 0] = 3 * a[:, -1] / sharp
    v = torch.randn(heads, n, 2, generator=gen, dtype=torch.float64)
    h = _prior(kind, heads, n, gen)
    out, cert = block_sparse_attention(a, b, v, 0.5, h, eps, block=block)
    p = _dense_posterior(a, b, h, 0.5)
    read = _read_pairs(cert, n)
    skipped = (p * ~read).sum(-1)
    assert (skipped <= cert.bound + 1e-12).all(), (skipped - cert.bound).max()
    assert cert.certified and (cert.bound <= eps).all()
    restricted = torch.softmax((0.5 * a @ b.transpose(-1, -2) + (0 if h is None else h[:, None]))
                               .masked_fill(~(read & torch.ones(n, n, dtype=torch.bool).tril()),
                                            float("-inf")), -1) @ v
    torch.testing.assert_close(out, restricted, rtol=0, atol=1e-10)
    exact = p @ v
    assert ((out - exact).abs().amax(-1) <= 2 * cert.bound * v.abs().amax() + 1e-10).all()


def test_the_certificate_holds_for_float32_scores():
    """Sharp float32 factors: the products' rounding is charged to the bound."""
    gen = torch.Generator().manual_seed(3)
    n, k = 400, 16
    a = 6 * torch.randn(2, n, k, generator=gen)
    b = torch.randn(2, n, k, generator=gen)
    h = _prior("alibi", 2, n, gen).float()
    cert = certify_blocks(a, b, 0.25, h, 1e-4, block=32)
    p = _dense_posterior(a, b, h, 0.25)
    skipped = (p * ~_read_pairs(cert, n)).sum(-1)
    assert (skipped <= cert.bound + 1e-12).all()
    assert cert.skipped > 0.2  # not the whole past: the bound is tested where it cuts


def test_gradients_through_the_blocks_read():
    gen = torch.Generator().manual_seed(4)
    n = 40
    a, b = (torch.randn(2, n, 3, generator=gen, dtype=torch.float64, requires_grad=True)
            for _ in range(2))
    v = torch.randn(2, n, 2, generator=gen, dtype=torch.float64, requires_grad=True)
    h = (_prior("alibi", 2, n, gen) * 4).requires_grad_()
    _, cert = block_sparse_attention(a, b, v, 0.5, h, 1e-3, block=8)
    assert 0 < cert.skipped < 1  # some blocks read, some skipped

    def f(a, b, v, h):
        return block_sparse_attention(a, b, v, 0.5, h, 1e-3, block=8)[0]

    assert torch.autograd.gradcheck(f, (a, b, v, h))


def _drifting(n, k, rho, gen):
    """Slowly drifting activations: an AR(1) sequence of unit variance per dimension."""
    x = torch.empty(n, k, dtype=torch.float64)
    x[0] = torch.randn(k, generator=gen, dtype=torch.float64)
    noise = torch.randn(n, k, generator=gen, dtype=torch.float64) * math.sqrt(1 - rho ** 2)
    for t in range(1, n):
        x[t] = rho * x[t - 1] + noise[t]
    return x


def _best_skip(p, L, eps):
    """The most any reading of whole key blocks could skip, knowing the true posterior ``p``
    ``(N, N)``: per child block, the fewest earlier blocks whose complement holds ≤ eps of
    every child's mass (blocks taken by their largest mass)."""
    n = p.shape[-1]
    nb = n // L
    mass = p.view(n, nb, L).sum(-1)  # (N, nb)
    needed = total = 0
    for c in range(1, nb):
        rows = mass[c * L:(c + 1) * L, :c]
        order = rows.amax(0).argsort(descending=True)
        beyond = torch.cat([rows[:, order].flip(-1).cumsum(-1).flip(-1),
                            rows.new_zeros(L, 1)], -1)  # [r]: the mass of ranks ≥ r
        needed += int((beyond <= eps).all(0).nonzero()[0])
        total += c
    return 1 - needed / total


@pytest.mark.parametrize("kind", ["uniform", "alibi", "forget"])
@torch.no_grad()
def test_sharp_queries_skip_most_key_blocks_and_read_a_far_match(kind):
    """N = 4,096 slowly drifting activations, queries 30× sharper than the keys, the last
    token's match planted 3,000 back, ε = 1e-4: ≥ 75% of the key blocks skipped, ≥ 90% of
    what a reading that knew the true posterior could skip, and the match's block read."""
    gen = torch.Generator().manual_seed(5)
    n, k, far, L, eps = 4096, 16, 3000, 64, 1e-4
    x = _drifting(n, k, 0.999, gen)
    a, b = 30 * x / math.sqrt(k), x.clone()
    b[n - 1 - far] = 2 * x[-1]  # a key aligned with the last query, and longer
    v = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    pos = torch.arange(n, dtype=torch.float64)
    h = {"uniform": None, "alibi": pos / 256,
         "forget": (0.02 * torch.rand(n, generator=gen, dtype=torch.float64)).cumsum(-1)}[kind]
    out, cert = block_sparse_attention(a, b, v, 1 / math.sqrt(k), h, eps, block=L)
    p = _dense_posterior(a, b, h, 1 / math.sqrt(k))
    best = _best_skip(p, L, eps)
    assert cert.skipped >= 0.75 and cert.skipped >= 0.9 * best, (cert.skipped, best)
    assert cert.read[(n - 1) // L, (n - 1 - far) // L]
    assert p[-1, n - 1 - far] > 0.5  # the match holds most of the last child's posterior
    torch.testing.assert_close(out[-1], p[-1] @ v, rtol=0, atol=2 * eps * v.abs().max())


def test_each_head_chooses_its_own_blocks():
    """ALiBi's slow head reads far back; the fast head is not held by it."""
    gen = torch.Generator().manual_seed(6)
    n = 512
    a = torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
    h = torch.tensor([[2.0], [0.01]], dtype=torch.float64) * torch.arange(n)
    cert = certify_blocks(a, b, 0.5, h, 1e-4, block=32)
    fast, slow = cert.read[0].sum(), cert.read[1].sum()
    assert fast < slow
    assert cert.read[0].sum(-1).max() <= 2  # the fast head: its own block and the one before


@pytest.mark.parametrize("together", [False, True])
def test_heads_read_together_where_most_would_read_all_of_their_past(together):
    """One fast ALiBi head of four skips most blocks; ``together`` (the CPU's rule: the kernels
    parallelise over heads) has it read all of its past with the three slow ones."""
    gen = torch.Generator().manual_seed(6)
    n, L = 1024, 32
    a = torch.randn(4, n, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(4, n, 8, generator=gen, dtype=torch.float64)
    h = torch.tensor([[2.0], [0.001], [0.001], [0.001]], dtype=torch.float64) * torch.arange(n)
    cert = certify_blocks(a, b, 0.5, h, 1e-4, block=L, worth=0.5, together=together)
    earlier = torch.arange(n // L)
    assert bool((cert.count[1:] == earlier).all())  # the slow heads: every earlier block
    if together:
        assert bool((cert.count[0] == earlier).all()) and cert.skipped == 0
        assert bool((cert.bound == 0).all())
    else:
        assert int(cert.count[0].max()) <= 1 and float(cert.bound[0].max()) <= 1e-4


def test_the_module_is_public():
    assert sa.block_sparse.block_sparse_attention is block_sparse_attention


def test_bad_arguments_are_refused():
    a = torch.randn(1, 10, 3)
    for eps in (0, 1, -0.1, True, "x"):
        with pytest.raises(ValueError, match="certify_blocks: eps"):
            certify_blocks(a, a, 1.0, None, eps)
    with pytest.raises(ValueError, match="block"):
        certify_blocks(a, a, 1.0, None, 0.1, block=0)
    with pytest.raises(ValueError, match="same N tokens"):
        certify_blocks(a, torch.randn(1, 9, 3), 1.0, None, 0.1)
    with pytest.raises(ValueError, match="no tokens"):
        certify_blocks(torch.randn(1, 0, 3), torch.randn(1, 0, 3), 1.0, None, 0.1)


@pytest.mark.parametrize("model", ["forgetting_attention", "alibi_attention"])
@pytest.mark.parametrize("tol", [0.05, 1e-4])
@torch.no_grad()
def test_a_layer_with_block_certificates_stays_within_its_bound_of_pyro(model, tol, monkeypatch):
    """``certificate="blocks"`` on FoX and ALiBi layers: each token's posterior is within the
    reported bound of Pyro's exact enumeration over the whole past (total variation), the
    trace reports the blocks, and the per-head values move by at most 2·bound·max|v|. (The
    CPU's cost rule, which reads so short a sequence whole, is set aside: the certificate's
    reading is what is checked.)"""
    _certify_always(monkeypatch)
    torch.manual_seed(7)
    m = getattr(sa.models, model)(8, heads=2, d_k=4, tol=tol, certificate="blocks",
                                  block_size=4, dtype=torch.float64)
    x = torch.randn(2, 48, 8, dtype=torch.float64)
    x[:, 1:] = 0.8 * x[:, :-1] + 0.2 * x[:, 1:]  # nearby tokens alike
    x = 3 * x
    exact = sa.inference.exact(m, x)
    y, p, trace = sa.compile(m)(x, return_posterior=True, return_trace=True)
    cert = trace.truncation[m.family_name]
    assert isinstance(cert, sa.block_sparse.BlockSparse) and cert.certified
    assert (cert.bound <= tol).all()
    want = exact.marginals[m.family_name]
    tv = (p - want).abs().sum(-1) / 2  # (2, H, N)
    assert (tv <= cert.bound + 1e-12).all()
    torch.testing.assert_close(sa.compile(m)(x), y, atol=1e-12, rtol=0)  # the same reading


def test_a_layer_with_block_certificates_trains(monkeypatch):
    _certify_always(monkeypatch)
    torch.manual_seed(8)
    m = sa.models.alibi_attention(4, heads=2, d_k=2, tol=1e-3, certificate="blocks",
                                  block_size=4, dtype=torch.float64)
    x = (torch.randn(1, 24, 4, dtype=torch.float64).cumsum(-2) * 0.3).requires_grad_()
    layer = sa.compile(m)
    assert torch.autograd.gradcheck(lambda xx, wq: layer(xx), (x, m.W_q))


def _certify_always(monkeypatch):
    """The layers certify their blocks whatever the device's cost rule says."""
    from structattn.kinds import window

    monkeypatch.setattr(window, "_block_worth", lambda *args: sa.block_sparse.WORTH)


@pytest.mark.parametrize("model", ["forgetting_attention", "alibi_attention"])
def test_on_the_cpu_a_certificate_that_cannot_pay_is_not_computed(model, monkeypatch):
    """On the CPU the block certificate costs more than the whole past's forward: without a
    gradient, or under 64 key blocks, the layer reads all of the past (bound 0), computing no
    certificate, and equals the exact layer."""
    from structattn import block_sparse

    def refuse(*args, **kwargs):
        raise AssertionError("a certificate was computed")

    monkeypatch.setattr(block_sparse, "choose_blocks", refuse)
    torch.manual_seed(3)
    m = getattr(sa.models, model)(8, heads=2, d_k=4, tol=1e-4, certificate="blocks",
                                  block_size=4, dtype=torch.float64)
    exact = getattr(sa.models, model)(8, heads=2, d_k=4, dtype=torch.float64)
    exact.load_state_dict(m.state_dict())
    x = torch.randn(1, 40, 8, dtype=torch.float64)
    for grad in (False, True):  # 10 key blocks: never worth it
        with torch.set_grad_enabled(grad):
            y, trace = sa.compile(m)(x.requires_grad_(grad), return_trace=True)
            cert = trace.truncation[m.family_name]
            assert isinstance(cert, sa.block_sparse.BlockSparse) and cert.skipped == 0
            assert cert.certified and bool((cert.bound == 0).all())
            assert bool(cert.read.equal(torch.ones(10, 10, dtype=torch.bool).tril()
                                        .expand_as(cert.read)))
            torch.testing.assert_close(y, sa.compile(exact)(x), rtol=0, atol=1e-12)


def test_block_certificates_need_a_tol_and_a_known_name():
    with pytest.raises(ValueError, match="certificate='blocks' reads the key blocks"):
        sa.models.forgetting_attention(8, certificate="blocks")
    with pytest.raises(ValueError, match="certificate must be 'window' or 'blocks'"):
        sa.models.alibi_attention(8, tol=0.1, certificate="band")
    with pytest.raises(ValueError, match="ALiBi prior: certificate"):
        sa.priors.ALiBi(2, causal=True, tol=0.1, certificate=None)


@torch.no_grad()
def test_a_head_read_whole_reads_every_earlier_block():
    """iid sharp queries under the uniform prior: nothing can be skipped, the sampled child
    blocks say so, and the head reads all of its past (bound 0, no mass skipped)."""
    gen = torch.Generator().manual_seed(9)
    n, L = 1024, 32
    a = 10 * torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
    b = torch.randn(2, n, 8, generator=gen, dtype=torch.float64)
    cert = certify_blocks(a, b, 0.35, None, 1e-4, block=L)
    assert cert.skipped == 0 and cert.certified and (cert.bound == 0).all()
    assert (cert.read == torch.ones(n // L, n // L, dtype=torch.bool).tril()).all()
    p = _dense_posterior(a, b, None, 0.35)
    assert (p * ~_read_pairs(cert, n)).sum(-1).max() == 0


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 4), block=st.sampled_from([2, 3, 4]), nb=st.integers(17, 40),
       kind=st.sampled_from(["uniform", "alibi", "forget"]), sharp=st.sampled_from([0.3, 3.0]),
       worth=st.sampled_from([1 / 16, 0.5, 0.95]), together=st.booleans(),
       eps=st.sampled_from([1e-2, 1e-4]), seed=st.integers(0, 10_000))
def test_the_last_childs_shortcut_never_changes_the_blocks(heads, block, nb, kind, sharp, worth,
                                                          together, eps, seed):
    """The exact test of the last sampled block's last child (``_last_child_whole``), which
    reads heads whole before the certificate's statistics are computed, chooses exactly what
    the certificate's own sample would: the same blocks, counts and bounds with it and
    without it."""
    from structattn import block_sparse

    gen = torch.Generator().manual_seed(seed)
    n = nb * block - (seed % block)
    a = torch.randn(heads, n, 4, generator=gen, dtype=torch.float64) * sharp
    b = torch.randn(heads, n, 4, generator=gen, dtype=torch.float64)
    h = _prior(kind, heads, n, gen)
    kw = dict(block=block, worth=worth, together=together)
    fast = certify_blocks(a, b, 0.5, h, eps, **kw)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(block_sparse, "_last_child_whole",
                  lambda A, *rest: torch.zeros(A.shape[0], dtype=torch.bool))
        plain = certify_blocks(a, b, 0.5, h, eps, **kw)
    assert torch.equal(fast.read, plain.read) and torch.equal(fast.count, plain.count)
    assert torch.equal(fast.bound, plain.bound)


@settings(max_examples=40, deadline=None)
@given(heads=st.integers(1, 4), block=st.sampled_from([2, 3, 4]), nb=st.integers(17, 40),
       kind=st.sampled_from(["uniform", "alibi", "forget"]), sharp=st.sampled_from([0.3, 3.0, 12.0]),
       budget=st.sampled_from([0.0, 0.05, 0.3]), eps=st.sampled_from([1e-2, 1e-4]),
       seed=st.integers(0, 10_000))
def test_a_budget_only_reads_heads_whole(heads, block, nb, kind, sharp, budget, eps, seed):
    """``budget``, a cost rule, changes no certified head: each head chooses the blocks,
    counts and bounds it chooses without one, or reads all of its past (bound 0)."""
    gen = torch.Generator().manual_seed(seed)
    n = nb * block - (seed % block)
    a = torch.randn(heads, n, 4, generator=gen, dtype=torch.float64) * sharp
    b = torch.randn(heads, n, 4, generator=gen, dtype=torch.float64)
    h = _prior(kind, heads, n, gen)
    plain = certify_blocks(a, b, 0.5, h, eps, block=block, worth=0.5)
    held = certify_blocks(a, b, 0.5, h, eps, block=block, worth=0.5, budget=budget)
    earlier = torch.arange(held.count.shape[-1])
    for g in range(heads):
        same = torch.equal(held.count[g], plain.count[g]) and torch.equal(
            held.bound[g], plain.bound[g]) and torch.equal(held.read[g], plain.read[g])
        whole = torch.equal(held.count[g], earlier) and bool((held.bound[g] == 0).all())
        assert same or whole, g


def test_scores_needed_is_the_first_rank_whose_tail_fits():
    """``scores_needed`` against its definition, term by term in Python: the fewest top
    ceilings to score before the rest's sum is at most UNSCORED_SHARE·ε of the known mass."""
    from structattn.certificates.block_choice import UNSCORED_SHARE, scores_needed

    gen = torch.Generator().manual_seed(4)
    for eps in (1e-2, 1e-4):
        T = torch.randn(6, 30, generator=gen, dtype=torch.float64) * 8
        T[0, 5:] = float("-inf")  # blocks without keys
        known = torch.randn(6, generator=gen, dtype=torch.float64) * 8 + 10
        got = scores_needed(T, known, eps)
        for r in range(6):
            ranked = sorted(T[r].tolist(), reverse=True)
            need = 0
            while need < len(ranked):
                rest = sum(math.exp(t) for t in ranked[need:])
                if rest / (rest + math.exp(known[r])) <= UNSCORED_SHARE * eps:
                    break
                need += 1
            assert int(got[r]) == need, (r, int(got[r]), need)


def test_on_flat_scores_no_statistic_of_every_child_is_computed(monkeypatch):
    """Uniform scores over 2,048 tokens: the last sampled child leaves out no block, so every
    head reads all of its past without the certificate's ceilings being computed."""
    from structattn import block_sparse

    monkeypatch.setattr(block_sparse, "score_ceiling",
                        lambda *a, **k: pytest.fail("the ceilings were computed"))
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, 2048, 8, generator=gen) * 0.01
    b = torch.randn(2, 2048, 8, generator=gen)
    cert = certify_blocks(a, b, 0.5, None, 1e-4, block=32, worth=0.95)
    assert cert.skipped == 0 and bool((cert.bound == 0).all())
    assert bool((cert.count == torch.arange(64)).all())
