"""A retrieval probe on the byte-level language models: a passkey planted in real text.

Each trial takes validation bytes of the Python standard library's own source, writes
``pass key: 12345.`` (five random digits) at the start, fills ``d`` bytes of real text after
it, and ends with the cue ``pass key: ``. The model then reads the five digits one by one
(teacher-forced). Reported per variant and distance d (``--distances``, 64 … 8,192):

- **accuracy**: the share of the digits the model's most likely next byte gets right;
- **planted-edge mass**: the posterior mass the last layer's edge variables put on the planted
  digits (summed over the five key positions, averaged over heads and over the five answer
  positions) — what a posterior over edges shows that a point prediction does not: whether
  the model *looks* at the passkey, even where it cannot copy it;
- beside it, the mass a uniform causal posterior would give those positions (5/(i + 1)).

The models are ``gallery/train_lm.py``'s (trained here first where ``--out`` holds no
checkpoint). Writes ``passkey.md`` and ``passkey.png`` to ``--out``. Run:
``python gallery/passkey_probe.py [--variants causal rope fox fox+rope] [--steps 400]``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import train_lm  # noqa: E402


def model_for(variant: str, args) -> train_lm.ByteLM:
    """The variant's trained ByteLM, trained now if ``args.out`` holds no checkpoint."""
    folder = pathlib.Path(args.out) / "lm" / f"{variant}_T{args.context}"
    ckpt = folder / "checkpoint.pt"
    if not ckpt.exists():
        train_lm.main(["--attention", variant, "--steps", str(args.steps), "--context",
                       str(args.context), "--d-model", str(args.d_model), "--layers",
                       str(args.layers), "--heads", str(args.heads), "--final-eval", "windows",
                       "--eval-every", str(args.steps), "--out", str(folder.parent)]
                      + train_lm.lm_corpus.corpus_arguments(args))
    model = train_lm.ByteLM(args.d_model, args.layers, args.heads, variant)
    model.load_state_dict(torch.load(ckpt, weights_only=True)["model"])
    return model.eval()


def trial(text: torch.Tensor, distance: int, gen: torch.Generator):
    """``(tokens (T,), key positions (5,), answer positions (5,))``: the passkey at the start,
    ``distance`` bytes of ``text`` after it, the cue and the five answer digits; the answer
    digit at position t is predicted from position t − 1."""
    digits = "".join(str(int(d)) for d in torch.randint(0, 10, (5,), generator=gen))
    head = f"pass key: {digits}. ".encode()
    cue = b" pass key: "
    start = int(torch.randint(0, len(text) - distance - 1, (1,), generator=gen))
    filler = bytes(text[start:start + distance].tolist())
    seq = head + filler + cue + digits.encode()
    keys = torch.arange(len(b"pass key: "), len(b"pass key: ") + 5)
    answers = torch.arange(len(seq) - 5, len(seq))
    return torch.tensor(list(seq), dtype=torch.long), keys, answers


@torch.no_grad()
def probe(model: train_lm.ByteLM, tokens, keys, answers):
    """``(accuracy, planted-edge mass)`` of one trial (module docstring)."""
    x = tokens[None]
    h = model.embed(x)
    post = None
    for block in model.blocks:
        out, post = block.attn(block.ln1(h), return_posterior=True)  # post: (1, H, T, T)
        h = h + out
        h = h + block.mlp(block.ln2(h))
    logits = model.ln(h) @ model.embed.weight.T  # (1, T, 256)
    guess = logits[0, answers - 1].argmax(-1)
    accuracy = float((guess == tokens[answers]).float().mean())
    rows = post[0][:, answers - 1]  # (H, 5, T): the queries that predict each answer digit
    mass = float(rows[..., keys].sum(-1).mean())
    return accuracy, mass


def passkey_rows(model: train_lm.ByteLM, text: torch.Tensor, distances, trials: int,
                 seed: int) -> list[dict]:
    """Per distance, the means over ``trials`` trials of ``probe``'s accuracy and planted-edge
    mass, and of the mass a uniform causal posterior gives the keys."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for d in distances:
        found = []
        for _ in range(trials):
            tokens, keys, answers = trial(text, d, gen)
            # a uniform causal posterior: 1/(q + 1) on each of the five keys, q = answer − 1
            found.append((*probe(model, tokens, keys, answers),
                          float((5 / answers.double()).mean())))
        acc, mass, uniform = (sum(f[k] for f in found) / len(found) for k in range(3))
        rows.append({"distance": d, "accuracy": acc, "planted_edge_mass": mass,
                     "uniform_mass": uniform})
    return rows


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variants", nargs="+", default=["causal", "rope", "fox", "fox+rope"],
                   choices=train_lm.ATTENTIONS)
    p.add_argument("--distances", type=int, nargs="+", default=[64, 256, 1024, 4096, 8192])
    p.add_argument("--trials", type=int, default=4)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--max-files", type=int, default=None, help="the first N files only")
    train_lm.lm_corpus.add_corpus_argument(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "output" / "passkey"))
    p.add_argument("--quick", action="store_true", help="tiny models and distances (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.d_model, args.layers, args.heads = 3, 16, 1, 2
        args.distances, args.trials = [16, 64], 1
        args.max_files = None if args.corpus else 20
        args.variants = args.variants[:2]
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    _, val, _ = train_lm.lm_corpus.corpus_of(args, "passkey_probe")
    rows = []
    for variant in args.variants:
        for r in passkey_rows(model_for(variant, args), val, args.distances, args.trials,
                              args.seed):
            rows.append({"variant": variant, **r})
            print(f"{variant:>10} d={r['distance']:>5}: accuracy {r['accuracy']:.2f}, "
                  f"planted-edge mass {r['planted_edge_mass']:.2e} "
                  f"(uniform {r['uniform_mass']:.1e})", flush=True)
    (out / "passkey.json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    lines = ["| variant | distance | digits right | planted-edge mass | uniform's |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['variant']} | {r['distance']:,} | {r['accuracy']:.2f} | "
              f"{r['planted_edge_mass']:.2e} | {r['uniform_mass']:.1e} |" for r in rows]
    (out / "passkey.md").write_text("\n".join(lines) + "\n")
    _plot(rows, args.variants, out / "passkey.png")
    print("wrote", out / "passkey.md", "and", out / "passkey.png")
    return [str(out / name) for name in ("passkey.md", "passkey.png", "passkey.json")]


def _plot(rows, variants, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for v in variants:
        mine = [r for r in rows if r["variant"] == v]
        ds = [r["distance"] for r in mine]
        left.plot(ds, [r["accuracy"] for r in mine], "o-", label=v)
        right.plot(ds, [max(r["planted_edge_mass"], 1e-12) for r in mine], "o-", label=v)
    uniform = sorted({(r["distance"], r["uniform_mass"]) for r in rows})
    right.plot([d for d, _ in uniform], [u for _, u in uniform], "k--", label="uniform causal")
    for ax in (left, right):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("distance back to the passkey (bytes)")
    left.set_ylabel("share of the 5 digits predicted")
    left.set_ylim(-0.05, 1.05)
    left.set_title("Passkey retrieval (teacher-forced)")
    right.set_yscale("log")
    right.set_ylabel("last layer's posterior mass on the planted digits")
    right.set_title("Does the model look at it? (edge posterior)")
    right.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
