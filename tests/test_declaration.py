"""How a declaration is named: a function declaration by the function's name, in drawings and
in the message that asks for inputs, which names the drawing function actually called."""

import pytest
import torch

import structattn as sa


def program(x):
    n = sa.nodes("x", x)
    phi = sa.edges("attn", n, n, sa.priors.Uniform())
    sa.potential(phi, sa.potentials.DotProduct())
    return sa.value(phi, sa.values.Identity())


@pytest.mark.parametrize("draw", ["model_graph", "render", "to_networkx"])
def test_drawing_without_inputs_names_the_function_called(draw):
    with pytest.raises(NotImplementedError,
                       match=rf"structattn\.{draw}: function 'program' has no example_inputs\(\); "
                             rf"pass inputs explicitly, e.g. structattn\.{draw}\(program, x\)"):
        getattr(sa, draw)(program)


def test_a_lambda_is_named_as_python_names_it():
    with pytest.raises(NotImplementedError,
                       match=r"structattn\.model_graph: function '<lambda>' has no example_inputs"
                             r"\(\); pass inputs explicitly, e.g. structattn\.model_graph\(model, "
                             r"x\)"):
        sa.model_graph(lambda x: x)


def test_function_declaration_drawings_carry_the_function_name():
    x = torch.randn(1, 3, 4)
    plates = sa.model_graph(program, x).source
    assert "program — the declaration (plate notation)" in plates
    assert "FunctionDeclaration" not in plates
    adjacency = sa.render(program, x).source
    assert "program — " in adjacency and "FunctionDeclaration" not in adjacency
    assert sa.to_networkx(program, x).graph["model"] == "program"


def test_a_declaration_class_keeps_its_class_name():
    m = sa.models.self_attention(4, d_k=2)
    assert m.display_name == "SelfAttention"
    assert "SelfAttention — the declaration" in sa.model_graph(m).source
