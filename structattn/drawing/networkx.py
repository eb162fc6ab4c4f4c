"""The implied adjacency as a networkx graph: declared (support, prior) or inferred (posterior)."""

from __future__ import annotations

import networkx as nx
import torch

from ..declaration import as_declaration, example_inputs
from ..readers import trace_structure


def _inputs_or_examples(decl, inputs, caller="to_networkx"):
    if inputs:
        return inputs, True
    return example_inputs(decl, caller), False


def node_id(node_set: str, index: int) -> str:
    return f"{node_set}[{index}]"


def _add_edges(G, name, info, prior, post, top_k, threshold, steps) -> None:
    """Family ``name``'s kept edges (the support, pruned by ``threshold`` and ``top_k`` on the
    posterior, else the prior) with their prior, posterior and MAP attributes."""
    weight = post if post is not None else prior  # (H, C, P)
    keep = prior > 0  # the support (and whatever an approximate posterior reaches)
    if post is not None:
        keep |= post > 0
    if threshold > 0:
        keep &= weight >= threshold
    if top_k is not None and top_k < weight.shape[-1]:
        top = torch.zeros_like(keep)
        top.scatter_(-1, weight.masked_fill(~keep, -1.0).topk(top_k, -1).indices, True)
        keep &= top
    best = weight.masked_fill(~(prior > 0) & ~(weight > 0), -1.0).argmax(-1)  # MAP parent
    for h, i, j in keep.nonzero().tolist():
        attrs = {"family": name, "head": h, "support": True, "prior": float(prior[h, i, j])}
        if post is not None:
            attrs["posterior"] = float(post[h, i, j])
            attrs["map"] = bool(best[h, i] == j)
            if steps:
                attrs["step"] = max(steps.values())  # drawn at the final iterate
        G.add_edge(node_id(info["parents"], j), node_id(info["children"], i),
                   key=f"{name}/{h}", **attrs)


def to_networkx(model, *inputs, batch_index: int = 0, max_nodes: int | None = None,
                top_k: int | None = None, threshold: float = 0.0) -> nx.MultiDiGraph:
    """The edge structure of ``model`` as an ``nx.MultiDiGraph`` (a ``DiGraph`` subclass).

    Nodes are ``"name[i]"`` for each node of each node set (attributes ``node_set``,
    ``index``, ``observed``, ``memory``). Each allowed edge x_j → x_i of each family and head
    is an edge keyed ``"family/h"`` with attributes ``family``, ``head``, ``support`` (True),
    ``prior`` p(φ_i = j) and, when inputs are given, ``posterior`` p(φ_i = j | x) (for latent
    node sets, at the compiled reading's final states) and ``map``, True on each child's most
    probable parent per head (the MAP edge). For models that iterate, the graph's ``steps``
    (per latent) and each edge's ``step`` say which iterate is drawn. The graph's
    ``families`` describes each family, ``inferred`` says whether a posterior is drawn and
    ``batch`` is ``(batch_index, batch size)``.

    Large graphs: ``top_k`` and ``threshold`` prune edges by weight (the posterior when
    inferred, else the prior), so only the kept ones become networkx edges (O(C·k), not
    O(C·P)). A walk along the edges (multihop attention's ``Hops`` value) adds the node
    reached after k hops as family ``"name.hopk"`` (posterior P^k, prior p^k; ``hop`` and
    ``walk_of`` in its description).

    Args:
        model (Declaration | Callable): a ``structattn.Declaration`` (e.g. a catalogue model)
            or a Pyro program using ``structattn.nodes``/``edges``/``potential``/``value``.
        *inputs (Any): the model's inputs, as it is called with them (e.g. ``x``,
            ``(*batch, N, d)``): the posterior is read at them. Without any, the
            declaration's ``example_inputs()`` fix the sizes and only the declared structure
            is kept.
        batch_index: the element of the flattened batch that is drawn (default 0).
        max_nodes: refuse a family whose two rows (parents and children) hold more nodes than
            this, before any O(C·P) work (default None: any size).
        top_k: keep only each child's k heaviest edges per head (default None: all).
        threshold: a probability in [0, 1]: drop edges lighter than it (default 0: every
            edge of the support is kept).

    Returns:
        The graph, an ``nx.MultiDiGraph``.

    Raises:
        ValueError: ``model`` is neither a ``Declaration`` nor callable, ``top_k`` is not a
            positive int, ``threshold`` is not in [0, 1], a family has more than
            ``max_nodes`` nodes, or ``batch_index`` is out of range.
        NotImplementedError: no inputs are given and the declaration has no
            ``example_inputs()``.
    """
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int)
                              or top_k < 1):
        raise ValueError(f"top_k must be a positive int or None; got {top_k!r}")
    if not 0.0 <= threshold <= 1.0:
        raise ValueError(f"threshold must be a probability in [0, 1]; got {threshold!r}")
    decl = as_declaration(model)
    inputs, inferred = _inputs_or_examples(decl, inputs)
    structure, steps = read_structure(decl, inputs, inferred)
    for name, fam in structure.families.items():
        drawn = fam.children.size + fam.parents.size
        if max_nodes is not None and drawn > max_nodes:
            raise ValueError(
                f"family {name!r} has {drawn} nodes to draw ({fam.parents.size} parents + "
                f"{fam.children.size} children), more than max_nodes={max_nodes}: a graph of "
                f"that many nodes shows no structure. Plot what it says instead, "
                f"structattn.plot_attention(model, *inputs) (attention distance per head, each "
                f"child's MAP parent, the window of each token), draw fewer nodes, or raise "
                f"max_nodes"
            )
    G = nx.MultiDiGraph(inferred=inferred, model=decl.display_name, families={},
                        steps=steps)
    for ns in structure.node_sets.values():
        for i in range(ns.size):
            G.add_node(node_id(ns.name, i), node_set=ns.name, index=i, observed=ns.observed,
                       memory=getattr(ns, "memory", False))
    for name, info, prior, post in family_tables(structure, batch_index, inferred):
        G.graph["families"][name] = info
        G.graph["batch"] = (batch_index, info["batch"])
        _add_edges(G, name, info, prior, post, top_k, threshold, steps)
    return G


def read_structure(decl, inputs, inferred):
    """The declaration's structure on ``inputs``; models that iterate at their compiled final
    states. Returns ``(structure, steps)``, ``steps`` the iterations per latent (or None)."""
    structure = trace_structure(decl.model, *inputs)
    if not (inferred and structure.latents):
        return structure, None
    from ..compiler import compile as compile_model

    with torch.no_grad():
        _, trace = compile_model(decl)(*inputs, return_trace=True)
    final = {name: states[-1] for name, states in trace.states.items()}
    structure = trace_structure(decl.model, *inputs, latent_values=final)
    return structure, {name: int(trace.steps) for name in structure.latents}


def family_tables(structure, batch_index, inferred):
    """Each edge family's prior and posterior as ``(H, C, P)`` float64 tables of batch element
    ``batch_index`` (posterior None without inputs), with its description: yields ``(name,
    info, prior, posterior)``. A walk along a family's edges (a ``Hops`` value, multihop
    attention) adds its later hops as ``"name.hopk"``: the node reached in k steps, P^k (and
    the prior's p^k) — Pyro's ``exact(...).marginals["name.hopk"]``."""
    for name, fam in structure.families.items():
        info = {"children": fam.children.name, "parents": fam.parents.name, "heads": fam.heads,
                "prior": fam.prior.describe(),
                "potentials": [p.describe() for p in fam.potentials],
                "value": fam.value.describe() if fam.value is not None else None}
        with torch.no_grad():
            prior = _select(structure.log_prior(name).exp(), batch_index)  # (H, C, P)
            table = structure.posterior(name) if inferred else None
            post = _select(table, batch_index) if inferred else None
        # how many batch elements the inputs held (the prior alone has none)
        info["batch"] = table[..., 0, 0, 0].numel() if table is not None else 1
        yield name, info, prior, post
        weights = getattr(fam.value, "weights", None) if fam.value is not None else None
        if not weights or fam.children is not fam.parents:
            continue
        prior_k, post_k = prior, post
        for k in range(2, len(weights)):
            prior_k = prior_k @ prior
            post_k = None if post is None else post_k @ post
            if weights[k]:
                yield f"{name}.hop{k}", dict(
                    info, prior=f"walk of {k} steps along φ '{name}' (P^{k})", potentials=[],
                    value=None, hop=k, walk_of=name), prior_k, post_k


def _select(t: torch.Tensor, batch_index: int) -> torch.Tensor:
    """``(*batch, H, C, P) -> (H, C, P)`` at flat batch index ``batch_index``."""
    flat = t.reshape(-1, *t.shape[-3:])
    if not 0 <= batch_index < flat.shape[0]:
        raise ValueError(f"batch_index must be in [0, {flat.shape[0]}); got {batch_index}")
    return flat[batch_index].double().cpu()
