"""convert(): a stock Llama or Mistral model turned into a StructAttnForCausalLM. With the uniform
causal prior it gives the stock logits (float64, the rotary tables made to agree), padded
batches included; FoX starts next to the stock function; the converted model saves and loads
back through AutoModelForCausalLM as what it is, in the dtype asked for."""

import pytest
import torch

from .hf import VOCAB, convert, transformers


def _float64_rotary(model):
    """The stock model's rotary table computed in float64 with structattn's formula
    θ_k = base^(−2k/d) (HF's is float32): where the two agree, the converted model's logits
    are the stock ones exactly."""
    rotary = model.model.rotary_emb
    base = model.config.rope_parameters["rope_theta"]
    d = model.config.head_dim

    def forward(x, position_ids):
        theta = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        angle = position_ids[..., None].double() * theta
        angle = torch.cat([angle, angle], -1)
        return angle.cos().to(x.dtype), angle.sin().to(x.dtype)

    rotary.forward = forward


def _stock(kind="llama", kv_heads=2, **extra):
    cls, cfg = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig)}[kind]
    config = cfg(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=kv_heads, initializer_range=0.3,
                 pad_token_id=0, **extra)
    model = cls(config).to(torch.float64).eval()
    _float64_rotary(model)
    return model


@pytest.mark.parametrize("kind,kv_heads", [("llama", 2), ("llama", 4), ("mistral", 1)])
def test_uniform_prior_gives_the_stock_logits(kind, kv_heads):
    stock = _stock(kind, kv_heads, **({"sliding_window": None} if kind == "mistral" else {}))
    converted = convert(stock, "self_attention")
    assert converted.dtype == torch.float64 and not converted.training
    ids = torch.randint(1, VOCAB, (3, 9))
    with torch.no_grad():
        want, got = stock(ids).logits, converted(ids).logits
    assert (got - want).abs().max() < 1e-12


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_batches_give_the_stock_logits_at_real_tokens(side):
    stock = _stock()
    converted = convert(stock, "self_attention")
    ids = torch.randint(1, VOCAB, (3, 8))
    mask = torch.ones_like(ids)
    pads = {"left": (slice(0, 3), slice(0, 5)), "right": (slice(5, 8), slice(3, 8))}[side]
    mask[1, pads[0]], mask[2, pads[1]] = 0, 0
    with torch.no_grad():
        want = stock(ids, attention_mask=mask).logits
        got = converted(ids, attention_mask=mask).logits
    real = mask.bool()
    assert (got - want)[real].abs().max() < 1e-12


def test_fox_starts_next_to_the_stock_function():
    stock = _stock()
    ids = torch.randint(1, VOCAB, (2, 12))
    with torch.no_grad():
        want = stock(ids).logits
        near = convert(stock, "forgetting_attention")(ids).logits
        exact = convert(stock, "forgetting_attention", gate_bias=40.0)(ids).logits
    assert (exact - want).abs().max() < 1e-12  # f = σ(40): the gates are open
    assert 0 < (near - want).abs().max() < 1e-2  # f = σ(8) ≈ 0.9997 per token


def test_converted_model_saves_and_loads_as_what_it_is(tmp_path):
    stock = _stock()
    converted = convert(stock, "alibi_attention")
    converted.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert type(loaded) is type(converted) and loaded.dtype == torch.float32
    assert loaded.config.attention == "alibi_attention"
    assert loaded.config.attention_kwargs["rope_base"] == stock.config.rope_parameters["rope_theta"]
    ids = torch.randint(1, VOCAB, (2, 7))
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, converted.float()(ids).logits)


def test_what_does_not_convert_is_refused_in_one_line():
    with pytest.raises(ValueError, match="attention biases"):
        convert(_stock(attention_bias=True))
    with pytest.raises(ValueError, match="sliding_window=4"):
        convert(_stock("mistral", sliding_window=4))
    with pytest.raises(ValueError, match="model_type"):
        convert(transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=1, n_embd=8,
                                                                       n_head=2)))
    with pytest.raises(ValueError, match="importable"):
        convert(_stock(), attention=lambda d_model, **kw: None)
