"""What the dot-product catalogue models share (models/_projections.py): argument checks,
heads that must divide the width, a learned temperature, named families that let two layers
share one declaration."""


import pytest
import torch

import structattn as sa


@pytest.mark.parametrize("kwargs, match", [
    ({"heads": True}, r"heads must be a positive int; got True"),
    ({"d_k": 0}, r"d_k must be a positive int; got 0"),
    ({"temperature": "hot"}, r"temperature must be a number > 0, a tensor, None"),
])
def test_catalogue_argument_checks(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sa.models.self_attention(6, **kwargs)


TOL = 1e-6


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def test_two_catalogue_layers_in_one_declaration_and_render_heads_per_family():
    class Stack(sa.Declaration):
        def __init__(self):
            super().__init__()
            self.local = sa.models.self_attention(6, d_k=2, heads=2, causal=True, name="local",
                                                  dtype=torch.float64)
            self.cross = sa.models.cross_attention(6, 4, d_k=3, heads=1, name="memory",
                                                   dtype=torch.float64)

        def model(self, x, mem):
            return self.local.model(x) + self.cross.model(x, mem)

    m = Stack()
    x, mem = _x(2, 5, 6), _x(2, 3, 4)
    _, posts = sa.compile(m)(x, mem, return_posterior=True)
    assert set(posts) == {"local", "memory"}
    assert sa.inference.compare(m, x, mem).max_abs_diff < TOL
    dot = sa.render(m, x, mem, heads=1)  # 'memory' has one head: drawn for 'local' only
    assert "local · head 1" in dot.source and "memory · head" not in dot.source


@pytest.mark.parametrize("build", [lambda: sa.models.self_attention(64, heads=5),
                                   lambda: sa.models.cross_attention(10, heads=3),
                                   lambda: sa.models.hopfield(10, heads=4)])
def test_heads_that_do_not_divide_the_width_are_refused(build):
    with pytest.raises(ValueError, match="not divisible by heads=.*give d_k"):
        build()
    assert sa.models.self_attention(64, heads=5, d_k=12).d_k == 12


def test_learned_temperature_gets_gradients_and_stays_positive():
    m = sa.models.self_attention(6, d_k=4, heads=2, temperature="learned", dtype=torch.float64)
    assert float(m.temperature.detach()) == pytest.approx(2.0)
    x = _x(2, 5, 6)
    sa.compile(m)(x).square().sum().backward()
    assert m.log_temperature.grad is not None and m.log_temperature.grad != 0
    assert sa.inference.compare(m, x).max_abs_diff < TOL
    with pytest.raises(ValueError, match=r"temperature must be a number > 0, a tensor, None .* "
                                         r"or 'learned'; got 'learn'"):
        sa.models.self_attention(6, temperature="learn")
