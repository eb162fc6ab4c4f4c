"""``structattn render MODEL --out FILE``: draw a catalogue model from the command line.

::

    structattn render self_attention --out sa.svg                 # the declared prior
    structattn render hopfield --inputs 6 --out hopfield.png      # inferred on example inputs
    structattn render expanding_attention --inputs 2000 --out w.png  # plotted, not a graph
    structattn list                                               # the catalogue
"""

from __future__ import annotations

import argparse
import math
import sys


def _positive_int(text: str) -> int:
    """An argparse type for sizes (--inputs, --heads, --top-k, --max-nodes): an int ≥ 1, or a
    clean usage error (no traceback) naming the option."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int; got {value}")
    return value


def _finite_float(text: str) -> float:
    """An argparse type for --scale and --threshold: a finite number, or a clean usage error."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number; got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number; got {text!r}")
    return value


def _build(name: str, heads: int | None):
    import structattn as sa

    if name not in sa.models.REGISTRY:
        raise SystemExit(f"structattn: unknown model {name!r}; choose one of "
                         f"{', '.join(sorted(sa.models.REGISTRY))}")
    kwargs = dict(sa.models.EXAMPLES.get(name, {}))
    if heads is not None:
        if "heads" not in kwargs:
            raise SystemExit(f"structattn: {name} has no heads option")
        kwargs["heads"] = heads
    return sa.models.REGISTRY[name](**kwargs)


def render(args) -> str:
    import torch

    import structattn as sa

    torch.manual_seed(args.seed)
    model = _build(args.model, args.heads)
    inputs = ()
    if args.inputs is not None:
        inputs = tuple(x * args.scale if x.is_floating_point() else x
                       for x in model.example_inputs(n=args.inputs))
    if inputs and args.out.lower().endswith((".png", ".svg", ".pdf")) and _too_big(
            model, inputs, args.max_nodes):  # a graph would show nothing: plot what it says
        print(f"structattn render: more than {args.max_nodes} nodes in a family; plotting the "
              f"attention (distance per head, MAP parents, windows) instead of a graph",
              file=sys.stderr)
        sa.plot_attention(model, *inputs, filename=args.out)
        return args.out
    dot = sa.render(model, *inputs, top_k=args.top_k, threshold=args.threshold,
                    labels=args.labels, max_nodes=args.max_nodes)
    return sa.save(dot, args.out)


def _too_big(model, inputs, max_nodes: int) -> bool:
    import structattn as sa

    families = sa.trace_structure(model.model, *inputs).families.values()
    return any(f.children.size + f.parents.size > max_nodes for f in families)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="structattn", description="structattn command line")
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render", help="draw a catalogue model's declared or inferred structure")
    r.add_argument("model", help="a name from structattn.models.REGISTRY (see: structattn list)")
    r.add_argument("--out", required=True, help="output file: .svg, .png, .pdf or .dot")
    r.add_argument("--inputs", type=_positive_int, metavar="N",
                   help="draw the posterior on example inputs of N nodes (default: the prior)")
    r.add_argument("--heads", type=_positive_int, help="number of heads (catalogue example: 2)")
    r.add_argument("--top-k", type=_positive_int,
                   help="keep each child's k most probable parents")
    r.add_argument("--threshold", type=_finite_float, default=0.0, help="drop lighter edges")
    r.add_argument("--labels", action="store_true", help="print probabilities on MAP edges")
    r.add_argument("--max-nodes", type=_positive_int, default=64,
                   help="families with more nodes (parents + children) are plotted as "
                        "statistics (an image --out) or refused (default 64)")
    r.add_argument("--scale", type=_finite_float, default=3.0,
                   help="scale of the random example inputs (sharper posteriors)")
    r.add_argument("--seed", type=int, default=0)
    sub.add_parser("list", help="list the catalogue")
    args = ap.parse_args(argv)
    if args.command == "list":
        import structattn as sa

        for name in sorted(sa.models.REGISTRY):
            doc = (sa.models.REGISTRY[name].__doc__ or "").strip().splitlines()
            print(f"{name:30s} {doc[0] if doc else ''}")
        return 0
    from .drawing import RenderError

    try:
        print(render(args))
    except (ValueError, RenderError) as e:
        print(f"structattn render: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
