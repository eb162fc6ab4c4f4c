"""Independent dense references, written from the maths, not from the library."""

import math

import torch


def heads_of(t, H):
    return t.unflatten(-1, (H, t.shape[-1] // H)).transpose(-3, -2)


def softmax_attention(W_q, W_k, W_v, W_o, queries, keys, heads, *, mask=None, causal=False,
                      bias=None, temperature=None):
    """softmax(Q Kᵀ/τ + bias, masked) V per head, heads concatenated, then W_o. Also returns P."""
    q, k, v = heads_of(queries @ W_q.T, heads), heads_of(keys @ W_k.T, heads), \
        heads_of(keys @ W_v.T, heads)
    tau = math.sqrt(q.shape[-1]) if temperature is None else temperature
    s = q @ k.transpose(-1, -2) / tau
    if bias is not None:
        s = s + bias
    allowed = torch.ones(s.shape[-2:], dtype=torch.bool)
    if causal:
        allowed = allowed.tril()
    if mask is not None:
        allowed = allowed & mask
    s = s.masked_fill(~allowed, float("-inf"))
    p = s.softmax(-1)
    y = (p @ v).transpose(-3, -2).flatten(-2)
    return (y if W_o is None else y @ W_o.T), p


def random_support(C, P, *, generator=None, density=0.5):
    """A random boolean (C, P) mask with at least one allowed parent per child."""
    m = torch.rand(C, P, generator=generator) < density
    m[torch.arange(C), torch.randint(P, (C,), generator=generator)] = True
    return m


def random_graph(n, g, density=0.4, self_loops=True):
    mask = torch.rand(n, n, generator=g) < density
    if self_loops:
        mask |= torch.eye(n, dtype=torch.bool)
    dst, src = mask.nonzero().T  # mask[i, j]: child i, parent j
    perm = torch.randperm(src.numel(), generator=g)  # edge order must not matter
    return mask, torch.stack([src[perm], dst[perm]])


def band_per_child(a, b, u, e, window, offset, scale):
    """Each child's band written out, ``(G, N, dv)``: child i = offset + q reads parents
    1 ≤ i − j ≤ W_i under softmax_j(scale·⟨a_i, b_j⟩ + (i − j)·e_i); W_i = 0 gives zeros."""
    N, P = a.shape[1], b.shape[1]
    d = (torch.arange(offset, offset + N, device=a.device)[:, None]
         - torch.arange(P, device=a.device)[None]).to(a.dtype)
    on = (d >= 1) & (d <= window[..., None])
    logits = torch.where(on, scale * a @ b.transpose(-1, -2) + d * e[..., None], -torch.inf)
    return torch.softmax(logits, -1).nan_to_num(0.0) @ u
