"""The output's batch dims come from an input or a value: a declaration whose output gains
batch dims neither has (a value ``(*batch, H, C, d_v)`` added to a ``(*batch, C, d)`` tensor
without ``merge_heads`` mixes every batch element with every other) is refused, in every
reading.
"""

from __future__ import annotations

import torch


def _fits(batch: tuple, allowed: tuple) -> bool:
    """Every dim of ``batch`` of size > 1 is the same dim of ``allowed`` (aligned from the right,
    as broadcasting aligns them)."""
    for i, n in enumerate(reversed(batch)):
        if n != 1 and (i >= len(allowed) or allowed[len(allowed) - 1 - i] != n):
            return False
    return True


def _tensors(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)


def _symbolic(*things) -> bool:
    """Whether a tensor among ``things`` has a symbolic size (a plan being recorded)."""
    flat = [t for x in things for t in _tensors(list(x.values()) if isinstance(x, dict) else x)]
    return any(not isinstance(n, int) for t in flat for n in t.shape)


def check_output_batch(owner: str, out, inputs: tuple, kwargs: dict, families: dict) -> None:
    """Refuse an output tensor ``(*b, n, d)`` whose batch ``b`` fits no input's batch
    (``x.shape[:-2]``), no family's batch and no family's value batch ``(*batch, heads)``.

    Args:
        owner (str): the declaration's name, for the message.
        out (Any): the program's output (tensors, or tuples/lists of them, are checked).
        inputs (tuple): the program's positional inputs.
        kwargs (dict): its keyword inputs.
        families (dict): the edge families the reading declared, by name.

    Raises:
        ValueError: an output with batch dims that neither an input nor a value has.
    """
    if not families or torch.compiler.is_compiling() or _symbolic(out, inputs, kwargs):
        return  # no value to broadcast; or a recording, whose concrete reading was checked
    given = sorted({tuple(x.shape[:-2]) for x in (*inputs, *kwargs.values())
                    if isinstance(x, torch.Tensor) and x.dim() >= 2})
    # a family's own batch (its node sets', which a program may have reshaped its inputs
    # into) and its value's (*batch, heads)
    values = sorted({shape for f in families.values()
                     for shape in (tuple(f.batch_shape), (*f.batch_shape, f.heads))})
    for t in _tensors(out):
        batch = tuple(t.shape[:-2])
        if not any(_fits(batch, a) for a in (*given, *values)):
            raise ValueError(
                f"{owner}: the output {tuple(t.shape)} has batch dims {batch} that no input "
                f"(batch {given}) and no family or value ((*batch[, heads]) {values}) has: a value "
                f"(*batch, heads, children, d_v) was broadcast against a (*batch, children, d) "
                f"tensor — merge its heads first, structattn.merge_heads(structattn.value(…)) "
                f"→ (*batch, children, heads·d_v)")
