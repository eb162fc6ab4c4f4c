"""Bad input gets a ValueError naming the node set / edge family, expected vs actual."""

import re

import pytest
import torch

import structattn as sa

from .reference import random_support


def _m(**kw):
    return sa.models.self_attention(7, d_k=3, heads=2, dtype=torch.float64, **kw)


def _x(*shape, dtype=torch.float64):
    return torch.randn(*shape, dtype=dtype)


def test_wrong_feature_size_names_the_node_set():
    with pytest.raises(ValueError, match=r"node set 'x'.*\(\*batch, n, 7\).*\(2, 5, 6\)"):
        sa.compile(_m())(_x(2, 5, 6))


def test_too_few_dims():
    with pytest.raises(ValueError, match=r"node set 'x'.*at least 2 dims.*\(7,\)"):
        sa.compile(_m())(_x(7))


def _own(device=None):
    """A declaration of one's own (the self attention of ``_m``, as a function): its node set and
    its potential check the input, not a catalogue model's ``check_inputs``."""
    W_q, W_k, W_v = (torch.randn(6, 7, dtype=torch.float64, device=device) for _ in range(3))

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform(), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W_q, W_k, heads=2))
        return sa.merge_heads(sa.value(phi, sa.values.Linear(W_v, heads=2)))
    return program


def test_integer_states():
    with pytest.raises(ValueError, match=r"node set 'x'.*floating point.*torch.int64"):
        sa.compile(_own())(torch.ones(2, 5, 7, dtype=torch.long))


def test_dtype_mismatch_names_family_and_node_set():
    with pytest.raises(ValueError, match=r"edge family 'attn'.*'x' has dtype torch.float32.*"
                                         r"W_q has dtype torch.float64"):
        sa.compile(_own())(_x(2, 5, 7, dtype=torch.float32))


def test_device_mismatch_names_family():
    with pytest.raises(ValueError, match=r"edge family 'attn'.*'x' is on cpu.*W_q is on meta"):
        sa.compile(_own(device="meta"))(_x(2, 5, 7))


def test_catalogue_models_check_inputs_against_their_parameters():
    """A catalogue model checks its inputs first (``Declaration.check_inputs``): the argument,
    the parameter, the actual and the expected dtype (device), before any projection."""
    with pytest.raises(ValueError, match=r"^SelfAttention: x has dtype torch.int64 but parameter "
                                         r"W_q has dtype torch.float64; states are floating "
                                         r"point: convert the input"):
        sa.compile(_m())(torch.ones(2, 5, 7, dtype=torch.long))
    with pytest.raises(ValueError, match=r"^SelfAttention: x has dtype torch.float32 but parameter "
                                         r"W_q has dtype torch.float64; convert one of them "
                                         r"\(e.g. layer.to\(torch.float32\)\)"):
        sa.compile(_m())(_x(2, 5, 7, dtype=torch.float32))
    m = sa.models.self_attention(7, d_k=3, heads=2, device="meta")
    with pytest.raises(ValueError, match=r"^SelfAttention: x is on cpu but parameter W_q is on "
                                         r"meta; move one of them"):
        sa.compile(m)(torch.randn(2, 5, 7))
    with pytest.raises(ValueError, match=r"^SelfAttention: x must be a torch.Tensor; got list"):
        sa.compile(_m())([[0.0] * 7])


def test_cross_attention_batch_mismatch():
    m = sa.models.cross_attention(7, 5, d_k=3, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"edge family 'attn'.*share batch dims.*batch \(2,\) vs \(3,\)"):
        sa.compile(m)(_x(2, 4, 7), _x(3, 4, 5))


def test_nan_input():
    x = _x(2, 5, 7)
    x[1, 3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"node set 'x' contains non-finite.*\(1, 3, 2\)"):
        sa.compile(_m())(x)


def test_nan_check_can_be_switched_off():
    x = _x(2, 5, 7)
    x[1, 3, 2] = float("nan")
    with sa.validation(False):
        y = sa.compile(_m())(x)
    assert torch.isnan(y[1]).any() and not torch.isnan(y[0]).any()


def test_empty_support_names_the_child():
    mask = random_support(5, 5)
    mask[3] = False
    with pytest.raises(ValueError, match=r"edge family 'attn': child 3 \(index \(3,\)\) has an "
                                         r"empty support .* 1 of 5 children"):
        sa.compile(_m())(_x(2, 5, 7), mask)


def test_empty_support_also_caught_by_pyro_reading():
    mask = random_support(5, 5)
    mask[0] = False
    with pytest.raises(ValueError, match=r"edge family 'attn': child 0 \(index \(0,\)\) has an "
                                         r"empty support .* 1 of 5 children"):
        sa.inference.exact(_m(), _x(2, 5, 7), mask)


def test_causal_and_mask_together_can_empty_a_row():
    mask = torch.ones(5, 5, dtype=torch.bool)
    mask[:, 0] = False  # child 0 may only look at j ≤ 0 = parent 0: nothing left
    with pytest.raises(ValueError, match=r"edge family 'attn': child 0 \(index \(0,\)\) has an "
                                         r"empty support .* 1 of 5 children"):
        sa.compile(_m(causal=True))(_x(1, 5, 7), mask)


def test_support_mask_wrong_shape():
    with pytest.raises(ValueError, match=r"edge family 'attn': prior support mask must broadcast "
                                         r"to \(\*batch, heads, children, parents\)=\(2, 2, 5, 5\); "
                                         r"got \(5, 4\)"):
        sa.compile(_m())(_x(2, 5, 7), torch.ones(5, 4, dtype=torch.bool))


def test_support_mask_wrong_dtype():
    with pytest.raises(ValueError, match=r"Uniform prior: support must be a boolean tensor "
                                         r"\(…, children, parents\); got torch.float32"):
        sa.compile(_m())(_x(2, 5, 7), torch.ones(5, 5))


@pytest.mark.parametrize("t", [0.0, -1.0, float("nan"), float("inf")])
def test_temperature_must_be_positive(t):
    with pytest.raises(ValueError, match=rf"SelfAttention: temperature must be a finite number "
                                         rf"> 0; got {t}"):
        sa.models.self_attention(7, d_k=3, temperature=t)
    W = torch.randn(3, 7)
    with pytest.raises(ValueError, match=rf"Bilinear potential: temperature must be a finite "
                                         rf"number > 0; got {t}"):
        sa.potentials.Bilinear(W, W, temperature=t)


def test_tensor_temperature_checked_at_run_time():
    W = torch.randn(3, 4, dtype=torch.float64)

    def program(x, tau):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W, temperature=tau))
        return sa.value(phi, sa.values.Linear(W))

    x = _x(1, 3, 4)
    layer = sa.compile(program)
    assert layer(x, torch.tensor(0.5, dtype=torch.float64)).shape == (1, 1, 3, 3)
    with pytest.raises(ValueError, match=r"edge family 'attn': temperature must be > 0; got -2"):
        layer(x, torch.tensor(-2.0, dtype=torch.float64))


def test_heads_mismatch_between_family_and_potential():
    W = torch.randn(6, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform(), heads=2)
        sa.potential(phi, sa.potentials.Bilinear(W, W, heads=3))
        return sa.value(phi, sa.values.Linear(W, heads=2))

    with pytest.raises(ValueError, match=r"edge family 'attn' has heads=2 but its potential "
                                         r"Bilinear has heads=3"):
        sa.compile(program)(_x(1, 3, 4))


def test_value_before_potential():
    W = torch.randn(2, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"edge family 'attn' has no potential"):
        sa.compile(program)(_x(1, 3, 4))


def test_family_declared_twice():
    W = torch.randn(2, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        for _ in range(2):
            phi = sa.edges("attn", n, n, sa.priors.Uniform())
            sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"edge family 'attn' is declared twice"):
        sa.compile(program)(_x(1, 3, 4))


def test_not_a_node_set_or_prior():
    x = _x(1, 3, 4)
    n = sa.nodes("x", x)
    with pytest.raises(ValueError, match=r"edge family 'attn': children must be a node set"):
        sa.edges("attn", x, n, sa.priors.Uniform())
    with pytest.raises(ValueError, match=r"edge family 'attn': prior must be a structattn prior"):
        sa.edges("attn", n, n, "uniform")


def test_categorical_logits_with_nan():
    logits = torch.zeros(3, 3, dtype=torch.float64)
    logits[1, 1] = float("nan")
    W = torch.randn(2, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Categorical(logits))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"edge family 'attn': prior log weights .* non-finite"):
        sa.compile(program)(_x(1, 3, 4))


def test_no_edge_family_for_exact():
    with pytest.raises(ValueError, match=r"the model declares no edge family \(structattn.edges\); "
                                         r"nothing to infer"):
        sa.inference.exact(lambda x: sa.nodes("x", x), _x(1, 3, 4))


def test_compile_rejects_non_callables():
    with pytest.raises(ValueError, match=r"expected a structattn Declaration or a callable"):
        sa.compile(42)


def test_potential_after_value_is_refused():
    W = torch.randn(2, 4, dtype=torch.float64)

    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, sa.priors.Uniform())
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        y = sa.value(phi, sa.values.Linear(W))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return y

    with pytest.raises(ValueError, match=r"edge family 'attn': potentials must be declared before"):
        sa.compile(program)(_x(1, 3, 4))


# -- hyper-parameters refused at the factory, naming the argument and the class called ---------
@pytest.mark.parametrize("weights, match", [
    ((float("nan"), 1.0), r"hop_weights must be finite numbers .* got nan"),
    ((1.0, float("inf")), r"hop_weights must be finite numbers .* got inf"),
    ((0.0, 0.0, 0.0), r"hop_weights are all zero"),
    ((1.0,), r"hop_weights must be \(w_0, …, w_K\) with K ≥ 1"),
    ((True, 1.0), r"hop_weights must be finite numbers .* got True"),
    ("ab", r"hop_weights must be finite numbers .* got 'a'"),
    (3.0, r"hop_weights must be a sequence"),
])
def test_multihop_refuses_bad_hop_weights(weights, match):
    with pytest.raises(ValueError, match=match):
        sa.models.multihop_attention(8, hop_weights=weights)


def test_multihop_takes_negative_and_zero_weights():
    m = sa.models.multihop_attention(6, d_k=3, hop_weights=(0.0, -1.0, 2.0), dtype=torch.float64)
    x = _x(2, 4, 6)
    truth = sa.inference.exact(m, x)
    torch.testing.assert_close(sa.compile(m)(x), truth.output, rtol=0, atol=1e-10)


@pytest.mark.parametrize("bias", [float("nan"), float("inf"), -float("inf"), "3", None])
def test_forgetting_attention_refuses_a_gate_bias_that_is_not_finite(bias):
    with pytest.raises(ValueError, match=r"ForgettingAttention: gate_bias must be a finite number"):
        sa.models.forgetting_attention(8, heads=2, gate_bias=bias)


@pytest.mark.parametrize("temperature", [0, -1.0, float("nan")])
def test_block_slot_attention_names_itself_for_a_bad_temperature(temperature):
    with pytest.raises(ValueError, match=r"^BlockSlotAttention: temperature must be"):
        sa.models.block_slot_attention(3, 8, num_blocks=2, num_prototypes=4,
                                       temperature=temperature)
    with pytest.raises(ValueError, match=r"^SlotAttention: temperature must be"):
        sa.models.slot_attention(3, 8, temperature=temperature)


@pytest.mark.parametrize("option", ["return_posterior", "return_trace", "trace_posteriors"])
@pytest.mark.parametrize("value", ["yes", 1, None])
def test_output_options_take_only_bool(option, value):
    layer = sa.compile(sa.models.self_attention(8, heads=2))
    x = torch.randn(1, 3, 8)
    for _ in range(3):  # read, record, replay: refused on every path
        with pytest.raises(TypeError, match=rf"SelfAttention: {option} must be True or False; "
                                            rf"got {value!r}"):
            layer(x, **{option: value})


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_graph_attention_says_a_dense_mask_must_be_bool(dtype):
    m = sa.models.graph_attention(8, heads=2)
    adjacency = torch.ones(5, 5, dtype=dtype)
    with pytest.raises(ValueError, match=r"looks like a dense \(n, n\) mask, which must be bool"):
        sa.compile(m)(torch.randn(1, 5, 8), adjacency)


# -- a NaN in an argument is named as the argument, at its own index ----------------------------
NAMED_ARGUMENTS = {
    # model, inputs of the right shapes, the argument spoiled, its index, its size
    "predictive_coding": (lambda: sa.models.predictive_coding([4, 5, 3]),
                          lambda: (torch.randn(2, 4),), "PredictiveCoding: x", 0, (0, 1), 8),
    "predictor_choice_coding": (lambda: sa.models.predictor_choice_coding([4, 5, 3]),
                                lambda: (torch.randn(2, 4),), "PredictorChoiceCoding: x", 0,
                                (0, 1), 8),
    "classification": (lambda: sa.models.classification(6, 3), lambda: (torch.randn(2, 6),),
                       "Classification: features", 0, (0, 1), 12),
    "slot_attention": (lambda: sa.models.slot_attention(3, 8), lambda: (torch.randn(2, 12, 8),),
                       "SlotAttention: inputs", 0, (0, 0, 1), 192),
    "block_slot_attention": (lambda: sa.models.block_slot_attention(3, 8, num_blocks=2,
                                                                    num_prototypes=4),
                             lambda: (torch.randn(2, 12, 8),), "BlockSlotAttention: inputs", 0,
                             (0, 0, 1), 192),
}


@pytest.mark.parametrize("name", sorted(NAMED_ARGUMENTS))
def test_a_nan_argument_is_named_before_any_transformation(name):
    """Predictive coding reshapes x into units (three indices), classification calls its
    argument 'outputs', slot attention normalises first (one NaN read as 8): the message names
    the argument the user passed, one NaN, at its index there — on a read and on a replay."""
    build, inputs, what, arg, index, size = NAMED_ARGUMENTS[name]
    torch.manual_seed(0)
    m = build()
    clean = inputs()
    layer = sa.compile(m)
    for _ in range(3):  # read, record, replay
        layer(*clean)
    bad = list(clean)
    bad[arg] = clean[arg].clone()
    bad[arg][index] = float("nan")
    message = (rf"^{what} contains non-finite values \(NaN or inf\): 1 of {size} entries, the "
               rf"first at index {re.escape(str(index))}\.")
    with pytest.raises(ValueError, match=message):
        layer(*bad)
    with pytest.raises(ValueError, match=message):
        sa.compile(m)(*bad)


def test_the_public_checks_name_their_owner_and_argument():
    from structattn.checks import check_positive, check_size

    assert check_size("MyModel", "heads", 4) == 4
    with pytest.raises(ValueError, match=r"^MyModel: heads must be a positive int; got 0$"):
        check_size("MyModel", "heads", 0)
    assert check_positive("MyModel", "rate", 2) == 2.0
    for bad in (0.0, -1.0, float("nan"), torch.tensor([1.0, -2.0])):
        with pytest.raises(ValueError, match=r"^MyModel: rate must be finite and > 0"):
            check_positive("MyModel", "rate", bad)
    with pytest.raises(ValueError, match=r"^ExpandingAttention: a must be finite and > 0"):
        sa.models.expanding_attention(8, a=-1.0)
