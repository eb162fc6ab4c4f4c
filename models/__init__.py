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
