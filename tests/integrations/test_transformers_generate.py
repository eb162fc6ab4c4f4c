"""generate() through StructAttnCache: greedy decoding equals a full-recompute loop token for
token, for every causal catalogue attention, left-padded batches included; continuing from a
returned cache equals generating in one call."""

import pytest
import torch

from .hf import CAUSAL, VOCAB, StructAttnCache, greedy_loop, tiny


@pytest.mark.parametrize("attention", sorted(CAUSAL))
def test_greedy_generate_equals_full_recompute(attention):
    model = tiny(attention)
    ids = torch.randint(1, VOCAB, (2, 7))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(out, greedy_loop(model, ids, 5))


@pytest.mark.parametrize("attention", ["self_attention", "alibi_attention", "forgetting_attention",
                                       "stick_breaking_attention", "expanding_attention"])
def test_left_padded_batch_generates_each_row_as_alone(attention):
    model = tiny(attention)
    ids = torch.randint(1, VOCAB, (3, 8))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # a 5-token prompt, left-padded
    mask[2, :6] = 0  # a 2-token prompt
    ids = ids.masked_fill(mask == 0, 0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False,
                         pad_token_id=0)
    assert torch.equal(out, greedy_loop(model, ids, 4, mask))
    for row, pad in ((0, 0), (1, 3), (2, 6)):
        alone = model.generate(ids[row:row + 1, pad:], max_new_tokens=4, do_sample=False,
                               pad_token_id=0)
        assert torch.equal(out[row, 8:], alone[0, 8 - pad:])


@pytest.mark.parametrize("attention", ["rope_attention", "forgetting_attention"])
def test_continuing_from_a_returned_cache_equals_one_call(attention):
    model = tiny(attention)
    ids = torch.randint(1, VOCAB, (2, 6))
    once = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=0)
    first = model.generate(ids, max_new_tokens=3, do_sample=False, pad_token_id=0,
                           return_dict_in_generate=True)
    cache = first.cache
    assert isinstance(cache, StructAttnCache) and cache.get_seq_length() == 8
    second = model.generate(first.sequences, cache=cache, max_new_tokens=5, do_sample=False,
                            pad_token_id=0)
    assert torch.equal(second, once)
    assert cache.get_seq_length() == 13 and cache.held() == [13, 13]


def test_a_fixed_capacity_cache_generates_as_a_growing_one():
    model = tiny("forgetting_attention")
    ids = torch.randint(1, VOCAB, (2, 6))
    grown = model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cache = StructAttnCache(model.config, capacity=16)
    fixed = model.generate(ids, cache=cache, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(fixed, grown)
    assert cache.get_max_length() == 16
    assert cache.decode_caches()[0].keys.shape[-2] == 16


def test_certified_cache_stays_within_its_bound():
    """FoX with a forgetful gate: the certified cache evicts, says by how much its evicted
    tokens could move the posterior (≤ tol), and its logits stay within what that allows."""
    model = tiny("forgetting_attention", {"gate_bias": -2.0}, layers=1)
    ids = torch.randint(1, VOCAB, (1, 200))
    cache = StructAttnCache(model.config, tol=1e-6, block=8)
    with torch.no_grad():
        steps = [model(ids[:, :8], cache=cache, use_cache=True).logits]
        steps += [model(ids[:, t:t + 1], cache=cache, use_cache=True).logits
                  for t in range(8, 200)]
        full = model(ids, use_cache=False).logits
    assert cache.evicted[0] > 0 and cache.certified and 0 < cache.bound <= 1e-6
    assert cache.held()[0] + cache.evicted[0] == 200
    gap = (torch.cat(steps, 1) - full).abs().max()
    assert 0 < gap < 1e-3  # the evicted tokens were dropped, and moved the logits very little


def test_beam_search_is_refused_in_one_line():
    model = tiny()
    ids = torch.randint(1, VOCAB, (1, 4))
    with pytest.raises(NotImplementedError, match="beam search"):
        model.generate(ids, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
