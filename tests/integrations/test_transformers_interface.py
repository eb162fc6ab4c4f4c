"""A stock LlamaForCausalLM (grouped queries: 4 heads over 2 key/value heads, float64) switched
to the structattn attn_implementation under ALiBi, the generalised Gaussian (learned),
relative positions and a user's DistancePrior: prefill equals a plain-torch reference over
the same projected q, k, v; decoding with a DynamicCache equals prefill; greedy generate()
equals full recompute; a left-padded batch reads each row as alone; what it cannot read is
refused in one line."""

import pytest
import torch

import structattn as sa
from structattn.kinds import distance_table
from structattn.priors.alibi import alibi_slopes

from .hf import (
    VOCAB,
    StructAttnPrior,
    aligned_attention,
    greedy_loop,
    transformers,
    use_prior,
)

f64 = torch.float64
HEADS, K = 4, 3


class PowerLaw(sa.priors.DistancePrior):
    """A user's prior: log w(d) = −a·log(1 + d), one a shared by every head."""

    def __init__(self, a):
        self.a = a
        super().__init__("PowerLaw prior", causal=True)

    def log_at_distance(self, d, dtype=None):
        a = self.a if dtype is None else self.a.to(dtype)
        return -a.reshape(-1, *([1] * d.dim())) * torch.log1p(d.abs().to(a.dtype))


def _gaussian(module):
    return StructAttnPrior(
        lambda loc, log_scale, log_shape: sa.priors.GeneralisedGaussian(
            loc, log_scale, log_shape.exp()),
        loc=torch.tensor([0.0, 1.0, 2.5, 0.5], dtype=f64),
        log_scale=torch.tensor([-1.0, 0.0, -0.5, 0.3], dtype=f64),
        log_shape=torch.tensor([0.0, 0.7, -0.3, 0.2], dtype=f64))


SLOPES = alibi_slopes(HEADS).double()
LOGITS = torch.linspace(-1.0, 1.5, HEADS * (2 * K + 1), dtype=f64).reshape(HEADS, -1).sin()
A = torch.tensor([1.3], dtype=f64)

#: name → (the prior use_prior attaches, the reference's log weight at distances d ≥ 0)
PRIORS = {
    "alibi": (sa.priors.ALiBi(HEADS, slopes=SLOPES, causal=True),
              lambda module, d: -SLOPES[:, None, None] * d.to(f64)),
    "generalised_gaussian": (_gaussian, lambda module, d: -(
        (d.to(f64) - module.structattn_prior.loc[:, None, None])
        * module.structattn_prior.log_scale.exp()[:, None, None]).abs()
        ** module.structattn_prior.log_shape.exp()[:, None, None]),
    "relative": (sa.priors.RelativePosition(LOGITS, causal=True),
                 lambda module, d: LOGITS[:, d.clamp(max=K) + K]),
    "power_law": (PowerLaw(A), lambda module, d: -A * torch.log1p(d.to(f64))),
}


def llama(prior=None):
    """A float64 LlamaForCausalLM of width 16, 4 query heads over 2 key/value heads, switched
    to structattn under PRIORS[prior] (None: as built, sdpa)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=HEADS,
                                      num_key_value_heads=2, initializer_range=0.3)
    model = transformers.LlamaForCausalLM(config).to(f64).eval()
    return model if prior is None else use_prior(model, PRIORS[prior][0])


def reference(log_weight):
    """softmax(q kᵀ·scale + ℓ(i − j)) over j ≤ i, in plain torch, the C queries the last C of
    the P keys: an attn_implementation reading the model's own q, k, v."""
    def attention(module, q, k, v, attention_mask, dropout=0.0, scaling=None, **kwargs):
        assert attention_mask is None
        k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], 1) for x in (k, v))
        C, P = q.shape[2], k.shape[2]
        d = (torch.arange(C) + P - C)[:, None] - torch.arange(P)
        logits = q @ k.transpose(-1, -2) * scaling + log_weight(module, d.clamp(min=0))
        weights = logits.masked_fill(d < 0, float("-inf")).softmax(-1)
        return (weights @ v).transpose(1, 2), None
    return attention


@pytest.mark.parametrize("prior", sorted(PRIORS))
def test_prefill_equals_a_plain_torch_reference(prior):
    model = llama(prior)
    ids = torch.randint(1, VOCAB, (2, 11))
    logits = model(ids).logits
    transformers.AttentionInterface.register(f"reference_{prior}", reference(PRIORS[prior][1]))
    model.set_attn_implementation(f"reference_{prior}")
    torch.testing.assert_close(logits, model(ids).logits, rtol=0, atol=1e-10)
    model.set_attn_implementation("sdpa")
    assert (logits - model(ids).logits).abs().max() > 1e-3  # the prior is read


@pytest.mark.parametrize("prior", sorted(PRIORS))
def test_decoding_with_a_cache_equals_prefill(prior):
    model = llama(prior)
    ids = torch.randint(1, VOCAB, (2, 10))
    full = model(ids).logits
    cache = transformers.DynamicCache(config=model.config)
    cuts = [0, 4, 7, 8, 9, 10]  # 4 tokens, 3 over the cached 4, then one at a time
    steps = [model(ids[:, a:b], cache=cache, use_cache=True).logits
             for a, b in zip(cuts[:-1], cuts[1:], strict=True)]
    torch.testing.assert_close(torch.cat(steps, 1), full, rtol=0, atol=1e-10)


@pytest.mark.parametrize("prior", sorted(PRIORS))
def test_greedy_generate_equals_full_recompute(prior):
    model = llama(prior)
    ids = torch.randint(1, VOCAB, (2, 7))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_loop(model, ids, 5))


def test_the_kernel_reads_the_unpadded_calls():
    model = llama("generalised_gaussian")
    ids = torch.randint(1, VOCAB, (2, 6))
    with pytest.MonkeyPatch.context() as mp:
        calls = []
        read = distance_table.distance_table_attention
        mp.setattr(distance_table, "distance_table_attention",
                   lambda *a: calls.append(a[0].shape) or read(*a))
        model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert calls[:2] == [torch.Size([2, HEADS, 6, 4])] * 2  # prefill: both layers
    assert calls[2:] == [torch.Size([2, HEADS, 1, 4])] * 4  # two steps: one query each


@pytest.mark.parametrize("prior", ["alibi", "generalised_gaussian"])
def test_a_left_padded_batch_reads_each_row_as_alone(prior):
    model = llama(prior)
    ids = torch.randint(1, VOCAB, (3, 8))
    mask = torch.ones_like(ids)
    mask[1, :3], mask[2, :6] = 0, 0
    ids = ids.masked_fill(mask == 0, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    logits = model(ids, attention_mask=mask, position_ids=positions).logits
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         pad_token_id=0)
    for row, pad in ((0, 0), (1, 3), (2, 6)):
        alone = model(ids[row:row + 1, pad:]).logits[0]
        torch.testing.assert_close(logits[row, pad:], alone, rtol=0, atol=1e-10)
        again = model.generate(ids[row:row + 1, pad:], max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
        assert torch.equal(out[row, 8:], again[0, 8 - pad:])


@pytest.mark.parametrize("prior", ["relative", "power_law"])
def test_the_last_rows_equal_the_priors_own_dense_table(prior):
    """The function alone, C = 3 queries over P = 7 keys, grouped: the last 3 rows of
    softmax(q kᵀ·scale + log_weights) with structattn's own P × P table of the prior; a mask
    removing one pair (one SDPA call with the bias) equals the table with that pair removed."""
    made = PRIORS[prior][0]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, HEADS, 3, 4, generator=g, dtype=f64)
    k, v = (torch.randn(2, 2, 7, 4, generator=g, dtype=f64) for _ in range(2))
    table = made.tables(7, 7, q.device).log_weights(f64)[..., 4:, :]  # (H|1, 3, 7)
    kk, vv = (x.repeat_interleave(2, 1) for x in (k, v))
    logits = q @ kk.transpose(-1, -2) / 2 + table
    torch.testing.assert_close(aligned_attention(q, k, v, made),
                               logits.softmax(-1) @ vv, rtol=0, atol=1e-12)
    keep = torch.ones(2, 1, 3, 7, dtype=torch.bool)
    keep[1, 0, 2, 5] = False
    expected = logits.masked_fill(~keep, float("-inf")).softmax(-1) @ vv
    torch.testing.assert_close(aligned_attention(q, k, v, made, keep), expected,
                               rtol=0, atol=1e-12)


def test_a_learned_prior_trains_and_is_saved():
    model = llama("generalised_gaussian")
    model(torch.randint(1, VOCAB, (2, 9))).logits.square().mean().backward()
    held = model.model.layers[0].self_attn.structattn_prior
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in held.parameters())
    assert "model.layers.1.self_attn.structattn_prior.log_shape" in model.state_dict()


def test_the_registered_alibi_is_alibi_with_the_papers_slopes():
    ids = torch.randint(1, VOCAB, (2, 9))
    model = llama()
    model.set_attn_implementation("structattn_alibi")
    torch.testing.assert_close(model(ids).logits, llama("alibi")(ids).logits, rtol=0, atol=0)


def _switched(model, name):
    model.set_attn_implementation(name)
    return model


class ByProduct(sa.priors.Prior):
    """A prior that is not stationary: its weight depends on i·j."""

    def support(self, num_children, num_parents):
        return sa.kinds.Causal()

    def log_weight(self, child, parent, sizes):
        return -(child * parent).to(f64) / 10


REFUSED = {
    "not stationary": (lambda: use_prior(llama(), ByProduct()), "is not stationary on j ≤ i"),
    "not causal": (lambda: use_prior(llama(), sa.priors.ALiBi(HEADS)), "causal=False"),
    "wrong heads": (lambda: use_prior(llama(), sa.priors.ALiBi(3, causal=True)),
                    "has 3 heads of parameters but the attention has 4 query heads"),
    "no prior": (lambda: _switched(llama(), "structattn"), "carries no StructAttnPrior"),
}


@pytest.mark.parametrize("case", sorted(REFUSED) + ["static cache", "dropout", "empty slots"])
def test_what_it_cannot_read_is_refused_in_one_line(case):
    ids = torch.randint(1, VOCAB, (2, 5))
    if case == "static cache":
        model, match = llama("alibi"), "an empty StaticCache's prefill"
        run = lambda: model.generate(ids, max_new_tokens=2, do_sample=False, pad_token_id=0,  # noqa: E731
                                     cache_implementation="static")
    elif case == "dropout":
        model, match = llama("alibi").train(), "dropout=0.1"
        model.config.attention_dropout = 0.1
        for layer in model.model.layers:
            layer.self_attn.attention_dropout = 0.1
        run = lambda: model(ids)  # noqa: E731
    elif case == "empty slots":  # a StaticCache's decoding step: its last slots hold nothing
        q, kv = torch.randn(2, HEADS, 1, 4, dtype=f64), torch.randn(2, 2, 6, 4, dtype=f64)
        keep = torch.arange(6) < 4
        match = "the last query reads the last key in no row"
        run = lambda: aligned_attention(q, kv, kv, PRIORS["alibi"][0], keep[None, None, None])  # noqa: E731
    else:
        make, match = REFUSED[case]
        model = make()
        run = lambda: model(ids)  # noqa: E731
    with pytest.raises(ValueError, match=match) as err:
        run()
    assert "\n" not in str(err.value)
