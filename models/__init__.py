"""The catalogue: one small declaration per mechanism (SPEC.md, Table 1).

Every public model here is listed in ``REGISTRY`` (name → factory); the test
suite fails when a module in this package is not registered.
"""

from .absolute_position_attention import AbsolutePositionAttention as AbsolutePositionAttention
from .absolute_position_attention import absolute_position_attention as absolute_position_attention
from .alibi_attention import ALiBiAttention as ALiBiAttention
from .alibi_attention import alibi_attention as alibi_attention
from .block_slot_attention import BlockSlotAttention as BlockSlotAttention
from .block_slot_attention import block_slot_attention as block_slot_attention
from .classification import Classification as Classification
from .classification import classification as classification
from .cross_attention import CrossAttention as CrossAttention
from .cross_attention import cross_attention as cross_attention
from .expanding_attention import ExpandingAttention as ExpandingAttention
from .expanding_attention import expanding_attention as expanding_attention
from .graph_attention import GraphAttention as GraphAttention
from .graph_attention import graph_attention as graph_attention
from .hopfield import Hopfield as Hopfield
from .hopfield import hopfield as hopfield
from .multihop_attention import MultihopAttention as MultihopAttention
from .multihop_attention import multihop_attention as multihop_attention
from .predictive_coding import PredictiveCoding as PredictiveCoding
from .predictive_coding import predictive_coding as predictive_coding
from .relative_position_attention import RelativePositionAttention as RelativePositionAttention
from .relative_position_attention import relative_position_attention as relative_position_attention
from .self_attention import SelfAttention as SelfAttention
from .self_attention import self_attention as self_attention
from .slot_attention import SlotAttention as SlotAttention
from .slot_attention import slot_attention as slot_attention

REGISTRY = {
    "absolute_position_attention": absolute_position_attention,
    "alibi_attention": alibi_attention,
    "block_slot_attention": block_slot_attention,
    "classification": classification,
    "cross_attention": cross_attention,
    "expanding_attention": expanding_attention,
    "graph_attention": graph_attention,
    "hopfield": hopfield,
    "multihop_attention": multihop_attention,
    "predictive_coding": predictive_coding,
    "relative_position_attention": relative_position_attention,
    "self_attention": self_attention,
    "slot_attention": slot_attention,
}

#: small, readable configurations of every model (the factories' defaults are layer-sized):
#: what ``structattn render MODEL`` and the gallery's catalogue draw
EXAMPLES = {
    "absolute_position_attention": dict(d_model=8, max_len=16, heads=2, causal=True),
    "alibi_attention": dict(d_model=8, heads=2),
    "block_slot_attention": dict(num_slots=3, dim=8, num_blocks=2, num_prototypes=3, iters=3,
                                 hidden_dim=16),
    "classification": dict(d=8, num_classes=4),
    "cross_attention": dict(d_query=8, heads=2),
    "expanding_attention": dict(d_model=8, heads=2, a=2.0, b=2.0),
    "graph_attention": dict(d_model=8, heads=2),
    "hopfield": dict(d_query=8, heads=2, update_steps=3),
    "multihop_attention": dict(d_model=8, heads=2, causal=True),
    "predictive_coding": dict(layer_sizes=[6, 4, 3], steps=10),
    "relative_position_attention": dict(d_model=8, max_distance=2, heads=2, causal=True),
    "self_attention": dict(d_model=8, heads=2, causal=True),
    "slot_attention": dict(num_slots=3, dim=8, iters=3, hidden_dim=16),
}
