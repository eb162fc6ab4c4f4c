"""Graph / sparse attention (paper Table 1): each node picks one of its neighbours."""

from __future__ import annotations

import torch

from structattn.priors import Uniform

from ._catalogue import TOKEN_SIZES, Entry, randn64
from ._projections import TokenAttention


class GraphAttention(TokenAttention):
    r"""$φ_i ∼ \mathrm{Uniform}(N(i))$, $N(i)$ = the parents of node $i$ in ``adjacency``;
    $ψ = x_iᵀW_QᵀW_K x_j / τ$; $v = W_V x_j$.

    adjacency: a dense boolean ``(n, n)`` mask (``adjacency[i, j]``: i may attend to j;
    lowered to SDPA with a boolean mask) or an ``edge_index`` ``(2, E)`` int64 with row 0
    the parents j and row 1 the children i (PyG's source → target; lowered to an
    O(E)-memory segment softmax, so 10⁵ nodes and 10⁶ edges never build an n×n matrix), or
    a networkx graph on nodes 0..n−1 (an edge u → v: v may attend to u; undirected: both).
    ``empty="zero"`` lets nodes without parents output zero instead of raising.
    x: ``(*batch, n, d_model)`` → ``(*batch, n, d_model or heads·d_v)``; with an edge list
    the posterior (``return_posterior=True``) is per edge, ``(*batch, heads, E)``.

    Args:
        d_model (int): the nodes' width, x's last dimension ``d_model``; a positive int.
        empty (str): what a node without parents gets: ``"error"`` (default): a ValueError;
            ``"zero"``: a zero output and an all-zero posterior row.
        **kwargs (Any): TokenAttention's options (d_k, d_v, heads, causal, out_proj,
            temperature, rope_base, rope_dims, device, dtype, name).
    """

    def __init__(self, d_model, *, empty="error", **kwargs):
        super().__init__(d_model, **kwargs)
        if empty not in ("error", "zero"):
            raise ValueError(f"GraphAttention: empty must be 'error' or 'zero'; got {empty!r}")
        self.empty = empty

    def model(self, x, adjacency):
        tokens = self.tokens(x)
        if _is_networkx(adjacency):
            adjacency = edge_index_from_networkx(adjacency, x.shape[-2], x.device)
        if isinstance(adjacency, torch.Tensor) and adjacency.dtype == torch.bool:
            prior = Uniform(support=adjacency, causal=self.causal, empty=self.empty)
        elif isinstance(adjacency, torch.Tensor) and not adjacency.is_floating_point() \
                and adjacency.dim() == 2 and adjacency.shape[0] == adjacency.shape[1] != 2:
            raise ValueError(
                f"GraphAttention: adjacency of shape {tuple(adjacency.shape)} and dtype "
                f"{adjacency.dtype} looks like a dense (n, n) mask, which must be bool "
                f"(adjacency.bool()); an edge_index is int64 of shape (2, E)")
        elif isinstance(adjacency, torch.Tensor) and adjacency.dtype == torch.long:
            prior = Uniform(edge_index=adjacency, causal=self.causal, empty=self.empty)
        else:
            got = adjacency.dtype if isinstance(adjacency, torch.Tensor) else type(adjacency).__name__
            raise ValueError(
                f"GraphAttention: adjacency must be a boolean (n, n) mask, an int64 edge_index "
                f"(2, E) or a networkx graph on nodes 0..n−1; got {got}"
            )
        return self.attend(self.family_name, tokens, tokens, prior)

    def example_inputs(self, n=5, batch=1):
        """Tokens and an ``edge_index``: self-loops, a ring (j → j + 1) and chords (i + 2 → i),
        each edge once (a support is a set: for n ≤ 3 these coincide)."""
        ring = torch.arange(n)
        edge_index = torch.cat([torch.stack([ring, ring]), torch.stack([ring, (ring + 1) % n]),
                                torch.stack([(ring + 2) % n, ring])], dim=1)
        return (self._randn(batch, n, self.d_model), edge_index.unique(dim=1))


def graph_attention(d_model, **kwargs) -> GraphAttention:
    """Graph attention over a dense mask or an edge list; see ``GraphAttention``."""
    return GraphAttention(d_model, **kwargs)


def _is_networkx(obj) -> bool:
    return type(obj).__module__.startswith("networkx")


def edge_index_from_networkx(graph, n: int, device=None) -> torch.Tensor:
    """``(2, E)`` edge_index of a networkx graph on nodes 0..n−1: row 0 parents j, row 1
    children i (i attends to j along j → i); an undirected edge is both ways, self-loops kept."""
    nodes = set(graph.nodes)
    if not nodes <= set(range(n)):
        bad = sorted(nodes - set(range(n)), key=str)[:3]
        raise ValueError(f"GraphAttention: a networkx adjacency must have nodes 0..{n - 1} (the "
                         f"token positions); got nodes such as {bad}")
    pairs = set()
    for u, v in graph.edges():
        pairs.add((u, v))
        if not graph.is_directed():
            pairs.add((v, u))
    if not pairs:
        return torch.zeros(2, 0, dtype=torch.long, device=device)
    return torch.tensor(sorted(pairs), dtype=torch.long, device=device).T.contiguous()


def _case():
    m = graph_attention(7, d_k=3, heads=2, dtype=torch.float64)
    n = 5
    ring = torch.arange(n)
    edge_index = torch.cat([torch.stack([ring, ring]), torch.stack([(ring + 1) % n, ring]),
                            torch.tensor([[0, 3], [2, 4]])], dim=1)  # self-loops, ring, two chords
    return m, (randn64(2, n, 7), edge_index)


#: the catalogue's statement (structattn/models/_catalogue.py)
ENTRY = Entry(graph_attention, GraphAttention, case=_case,
              example=dict(d_model=8, heads=2),
              sizes=TOKEN_SIZES)
