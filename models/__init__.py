"""The catalogue: one small declaration per mechanism (SPEC.md, Table 1).

Every public model here is listed in ``REGISTRY`` (name → factory); the test
suite fails when a module in this package is not registered.
"""

from .cross_attention import CrossAttention as CrossAttention
from .cross_attention import cross_attention as cross_attention
from .self_attention import SelfAttention as SelfAttention
from .self_attention import self_attention as self_attention

REGISTRY = {
    "cross_attention": cross_attention,
    "self_attention": self_attention,
}
