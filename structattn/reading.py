"""The reading stack: who answers a declaration's primitives, and in which modes.

A declaration is read by whichever ``Reading`` is innermost: every primitive
(``structattn.nodes``, ``deterministic``, ``edges``, ``latent``, ``infer``, ``energy``) calls
``current_reading().<primitive>(...)``. There is one path:

- ``PYRO`` (``PyroReading``), below every other: the primitives *are* Pyro sites — an edge
  family a ``pyro.sample`` of a ``Categorical`` marked for enumeration, a latent a
  ``pyro.sample``, an energy a ``pyro.factor`` — so a declaration runs under plain
  ``pyro.poutine`` handlers and ``structattn.inference`` sees ordinary Pyro sites;
- ``structattn.readers.Marginalise`` (the compiled reading) and ``TraceStructure`` (the
  structure, for the oracles and the drawings): readings entered with ``with reading:``.

One ``ReadingContext`` holds everything else a reading depends on: the readings entered and
the modes — value checks on or off, a plan being recorded (its flags, ``as_guards``), an
export, the compiled kernels, the Triton kernels on the CPU, the iteration overrides. It is
immutable: a mode is entered as a new context (``entered(...)``), and the previous one comes
back on exit. Each thread holds its own (e.g. an ``nn.DataParallel`` replica), in one
per-thread slot; a new thread starts from the defaults. (The slot is a ``threading.local``,
not a ``contextvars.ContextVar``: ``torch.compile`` traces the one and refuses the other, and a
compiled module's reading is entered inside the code it traces.)
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class ReadingContext:
    """The readings entered and the modes they read in (immutable: see ``entered``).

    Attributes:
        readings: the readings entered, innermost last (``PYRO`` answers when there is none).
        validate: the value checks: True or False inside ``structattn.validation(...)``;
            None: the process-wide default (``structattn.set_validation``).
        flags: while a plan is recorded or a program exported, the list the value checks note
            their verdicts in instead of reading them (``structattn.checking._validation.passes``);
            None otherwise.
        exporting: ``structattn.export`` is reading the declaration.
        as_guards: with the checks off, record them all the same, as the plan's guards.
        kernels: the compiled C++ kernels may be used (False inside
            ``structattn.kernels.disabled()``).
        triton_on_cpu: the Triton kernels serve CPU tensors under the interpreter
            (``structattn.triton_kernels.on_cpu()``).
        flex: FlexAttention may read a family on CUDA (False inside
            ``structattn.kinds.flex_reading.disabled()``).
        iteration: ``structattn.iteration(...)``'s overrides of the latents' options
            (name → value), replaced, never changed in place.
        window: while ``structattn.export(..., window=W)`` reads the declaration, ``(width,
            verdicts)``: the width every certified window reads (the program's runtime
            input, symbolic while traced) and the list each window's certificate at it goes
            into (a bool tensor: every child's posterior mass beyond it ≤ tol); None
            otherwise.
    """

    readings: tuple = ()
    validate: bool | None = None
    flags: list | None = None
    exporting: bool = False
    as_guards: bool = False
    kernels: bool = True
    triton_on_cpu: bool = False
    flex: bool = True
    iteration: dict = field(default_factory=dict)
    window: tuple | None = None


#: the context a thread starts with
DEFAULT = ReadingContext()
_slot = threading.local()  # .context: the thread's ReadingContext, when not DEFAULT


def context() -> ReadingContext:
    """The ``ReadingContext`` in force in the calling thread.

    Returns:
        ReadingContext: the thread's context (``DEFAULT`` where none was entered).
    """
    return getattr(_slot, "context", DEFAULT)


def _set(ctx: ReadingContext) -> ReadingContext:
    """Put ``ctx`` in force in the calling thread; returns the one it replaces."""
    old = getattr(_slot, "context", DEFAULT)
    _slot.context = ctx
    return old


_DERIVED: dict = {}  # (id(context), changes) → (context, derived context): see ``derived``


def derived(ctx: ReadingContext, **changes) -> ReadingContext:
    """``ctx`` with ``changes`` (``dataclasses.replace``), the same object for the same request.

    Outside a reading and a recording, the same ``ctx`` with the same hashable changes gives
    the same object each time: a mode entered on every call (``with
    structattn.validation(False): layer(x)``) then keeps one context, which a plan's fast
    path compares by identity, and costs no new object. Up to 256 such contexts are kept.

    Args:
        ctx (ReadingContext): the context to derive from.
        **changes (Any): the fields to replace, e.g. ``validate=False``.

    Returns:
        ReadingContext: ``ctx`` with the changes (a new one inside a reading or a recording,
            or where a change is unhashable).
    """
    if ctx.readings or ctx.flags is not None:
        return replace(ctx, **changes)
    try:
        key = (id(ctx), *sorted(changes.items()))
        hash(key)
    except TypeError:  # e.g. iteration overrides (a dict)
        return replace(ctx, **changes)
    hit = _DERIVED.get(key)
    if hit is not None and hit[0] is ctx:
        return hit[1]
    if len(_DERIVED) > 256:  # contexts of iteration overrides come and go
        _DERIVED.clear()
    new = replace(ctx, **changes)
    _DERIVED[key] = (ctx, new)
    return new


@contextlib.contextmanager
def entered(**changes):
    """Context manager: the context in force with ``changes`` (``ReadingContext`` fields by
    name) inside the block; the previous one is back on exit, also when the block raises.

    Args:
        **changes (Any): the fields to replace, e.g. ``validate=False``.

    Yields:
        (ReadingContext): the context in force inside the block.
    """
    ctx = derived(context(), **changes)
    old = _set(ctx)
    try:
        yield ctx
    finally:
        _set(old)


class Reading:
    """What answers a declaration's primitives. A subclass overrides the primitives it reads
    differently; entered with ``with reading:`` (pushed on the context's readings), it answers
    every primitive called inside the block, in the block's thread.

    Attributes:
        declaration: the declaration (``nn.Module``) read, if known: a non-finite state
            computed from its parameters names the parameter (``_validation.blame_parameters``).
        context: the ``ReadingContext`` the reading was entered in (itself innermost); None
            before it is entered.
    """

    declaration = None
    _entered_in: ReadingContext | None = None  # the context around it, without it

    @property
    def context(self) -> ReadingContext | None:
        # built on each read, not stored: a reading holding a context that holds the reading
        # is a reference cycle, and every table of its pass (C×P and more) would then outlive
        # the call until the cyclic collector ran — the next layer's tables on top of them
        outer = self._entered_in
        return None if outer is None else replace(outer, readings=(*outer.readings, self))

    def __enter__(self):
        self._entered_in = context()
        self._outer = _set(self.context)
        return self

    def __exit__(self, *exc):
        _set(self._outer)
        return False

    # -- the primitives (each returns what the primitive returns) ---------------------------
    def nodes(self, node_set):
        """An observed (or deterministic) node set declared: returned as it is."""
        return node_set

    def edges(self, family):
        """An edge family declared (``structattn.edges``): the handle its ``potential`` and
        ``value`` are called on."""
        raise NotImplementedError

    def latent(self, node_set):
        """A latent node set declared (``structattn.latent``): returned, placed."""
        raise NotImplementedError

    def infer(self, node_sets) -> None:
        """``structattn.infer(*node_sets)``: their states made final (``node_set.states``)."""

    def energy(self, term):
        """An energy term declared (``structattn.energy``): returned."""
        raise NotImplementedError


class PyroReading(Reading):
    """Plain Pyro, below every other reading: each primitive emits its Pyro sites.

    An edge family emits its ``pyro.sample`` of φ ~ Categorical and its potentials'
    ``pyro.factor``; a latent its ``pyro.sample``; an energy its ``pyro.factor``: Pyro's
    handlers and inference see them as any others. It takes no arguments; ``PYRO`` is the
    one that answers when no other reading is entered.

    Attributes:
        declaration (None): None (a plain Pyro run names no declaration).
        context (ReadingContext | None): the context the reading was entered in; None
            before it is entered.
    """

    def edges(self, family):
        return family.pyro_sample()

    def latent(self, node_set):
        return node_set.pyro_sample()

    def energy(self, term):
        return term.pyro_factor()


#: the reading that answers when no other is entered
PYRO = PyroReading()


def current_reading() -> Reading:
    """The reading that answers a primitive called now, in the calling thread.

    Returns:
        Reading: the innermost reading entered, or ``PYRO`` where none is.
    """
    readings = getattr(_slot, "context", DEFAULT).readings
    return readings[-1] if readings else PYRO


def readings() -> tuple:
    """The readings entered in the calling thread.

    Returns:
        tuple: the readings, innermost last (empty: Pyro reads).
    """
    return getattr(_slot, "context", DEFAULT).readings
