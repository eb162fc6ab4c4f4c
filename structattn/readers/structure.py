"""Read a declaration's structure (node sets and edge families) by running it once."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checking.output_batch import check_output_batch
from ..compiling import lowering
from ..family import EdgeFamily
from ..latent import LatentNodeSet, place_latent
from ..nodes import NodeSet
from ..priors.declared import declared_log_prior
from ..reading import Reading


@dataclass
class Structure:
    """The IR of a declaration run on concrete inputs.

    ``trace_structure`` builds it. ``latents`` picks the latent node sets out of
    ``node_sets``; ``support``, ``log_prior`` and ``posterior`` read one family's edge
    distribution densely.

    Attributes:
        node_sets: every node set by name (observed, latent and deterministic), in
            declaration order.
        families: the edge families (``EdgeFamily``) by name, in declaration order.
        output: the program's output with placeholder zero values — for shapes only.
        energies: the ``structattn.energy`` terms by name (None when not given).
    """

    node_sets: dict[str, NodeSet]
    families: dict[str, EdgeFamily]
    output: object
    energies: dict = None  # name → structattn.energy term
    @property
    def latents(self) -> dict:
        """The latent node sets (``structattn.latent``) by name, in declaration order."""
        return {k: ns for k, ns in self.node_sets.items() if isinstance(ns, LatentNodeSet)}

    @property
    def max_plate_nesting(self) -> int:
        latents = [len(ns.batch_shape) + 2 for ns in self.latents.values()]  # (*batch, 1, n)
        return max([f.plate_nesting for f in self.families.values()] + latents, default=0)

    def support(self, name: str) -> torch.Tensor:
        """Boolean ``(*batch, H, C, P)`` support of family ``name``."""
        return torch.isfinite(self.log_prior(name))

    def log_prior(self, name: str) -> torch.Tensor:
        """Normalised log prior ``(*batch, H, C, P)`` of family ``name``."""
        f = self.families[name]
        t, _ = declared_log_prior(f)  # parentless children (empty="zero"): no prior edge at all
        return t.expand(*f.batch_shape, f.heads, *t.shape[-2:])

    def posterior(self, name: str) -> torch.Tensor:
        """Edge posterior ``(*batch, H, C, P)`` of family ``name`` (dense; all-zero rows for
        parentless children under empty="zero")."""
        return lowering.posterior(self.families[name])


class StructureEdge:
    """Handle for an edge family under ``TraceStructure``: records, computes nothing."""

    def __init__(self, family: EdgeFamily, reader: TraceStructure):
        self.family, self.reader = family, reader

    def add_potential(self, potential):
        self.family.add_potential(potential)

    def expect(self, value):
        self.family.set_value(value)
        return self.reader.expectation(self.family)


def _raw_sites() -> type:
    """``_RawSites``, a Pyro messenger that refuses a raw Pyro site in a declaration read by
    ``TraceStructure``: defined on the first such reading, so that importing structattn does
    not import Pyro."""
    global _RawSites
    if "_RawSites" in globals():
        return _RawSites
    from pyro.poutine.messenger import Messenger

    class _RawSites(Messenger):
        """Refuses a raw Pyro site in a declaration read by ``TraceStructure``."""

        def _pyro_sample(self, msg):
            """Every random variable of a declaration comes from a structattn primitive; a raw
            ``pyro.sample`` / ``pyro.factor`` has no compiled reading, so it is refused here, where
            every oracle starts."""
            from pyro.poutine.subsample_messenger import _Subsample

            if isinstance(msg["fn"], _Subsample):  # a plate's own bookkeeping site
                return
            kind = "pyro.factor" if msg["is_observed"] and msg["fn"].__class__.__name__ == "Unit" \
                else "pyro.sample"
            raise ValueError(
                f"site {msg['name']!r} is a raw {kind}, which structattn's readers do not support "
                f"(the compiled module would ignore it or draw it at random). Declare latent "
                f"variables with structattn.latent(...), edges with structattn.edges(...), edge "
                f"log-likelihoods with structattn.potential(...) and other terms of −log p with "
                f"structattn.energy(...)")

    return _RawSites


class TraceStructure(Reading):
    """The structure's reading: records the declaration, computes no expectation (v ↦ 0).

    Records node sets (in declaration order), edge families, latent node sets and energies;
    each value site returns zeros of its shape ``(*batch, H, C, d_v)``. It shares no code
    with the compiled reading (``Marginalise``), so an oracle that traces the structure first
    never runs the lowering. Raw ``pyro.sample``/``pyro.factor`` sites and a family, latent or
    energy declared twice are refused (ValueError). ``trace_structure`` runs a program under it.

    Args:
        latent_values (dict | None): latent node sets' states by name; None, the default:
            each latent at its initial state.

    Attributes:
        node_sets (dict): the node sets seen, by name, in declaration order.
        families (dict): the edge families, by name.
        latents (dict): the latent node sets, by name.
        energies (dict): the energy terms, by name.
    """

    def __init__(self, latent_values: dict | None = None):
        super().__init__()
        self.latent_values = latent_values
        self.node_sets: dict[str, NodeSet] = {}
        self.families: dict[str, EdgeFamily] = {}
        self.latents: dict = {}
        self.energies: dict = {}

    def __enter__(self):
        self._refusal = _raw_sites()().__enter__()  # inside the reading: leaves it first
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        return self._refusal.__exit__(*exc)

    def nodes(self, ns):
        self.node_sets.setdefault(ns.name, ns)
        return ns

    def edges(self, family):
        if family.name in self.families:
            raise ValueError(f"edge family {family.name!r} is declared twice in one model")
        self.families[family.name] = family
        for ns in (family.parents, family.children):
            self.node_sets.setdefault(ns.name, ns)
        return StructureEdge(family, self)

    def latent(self, node_set):
        if node_set.name in self.latents:
            raise ValueError(f"latent node set {node_set.name!r} is declared twice in one model")
        place_latent(node_set, self.latent_values)
        node_set.inferred = True  # the structure only: no iteration
        self.latents[node_set.name] = node_set
        self.node_sets.setdefault(node_set.name, node_set)
        return node_set

    def energy(self, term):
        if term.name in self.energies:
            raise ValueError(f"energy {term.name!r} is declared twice in one model")
        self.energies[term.name] = term
        return term

    def expectation(self, family):
        family.check_complete()
        v = family.value.parent_values(family.parents.states)  # (*batch, H, P, d_v)
        return v.new_zeros(*family.batch_shape, family.heads, family.children.size, v.shape[-1])


class SubstituteExpectations(TraceStructure):
    """A ``TraceStructure`` whose value sites return given expectations E[v_i].

    With Pyro's exact expectations, the rest of the program — head merging, output
    projections — runs on ground truth (``structattn.inference.exact``).

    Args:
        expectations (dict): E[v_i] by family name, ``(*batch, H, C, d_v)`` each; a value
            site of a family not in it is a ValueError.
        latent_values (dict | None): latent node sets' states by name; None, the default:
            each latent at its initial state.
    """

    def __init__(self, expectations: dict, latent_values: dict | None = None):
        super().__init__(latent_values=latent_values)
        self.given = expectations

    def expectation(self, family):
        try:
            return self.given[family.name]
        except KeyError:
            raise ValueError(f"no expectation given for edge family {family.name!r}") from None


def trace_structure(program, *inputs, latent_values: dict | None = None, **kwargs) -> Structure:
    """Run ``program(*inputs)`` under ``TraceStructure`` and return its ``Structure``.

    The program runs once, without gradients; nothing is sampled and no expectation is
    computed (each value site returns zeros of its shape). Latent node sets stay at their
    initial state, or at ``latent_values``.

    Args:
        program (Callable): the declaration (a ``structattn.Declaration``) or a plain Pyro
            program built from structattn's primitives.
        *inputs (Any): the program's positional inputs, e.g. ``x`` ``(*batch, n, d)``.
        latent_values: latent node sets' states by name, each shaped like its initial state;
            None: every latent at its initial state.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        The ``Structure``: node sets, edge families, energies and the program's output.

    Raises:
        ValueError: the program holds a raw ``pyro.sample`` or ``pyro.factor`` site, declares
            an edge family, latent node set or energy twice, reads a family's value before
            declaring a potential, or ``latent_values`` lacks a latent or holds one of another
            shape; and whatever the primitives refuse as the program declares them.
    """
    with torch.no_grad(), TraceStructure(latent_values) as reader:
        out = program(*inputs, **kwargs)
    owner = getattr(getattr(program, "__self__", None), "display_name", None) \
        or getattr(program, "__name__", type(program).__name__)
    check_output_batch(owner, out, inputs, kwargs, reader.families)
    return Structure(reader.node_sets, reader.families, out, dict(reader.energies))
