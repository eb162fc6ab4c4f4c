"""Ground truth by exact enumeration in Pyro.

The declaration is run as the Pyro program it is: every edge family is a
``Categorical`` sample site enumerated in parallel, every potential a
``pyro.factor``. ``TraceEnum_ELBO.compute_marginals`` gives the edge posteriors,
``infer_discrete(temperature=0)`` the MAP edges, and the value site under
enumeration gives v_i(x, j) for every j, contracted with the marginals to
E[v_i]. The program's output is then recomputed with each value site replaced
by that exact expectation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pyro import poutine
from pyro.infer import Trace_ELBO, TraceEnum_ELBO, infer_discrete

from structattn.declaration import as_declaration
from structattn.readers import SubstituteExpectations, trace_structure

from ._arviz import edge_dims, inference_data, output_dims, point


@dataclass
class ExactPosterior:
    """What exact enumeration says about a declaration on given inputs: p(φ | x) and more.

    Returned by ``exact``; ``to_arviz()`` converts it.

    Attributes:
        marginals (dict): per family f, p(φ_i = j | x), ``(*batch, H, C, P)``.
        expectations (dict): per family f, E[v_i], ``(*batch, H, C, d_v)``.
        map_edges (dict): per family f, argmax_j p(φ_i = j | x), ``(*batch, H, C)`` (long;
            P — "no parent" — for a child without any parent under ``empty="zero"``).
        output (Any): the program's output with each value replaced by its expectation — equal
            to E[output] when the program is affine in its values (``sample`` estimates
            E[output] without that assumption).
        free_energy (float | None): −log p(x, z) with the edges summed out (z the given
            latents), summed over the batch: the collapsed free energy.
    """

    marginals: dict
    expectations: dict
    map_edges: dict
    output: object
    free_energy: float | None = None

    def to_arviz(self):
        """ArviZ data (``structattn/inference/_arviz.py``'s convention), a point result: one chain of one
        draw. Per edge family f: ``f`` the MAP edges (dims ``f_batch_k``, ``f_head``,
        ``f_child``), ``f_posterior`` the marginals (… ``f_parent``), ``f_value`` E[v] (…
        ``f_feature``); ``output``; ``free_energy`` in sample_stats."""
        variables, dims = {}, {}
        for name, edges in self.map_edges.items():
            batch = edges.dim() - 2
            variables[name] = point(edges)
            dims[name] = edge_dims(name, batch)
            variables[f"{name}_posterior"] = point(self.marginals[name])
            dims[f"{name}_posterior"] = [*edge_dims(name, batch), f"{name}_parent"]
            if name in self.expectations:
                variables[f"{name}_value"] = point(self.expectations[name])
                dims[f"{name}_value"] = [*edge_dims(name, batch), f"{name}_feature"]
        if isinstance(self.output, torch.Tensor):
            variables["output"] = point(self.output)
            dims["output"] = output_dims(self.output.dim())
        stats = {} if self.free_energy is None else {"free_energy": point(
            torch.as_tensor(float(self.free_energy), dtype=torch.float64))}
        return inference_data({"posterior": variables, "sample_stats": stats}, dims)


def _no_guide(*args, **kwargs):
    pass


def _expectation_from_table(table: torch.Tensor, enum_dim: int, probs: torch.Tensor):
    """Contract an enumerated value table with the edge marginals.

    table: the value site under enumeration, enumerated parent j in batch dim
    ``enum_dim`` (negative, counted before the event dim d_v); probs: ``(…, C, P)``.
    """
    dim = enum_dim - 1  # the value has one event dim
    if table.dim() < -dim:
        table = table.reshape((1,) * (-dim - table.dim()) + table.shape)
    table = table.movedim(dim, -2)  # (…, *batch, H, C or 1, P, d_v)
    out = (probs.unsqueeze(-1) * table).sum(-2)
    # other families' enumeration dims are size 1 here: drop them
    return out.reshape(probs.shape[:-1] + out.shape[-1:])


def site_values(states: dict) -> dict:
    """Latent states ``(*batch, n, d)`` by name as their ``pyro.sample`` sites' values
    ``(*batch, 1, n, d)`` (the families' heads dim), detached copies (safe to initialise a
    guide or sampler with: nothing trains the caller's tensors)."""
    return {name: z.detach().clone().unsqueeze(-3) for name, z in states.items()}


def condition_latents(program, latents: dict):
    """``program`` with every latent node set's ``pyro.sample`` site observed at ``latents``
    (name → states ``(*batch, n, d)``)."""
    data = {name: z.unsqueeze(-3) for name, z in latents.items()}  # the sites' heads dim
    return poutine.condition(program, data=data)


def is_enumerable(structure) -> bool:
    """Whether any edge family has a choice to enumerate (Pyro warns when none has)."""
    return any(f.outcomes > 1 for f in structure.families.values())


def elbo_for(structure, **kwargs):
    """``TraceEnum_ELBO`` when some edge family can be enumerated, else ``Trace_ELBO`` (node
    energies only), with the structure's plate nesting."""
    cls = TraceEnum_ELBO if is_enumerable(structure) else Trace_ELBO
    return cls(max_plate_nesting=structure.max_plate_nesting, **kwargs)


def enumeration_bytes(structure) -> int:
    """A lower bound on the memory of one parallel enumeration of ``structure``: for each
    family the enumerated score and value tables, P × (*batch, H, C) × (1 + d_v) entries."""
    total = 0
    for f in structure.families.values():
        cells = f.outcomes * f.batch_shape.numel() * f.heads * f.children.size
        d_v = 1 if f.value is None else f.value.parent_values(f.parents.states).shape[-1]
        hops = 1 if f.value is None or f.value.single_edge else len(getattr(f.value, "weights", ()))
        total += cells * (1 + d_v) * max(hops, 1) * f.children.states.element_size()
    return total


def _at_latents(program, inputs, kwargs, latents):
    """The program and its structure, conditioned on ``latents`` where it has latent node
    sets (which must all be given, and nothing else)."""
    structure = trace_structure(program, *inputs, **kwargs)  # first: which latents exist
    if structure.latents and latents is None:
        raise ValueError(
            f"the model has latent node sets {sorted(structure.latents)}: exact enumeration "
            f"reads it at given latent states — pass latents={{name: states}} (e.g. a compiled "
            f"layer's trace.states or structattn.inference.map_estimate(...).latents)")
    if latents is not None:
        unknown = set(latents) - set(structure.latents)
        if unknown:
            raise ValueError(f"latents= names {sorted(unknown)} that are not latent node sets "
                             f"of the model; its latents: {sorted(structure.latents)}")
        structure = trace_structure(program, *inputs, latent_values=latents, **kwargs)
        program = condition_latents(program, latents)
    return program, structure


def _check_enumerable(structure, max_bytes: int) -> None:
    """Refuse a model with no edge family, one whose enumeration needs more than
    ``max_bytes``, or an empty batch."""
    if not structure.families and not structure.latents:
        raise ValueError("the model declares no edge family (structattn.edges); nothing to infer")
    need = enumeration_bytes(structure)
    if need > max_bytes:
        sizes = ", ".join(f"{n}: {f.parents.size} parents" for n, f in structure.families.items())
        raise ValueError(
            f"exact enumeration of this model needs at least {need / 2**30:.1f} GiB (every "
            f"family enumerated over its parents: {sizes}), "
            f"more than max_bytes={max_bytes / 2**30:.1f} GiB. Check on smaller inputs (fewer "
            f"nodes or batch elements: the layer is the same), draw edges with "
            f"structattn.inference.sample, or raise max_bytes")
    for name, f in structure.families.items():
        if 0 in f.batch_shape:
            raise ValueError(f"edge family {name!r}: the batch is empty (batch shape "
                             f"{tuple(f.batch_shape)}); Pyro cannot enumerate over it")


def _marginals(program, structure, inputs, kwargs, enumerable: bool):
    """``(marginals, outcomes)``: each family's p(φ_i = j | x) ``(*batch, H, C, P)``, and
    every enumerated site's marginal over all its outcomes (a family whose children may have
    no parent has one more, "no parent": its value is zero there; e.g. multihop's later hops
    are sites too)."""
    marginal_dists = {}
    if enumerable:
        elbo = TraceEnum_ELBO(max_plate_nesting=structure.max_plate_nesting)
        marginal_dists = elbo.compute_marginals(program, _no_guide, *inputs, **kwargs)
    outcomes = {name: d.probs for name, d in marginal_dists.items()}
    marginals = dict(outcomes)
    for name, family in structure.families.items():
        P = family.parents.size
        shape = (*family.batch_shape, family.heads, family.children.size, P)
        if name in marginals:  # Pyro drops leading size-1 dims: restore them
            m = marginals[name]
            marginals[name] = m[..., :P].expand(shape)  # without "no parent": zero rows there
            outcomes[name] = m.expand(*shape[:-1], m.shape[-1])
        else:  # a single parent: not enumerated, φ_i = 0 surely
            marginals[name] = outcomes[name] = torch.ones(
                shape, dtype=family.children.states.dtype, device=family.children.states.device)
    return marginals, outcomes


def _expectations(program, structure, outcomes, first_dim: int, inputs, kwargs) -> dict:
    """E[v] per family: Σ over the value's terms of E_{marginal of the term's edge site}
    [term], read from the enumerated trace."""
    enum_trace = poutine.trace(poutine.enum(program, first_available_dim=first_dim)).get_trace(
        *inputs, **kwargs)
    expectations = {}
    for site in enum_trace.nodes.values():
        term = site.get("infer", {}).get("structattn_term") if site["type"] == "sample" else None
        if term is None:
            continue
        family = structure.families[term["family"]]
        target = (*family.batch_shape, family.heads, family.children.size, site["value"].shape[-1])
        edge = term["edge"]
        enum_dim = None if edge is None else enum_trace.nodes[edge]["infer"].get("_enumerate_dim")
        table = site["value"]
        if enum_dim is None:  # depends on no enumerated edge: its own expectation
            e = table.reshape(table.shape[max(0, table.dim() - len(target)):]).expand(target)
        else:
            probs = outcomes[edge]
            e = _expectation_from_table(table, enum_dim, probs.expand(*target[:-1], probs.shape[-1]))
        expectations[term["family"]] = expectations.get(term["family"], 0) + e
    return expectations


def exact(model, *inputs, latents: dict | None = None, max_bytes: int = 4 * 2**30,
          **kwargs) -> ExactPosterior:
    """p(φ_i = j | x), E[v_i], argmax_j p(φ_i = j | x) and the output, by Pyro enumeration.

    Each family is enumerated once in parallel over its P parents, materialising
    ``(P, *batch, H, C, d)`` tables: keep inputs small (it is the oracle, not the layer).

    Args:
        model (Declaration | Callable): a ``structattn`` declaration (e.g. a catalogue
            model) or a Pyro program built from ``structattn.nodes``/``edges``/``potential``/
            ``value``.
        *inputs (Any): the program's inputs.
        latents (dict | None): states by latent node set name, required when the model has
            latent node sets (``structattn.latent``): they are observed there, so everything
            is exact conditional on them (e.g. a compiled layer's final iterate, or
            ``map_estimate(...).latents``). None, the default: no latents.
        max_bytes (int): the most memory the enumeration may take (estimated first);
            default 4 GiB.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        ExactPosterior: the marginals, expectations, MAP edges, output and free energy.

    Raises:
        ValueError: a model with latents but no ``latents`` (or naming others), no edge
            family, an empty batch, or an enumeration estimated beyond ``max_bytes``.
    """
    decl = as_declaration(model)
    program, structure = _at_latents(decl.model, inputs, kwargs, latents)
    _check_enumerable(structure, max_bytes)
    first_dim = -structure.max_plate_nesting - 1
    enumerable = is_enumerable(structure)
    marginals, outcomes = _marginals(program, structure, inputs, kwargs, enumerable)
    expectations = _expectations(program, structure, outcomes, first_dim, inputs, kwargs)
    map_program = (infer_discrete(program, first_available_dim=first_dim, temperature=0)
                   if enumerable else program)
    map_trace = poutine.trace(map_program).get_trace(*inputs, **kwargs)
    map_edges = {name: map_trace.nodes[name]["value"].expand(marginals[name].shape[:-1])
                 for name in structure.families}

    free_energy = elbo_for(structure).loss(program, _no_guide, *inputs, **kwargs)
    with SubstituteExpectations(expectations, latent_values=latents):
        output = program(*inputs, **kwargs)
    return ExactPosterior(marginals, expectations, map_edges, output, free_energy)
