"""The compiler's reading: every edge family is summed out in closed form."""

from __future__ import annotations

from ..compiling import lowering
from ..compiling.trace import Trace
from ..family import EdgeFamily
from ..iterative.iterate import Engine, touches
from ..kinds.lowered import warn_if_large
from ..latent import LatentNodeSet, place_latent
from ..reading import Reading


class MarginalEdge:
    """Handle for an edge family under ``Marginalise``: nothing sampled, values expected."""

    def __init__(self, family: EdgeFamily, reader: Marginalise):
        self.family, self.reader = family, reader

    def add_potential(self, potential):
        self.family.add_potential(potential)

    def expect(self, value):
        self.family.set_value(value)
        fam = self.family
        if any(not ns.observed and not ns.inferred for ns in (fam.children, fam.parents)):
            self.reader.infer()  # a value is read at the inferred states
        return self.reader.expectation(fam)


class Marginalise(Reading):
    """The compiled reading: each edge family summed out in closed form, v ↦ E_{p(φ|x)}[v].

    Entered with ``with Marginalise(...):`` (``structattn.reading``): ``structattn.edges``
    returns ``MarginalEdge`` handles and ``structattn.value`` returns E_{p(φ|x)}[v] (SDPA fast
    path, or the dense twin when the posterior is recorded). Latent node sets
    (``structattn.latent``) start at their initial state; ``infer`` (called by
    ``structattn.infer`` or by the first value of a family touching a latent) iterates every
    pending latent against the families declared so far (``structattn.iterative.iterate``). Declaring
    a family, latent or energy twice is a ValueError.

    Args:
        record_posterior (bool): keep each family's dense posterior p(φ_i = j | x) in
            ``posteriors``; default False.
        record_trace (bool): keep the iteration's ``Trace`` (and the operators' reports,
            e.g. a certified window) in ``trace``; default False.
        record_trace_posteriors (bool): also keep the posterior of every step in the trace
            (implies ``record_trace``); default False.
        latent_values (dict | None): latent node sets' states by name: fixed there, no
            iteration (the reading of a model at a point, e.g. Pyro's MAP); None, the
            default: iterated from their initial states.
        declaration (nn.Module | None): the declaration read, whose parameters an error names when states
            computed from them are non-finite; default None.

    Attributes:
        families (dict): the edge families declared, by name (the IR).
        latents (dict): the latent node sets declared, by name.
        energies (dict): the energy terms declared, by name.
        posteriors (dict): recorded posteriors by family, ``(*batch, H, C, P)``.
        expectations (dict): each family's E[v], ``(*batch, H, C, d_v)``.
        trace (Trace | None): what was iterated (latents and schemes alike), or None.
        lowering (dict): how each family was read, by name (``kinds.lowered.Lowering``); a
            dense reading of N ≥ 4,096 tokens warns once (``DenseReadingWarning``).
    """

    def __init__(self, *, record_posterior: bool = False, record_trace: bool = False,
                 record_trace_posteriors: bool = False, latent_values: dict | None = None,
                 declaration=None):
        super().__init__()
        self.declaration = declaration
        self.record_posterior = record_posterior
        self.record_trace = record_trace or record_trace_posteriors
        self.record_trace_posteriors = record_trace_posteriors
        self.latent_values = latent_values
        self.families: dict[str, EdgeFamily] = {}
        self.latents: dict[str, LatentNodeSet] = {}
        self.energies: dict = {}
        self.posteriors: dict = {}
        self.expectations: dict = {}
        self.trace: Trace | None = None  # what was iterated: latents and schemes alike
        self.lowering: dict = {}
        self._caches: dict = {}
        self._final_ops: dict = {}

    def energy(self, term):
        if term.name in self.energies:
            raise ValueError(f"energy {term.name!r} is declared twice in one model")
        self.energies[term.name] = term
        return term

    def latent(self, node_set: LatentNodeSet) -> LatentNodeSet:
        if node_set.name in self.latents:
            raise ValueError(f"latent node set {node_set.name!r} is declared twice in one model")
        place_latent(node_set, self.latent_values)
        self.latents[node_set.name] = node_set
        return node_set

    def infer(self, node_sets=()) -> None:
        """Iterate the pending latents — every latent declared so far, whichever
        ``node_sets`` asks for — to their fixed point (see ``structattn.iterative.iterate``)."""
        pending = [z for z in self.latents.values() if not z.inferred]
        if not pending:  # e.g. every layer clamped: the posteriors at the observed states
            if self.record_posterior:
                for name, fam in self.families.items():
                    if name not in self.posteriors:
                        self.posteriors[name] = lowering.operator_for(
                            fam, self._caches.setdefault(name, {})).posterior()
            return
        for z in pending:
            if not any(touches(f, z) for f in self.families.values()) \
                    and not any(e.touches(z) for e in self.energies.values()):
                raise ValueError(f"latent node set {z.name!r} is in no edge family and no "
                                 f"energy: declare its families (structattn.edges) or energies "
                                 f"(structattn.energy) before inferring it")
        engine = Engine(pending, dict(self.families), self._caches, dict(self.energies))
        trace = engine.run(record=self.record_trace,
                           record_posteriors=self.record_trace_posteriors)
        if self.trace is not None:  # schemes read before: their histories stay
            trace.mean_field.update(self.trace.mean_field)
        self.trace = trace
        for z in pending:
            z.inferred = True
        # the families' operators at the inferred states: they serve the values read next
        self._final_ops.update(engine.operators())
        if self.record_posterior:  # the posteriors at the inferred states (the last step's)
            for name in engine.families:
                self.posteriors[name] = self._final_ops[name].posterior()

    def edges(self, family) -> MarginalEdge:
        if family.name in self.families:
            raise ValueError(f"edge family {family.name!r} is declared twice in one model")
        self.families[family.name] = family
        return MarginalEdge(family, self)

    def expectation(self, family: EdgeFamily):
        # a family the iteration used: its operator at the inferred states (prior tables, the
        # observed side's factor, the posterior if already built) serves the value too
        family.check_complete()
        op = self._final_ops.get(family.name)
        if op is None:
            op = lowering.operator_for(family, record=self.record_trace)
        out, post = lowering.expectation(family, op, want_posterior=self.record_posterior)
        if post is not None:
            self.posteriors[family.name] = post
        if op.history is not None:  # an inference scheme iterated: its field of the trace
            self._scheme_history(family, op.history)
        read = self.lowering[family.name] = op.lowering()
        warn_if_large(family.name, read)
        reports = op.reports() if self.record_trace else {}
        if reports:  # e.g. a certified window chosen, a stick-breaking leftover
            if self.trace is None:
                self.trace = Trace()
            for field_name, entry in reports.items():
                getattr(self.trace, field_name)[family.name] = entry
        self.expectations[family.name] = out
        return out

    def _scheme_history(self, family: EdgeFamily, history) -> None:
        if self.trace is None:
            self.trace = Trace(converged=True)
        getattr(self.trace, family.inference.trace_field)[family.name] = history
        if not self.trace.states:  # no latent iterated: the schemes' rounds are the steps
            self.trace.steps = max(self.trace.steps, history.iterations)
            self.trace.converged = bool(self.trace.converged and history.converged)
