"""The catalogue under test: name → a small (model, inputs) case, float64.

Every entry of ``structattn.models.REGISTRY`` must appear here (test_catalogue
checks it), so the generic tests cover every model.
"""

import torch

import structattn as sa


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def self_attention_case():
    m = sa.models.self_attention(7, d_k=3, d_v=5, heads=2, causal=True, dtype=torch.float64)
    return m, (_x(2, 5, 7),)


def cross_attention_case():
    m = sa.models.cross_attention(7, 11, d_k=3, d_v=2, heads=3, dtype=torch.float64)
    return m, (_x(2, 5, 7), _x(2, 3, 11))


def relative_position_attention_case():
    m = sa.models.relative_position_attention(7, max_distance=2, d_k=3, heads=2, causal=True,
                                              dtype=torch.float64)
    with torch.no_grad():
        m.position_logits.normal_()
    return m, (_x(2, 5, 7),)


def alibi_attention_case():
    m = sa.models.alibi_attention(7, d_k=3, heads=3, dtype=torch.float64)
    return m, (_x(2, 5, 7),)


def absolute_position_attention_case():
    m = sa.models.absolute_position_attention(7, max_len=11, d_k=3, heads=2,
                                              temperature="learned", dtype=torch.float64)
    with torch.no_grad():
        m.positions.normal_()
    return m, (_x(2, 5, 7),)


def classification_case():
    m = sa.models.classification(7, 5, temperature=0.7, dtype=torch.float64)
    return m, (_x(2, 3, 7),)


def multihop_attention_case():
    m = sa.models.multihop_attention(7, d_k=3, heads=2, hop_weights=(1 / 3, 1 / 3, 1 / 3),
                                     dtype=torch.float64)
    return m, (_x(2, 4, 7),)


def graph_attention_case():
    m = sa.models.graph_attention(7, d_k=3, heads=2, dtype=torch.float64)
    n = 5
    ring = torch.arange(n)
    edge_index = torch.cat([torch.stack([ring, ring]), torch.stack([(ring + 1) % n, ring]),
                            torch.tensor([[0, 3], [2, 4]])], dim=1)  # self-loops, ring, two chords
    return m, (_x(2, n, 7), edge_index)


def expanding_attention_case():
    m = sa.models.expanding_attention(6, heads=2, a=1.5, b=2.0, variant="exact",
                                      dtype=torch.float64)
    with torch.no_grad():
        m.raw_prior.add_(torch.randn_like(m.raw_prior) * 0.3)  # heads with their own a, b
    return m, (_x(2, 6, 6),)


def hopfield_case():
    m = sa.models.hopfield(7, 5, heads=2, d_k=3, d_v=2, beta=0.8, update_steps=3,
                           dtype=torch.float64)
    return m, (_x(2, 3, 7), _x(2, 6, 5))


def slot_attention_case():
    m = sa.models.slot_attention(3, 5, iters=2, hidden_dim=8, dtype=torch.float64)
    return m, (_x(2, 7, 5), _x(2, 3, 5))


def block_slot_attention_case():
    m = sa.models.block_slot_attention(3, 6, num_blocks=2, num_prototypes=4, iters=2,
                                       hidden_dim=8, dtype=torch.float64)
    return m, (_x(2, 7, 6), _x(2, 3, 6))


def predictive_coding_case():
    m = sa.models.predictive_coding([5, 4, 3], steps=3, step_size=0.2, dtype=torch.float64)
    return m, (_x(2, 5),)


CASES = {
    "absolute_position_attention": absolute_position_attention_case,
    "alibi_attention": alibi_attention_case,
    "block_slot_attention": block_slot_attention_case,
    "classification": classification_case,
    "cross_attention": cross_attention_case,
    "expanding_attention": expanding_attention_case,
    "graph_attention": graph_attention_case,
    "hopfield": hopfield_case,
    "multihop_attention": multihop_attention_case,
    "predictive_coding": predictive_coding_case,
    "relative_position_attention": relative_position_attention_case,
    "self_attention": self_attention_case,
    "slot_attention": slot_attention_case,
}
