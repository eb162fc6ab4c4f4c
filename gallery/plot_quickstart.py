"""Quickstart: declare, compile, check, draw
=========================================

Declare attention as a Pyro model, compile it, check it against Pyro, draw it.

1. declare causal multi-head self attention (the catalogue's declaration) and a
   model of our own (local-window attention over a memory, ten lines);
2. compile both to plain ``nn.Module`` layers;
3. check each layer against Pyro's exact enumeration of the same declaration;
4. draw the declared structure (prior over edges) and the inferred one
   (posterior over edges), and plot posterior heat maps beside Pyro's;
5. plot a long sequence's attention (2,000 tokens) as statistics, not as a graph.

Writes its pictures to ``--out`` (default ``gallery/output/quickstart``).
Run: ``python gallery/plot_quickstart.py [--out DIR] [--quick]``
"""
# mkdocs_gallery_thumbnail_path = "assets/self_attention_inferred.png"

from __future__ import annotations

import argparse
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

import structattn as sa  # noqa: E402


class LocalWindowReader(sa.Declaration):
    """Our own model: each token picks one memory slot within ±w of its position.

    φ_i ~ Uniform({j : |i − j| ≤ w}); ψ(m_j, x_i) = x_iᵀW_QᵀW_K m_j / √d_k; v = W_V m_j.
    """

    def __init__(self, d, d_k, window):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.window = window
        self.W_q = torch.nn.Parameter(torch.randn(d_k, d, generator=g, dtype=torch.float64) / d**0.5)
        self.W_k = torch.nn.Parameter(torch.randn(d_k, d, generator=g, dtype=torch.float64) / d**0.5)
        self.W_v = torch.nn.Parameter(torch.randn(d, d, generator=g, dtype=torch.float64) / d**0.5)

    def model(self, x, memory):
        tokens, slots = sa.nodes("x", x), sa.nodes("memory", memory)
        i = torch.arange(tokens.size)[:, None]
        j = torch.arange(slots.size)[None, :]
        phi = sa.edges("read", tokens, slots, sa.priors.Uniform(support=(i - j).abs() <= self.window))
        sa.potential(phi, sa.potentials.Bilinear(self.W_q, self.W_k))
        return x + sa.merge_heads(sa.value(phi, sa.values.Linear(self.W_v)))


def heatmaps(post, truth, path, title):
    """Compiled posterior, Pyro's marginals and their difference, one row per head."""
    H = post.shape[0]
    fig, axes = plt.subplots(H, 3, figsize=(9, 2.8 * H), squeeze=False)
    for h in range(H):
        for ax, data, name, cmap in (
            (axes[h, 0], post[h], f"compiled p(φ_i=j|x), head {h}", "Blues"),
            (axes[h, 1], truth[h], f"Pyro enumeration, head {h}", "Blues"),
            (axes[h, 2], (post[h] - truth[h]).abs(), "|difference|", "Reds"),
        ):
            im = ax.imshow(data.detach().numpy(), cmap=cmap, vmin=0, vmax=None if "diff" in name else 1)
            ax.set_title(name, fontsize=9)
            ax.set_xlabel("parent j")
            ax.set_ylabel("child i")
            fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "output",
                                                      "quickstart"))
    parser.add_argument("--quick", action="store_true", help="tiny sizes (for the test suite)")
    args = parser.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    n = 5 if args.quick else 8

    # 1–2. the catalogue's declaration, compiled
    m = sa.models.self_attention(d_model=64, d_k=16, d_v=16, heads=4, causal=True,
                                 dtype=torch.float64)
    layer = sa.compile(m)
    x = torch.randn(2, n, 64, dtype=torch.float64) * 2
    y, post = layer(x, return_posterior=True)
    print(f"self attention: x {tuple(x.shape)} -> y {tuple(y.shape)}, "
          f"posterior {tuple(post.shape)}")

    # 3. ground truth from the same declaration, through Pyro
    truth = sa.inference.exact(m, x)
    report = sa.inference.compare(m, x)
    print(report)
    assert report.max_abs_diff < 1e-6, "compiled layer disagrees with Pyro"
    print("MAP edges (batch 0, head 0):", truth.map_edges["attn"][0, 0].tolist())

    # 4. pictures
    written = [
        sa.save(sa.render(m, heads=[0, 1]), os.path.join(args.out, "self_attention_declared.png")),
        sa.save(sa.render(m, x, heads=[0, 1]), os.path.join(args.out, "self_attention_inferred.png")),
        sa.save(sa.render(m, x), os.path.join(args.out, "self_attention_inferred.svg")),
    ]
    heat = os.path.join(args.out, "self_attention_posterior_vs_pyro.png")
    shown = (post[0] - truth.marginals["attn"][0]).abs().max().item()  # the panels' own Δ
    heatmaps(post[0].detach(), truth.marginals["attn"][0], heat,
             f"causal self attention: compiled vs Pyro posterior (max |Δ| = {shown:.1e})")
    written.append(heat)

    # our own declaration: compiled and checked the same way
    mine = LocalWindowReader(d=12, d_k=4, window=1)
    xs, mem = torch.randn(1, n, 12, dtype=torch.float64) * 2, torch.randn(1, n, 12, dtype=torch.float64)
    print(f"\nLocalWindowReader: y {tuple(sa.compile(mine)(xs, mem).shape)}")
    report2 = sa.inference.compare(mine, xs, mem)
    print(report2)
    assert report2.max_abs_diff < 1e-6
    written.append(sa.save(sa.render(mine, xs, mem, labels=True),
                           os.path.join(args.out, "local_window_inferred.png")))

    # 5. a long sequence is plotted, not drawn as a graph: ALiBi's two heads (slopes 1/16 and
    # 1/256) on 2,000 random tokens — each token's MAP parent, attention per distance against
    # the prior's, and where each token looks
    n_long = 300 if args.quick else 2000
    alibi = sa.models.alibi_attention(16, heads=2)
    long_x = torch.randn(1, n_long, 16) * 2
    path = os.path.join(args.out, "long_sequence_attention.png")
    sa.plot_attention(alibi, long_x, filename=path)
    written.append(path)
    print("\nwrote:\n  " + "\n  ".join(written))
    return written


if __name__ == "__main__":
    main()
