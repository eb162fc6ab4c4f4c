"""The attention operators in torch that a support kind or a scheme reads through: blocked
banded attention (``band``), graph attention over an edge list (``segment``) and its
argument checks (``segment_checks``), and an operator's ``torch.compiler.disable`` on first call
(``_eager``)."""
