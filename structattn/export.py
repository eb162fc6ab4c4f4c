"""``export``: a compiled declaration as a ``torch.export.ExportedProgram``.

The program holds only PyTorch operators: it is saved with ``torch.export.save`` and runs
where ``torch`` is installed and neither structattn nor Pyro is. ``torch.export`` reads the
declaration once, non-strictly (as Python, on fake tensors), the way a plan is recorded
(``structattn.compiling.replay``); the value checks the reading makes become one fused
``torch._assert_async`` per kind in the program (off when exported under
``structattn.validation(False)``), so a NaN input still fails where the program runs —
with the message "structattn value check failed", not the reading's own (run the model
under structattn for that).

A prior with a certified ``tol`` chooses its window's width from the data on every call;
exported with ``window=W``, the program takes that width as its last input and asserts the
window's certificate at it (``structattn.certificates.certified.window_bound`` ≤ tol for every token) on
every call. What cannot be exported is refused in one line, before torch traces anything,
with the reason: a family read by an inference scheme (expanding attention's mean-field
windows, whose sizes depend on the data), certified key blocks, a Beta-geometric
``prior_tol``, or a certified window without ``window``. Iterative models are exported at
their fixed step count; graph attention with dynamic sizes (the number of nodes and of edges
vary).
"""

from __future__ import annotations

import contextlib
import io
import sys

import torch
from torch import nn

from . import reading
from .checking import _validation
from .compiler import CompiledModule, compile
from .kinds.window import Window
from .priors.beta_geometric import BetaGeometric

__all__ = ["export"]

_MESSAGE = ("structattn value check failed: an input holds NaN/inf or a support is empty "
            "(run the model under structattn for the check's own message)")


class _Program(nn.Module):
    """What is exported: one reading of the layer with the given options, checks fused."""

    def __init__(self, layer: CompiledModule, options: dict, window: bool = False):
        super().__init__()
        self.layer, self.options, self.window = layer, options, window
        self.certificate_message = (
            f"structattn certificate failed: {layer.declaration.display_name}'s certified "
            f"window at the width given (the program's last input) leaves more than its tol "
            f"of some child's posterior mass out; call it with a wider width")

    def forward(self, *inputs):
        flags: list = []
        certificates: list = []  # each certified window's verdict at the runtime width
        given = {}
        if self.window:
            *inputs, width = inputs
            torch._check(width >= 1)
            given = {"window": (width, certificates)}
        with _validation.recording(flags, exporting=True), reading.entered(**given):
            out = self.layer.interpret(*inputs, **self.options)
        if certificates:  # not a value check: the window's own guarantee, always asserted
            torch._assert_async(torch.stack(certificates).all(), self.certificate_message)
        sums = [f for f in flags if f.is_floating_point()]
        verdicts = [f for f in flags if not f.is_floating_point()]
        if sums:
            torch._assert_async(torch.isfinite(torch.stack([s.to(torch.float64) for s in sums])
                                               .sum()), _MESSAGE)
        if verdicts:
            torch._assert_async(torch.stack(verdicts).all(), _MESSAGE)
        return out


def _dynamic_shapes(dynamic, inputs: tuple, window: bool = False):
    """``torch.export``'s ``dynamic_shapes`` for the program's ``*inputs`` (and, with a
    ``window``, its runtime width, always dynamic)."""
    if (dynamic is None or dynamic is False) and not window:
        return None
    if dynamic is True:  # every dimension may vary; export keeps static what the model fixes
        dynamic = tuple({i: torch.export.Dim.AUTO for i in range(x.dim())}
                        if isinstance(x, torch.Tensor) else None for x in inputs)
    elif dynamic is None or dynamic is False:
        dynamic = (None,) * len(inputs)
    if window:
        dynamic = (*dynamic, torch.export.Dim.DYNAMIC)
    return (tuple(dynamic),)  # the program's forward takes *inputs: one entry for them all


def _refuse_data_dependent(layer: CompiledModule, inputs: tuple, kwargs: dict,
                           window: int | None = None) -> None:
    """The library's one-line refusal of what has no single program, found from the
    declaration's structure before torch traces anything: a family read by an inference
    scheme (expanding attention's mean-field windows: their sizes depend on the data), a
    prior with a certified ``tol`` exported without a ``window`` (its width is then chosen
    from the data on every call), or a ``window`` for a model with no certified window."""
    from .readers import trace_structure

    if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                               or window < 2):
        raise ValueError(f"structattn.export: window (the certified windows' width, the "
                         f"program's runtime input; here its example value) must be an int "
                         f"≥ 2 (torch specialises 0 and 1); got {window!r}")
    try:
        structure = trace_structure(layer.declaration.model, *inputs, **kwargs)
    except Exception:  # the reading's own error comes out of the export below
        return
    name = layer.declaration.display_name
    certified = [fam for fam in structure.families.values()
                 if fam.prior.tol is not None and isinstance(fam.support, Window)
                 and fam.prior.certificate == "window"]
    if window is not None and not certified:
        raise ValueError(f"structattn.export: window={window} is the width of certified "
                         f"windows (a tol on a distance prior), but {name} has none; export "
                         f"it without window")
    for fam in structure.families.values():
        if fam.inference is not None:
            raise ValueError(
                f"structattn.export: {name} cannot be exported: edge family {fam.name!r} is read "
                f"by {type(fam.inference).__name__}, whose windows are sized from the data on "
                f"every call, so no single program holds it; export its exact reading "
                f"(e.g. expanding attention's inference=None) or run it under structattn")
        if isinstance(fam.prior, BetaGeometric) and fam.prior.prior_tol is not None:
            raise ValueError(
                f"structattn.export: {name} cannot be exported: edge family {fam.name!r} cuts "
                f"its support at the prior's tail (prior_tol={fam.prior.prior_tol:g}), a width "
                f"read from the learned Beta parameters on every call, so no single program "
                f"holds it; export it with max_window (a fixed width) or run it under "
                f"structattn")
        tol = fam.prior.tol
        if tol is not None and isinstance(fam.support, Window) and fam.prior.certificate \
                == "blocks":  # (stick-breaking's tol only stops a scan: its exported
            # reading is the whole table)
            raise ValueError(
                f"structattn.export: {name} cannot be exported: edge family {fam.name!r} has "
                f"certified key blocks (tol={tol:g}), chosen from the data on every call, so "
                f"no single program holds them; export it with certificate='window' and a "
                f"window=, without tol (all of the past), or run it under structattn")
        if window is None and any(fam is c for c in certified):
            raise ValueError(
                f"structattn.export: {name} cannot be exported as it is: edge family "
                f"{fam.name!r} has a certified window (tol={tol:g}) whose width is chosen from "
                f"the data on every call; export it with window=W (the program then takes the "
                f"width as its last input and asserts the window's certificate at it on "
                f"every call), without tol (all of the past), or run it under structattn")


class _quiet_torch:
    """torch's own logging held to errors, and what it prints itself (a data-dependent
    guard's graph dump) kept, while exporting: a refused export printed hundreds of lines of
    warnings and graph dumps before the library's one-line message. What was printed comes
    out after a successful export."""

    NAMES = ("torch", "torch._dynamo", "torch._export", "torch.export",
             "torch.fx.experimental.symbolic_shapes", "torch._subclasses")

    def __enter__(self):
        import logging

        self.levels = [(logging.getLogger(n), logging.getLogger(n).level) for n in self.NAMES]
        for logger, _ in self.levels:
            logger.setLevel(logging.ERROR)
        self.printed = (io.StringIO(), io.StringIO())  # (torch prints its failed graph to
        self.redirects = (contextlib.redirect_stdout(self.printed[0]),  # stderr itself)
                          contextlib.redirect_stderr(self.printed[1]))
        for redirect in self.redirects:
            redirect.__enter__()
        return self

    def __exit__(self, kind, *exc):
        for redirect in reversed(self.redirects):
            redirect.__exit__(kind, *exc)
        for logger, level in self.levels:
            logger.setLevel(level)
        if kind is None:
            sys.stdout.write(self.printed[0].getvalue())
            sys.stderr.write(self.printed[1].getvalue())
        return False


def _size_oblivious(on: bool):
    """Tracing with a runtime width, torch's size-oblivious reasoning: a layout check (is a
    padded block contiguous, is a size 1) otherwise becomes a guard that pins the sequence
    length or the width to the example's case."""
    if not on:
        return contextlib.nullcontext()
    import torch.fx.experimental._config as shapes

    return shapes.patch(backed_size_oblivious=True)


def export(model, *example_inputs, dynamic=None, window: int | None = None,
           return_posterior: bool = False, **kwargs) -> torch.export.ExportedProgram:
    """Export the compiled ``model`` with ``torch.export.export`` at ``example_inputs``.

    The program holds only PyTorch operators: save it with ``torch.export.save(program,
    path)``, load it with ``torch.export.load(path)`` and call ``.module()(*inputs)`` — no
    structattn needed there. The value checks become fused asserts in the program (off when
    exported under ``structattn.validation(False)``). Iterative models are exported at their
    fixed step count.

    Args:
        model (Declaration | Callable | CompiledModule): a ``structattn.Declaration``, a Pyro
            program using structattn primitives, or a ``CompiledModule`` (exported as it is;
            the others are compiled first).
        *example_inputs (Any): the model's inputs to trace it at, as it is called with them
            (e.g. ``x``, ``(*batch, N, d)``).
        dynamic (bool | Sequence | None): None (default) or False: every shape as in the
            examples; True: every input dimension may vary (``torch.export.Dim.AUTO``, kept
            static where the model needs it); or ``torch.export``'s own ``dynamic_shapes``,
            one entry per input.
        window (int | None): for a model with certified windows (a ``tol`` on a distance
            prior: FoX, ALiBi, BAM, expanding attention's exact reading), the example value
            of their width, which the program then takes as its last input (``program.
            module()(x, width)``, any int ≥ 1): every certified window reads the band of
            that width, and the program asserts its certificate there on every call — each
            child's posterior mass beyond it ≤ tol — failing with "structattn certificate
            failed" where the data needs a wider one. A layer called under structattn
            reports the width it certified for an input (``return_trace=True``:
            ``trace.truncation``). None (default): a model with certified windows is
            refused.
        return_posterior: the program also returns the edge posteriors, as
            ``CompiledModule.forward`` does: ``(*batch, heads, children, parents)`` for one
            edge family, else a dict by family name.
        **kwargs (Any): further keyword arguments, passed to the model on every call of the
            program. Not ``return_trace`` or ``trace_posteriors``: a ``Trace`` is a
            structattn class.

    Returns:
        The ``torch.export.ExportedProgram``; its module returns the model's output (and
            the posteriors with ``return_posterior=True``).

    Raises:
        ValueError: ``return_trace`` or ``trace_posteriors`` is asked for; a family is read
            by an inference scheme (expanding attention's mean-field windows) or its prior
            chooses its support from the data (certified key blocks, a Beta-geometric
            ``prior_tol``, a certified ``tol`` without ``window``), so no single program
            holds it; ``window`` is not an int ≥ 2, or is given for a model without
            certified windows (all refused before torch traces anything); or
            ``torch.export`` fails, the message naming where the reading failed.
    """
    if kwargs.get("return_trace") or kwargs.get("trace_posteriors"):
        raise ValueError("structattn.export: return_trace returns a structattn Trace, which a "
                         "program loaded without structattn could not rebuild; export the "
                         "output (and return_posterior=True) instead")
    layer = model if isinstance(model, CompiledModule) else compile(model)
    _refuse_data_dependent(layer, example_inputs, kwargs, window)
    program = _Program(layer, {"return_posterior": return_posterior, **kwargs},
                       window=window is not None)
    inputs = tuple(example_inputs) + (() if window is None else (window,))
    try:
        with _quiet_torch(), _size_oblivious(window is not None):
            return torch.export.export(
                program, inputs, strict=False,
                dynamic_shapes=_dynamic_shapes(dynamic, example_inputs, window is not None))
    except Exception as err:
        from .plans.record import _where

        name = layer.declaration.display_name
        text = str(err)
        hint = (". A reading that branches on tensor values (a tolerance loop, data-dependent "
                "window sizes) has no single program: export a fixed-step or exact "
                "configuration") if "data-dependent" in text or "DataDependent" in repr(
                    type(err)) else ""
        raise ValueError(
            f"structattn.export: {name} could not be exported: its reading {_where(err)}"
            f"{type(err).__name__}: {text.splitlines()[0][:300]}{hint}") from err
