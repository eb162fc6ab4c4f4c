"""``compile``: a declaration → a plain ``torch.nn.Module`` with the edges summed out."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .checking.output_batch import check_output_batch
from .compiling.replay import MAX_PLANS, MISSED, Plans
from .declaration import Declaration, as_declaration
from .iterative.iterate import Engine
from .plans.internals import GLOBAL_HOOKS as _HOOKS
from .plans.internals import tracing_state
from .readers.marginalise import Marginalise


class CompiledModule(nn.Module):
    """The marginalised layer of a declaration; shares its parameters.

    ``forward(*inputs)`` runs the declaration under the ``Marginalise`` reading:
    each ``structattn.value`` returns E_{p(φ_i|x)}[v_i] in closed form (SDPA),
    and the rest of the program (head merging, output projections) runs as
    ordinary torch code. With ``return_posterior=True`` it also returns the
    edge posteriors p(φ_i = j | x): a tensor ``(*batch, heads, children,
    parents)`` when the model has one edge family, else a dict by family name.
    The output is E[program output] whenever the program is affine in its
    values (true of every catalogue model); ``structattn.inference.compare``
    checks it against Pyro.

    Compiled once per input signature (``structattn.compiling.replay``): the first call with given
    shapes, dtypes, devices and options reads the declaration; the second records what that
    reading does to tensors as a graph; later calls replay only the graph (``plans``: the
    ``Plan`` per signature; ``reset()`` drops them; ``replay=False`` reads every call).

    Models with latent node sets (``structattn.latent``) iterate: the latents move to the
    (approximate) fixed point of their collapsed free energy before any value is read.
    Families declared with an inference scheme (``structattn.iterative.scheme``, e.g. expanding
    attention's mean-field windows) iterate too. ``return_trace=True`` also returns the
    ``Trace``: states and free energy per step (with ``trace_posteriors=True`` the edge
    posteriors per step too), and one field per scheme (``trace.mean_field[family]``:
    windows, Beta parameters and expected distances per child and round). Outputs come in
    the order (output, posterior, trace); ``forward`` documents the call.

    Args:
        declaration: the ``Declaration`` to read (``structattn.compile`` wraps a plain Pyro
            program into one); kept as ``declaration``, whose parameters the module shares.
        replay: record a plan per input signature and replay it (the default); False reads
            the declaration on every call.
        max_plans: how many input signatures (shapes, dtypes, devices, options) the module
            records, ``MAX_PLANS`` (32) by default; calls with further signatures are read
            from the declaration every time, with a warning once. 0 records none.
        dynamic: once two sizes of the same inputs (ranks, dtypes, devices, options) have
            plans, record one plan with symbolic sizes (``dynamic_plans``) that serves every
            further size its guards accept (the default); False: a plan per size only.

    Raises:
        ValueError: when ``max_plans`` is not an int ≥ 0 (a bool is refused).
    """

    def __init__(self, declaration: Declaration, *, replay: bool = True,
                 max_plans: int = MAX_PLANS, dynamic: bool = True):
        super().__init__()
        if isinstance(max_plans, bool) or not isinstance(max_plans, int) or max_plans < 0:
            raise ValueError(f"compile: max_plans (how many input signatures are recorded) must "
                             f"be an int ≥ 0; got {max_plans!r}")
        if not isinstance(dynamic, bool):
            raise ValueError(f"compile: dynamic (whether a plan with symbolic sizes serves "
                             f"inputs of many sizes) must be True or False; got {dynamic!r}")
        self.declaration = declaration
        self._plans = Plans(replay, max_plans=max_plans, dynamic=dynamic)

    @property
    def plans(self) -> dict:
        """The recorded ``Plan`` per signature (a plan with ``graph`` None says, in ``reason``,
        why its signature is read every call)."""
        return dict(self._plans.plans)

    @property
    def dynamic_plans(self) -> dict:
        """The recorded ``Plan`` with symbolic sizes per sizes-free signature (its ``guards``:
        the conditions on the sizes it serves, as text; ``graph`` None and ``reason`` where
        the reading fixes every size)."""
        return dict(self._plans.dynamic_plans)

    def reset(self) -> None:
        """Forget every plan: the next calls read the declaration again (needed only after
        changing a plain attribute of a sub-module that is not a Declaration)."""
        self._plans.clear()

    def __call__(self, *inputs, **kwargs):
        # The common case first: the last plan's fast path without nn.Module's call machinery
        # (three Python frames, 2–4 µs of a 50 µs call at small sizes), wherever nothing
        # needs that machinery — no hooks on this module or global ones, no
        # nn.Module.compile(), no TorchScript tracer, not inside torch.compile. Otherwise, and
        # when the call is not the last plan's, nn.Module's own call (hooks, then forward).
        if "cache" in kwargs:  # a decoding step: the generated call of the cache's last plan
            step = getattr(kwargs["cache"], "_step", None)  # (a FixedCache's: CacheStep)
            if step is not None and self._compiled_call_impl is None \
                    and not (self._forward_pre_hooks or self._forward_hooks
                             or self._backward_hooks or self._backward_pre_hooks or _HOOKS[0]
                             or _HOOKS[1] or _HOOKS[2] or _HOOKS[3]) \
                    and not torch.compiler.is_compiling() and not tracing_state():
                out = step(self, inputs, kwargs)
                if out is not MISSED:
                    return out
            return super().__call__(*inputs, **kwargs)
        plans = self._plans
        last = plans._last
        if last is not None and plans.enabled and self._compiled_call_impl is None \
                and not (self._forward_pre_hooks or self._forward_hooks or self._backward_hooks
                         or self._backward_pre_hooks or _HOOKS[0] or _HOOKS[1] or _HOOKS[2]
                         or _HOOKS[3]) \
                and not torch.compiler.is_compiling() and not tracing_state():
            out = last.run(self, inputs, kwargs)
            if out is MISSED:  # another recent plan's: e.g. evaluation between training steps
                out = plans.replay_recent(self, inputs, kwargs)
            if out is not MISSED:
                return out
        return super().__call__(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs):
        """Run the declaration's program with every edge family marginalised.

        Args:
            *inputs (torch.Tensor): the model's positional inputs, as the declaration's
                ``model`` takes them (e.g. ``x`` ``(*batch, N, d)``).
            **kwargs (Any): the model's keyword inputs, passed on to it, and three options,
                each True or False (False by default): ``return_posterior`` also returns the
                edge posteriors p(φ_i = j | x); ``return_trace`` also returns the ``Trace``;
                ``trace_posteriors`` records the edge posteriors per step in the trace.
                ``cache=layer.new_cache()`` (a causal model) reads x's tokens after those
                the cache holds and appends them (``structattn.decoding.read``: ``lengths=``,
                ``return_posterior=``).

        Returns:
            (torch.Tensor | tuple): the model's output with every value replaced by its
                posterior expectation, or, with options set, a tuple in the order (output,
                posterior, trace). The posterior is a tensor ``(*batch, heads, children,
                parents)`` when the model has one edge family, else a dict by family name.

        Raises:
            TypeError: when ``return_posterior``, ``return_trace`` or ``trace_posteriors``
                is not a bool.
            ValueError: when ``return_trace=True`` and the model has nothing to trace (no
                latent node set, inference scheme, certified truncation or stick-breaking
                prior), or when a value check fails while validation is on (e.g. a
                non-finite input or parameter). On a GPU a replayed call queues its checks,
                and a failed one raises at a later call of the module or at
                ``structattn.raise_pending()``.
        """
        if "cache" in kwargs:  # decoding: read eagerly against the cache (structattn.decoding)
            from .decoding import read
            return read(self, *inputs, **kwargs)
        plans = self._plans
        if plans.enabled and not torch.compiler.is_compiling():
            last = plans._last  # the plan replayed last, behind its guard: the common case
            if last is not None:
                out = last.run(self, inputs, kwargs)
                if out is MISSED:
                    out = plans.replay_recent(self, inputs, kwargs)
                if out is not MISSED:
                    return out
            return plans(self, inputs, kwargs)
        return self.interpret(*inputs, **kwargs)

    def new_cache(self, capacity: int | None = None, *, tol=None, query_norm=None,
                  key_norm=None, input_norm=None, block=64):
        """An empty ``structattn.decoding.DecodeCache`` for ``self(x_new, cache=c)``: each
        call reads x_new's tokens after everything ``c`` holds and appends them (a causal
        model only; ``lengths=`` for rows with different numbers of new tokens).

        Args:
            capacity (int | None): None: the cache grows as it fills; an int: room for that
                many tokens per row, allocated by the first call and written in place, so
                that every step has the same shapes and replays one recorded plan (and
                ``torch.compile`` traces it once); a call beyond it is refused.
            tol (float | None): certified eviction (``structattn.decoding.evict``), in
                (0, 1), for a growing cache: the oldest blocks of ``block`` keys are dropped
                once their posterior mass is proved ≤ tol for every later query, from
                ceilings on the future queries' and keys' norms — ``query_norm`` and
                ``key_norm`` (a number, or one per head), or ``input_norm``, a ceiling on ‖x‖
                carried through the projections' spectral norms. ALiBi, FoX and the
                generalised Gaussian with loc ≤ 0 only; ``c.trace`` reports each call.
        """
        from .decoding import new_cache
        given = {k: v for k, v in (("query_norm", query_norm), ("key_norm", key_norm),
                                   ("input_norm", input_norm)) if v is not None}
        if block != 64:
            given["block"] = block
        return new_cache(self, capacity, tol, **given)

    def interpret(self, *inputs, return_posterior: bool = False, return_trace: bool = False,
                  trace_posteriors: bool = False, **kwargs):
        """One reading of the declaration under ``Marginalise``: what ``forward`` does on a
        signature's first call (and ``torch.compile`` / ``torch.export`` trace)."""
        for name, flag in (("return_posterior", return_posterior), ("return_trace", return_trace),
                           ("trace_posteriors", trace_posteriors)):
            if not isinstance(flag, bool):
                raise TypeError(f"{type(self.declaration).__name__}: {name} must be True or "
                                f"False; got {flag!r} ({type(flag).__name__})")
        with Marginalise(record_posterior=return_posterior, record_trace=return_trace,
                         record_trace_posteriors=trace_posteriors,
                         declaration=self.declaration) as reader:
            out = self.declaration.model(*inputs, **kwargs)
        check_output_batch(self.declaration.display_name, out, inputs, kwargs, reader.families)
        result = (out,)
        if return_posterior:
            posts = reader.posteriors
            result += (next(iter(posts.values())) if len(posts) == 1 else dict(posts),)
        if return_trace:
            if reader.trace is None:
                raise ValueError(f"{type(self.declaration).__name__} declares no latent node set "
                                 f"(structattn.latent), no family with an inference scheme "
                                 f"(structattn.edges(..., inference=…)), no certified "
                                 f"truncation (a prior's tol=…) and no stick-breaking prior: "
                                 f"there is nothing to trace")
            reader.trace.lowering.update(reader.lowering)
            result += (reader.trace,)
        return result[0] if len(result) == 1 else result

    def explain(self, *inputs, **kwargs) -> dict:
        """How each edge family is read for these inputs, in the caller's grad mode (a
        gradient can change the reading: the CPU's key-bias path needs its compiled kernel
        for one): one reading of the declaration, its output dropped.

        Args:
            *inputs (torch.Tensor): the model's inputs, as ``forward`` takes them.
            **kwargs (Any): the model's keyword inputs.

        Returns:
            dict: family name → ``structattn.kinds.lowered.Lowering``: the reading (e.g.
                ``"distance table"``, ``"key-bias terms"``, ``"sdpa"``, ``"window"``,
                ``"dense"``), its size and, for a dense one, why; ``str()`` of one is a line.
        """
        with Marginalise(declaration=self.declaration) as reader:
            self.declaration.model(*inputs, **kwargs)
        return dict(reader.lowering)

    def free_energy(self, *inputs, latents: dict | None = None, **kwargs):
        """F = −log p(x, z) with the edges summed out, ``(*batch,)``, at given latent states
        ``latents`` (name → states; default: the final iterate of a forward pass; a model with
        nothing latent, e.g. every layer clamped, needs none). Its
        gradient with respect to the parameters at fixed states is predictive coding's local
        learning rule: ``layer.free_energy(x, latents=final).sum().backward()``."""
        with Marginalise(latent_values=latents, record_trace=latents is None,
                         declaration=self.declaration) as reader:
            self.declaration.model(*inputs, **kwargs)
        if latents is None and reader.trace is not None and reader.trace.free_energy is not None:
            return reader.trace.free_energy[-1]
        missing = set(latents or {}) - set(reader.latents)
        if missing:
            raise ValueError(f"latents= names {sorted(missing)}, which the model does not "
                             f"declare; its latents: {sorted(reader.latents)}")
        return Engine(list(reader.latents.values()), dict(reader.families), {},
                      dict(reader.energies)).free_energy()

    def extra_repr(self) -> str:
        return f"compiled from {type(self.declaration).__name__}"


def compile(model: Declaration | Callable, *, replay: bool = True,  # noqa: A001
            max_plans: int = MAX_PLANS, dynamic: bool = True) -> CompiledModule:
    """Compile a declaration (or a plain Pyro program using structattn primitives) into a
    ``torch.nn.Module`` that marginalises its edge families in closed form.

    Args:
        model: a ``structattn.Declaration`` (e.g. a catalogue model) or a function using
            ``structattn.nodes``/``edges``/``potential``/``value``.
        replay: record a plan per input signature and replay it (False: read the
            declaration on every call).
        max_plans: how many input signatures (shapes, dtypes, options) the module records;
            calls with further ones are read every time, and the module warns once when that
            starts.
        dynamic: once two sizes of the same inputs have plans, one plan with symbolic sizes
            serves every further size its guards accept (True, the default); False: a plan
            per size only.

    Returns:
        CompiledModule: ``layer(*inputs)`` → the model's output with every value replaced by
            its posterior expectation; ``return_posterior``/``return_trace`` add the
            posteriors and the iterations' trace.

    Example:
        Causal attention declared as a model, compiled, and checked against Pyro:

        >>> import torch, structattn as sa
        >>> def attention(x):
        ...     tokens = sa.nodes("x", x)
        ...     phi = sa.edges("attn", tokens, tokens, sa.priors.Uniform(causal=True))
        ...     sa.potential(phi, sa.potentials.DotProduct())
        ...     return sa.value(phi, sa.values.Identity())
        >>> x = torch.randn(2, 5, 4, dtype=torch.float64)
        >>> layer = sa.compile(attention)
        >>> layer(x).shape  # (batch, heads, tokens, d_v)
        torch.Size([2, 1, 5, 4])
        >>> torch.allclose(layer(x), sa.inference.exact(attention, x).output)
        True
    """
    return CompiledModule(as_declaration(model), replay=replay, max_plans=max_plans,
                          dynamic=dynamic)
