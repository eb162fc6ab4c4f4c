"""The model family: save/load round-trips, initialisation, padded batches in the forward (and
its gradients), a user's own declaration, Trainer, and what is refused."""

import pytest
import torch

from .hf import (
    VOCAB,
    StrictDataclassClassValidationError,
    StructAttnConfig,
    StructAttnForCausalLM,
    greedy_loop,
    tiny,
    transformers,
)


@pytest.mark.parametrize("attention", ["rope_attention", "forgetting_attention",
                                       "generalised_gaussian_attention",
                                       "tests.integrations.hf:power_law_attention"])
def test_save_pretrained_round_trips_exactly(attention, tmp_path):
    model = tiny(attention)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64).eval()
    assert type(loaded) is StructAttnForCausalLM and loaded.config.attention == attention
    saved, read = model.state_dict(), loaded.state_dict()
    assert saved.keys() == read.keys()
    assert all(torch.equal(saved[key], read[key]) for key in saved)  # every tensor, exactly
    ids = torch.randint(1, VOCAB, (2, 9))
    with torch.no_grad():
        # the loaded tensors are views into the file's buffer, whose alignment can change
        # which BLAS kernel runs: the logits agree to the last bits, and exactly once the
        # tensors are copied into fresh memory
        assert (loaded(ids).logits - model(ids).logits).abs().max() < 1e-13
        for p in loaded.parameters():
            p.data = p.data.clone()
        assert torch.equal(loaded(ids).logits, model(ids).logits)
    base = transformers.AutoModel.from_pretrained(tmp_path, dtype=torch.float64)
    assert type(base).__name__ == "StructAttnModel"
    assert isinstance(transformers.AutoConfig.from_pretrained(tmp_path), StructAttnConfig)


def test_initialisation_follows_initializer_range():
    cfg = StructAttnConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64,
                           num_hidden_layers=1, num_attention_heads=4,
                           attention="forgetting_attention", initializer_range=0.05)
    declaration = StructAttnForCausalLM(cfg).model.layers[0].self_attn.declaration
    for name in ("W_q", "W_k", "W_v", "W_o", "W_f"):
        std = getattr(declaration, name).std().item()
        assert 0.04 < std < 0.06, (name, std)
    assert torch.equal(declaration.b_f, torch.full((4,), 3.0))  # the prior's own declared start


@pytest.mark.parametrize("attention", ["self_attention", "forgetting_attention"])
def test_a_padded_batch_gives_each_row_what_it_gets_alone(attention):
    """Left and right padding, outputs and every parameter's gradient: the padded batch's rows
    are the rows read alone."""
    model = tiny(attention)
    ids = torch.randint(1, VOCAB, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    mask[2, 5:] = 0
    logits = model(ids, attention_mask=mask, use_cache=False).logits
    rows = [(0, slice(0, 7)), (1, slice(3, 7)), (2, slice(0, 5))]
    for row, real in rows:
        alone = model(ids[row:row + 1, real], use_cache=False).logits[0]
        assert (logits[row, real] - alone).abs().max() < 1e-12
    loss = sum(logits[row, real].square().sum() for row, real in rows)
    grads = torch.autograd.grad(loss, list(model.parameters()))
    alone = sum(model(ids[row:row + 1, real], use_cache=False).logits.square().sum()
                for row, real in rows)
    for got, want in zip(grads, torch.autograd.grad(alone, list(model.parameters())), strict=True):
        assert (got - want).abs().max() < 1e-10


def test_a_users_declaration_by_import_path_trains_its_prior_and_generates():
    """A declaration without an incremental reading: trained and read whole; generate() runs
    without a cache (each step reads the sequence), and asking for one says why not."""
    model = tiny("tests.integrations.hf:power_law_attention", kwargs={})
    ids = torch.randint(1, VOCAB, (2, 6))
    model(ids, labels=ids).loss.backward()
    a = model.model.layers[0].self_attn.declaration.a
    assert a.grad is not None and a.grad.abs().sum() > 0
    assert not model.model.decodes and model(ids).cache is None
    out = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_loop(model, ids, 3))
    with pytest.raises(NotImplementedError, match="no incremental reading"):
        model(ids, use_cache=True)


def test_trainer_runs_a_few_steps(tmp_path):
    model = tiny("alibi_attention").float().train()
    ids = torch.randint(1, VOCAB, (16, 12))
    data = [{"input_ids": row, "labels": row} for row in ids]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), max_steps=3,
                                          per_device_train_batch_size=4, learning_rate=1e-2,
                                          report_to=[], use_cpu=True, save_strategy="no",
                                          logging_steps=1, disable_tqdm=True)
    before = [p.detach().clone() for p in model.parameters()]
    result = transformers.Trainer(model=model, args=args, train_dataset=data).train()
    assert result.global_step == 3 and torch.isfinite(torch.tensor(result.training_loss))
    assert any(not torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))


def test_what_the_model_does_not_read_is_refused_in_one_line():
    model = tiny()
    ids = torch.randint(1, VOCAB, (2, 5))
    with pytest.raises(ValueError, match="2-D padding mask"):
        model(ids, attention_mask=torch.ones(2, 1, 5, 5))
    with pytest.raises(ValueError, match="return_posterior"):
        model(ids, output_attentions=True)
    with pytest.raises(ValueError, match="position_ids must count"):
        model(ids, position_ids=torch.arange(5)[None] + 3)
    model(ids, position_ids=torch.arange(5)[None])  # the positions it reads: accepted
    # HF validates a config with its strict dataclasses, which wrap the config's own refusal
    with pytest.raises(StrictDataclassClassValidationError, match="causal catalogue model"):
        StructAttnConfig(attention="cross_attention")
    with pytest.raises(ValueError, match="importable"):
        tiny("no.such.module:factory")
    with pytest.raises(TypeError, match="StructAttnCache"):
        model(ids, cache=transformers.DynamicCache(config=model.config), use_cache=True)
