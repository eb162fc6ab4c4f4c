"""``split_heads`` and ``merge_heads`` (``structattn/heads.py``): inverse of each other, and a
one-head merge split again gives back the heads it came from (no view op), where nothing
wrote into them since — under autograd, ``no_grad`` and ``inference_mode`` alike."""

import pytest
import torch

from structattn.heads import merge_heads, split_heads


@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference_mode"])
def test_split_inverts_merge(heads, mode):
    torch.manual_seed(0)
    t = torch.randn(2, heads, 5, 4)
    ctx = {"grad": torch.enable_grad, "no_grad": torch.no_grad,
           "inference_mode": torch.inference_mode}[mode]
    with ctx():
        x = t.clone().requires_grad_(mode == "grad") if mode != "inference_mode" else t.clone()
        merged = merge_heads(x)
        assert merged.shape == (2, 5, heads * 4)
        torch.testing.assert_close(merged, x.transpose(-3, -2).flatten(-2), rtol=0, atol=0)
        back = split_heads(merged, heads)
        torch.testing.assert_close(back, x, rtol=0, atol=0)
        if heads == 1 and mode != "inference_mode":
            assert back is x  # the heads themselves: no unsqueeze recorded
        if mode == "grad":
            (back * torch.arange(4.0)).sum().backward()
            torch.testing.assert_close(x.grad, torch.arange(4.0).expand_as(x), rtol=0, atol=0)


def test_a_merged_head_written_into_is_split_anew():
    torch.manual_seed(0)
    t = torch.randn(2, 1, 5, 4)
    merged = merge_heads(t)
    merged.add_(1.0)  # (a view: the heads change too, their versions with them)
    back = split_heads(merged, 1)
    assert back is not t
    torch.testing.assert_close(back, merged.unsqueeze(-3), rtol=0, atol=0)
    other = torch.randn(2, 5, 4)
    torch.testing.assert_close(split_heads(other, 1), other.unsqueeze(-3), rtol=0, atol=0)
