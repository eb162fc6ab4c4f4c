"""Drawings of the implied adjacency structure (networkx, graphviz) and plots of a long
sequence's attention (matplotlib)."""

from .graphviz import RenderError as RenderError
from .graphviz import graph_to_dot as graph_to_dot
from .graphviz import render as render
from .graphviz import save as save
from .model import model_graph as model_graph
from .networkx import to_networkx as to_networkx
from .summary import plot_attention as plot_attention
