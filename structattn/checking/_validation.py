"""Value checks that cost a pass over the data, switchable like ``torch.distributions``.

Shape, dtype and device checks are always on (they are free). Checks that read
tensor *values* — NaN inputs, children whose support is empty — need a pass
over the data and a device sync, so they follow the ``torch.distributions``
convention: on by default, off with ``structattn.set_validation(False)``.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import replace

import torch

from .. import reading

_DEFAULT = True  # the process-wide default (set_validation)
_QUEUED = True  # whether a replayed call on a GPU queues its verdicts (structattn.checking.verdicts)


def set_validation(enabled: bool, queued: bool | None = None) -> None:
    """Turn the value checks on or off by default, in every thread (on by default).

    The setting is process-wide: it applies in every thread that has no ``validation()``
    override of its own, and it drops the calling thread's override.

    Args:
        enabled: whether value checks (NaN inputs, empty supports, parameter ranges) run;
            converted with ``bool``.
        queued: on a GPU, whether a replayed call queues its checks' verdicts and returns
            without waiting for them (True, the initial setting: a failed check raises at the
            next call of the layer after the GPU ran it, or at ``structattn.raise_pending()``;
            ``structattn.checking.verdicts``), or waits for them in the call (False). None, the
            default, leaves the current setting unchanged.
    """
    global _DEFAULT, _QUEUED
    _DEFAULT = bool(enabled)
    if queued is not None:
        _QUEUED = bool(queued)
    ctx = reading.context()
    if ctx.validate is not None:  # the calling thread's override is dropped
        reading._set(replace(ctx, validate=None))


def checks_on() -> bool:
    """Whether value checks run: validating, and not traced by ``torch.compile`` (where a
    check would break the graph) — unless a plan is recorded or a program exported, where
    checks become flags (``passes``). While a plan is recorded ``as_guards`` (checks off, on
    the CPU), the checks are recorded too: there they guard the plan, not the call."""
    ctx = reading.context()
    if not (_DEFAULT if ctx.validate is None else ctx.validate):
        return ctx.as_guards
    return ctx.flags is not None or not torch.compiler.is_compiling()


def is_validating() -> bool:
    """Whether value checks are on in the calling thread.

    Returns:
        The thread's own setting inside a ``validation()`` block, otherwise the
            process-wide default of ``set_validation`` (True unless changed).
    """
    override = reading.context().validate
    return _DEFAULT if override is None else override


@contextlib.contextmanager
def validation(enabled: bool):
    """Context manager that turns the value checks on or off in the calling thread only.

    ``with structattn.validation(False): layer(x)`` runs ``layer`` unchecked; other threads
    (e.g. ``nn.DataParallel`` replicas) keep their own setting. On exit, also when the block
    raises, the thread's previous setting comes back.

    Args:
        enabled: whether value checks run inside the block; converted with ``bool``.

    Yields:
        (None): nothing; the block runs with the setting in force.
    """
    old = reading._set(reading.derived(reading.context(), validate=bool(enabled)))
    try:
        yield
    finally:
        reading._set(old)


@contextlib.contextmanager
def recording(flags: list, *, exporting: bool = False, as_guards: bool = False):
    """While a plan is recorded (``structattn.compiling.replay``) or a program exported
    (``structattn.export``): value checks append their verdicts (boolean tensors, or sums that
    must be finite) to ``flags`` instead of reading them. ``as_guards``: with the checks off,
    record them all the same, as the conditions under which the plan is valid (the replay
    re-reads a call that fails one, and that reading, unchecked, carries NaN its own way)."""
    with reading.entered(flags=flags, exporting=exporting, as_guards=as_guards):
        yield


def is_exporting() -> bool:
    """Whether ``structattn.export`` is reading the declaration in this thread."""
    return reading.context().exporting


def is_recording() -> bool:
    """Whether a plan is being recorded in this thread (``structattn.compiling.replay``)."""
    return reading.context().flags is not None


def verdict(ok: torch.Tensor) -> bool:
    """A value check's verdict read on the host (one sync where ``ok`` is on a device): a
    floating-point ``ok`` passes when it is finite (a sum: finite iff every summand is,
    unless it overflows), a boolean one when it is True."""
    return math.isfinite(float(ok)) if ok.is_floating_point() else bool(ok)


def passes(ok: torch.Tensor) -> bool:
    """A value check's ``verdict(ok)``; while a plan is recorded, True after noting ``ok``: the
    replay reads every noted verdict (or, on a GPU, queues them: ``structattn.checking.verdicts``),
    and a call whose verdict fails is read again, check by check, to raise the message."""
    flags = reading.context().flags
    if flags is None:
        return verdict(ok)
    flags.append(ok)
    return True


def may_hold(flag: torch.Tensor) -> bool:
    """``bool(flag)`` for a shortcut that skips a check when it cannot fail (e.g. no −∞ in a
    table: no empty row); True while a plan is recorded, so that the full check is recorded."""
    return True if reading.context().flags is not None else bool(flag)


def first_true(flags: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the first True in a boolean tensor, or None when there is none (a value
    check: while a plan is recorded, None after noting that there must be none)."""
    if passes(~flags.any()):
        return None
    return tuple(int(i) for i in flags.nonzero()[0])


def check_finite(what: str, tensor: torch.Tensor) -> None:
    """Refuse NaN and ±inf: a ValueError naming ``what`` when ``tensor`` holds any.

    A no-op while validation is off (``structattn.set_validation(False)``). The message
    counts the non-finite entries and gives the first one's index; where the declaration
    being read has a non-finite parameter, the error names that parameter instead.

    Args:
        what (str): the tensor's name in the message (e.g. "input x").
        tensor (torch.Tensor): the tensor to check, any shape.

    Raises:
        ValueError: ``tensor`` holds NaN or ±inf (or a parameter it came from does).
    """
    if not checks_on():
        return
    # A finite sum means every entry is finite (NaN or ±inf anywhere poisons it), and the
    # sum allocates nothing the size of the tensor; scan elementwise only when it is not.
    if passes((tensor.detach() if tensor.requires_grad else tensor).sum()):
        return
    bad = ~torch.isfinite(tensor)
    first = first_true(bad)
    if first is not None:
        blame_parameters(what)  # a diverged parameter, not the input, when one is non-finite
        raise ValueError(
            f"{what} contains non-finite values (NaN or inf): {int(bad.sum())} of "
            f"{tensor.numel()} entries, the first at index {first}. structattn refuses to "
            f"propagate them into a posterior; clean the input or call "
            f"structattn.set_validation(False) to skip this check."
        )


def blame_parameters(what: str) -> None:
    """Raise a ValueError naming the first non-finite parameter (or buffer) of the declaration
    being read, when ``what`` — states computed from the inputs and the parameters — turned out
    non-finite and such a parameter exists; return otherwise. Reads the parameters only on this
    failure path (the compiled reading tells which declaration it reads: ``reader.declaration``)."""
    module = next((r.declaration for r in reversed(reading.readings())
                   if r.declaration is not None), None)
    if module is not None:
        check_parameters(module, f"; {what}, computed from it, is non-finite")


def check_parameters(module, because: str = "") -> None:
    """A ValueError naming the first non-finite parameter (or buffer) of ``module``, if any
    (``because``: what it made non-finite, appended to the message)."""
    for name, t in (*module.named_parameters(), *module.named_buffers()):
        if not t.is_floating_point() or bool(torch.isfinite(t).all()):
            continue
        bad = ~torch.isfinite(t.detach())
        raise ValueError(
            f"parameter {name!r} of {type(module).__name__} contains non-finite values (NaN or "
            f"inf): {int(bad.sum())} of {t.numel()} entries, the first at index "
            f"{first_true(bad)}{because}. A parameter is not an "
            f"input to clean: it diverged in training (lower the learning rate, clip the "
            f"gradients) or was loaded so — restore it from a checkpoint or re-initialise it.")


def check_size(owner: str, name: str, value, least: int = 1) -> int:
    """A size argument (heads, widths, counts, steps) checked: an integer ≥ ``least``.

    Args:
        owner (str): who takes the argument, the message's prefix (e.g. "Bilinear").
        name (str): the argument's name in the message.
        value (int): the value given; numpy integers are accepted, bools, floats and strings
            refused.
        least (int): the smallest value allowed; default 1.

    Returns:
        int: ``value`` as an int.

    Raises:
        ValueError: ``"<owner>: <name> must be a positive int; got <value>"`` (or ``an
            int ≥ <least>``) when ``value`` is not an integer ≥ ``least``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        want = "a positive int" if least == 1 else f"an int ≥ {least}"
        raise ValueError(f"{owner}: {name} must be {want}; got {value!r}")
    return int(value)


def check_positive(owner: str, name: str, value):
    """A positive parameter (e.g. a Beta parameter) checked: finite and > 0.

    A tensor's values are checked while validation is on; where they are non-finite and a
    parameter of the declaration being read diverged, the error names that parameter.

    Args:
        owner (str): who takes the argument, the message's prefix.
        name (str): the argument's name in the message.
        value (float | torch.Tensor): a number, or a floating-point tensor ``()`` or
            ``(heads,)``; bools refused.

    Returns:
        (float | torch.Tensor): a number as a float, a tensor as it is.

    Raises:
        ValueError: ``"<owner>: <name> must be finite and > 0 …"``, or a tensor that is not
            floating point or has more than one dimension.
    """
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point() or value.dim() > 1:
            raise ValueError(f"{owner}: {name} must be a float or a floating-point "
                             f"tensor () or (heads,); got {value.dtype} of shape "
                             f"{tuple(value.shape)}")
        if checks_on() and not passes(((value > 0) & value.isfinite()).all()):
            if not bool(value.isfinite().all()):  # computed from a parameter that diverged?
                blame_parameters(f"{owner}: {name}")
            raise ValueError(f"{owner}: {name} must be finite and > 0 (a Beta "
                             f"parameter); got {value.detach().cpu().tolist()}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}: {name} must be finite and > 0 (a Beta "
                         f"parameter); got {value!r}")
    return float(value)


def check_layer_sizes(owner: str, layer_sizes, order: str) -> list[int]:
    """A network's layer sizes checked: a list or tuple of ≥ 2 positive ints.

    Args:
        owner (str): who takes the argument, the message's prefix.
        layer_sizes (list | tuple): the sizes, each a positive int (``check_size``).
        order (str): which end is which, for the message (e.g. "input first").

    Returns:
        list[int]: the sizes as ints.

    Raises:
        ValueError: not a list or tuple of at least 2 entries, naming the list, or an entry
            that is not a positive int, naming it (``layer_sizes[l]``).
    """
    sizes = list(layer_sizes) if isinstance(layer_sizes, (list, tuple)) else None
    if not sizes or len(sizes) < 2:
        raise ValueError(f"{owner}: layer_sizes must be a list of ≥ 2 positive ints ({order}); "
                         f"got {layer_sizes!r}")
    return [check_size(owner, f"layer_sizes[{l}]", n) for l, n in enumerate(sizes)]


def check_like(what: str, states: torch.Tensor, reference: torch.Tensor, reference_name: str
               ) -> None:
    """States must have the dtype of a parameter they meet (``reference``, described as
    ``reference_name``, e.g. "potential W_q") and sit on its device: a ValueError naming both,
    with the actual and the expected dtype (device) and what to do, otherwise. Free: no pass over
    the data. Integer states are refused here too (states are floating point)."""
    if states.dtype != reference.dtype:
        fix = (f"convert one of them (e.g. layer.to({states.dtype}))" if states.is_floating_point()
               else f"states are floating point: convert the input (e.g. .to({reference.dtype}))")
        raise ValueError(f"{what} has dtype {states.dtype} but {reference_name} has dtype "
                         f"{reference.dtype}; {fix}")
    if not same_device(states.device, reference.device):
        raise ValueError(f"{what} is on {states.device} but {reference_name} is on "
                         f"{reference.device}; move one of them "
                         f"(e.g. layer.to({str(states.device)!r}))")


def shape_str(shape) -> str:
    return str(tuple(int(s) for s in shape))


def same_device(a, b) -> bool:
    """``cuda`` and ``cuda:0`` name the same device when the index is left out."""
    a, b = torch.device(a), torch.device(b)
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index
