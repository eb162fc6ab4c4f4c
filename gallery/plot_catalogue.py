"""The catalogue: declared and inferred structure
==============================================

Every catalogue model, drawn: its declared structure (prior over edges) and the structure
it infers on example inputs (posterior over edges), with a heat map of each posterior.

Reads ``structattn.models.REGISTRY``, so a new model appears here without editing this
file. Run: ``python gallery/plot_catalogue.py [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "../gallery/results/block_slot_attention_inferred.png"

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402

# small, readable configurations (the factories' defaults are layer-sized)
SETTINGS = sa.models.EXAMPLES


def build(name):
    torch.manual_seed(0)
    kwargs = SETTINGS.get(name)
    if kwargs is None:
        raise KeyError(f"add a small configuration for {name!r} to SETTINGS")
    model = sa.models.REGISTRY[name](**kwargs)
    if hasattr(model, "position_logits"):  # show a non-trivial learned prior
        with torch.no_grad():
            model.position_logits.normal_()
    inputs = tuple(x * 3 if x.is_floating_point() else x for x in model.example_inputs(n=6))
    return model, inputs


def heatmap(model, inputs, path, title):
    with torch.no_grad():
        structure = sa.trace_structure(model.model, *inputs)
        if structure.latents:  # latent node sets: the posterior at the inferred states
            _, trace = sa.compile(model)(*inputs, return_trace=True)
            final = {name: states[-1] for name, states in trace.states.items()}
            structure = sa.trace_structure(model.model, *inputs, latent_values=final)
    families = list(structure.families)
    heads = max(structure.families[f].heads for f in families)
    fig, axes = plt.subplots(len(families), heads, figsize=(max(2.6 * heads, 5.2), 2.4 * len(families)),
                             squeeze=False)
    for r, fam in enumerate(families):
        post = structure.posterior(fam).reshape(-1, *structure.posterior(fam).shape[-3:])[0]
        for h in range(heads):
            ax = axes[r, h]
            if h < post.shape[0]:
                ax.imshow(post[h].detach().double().numpy(), cmap="Blues", vmin=0, vmax=1)
                ax.set_title(f"{fam}, head {h}", fontsize=8)
                ax.set_xlabel("parent j", fontsize=7)
                ax.set_ylabel("child i", fontsize=7)
            else:
                ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output", "catalogue"))
    p.add_argument("--quick", action="store_true",
                   help="accepted for the test suite; the sizes are already small")
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    written = []
    for name in sorted(sa.models.REGISTRY):
        model, inputs = build(name)
        for kind, ins in (("declared", ()), ("inferred", inputs)):
            path = os.path.join(args.out, f"{name}_{kind}.png")
            written.append(sa.save(sa.render(model, *ins, heads=0), path))
        path = os.path.join(args.out, f"{name}_posterior.png")
        heatmap(model, inputs, path, f"{name}: p(φ_i = j | x) on example inputs")
        written.append(path)
    print("wrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
