"""Block-slot attention: two edge families on one latent node set (inputs → slots, slot
blocks → prototypes). Oracles: a hand-written SysBinder in SysBinder's own parameter layout
(the original recipe, and each of its two steps that differ from the block-wise variant
against its definition), slot attention (the block-wise recipe's one-block, no-memory limit),
a hand-written EM loop, Pyro's loss and MAP."""

import pytest
import torch

import structattn as sa

f64 = torch.float64


def test_one_block_without_memory_is_slot_attention():
    sa_model = sa.models.slot_attention(3, 8, iters=3, hidden_dim=16, dtype=f64)
    bs = sa.models.block_slot_attention(3, 8, num_blocks=1, num_prototypes=0, iters=3,
                                        hidden_dim=16, recipe="blockwise", dtype=f64)
    state = sa_model.state_dict()
    for k in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):  # GRUCell → one block
        state[f"gru.{k}"] = state[f"gru.{k}"].unsqueeze(0)
    for i in (0, 2):
        state[f"mlp.{i}.weight"] = state[f"mlp.{i}.weight"].unsqueeze(0)
        state[f"mlp.{i}.bias"] = state[f"mlp.{i}.bias"].unsqueeze(0)
    bs.load_state_dict(state)
    x, z = torch.randn(2, 10, 8, dtype=f64), torch.randn(2, 3, 8, dtype=f64)
    assert (sa.compile(bs)(x, z) - sa.compile(sa_model)(x, z)).abs().max() < 1e-12


def test_blockwise_recipe_reads_the_raw_memory_per_block():
    """The last operation of a step: each block becomes Σ_k p(ω = k) C_k with
    p(ω = k) = softmax_k(⟨z_block, C_k⟩/√d) at the state after the GRU and MLP."""
    m = sa.models.block_slot_attention(2, 6, num_blocks=3, num_prototypes=4, iters=1,
                                       hidden_dim=6, recipe="blockwise", dtype=f64)
    x, z0 = torch.randn(2, 5, 6, dtype=f64), torch.randn(2, 2, 6, dtype=f64)
    out, post = sa.compile(m)(x, z0, return_posterior=True)
    assert set(post) == {"assign", "bind"} and post["bind"].shape == (2, 3, 2, 4)
    # by hand: the slot step, then the read
    xn = m.norm_input(x)
    k, v = m.to_k(xn), m.to_v(xn)
    q = m.to_q(m.norm_slots(z0))
    p = torch.softmax(k @ q.transpose(-1, -2) / m.temperature, -1) + m.eps  # (B, N, S)
    w = p / p.sum(-2, keepdim=True)
    z = m.gru(w.transpose(-1, -2) @ v, z0)
    z = z + m.mlp(m.norm_pre_ff(z))
    blocks = z.unflatten(-1, (3, 2))  # (B, S, M, d)
    C = m.prototypes  # (M, K, d)
    scores = torch.einsum("bsmd,mkd->bsmk", blocks, C) / m.memory_temperature
    read = torch.einsum("bsmk,mkd->bsmd", torch.softmax(scores, -1), C).flatten(-2)
    assert (out - read).abs().max() < 1e-12


# -- SysBinder, written out in its own parameter layout ------------------------------------


def layer_norm(x, eps=1e-5):
    """(x − mean) / √(var + eps) over the last dim, without affine parameters."""
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / ((x - mu).pow(2).mean(-1, keepdim=True) + eps).sqrt()


def block_layer_norm(x, M):
    return layer_norm(x.reshape(*x.shape[:-1], M, -1)).reshape(x.shape)


def sysbinder_parameters(S, D, M, K, H, gen, I=None):
    """Random weights in the layout of SysBinder's ``state_dict()`` (sysbinder.py, utils.py):
    bias-free projections, a GRUCell whose matrices are masked block-diagonal, block linears
    ``w (M, d_in, d_out), b (1, M·d_out)``, the memory's prototypes (1, K, M, d) and its
    4-layer MLP d → 4d → 4d → 4d → d. ``I``: the inputs' width (SysBinder's input_size;
    default D), which project_k and project_v map to D (its slot_size)."""
    d = D // M
    I = D if I is None else I

    def r(*shape, s=0.5):
        return torch.randn(*shape, generator=gen, dtype=f64) * s

    p = {"slot_mu": r(1, 1, D), "slot_log_sigma": r(1, 1, D, s=0.1),
         "norm_inputs.weight": 1 + r(I, s=0.1), "norm_inputs.bias": r(I, s=0.1),
         "norm_slots.weight": 1 + r(D, s=0.1), "norm_slots.bias": r(D, s=0.1),
         "project_q.weight": r(D, D), "project_k.weight": r(D, I), "project_v.weight": r(D, I),
         "gru.gru.weight_ih": r(3 * D, D), "gru.gru.weight_hh": r(3 * D, D),
         "gru.gru.bias_ih": r(3 * D), "gru.gru.bias_hh": r(3 * D),
         "mlp.0.w": r(M, d, H // M), "mlp.0.b": r(1, H), "mlp.2.w": r(M, H // M, d),
         "mlp.2.b": r(1, D), "prototype_memory.mem_params": r(1, K, M, d, s=1.0)}
    for i, (a, b) in zip((0, 2, 4, 6), ((d, 4 * d), (4 * d, 4 * d), (4 * d, 4 * d), (4 * d, d)),
                         strict=True):
        p[f"prototype_memory.mem_proj.{i}.weight"] = r(b, a)
        p[f"prototype_memory.mem_proj.{i}.bias"] = r(b, s=0.1)
    return p


def sysbinder_reference(p, inputs, slots, iters, M, eps=1e-8):
    """SysBinder.forward with given initial slots, written out: returns (slots, attn_vis), the
    last iteration's attention before its update."""
    B, N = inputs.shape[:2]
    S, D = slots.shape[1:]
    d = D // M
    mask = torch.block_diag(*[torch.ones(d, d, dtype=f64)] * M).repeat(3, 1)  # GRU block mask
    W_ih, W_hh = p["gru.gru.weight_ih"] * mask, p["gru.gru.weight_hh"] * mask

    def gru(x, h):
        gi, gh = x @ W_ih.T + p["gru.gru.bias_ih"], h @ W_hh.T + p["gru.gru.bias_hh"]
        r = torch.sigmoid(gi[..., :D] + gh[..., :D])
        z = torch.sigmoid(gi[..., D:2 * D] + gh[..., D:2 * D])
        n = torch.tanh(gi[..., 2 * D:] + r * gh[..., 2 * D:])
        return (1 - z) * n + z * h

    def block_linear(x, w, b):
        xb = x.reshape(*x.shape[:-1], M, -1)
        return torch.einsum("...mi,mio->...mo", xb, w).reshape(*x.shape[:-1], -1) + b[0]

    def mem_proj(x):
        for i in (0, 2, 4, 6):
            x = x @ p[f"prototype_memory.mem_proj.{i}.weight"].T + \
                p[f"prototype_memory.mem_proj.{i}.bias"]
            x = torch.relu(x) if i < 6 else x
        return x

    x = layer_norm(inputs) * p["norm_inputs.weight"] + p["norm_inputs.bias"]
    k = x @ p["project_k.weight"].T * D ** -0.5
    v = x @ p["project_v.weight"].T
    mem = block_layer_norm(mem_proj(p["prototype_memory.mem_params"]).reshape(1, -1, D), M)
    memb = mem.reshape(-1, M, d).transpose(0, 1)  # (M, K, d)
    for _ in range(iters):
        prev = slots
        q = (layer_norm(slots) * p["norm_slots.weight"] + p["norm_slots.bias"]) @ \
            p["project_q.weight"].T
        attn_vis = torch.softmax(k @ q.transpose(-1, -2), -1)  # (B, N, S): over slots
        attn = attn_vis + eps
        attn = attn / attn.sum(-2, keepdim=True)
        slots = gru(attn.transpose(-1, -2) @ v, prev)
        slots = slots + block_linear(torch.relu(block_linear(block_layer_norm(slots, M),
                                                             p["mlp.0.w"], p["mlp.0.b"])),
                                     p["mlp.2.w"], p["mlp.2.b"])
        qb = block_layer_norm(slots, M).reshape(B, S, M, d) * d ** -0.5
        w = torch.softmax(torch.einsum("bsmd,mkd->bsmk", qb, memb), -1)
        slots = torch.einsum("bsmk,mkd->bsmd", w, memb).reshape(B, S, D)
    return slots, attn_vis


def sysbinder_model(S=3, D=8, M=2, K=5, H=16, iters=3, seed=0):
    p = sysbinder_parameters(S, D, M, K, H, torch.Generator().manual_seed(seed))
    m = sa.models.block_slot_attention(S, D, num_blocks=M, num_prototypes=K, iters=iters,
                                       hidden_dim=H, dtype=f64)
    m.load_sysbinder_state_dict(p)
    return m, p


def test_original_recipe_is_sysbinder():
    """SysBinder's weights (its own layout) give SysBinder's slots, and SysBinder's returned
    attention is the posterior at the state before the last update."""
    m, p = sysbinder_model()
    x, z0 = torch.randn(2, 11, 8, dtype=f64) * 2, torch.randn(2, 3, 8, dtype=f64)
    want, attn_vis = sysbinder_reference(p, x, z0, 3, M=2)
    out, trace = sa.compile(m)(x, z0, return_trace=True, trace_posteriors=True)
    assert (out - want).abs().max() < 1e-12
    assert want.abs().max() > 0.5  # a real state, not a collapsed one
    assert (trace.posteriors["assign"][-2].squeeze(-3) - attn_vis).abs().max() < 1e-12
    # the posterior at the final slots is another thing: SysBinder does not return it
    assert (trace.posteriors["assign"][-1].squeeze(-3) - attn_vis).abs().max() > 1e-3


def test_original_recipe_queries_the_memory_with_block_normalised_slots():
    """SysBinder's step (a): p(ω_sm = k | z) = softmax_k(⟨BlockLN(z)_m, C_mk⟩/√d) with the
    memory C = BlockLN(MLP(P)); checked at the initial slots (any state) and at the final
    slots (where the posterior is returned)."""
    m, p = sysbinder_model(M=2, D=8, K=3, iters=2, seed=1)
    x, z0 = torch.randn(2, 6, 8, dtype=f64), torch.randn(2, 3, 8, dtype=f64) * 2 + 1
    z, trace = sa.compile(m)(x, z0, return_trace=True, trace_posteriors=True)
    M, d = 2, 4
    h = p["prototype_memory.mem_params"][0]  # (K, M, d)
    for i in (0, 2, 4, 6):
        h = h @ p[f"prototype_memory.mem_proj.{i}.weight"].T + \
            p[f"prototype_memory.mem_proj.{i}.bias"]
        h = torch.relu(h) if i < 6 else h
    C = layer_norm(h)  # (K, M, d): each block of each prototype standardised
    assert (m.memory(()) - C.flatten(-2)).abs().max() < 1e-12  # the memory nodes, block-wise
    for t, state in ((0, z0), (-1, z)):
        zb = state.unflatten(-1, (M, d))
        want = torch.softmax(torch.einsum("bsmd,kmd->bmsk", layer_norm(zb), C) / d ** 0.5, -1)
        post = trace.posteriors["bind"][t]
        assert post.shape == (2, M, 3, 3)
        assert (post - want).abs().max() < 1e-12
    raw = torch.softmax(torch.einsum("bsmd,kmd->bmsk", z0.unflatten(-1, (M, d)), C) / d ** 0.5,
                        -1)
    assert (trace.posteriors["bind"][0] - raw).abs().max() > 1e-2  # raw slots would differ


def test_original_recipe_normalises_each_block_without_affine_before_the_mlp():
    """SysBinder's step (b): the pre-MLP norm standardises each block on its own and has no
    parameters."""
    m, _ = sysbinder_model(M=4, D=8)
    z = torch.randn(5, 3, 8, dtype=f64) * 3 + 1
    want = layer_norm(z.unflatten(-1, (4, 2))).flatten(-2)
    assert (m.norm_pre_ff(z) - want).abs().max() < 1e-12
    assert list(m.norm_pre_ff.parameters()) == []
    whole = layer_norm(z)
    assert (m.norm_pre_ff(z) - whole).abs().max() > 1e-2  # one LayerNorm over the slot differs
    # the step itself: z ← z + MLP(BlockLN(z)) after the GRU, then the read (one iteration)
    m1, p = sysbinder_model(M=4, D=8, iters=1, seed=2)
    x, z0 = torch.randn(1, 7, 8, dtype=f64), torch.randn(1, 3, 8, dtype=f64)
    assert (sa.compile(m1)(x, z0) - sysbinder_reference(p, x, z0, 1, M=4)[0]).abs().max() < 1e-12


def test_sysbinder_at_its_own_sizes_inputs_narrower_than_slots_and_a_narrow_mlp():
    """SysBinder's training script: inputs 192 wide, slots 2,048, mlp_hidden_size 192 over 8
    blocks (each block's MLP 24 wide, narrower than its 256-wide block). Here the same ratios
    at an eighth: inputs 24, slots 256, hidden 24, 8 blocks; SysBinder's weights load and give
    its slots and attention to 1e-12."""
    S, I, D, M, K, H = 3, 24, 256, 8, 4, 24
    p = sysbinder_parameters(S, D, M, K, H, torch.Generator().manual_seed(3), I=I)
    m = sa.models.block_slot_attention(S, D, num_blocks=M, num_prototypes=K, iters=3,
                                       hidden_dim=H, input_dim=I, dtype=f64)
    m.load_sysbinder_state_dict(p)
    assert m.mlp[0].weight.shape == (M, H // M, D // M)  # 3 wide per block, as SysBinder's
    x, z0 = torch.randn(2, 9, I, dtype=f64) * 2, torch.randn(2, S, D, dtype=f64)
    want, attn_vis = sysbinder_reference(p, x, z0, 3, M=M)
    out, trace = sa.compile(m)(x, z0, return_trace=True, trace_posteriors=True)
    assert want.abs().max() > 0.5
    assert (out - want).abs().max() < 1e-12
    assert (trace.posteriors["assign"][-2].squeeze(-3) - attn_vis).abs().max() < 1e-12
    # the model states its input width: a slot-wide input is refused, naming it
    with pytest.raises(ValueError, match=rf"BlockSlotAttention: inputs must have shape "
                                         rf"\(batch, n, {I}\)"):
        sa.compile(m)(torch.randn(2, 9, D, dtype=f64), z0)


def test_sysbinder_weights_of_other_sizes_are_refused():
    p = sysbinder_parameters(3, 8, 2, 5, 16, torch.Generator().manual_seed(0))
    m = sa.models.block_slot_attention(3, 8, num_blocks=2, num_prototypes=4, hidden_dim=16)
    with pytest.raises(ValueError, match=r"prototypes needs shape \(2, 4, 4\); SysBinder's "
                                         r"gives \(2, 5, 4\)"):
        m.load_sysbinder_state_dict(p)
    m = sa.models.block_slot_attention(3, 8, num_blocks=2, num_prototypes=5, recipe="blockwise")
    with pytest.raises(ValueError, match=r"needs recipe='original'.*recipe='blockwise'"):
        m.load_sysbinder_state_dict(p)


def block_em_loop(m, x, z, T):
    """EM for the collapsed recipe, written out: both families Gaussian."""
    k = m.to_k(m.norm_input(x))
    mu, prec = m.slots_mu, m.slots_logsigma.exp() ** -2
    tau, tau_m, M, d = m.temperature, m.memory_temperature, m.num_blocks, m.block_size
    C = m.prototypes  # (M, K, d)
    for _ in range(T):
        p = torch.softmax(-((k[:, :, None] - z[:, None]) ** 2).sum(-1) / (2 * tau), -1)  # (B,N,S)
        zb = z.unflatten(-1, (M, d))  # (B, S, M, d)
        r = torch.softmax(-((zb[:, :, :, None] - C) ** 2).sum(-1) / (2 * tau_m), -1)  # (B,S,M,K)
        pull_m = torch.einsum("bsmk,mkd->bsmd", r, C).flatten(-2) / tau_m
        z = (mu * prec + p.transpose(1, 2) @ k / tau + pull_m) / (
            prec + p.sum(1)[..., None] / tau + 1 / tau_m)
    return z


def test_collapsed_recipe_is_em_descends_and_reaches_pyros_map():
    m = sa.models.block_slot_attention(3, 4, num_blocks=2, num_prototypes=3, iters=30,
                                       recipe="collapsed", dtype=f64)
    x, z0 = torch.randn(2, 8, 4, dtype=f64), torch.randn(2, 3, 4, dtype=f64)
    out, trace = sa.compile(m)(x, z0, return_trace=True)
    assert (out - block_em_loop(m, x, z0, 30)).abs().max() < 1e-10
    assert (trace.free_energy[1:] - trace.free_energy[:-1]).max() <= 1e-10
    with sa.iteration(steps=3000, tol=1e-13):
        report = sa.inference.compare(m, x, z0)
    assert report.max_abs_diff < 1e-9, str(report)
    assert report.fixed_point["slots"] < 1e-4, str(report)


def test_gradcheck_one_step():
    for recipe in ("original", "blockwise", "collapsed"):
        m = sa.models.block_slot_attention(2, 4, num_blocks=2, num_prototypes=2, iters=1,
                                           hidden_dim=4, recipe=recipe, dtype=f64)
        layer = sa.compile(m)
        names = [n for n, _ in layer.named_parameters()]
        x, z = torch.randn(1, 3, 4, dtype=f64), torch.randn(1, 2, 4, dtype=f64)

        def f(x, z, *ps, layer=layer, names=names):
            return torch.func.functional_call(layer, dict(zip(names, ps, strict=True)), (x, z))

        params = tuple(p.detach().clone().requires_grad_() for p in layer.parameters())
        assert torch.autograd.gradcheck(f, (x.requires_grad_(), z.requires_grad_(), *params))


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_blocks=0, num_prototypes=2), "num_blocks"),
    (dict(num_blocks=3, num_prototypes=2), "divisible"),
    (dict(num_blocks=2, num_prototypes=-1), "num_prototypes"),
    (dict(num_blocks=2, num_prototypes=0, recipe="collapsed"), "num_prototypes ≥ 1"),
    (dict(num_blocks=2, num_prototypes=2, memory_temperature=0.0), "temperature"),
    (dict(num_blocks=2, num_prototypes=2, recipe="sysbinder"),
     r"recipe must be one of \('original', 'blockwise', 'collapsed'\); got 'sysbinder'"),
])
def test_bad_configurations_are_refused(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.models.block_slot_attention(3, 8, **kwargs)
