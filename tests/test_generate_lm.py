"""gallery/generate_lm.py: greedy generation through the caches is the full forward's on the
growing prefix, the sink-plus-window cache reads what a forward over its kept tokens reads
(ALiBi) and keeps their gate sums (FoX), and a tiny run writes its records and figure, with
the certified cache's bits per byte the full cache's."""

import importlib.util
import json
import pathlib

import torch

import structattn as sa

GALLERY = pathlib.Path(__file__).resolve().parents[1] / "gallery"


def _load():
    spec = importlib.util.spec_from_file_location("generate_lm", GALLERY / "generate_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny_lm(gen, variant):
    torch.manual_seed(0)
    return gen.train_lm.ByteLM(32, 2, 2, variant).eval()


def test_greedy_generation_through_the_cache_is_the_full_forward_on_the_prefix():
    gen = _load()
    for variant in ("fox", "alibi"):
        model = _tiny_lm(gen, variant)
        prompt = b"def f(x):\n    return"
        made = gen.generate(model, prompt, 8)
        tokens = list(prompt)
        with torch.no_grad():
            for _ in range(8):  # the full forward on the growing prefix, every step
                tokens.append(int(model(torch.tensor([tokens]))[0, -1].argmax()))
        assert made == bytes(tokens[len(prompt):]), variant
        # and the logits: a prefill and steps through the caches, against the full forward
        caches = gen.new_caches(model, "full", None)
        x = torch.tensor([tokens])
        steps = [gen.read(model, caches, x[:, :5])]
        steps += [gen.read(model, caches, x[:, t:t + 1]) for t in range(5, x.shape[1])]
        with torch.no_grad():
            assert torch.allclose(torch.cat(steps, 1), model(x), atol=1e-5)


def test_sampling_is_seeded_and_reads_the_temperature():
    gen = _load()
    model = _tiny_lm(gen, "fox")
    a = gen.generate(model, b"import ", 10, temperature=0.8, seed=3)
    assert len(a) == 10 and a == gen.generate(model, b"import ", 10, temperature=0.8, seed=3)


def test_sinks_and_window_read_the_forward_over_the_kept_tokens():
    """StreamingLLM's cache on one ALiBi layer (float64): between steps it holds the first 4
    tokens and the last W; step t's output is the last row of the forward over those and
    token t, at their positions in the cache."""
    gen = _load()
    torch.manual_seed(1)
    layer = sa.compile(sa.models.alibi_attention(8, heads=2, dtype=torch.float64))
    x = torch.randn(1, 40, 8, dtype=torch.float64)
    sinks, window = 4, 10
    cache = layer.new_cache()
    with torch.no_grad():
        for t in range(40):
            y = layer(x[:, t:t + 1], cache=cache)
            read = torch.cat([x[:, :min(sinks, t + 1)], x[:, max(sinks, t - window):t + 1]], 1)
            assert torch.allclose(y, layer(read)[:, -1:], rtol=0, atol=1e-12), t
            gen.keep_sinks_and_window(cache, sinks, window)
            assert len(cache) == min(t + 1, sinks + window)


def test_a_tiny_run_writes_its_records_and_the_certified_cache_keeps_the_bits(tmp_path):
    gen = _load()
    written = gen.main(["--quick", "--out", str(tmp_path)])
    assert [pathlib.Path(p).name for p in written] == ["generate_lm.json", "generate_lm.md",
                                                      "generate_lm.png"]
    assert (tmp_path / "generate_lm.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    record = json.loads((tmp_path / "generate_lm.json").read_text())
    length = record["args"]["length"]
    # the record names no local folder: tmp_path is outside the repository
    assert record["args"]["out"] == str(pathlib.Path("…", *tmp_path.parts[-2:]))
    assert str(tmp_path) not in (tmp_path / "generate_lm.json").read_text()
    for variant, r in record["results"].items():
        s = r["summary"]
        assert s["full"]["bytes"] == s["certified"]["bytes"] == length
        assert abs(s["full"]["bpb_all"] - s["certified"]["bpb_all"]) < 1e-3, variant
        assert s["sink+window"]["held_max"] == 4 + record["args"]["window"]
        assert r["bound_max"] <= record["args"]["tol"] and r["certified"]
        assert len(r["greedy"]) > 0 and len(r["passkey"]) == 1
        assert r["passkey"][0]["bound_max"] <= record["args"]["tol"]
    # FoX's certified cache evicts within the tiny text: the bits above agree with eviction
    fox = record["results"]["fox"]
    assert min(fox["evicted"]) > 0 and fox["summary"]["certified"]["held_last"] < length


def test_sinks_and_window_keep_foxs_gate_sums():
    """On one FoX layer (float64) the kept tokens keep their own gate sums: the posterior a
    step reads over them is the full forward's row restricted to them and renormalised."""
    gen = _load()
    torch.manual_seed(2)
    layer = sa.compile(sa.models.forgetting_attention(8, heads=2, dtype=torch.float64))
    x = torch.randn(1, 30, 8, dtype=torch.float64)
    sinks, window = 3, 7
    with torch.no_grad():
        _, full = layer(x, return_posterior=True)  # (1, H, 30, 30)
        cache = layer.new_cache()
        for t in range(30):
            _, post = layer(x[:, t:t + 1], cache=cache, return_posterior=True)
            kept = list(range(min(sinks, t + 1))) + list(range(max(sinks, t - window), t + 1))
            row = full[0, :, t, kept]
            assert torch.allclose(post[0, :, 0, :len(kept)], row / row.sum(-1, keepdim=True),
                                  rtol=0, atol=1e-12), t
            gen.keep_sinks_and_window(cache, sinks, window)
