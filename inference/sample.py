"""Posterior samples of edges and outputs, through Pyro's ``infer_discrete``.

Edges are drawn jointly from the exact posterior p(φ | x) (``infer_discrete`` with
temperature 1 runs forward-filter backward-sample over the enumerated model) and
the program runs on them, so the mean of the sampled outputs estimates E[output]
without assuming the program is affine in its values — the check ``exact`` cannot
make (its ``output`` is the program at E[v]).
"""

from __future__ import annotations

from structattn.declaration import as_declaration
from structattn.readers import trace_structure

from .draws import Draws, draw_edges

#: the draws of ``sample``: the same ``Draws`` (leading (chain, draw) dims) as every sampler's
PosteriorSamples = Draws


def sample(model, *inputs, num_samples: int = 200, chains: int = 1, progress: bool = False,
           **kwargs) -> Draws:
    """Independent joint draws φ_s ~ p(φ | x) of every edge family, and the output on each.

    The draws are independent: one chain, unless ``chains`` deals them into groups for
    ArviZ's between-chain diagnostics. Cost: ``num_samples`` enumerated runs of the Pyro
    program (the oracle, small inputs).

    Args:
        model (Declaration | Callable): a ``structattn`` declaration (e.g. a catalogue
            model) or a Pyro program built from ``structattn.nodes``/``edges``/``potential``/
            ``value``.
        *inputs (Any): the program's inputs.
        num_samples (int): the number of draws, an int ≥ 2; default 200.
        chains (int): the groups the draws are dealt into, an int ≥ 1 dividing
            ``num_samples``; default 1.
        progress (bool): show a tqdm bar; default False.
        **kwargs (Any): the program's keyword inputs.

    Returns:
        Draws: ``edges[family]`` ``(chains, num_samples / chains, *batch, H, C)`` and
            ``outputs`` ``(chains, num_samples / chains, *output)``.

    Raises:
        ValueError: ``num_samples`` or ``chains`` out of range, or a model that declares no
            edge family.
    """
    if not isinstance(num_samples, int) or isinstance(num_samples, bool) or num_samples < 2:
        raise ValueError(f"num_samples must be an int ≥ 2; got {num_samples!r}")
    if not isinstance(chains, int) or isinstance(chains, bool) or chains < 1 \
            or num_samples % chains:
        raise ValueError(f"chains must be a positive int dividing num_samples={num_samples}; "
                         f"got {chains!r}")
    program = as_declaration(model).model
    structure = trace_structure(program, *inputs, **kwargs)
    if not structure.families:
        raise ValueError("the model declares no edge family (structattn.edges); nothing to sample")
    return draw_edges(program, *inputs, latents=None, num_samples=num_samples, chains=chains,
                      progress=progress, structure=structure, **kwargs)
