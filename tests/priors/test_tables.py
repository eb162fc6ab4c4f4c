"""Prior tables (structattn/priors/tables.py): they live for one family and one pass (nothing
kept on the prior); edge-list supports honour a prior's log table and are checked once per
forward; a batched table without a heads dim says how to declare heads."""

import pyro
import pytest
import torch

import structattn as sa
import structattn.operators.segment
import structattn.operators.segment_checks
import structattn.priors.tables
from structattn.operators.segment import segment_attention

from ..reference import heads_of, softmax_attention

F64 = torch.float64


def _x(*shape, generator=None):
    return torch.randn(*shape, dtype=F64, generator=generator)


def _program(prior, W, heads=2):
    def program(x):
        n = sa.nodes("x", x)
        phi = sa.edges("attn", n, n, prior, heads=heads)
        sa.potential(phi, sa.potentials.Bilinear(W[0], W[1], heads=heads))
        return sa.value(phi, sa.values.Linear(W[2], heads=heads))
    return program


def _weights(heads=2, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [_x(heads * 3, d, generator=g) for _ in range(3)]


def _tensors_with_graph(obj, seen=None):
    """Every tensor reachable from ``obj``'s attributes (recursively) that has a grad_fn."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.grad_fn is not None else []
    if isinstance(obj, dict):
        items = list(obj.keys()) + list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        items = list(vars(obj).values())
    else:
        return []
    return [t for item in items for t in _tensors_with_graph(item, seen)]


class GraphPrior(sa.priors.Prior):
    """A prior stating an edge list *and* a log table (no built-in prior combines them)."""

    def __init__(self, edge_index, logits, *, causal=False, empty="error"):
        self.edge_index, self.logits, self.causal, self.empty = edge_index, logits, causal, empty

    def support(self, num_children, num_parents):
        return sa.kinds.EdgeList(self.edge_index, causal=self.causal)

    def log_weight(self, child, parent, sizes):
        i, j = torch.broadcast_tensors(child, parent)
        return torch.broadcast_to(self.logits, (*self.logits.shape[:-2], *sizes))[..., i, j]

    def log_table(self, num_children, num_parents, device, dtype):
        return self.logits if dtype is None else self.logits.to(dtype)


def _graph(n, g, density=0.5):
    mask = (torch.rand(n, n, generator=g) < density) | torch.eye(n, dtype=torch.bool)
    dst, src = mask.nonzero().T
    perm = torch.randperm(src.numel(), generator=g)
    return mask, torch.stack([src[perm], dst[perm]])


@pytest.mark.parametrize("kind", ["relative", "alibi", "categorical_of_param", "graph"])
def test_prior_holds_no_autograd_graph_after_forward_and_backward(kind):
    n = 6
    param = torch.nn.Parameter(_x(2, 5))
    W = _weights()
    if kind == "relative":
        make = lambda: sa.priors.RelativePosition(param, causal=True)  # noqa: E731
    elif kind == "alibi":
        slopes = torch.nn.Parameter(torch.tensor([0.5, 0.25], dtype=F64))
        make = lambda: sa.priors.ALiBi(2, slopes=slopes)  # noqa: E731
        param = slopes
    elif kind == "categorical_of_param":  # the tables derived from a leaf: dtype, bias, masks
        param = torch.nn.Parameter(_x(2, n, n))
        make = lambda: sa.priors.Categorical(param, support=torch.ones(n, n, dtype=torch.bool))  # noqa: E731
    else:
        _, edge_index = _graph(n, torch.Generator().manual_seed(0))
        param = torch.nn.Parameter(_x(2, n, n))
        make = lambda: GraphPrior(edge_index, param)  # noqa: E731 - per-edge gathers have a grad_fn
    prior = make()
    layer = sa.compile(_program(prior, W))
    x = _x(2, n, 4)
    for _ in range(2):
        layer(x).square().sum().backward()
        layer(x, return_posterior=True)[0].sum().backward()
    # the Pyro reading (an SVI step would differentiate through it too)
    tr = pyro.poutine.trace(_program(prior, W)).get_trace(x)
    tr.log_prob_sum().backward()
    assert param.grad is not None and torch.isfinite(param.grad).all()
    leaked = _tensors_with_graph(prior)
    assert leaked == [], [t.shape for t in leaked]


def test_prior_keeps_no_tables_at_all():
    prior = sa.priors.RelativePosition(_x(2, 5), causal=True)
    before = dict(vars(prior))
    layer = sa.compile(_program(prior, _weights()))
    layer(_x(2, 6, 4))
    sa.inference.exact(_program(prior, _weights()), _x(2, 6, 4))
    assert vars(prior).keys() == before.keys()
    assert all(vars(prior)[k] is v for k, v in before.items())


TOL = 1e-6


def test_changed_logits_give_fresh_tables_and_outputs():
    n, W = 5, _weights()
    x = _x(2, n, 4)
    logits = _x(2, n, n)
    prior = sa.priors.Categorical(logits)
    layer = sa.compile(_program(prior, W))

    def reference(b):
        return heads_of(softmax_attention(W[0], W[1], W[2], None, x, x, 2, bias=b)[0], 2)

    torch.testing.assert_close(layer(x), reference(logits), atol=TOL, rtol=0)
    new = _x(2, n, n)
    prior.logits = new  # replaced
    torch.testing.assert_close(layer(x), reference(new), atol=TOL, rtol=0)
    with torch.no_grad():
        prior.logits.mul_(3.0)  # modified in place
    torch.testing.assert_close(layer(x), reference(new), atol=TOL, rtol=0)
    # one-off readings of the prior are as fresh as a forward pass
    first = prior.tables(n, n, x.device).log_prob_table(F64)
    torch.testing.assert_close(first, new.log_softmax(-1), atol=TOL, rtol=0)
    prior.logits = logits
    torch.testing.assert_close(prior.tables(n, n, x.device).log_prob_table(F64),
                               logits.log_softmax(-1), atol=TOL, rtol=0)
    torch.testing.assert_close(prior.tables(n, n, x.device).bias(F64), logits, atol=0, rtol=0)


def test_a_family_builds_each_table_once():
    calls = []

    class Counting(sa.priors.RelativePosition):
        def log_table(self, *args):
            calls.append(1)
            return super().log_table(*args)

    prior = Counting(_x(2, 5), causal=True)
    tables = prior.tables(6, 6, torch.device("cpu"))
    tables.validate("attn", batch_shape=(2,), heads=2)
    tables.sdpa_inputs(F64)
    tables.log_prob_table(F64)
    tables.log_prob_table(torch.float32)
    tables.empty_children()
    assert len(calls) == 1
    assert len(calls) == 1 and prior.tables(6, 6, "cpu").table() is not tables.table()


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("table_shape", ["CP", "HCP", "BHCP"])
def test_edge_list_with_a_log_table_equals_pyro_and_the_dense_mask(causal, table_shape):
    g = torch.Generator().manual_seed(11)
    B, H, n = 3, 2, 7
    mask, edge_index = _graph(n, g)
    logits = _x(*{"CP": (n, n), "HCP": (H, n, n), "BHCP": (B, H, n, n)}[table_shape], generator=g)
    logits = logits.masked_fill(torch.rand(logits.shape, generator=g) < 0.15, float("-inf"))
    logits[..., torch.arange(n), torch.arange(n)] = 0.0  # self-loops stay: no empty support
    W = _weights(H)
    x = _x(B, n, 4, generator=g)
    sparse = _program(GraphPrior(edge_index, logits, causal=causal), W, H)
    dense = _program(sa.priors.Categorical(logits, support=mask, causal=causal), W, H)
    out, post = sa.compile(sparse)(x, return_posterior=True)
    # the reference, from the maths: softmax over each child's edges of ψ + log weight
    allowed = mask & ~logits.isneginf()
    ref, p_ref = softmax_attention(W[0], W[1], W[2], None, x, x, H, causal=causal,
                                   bias=logits.masked_fill(~allowed, 0), mask=allowed)
    torch.testing.assert_close(out, heads_of(ref, H), atol=TOL, rtol=0)
    src, dst = (edge_index[:, edge_index[0] <= edge_index[1]] if causal else edge_index)
    torch.testing.assert_close(post, p_ref[..., dst, src], atol=TOL, rtol=0)
    torch.testing.assert_close(out, sa.compile(dense)(x), atol=TOL, rtol=0)
    report = sa.inference.compare(sparse, x)
    assert report.max_abs_diff < TOL, str(report)


@pytest.mark.parametrize("shape", [(1, 6), (6,), (2, 1, 6)])
def test_edge_list_with_a_broadcast_log_table(shape):
    """A table that broadcasts to (…, C, P) without being C×P (one row for every child)."""
    g = torch.Generator().manual_seed(9)
    mask, edge_index = _graph(6, g)
    logits, W, x = _x(*shape, generator=g), _weights(2), _x(2, 6, 4, generator=g)
    out = sa.compile(_program(GraphPrior(edge_index, logits), W))(x)
    torch.testing.assert_close(out, sa.compile(_program(sa.priors.Categorical(logits, support=mask), W))(x),
                               atol=TOL, rtol=0)
    assert sa.inference.compare(_program(GraphPrior(edge_index, logits), W), x).max_abs_diff < TOL


def test_edge_list_log_table_gets_the_dense_gradient():
    g = torch.Generator().manual_seed(2)
    n, H = 6, 2
    mask, edge_index = _graph(n, g)
    W = _weights(H)
    x = _x(2, n, 4, generator=g)
    grads = []
    for make in (lambda t: GraphPrior(edge_index, t), lambda t: sa.priors.Categorical(t, support=mask)):
        logits = _x(H, n, n, generator=torch.Generator().manual_seed(4)).requires_grad_()
        W_ = [w.clone().requires_grad_() for w in W]
        y = sa.compile(_program(make(logits), W_, H))(x)
        y.square().sum().backward()
        grads.append([logits.grad.masked_fill(~mask, 0), *(w.grad for w in W_)])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_edge_list_log_table_empty_children():
    g = torch.Generator().manual_seed(6)
    n, H = 6, 2
    mask, edge_index = _graph(n, g)
    logits = _x(H, n, n, generator=g)
    logits[1, 3, :] = float("-inf")  # head 1: child 3 has no edge of finite weight
    W = _weights(H)
    x = _x(2, n, 4, generator=g)
    with pytest.raises(ValueError, match=r"edge family 'attn': child 3 has an empty support — no "
                                         r"edge of finite log weight"):
        sa.compile(_program(GraphPrior(edge_index, logits), W, H))(x)
    program = _program(GraphPrior(edge_index, logits, empty="zero"), W, H)
    out, post = sa.compile(program)(x, return_posterior=True)
    assert out[:, 1, 3].abs().max() == 0 and out[:, 0, 3].abs().max() > 0
    assert torch.isfinite(post).all()
    assert sa.inference.compare(program, x).max_abs_diff < TOL
    logits[0, 2, 2] = float("nan")
    with pytest.raises(ValueError, match=r"prior log weights contain non-finite values"):
        sa.compile(_program(GraphPrior(edge_index, logits), W, H))(x)


def test_edge_list_is_checked_once_per_forward(monkeypatch):
    counts = {"prior": 0, "kernel": 0}
    check = structattn.priors.tables.check_edge_index
    kernel_check = structattn.operators.segment_checks._check_values

    def counting(name, fn):
        def wrapped(*args, **kwargs):
            counts[name] += 1
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(structattn.priors.tables, "check_edge_index", counting("prior", check))
    monkeypatch.setattr(structattn.operators.segment_checks, "_check_values",
                        counting("kernel", kernel_check))
    _, edge_index = _graph(6, torch.Generator().manual_seed(1))
    m = sa.models.graph_attention(4, d_k=2, heads=2, dtype=F64)
    sa.compile(m)(_x(2, 6, 4), edge_index)
    assert counts == {"prior": 1, "kernel": 0}
    bad = edge_index.clone()
    bad[1, 0] = 6
    with pytest.raises(ValueError, match=r"edge_index child \(row 1\) indices must be in \[0, 6\)"):
        sa.compile(m)(_x(2, 6, 4), bad)
    segment_attention(*[_x(6, 2)] * 2, _x(6, 3), *edge_index, 6)  # direct use still checks
    assert counts["kernel"] == 1


def test_a_batched_table_without_heads_points_to_edges_heads():
    W = torch.randn(4, 4)
    logits = torch.randn(2, 3, 5)  # (*batch, C, P): the heads dim is missing

    def program(q, k):
        phi = sa.edges("a", sa.nodes("q", q), sa.nodes("k", k), sa.priors.Categorical(logits))
        sa.potential(phi, sa.potentials.Bilinear(W, W))
        return sa.value(phi, sa.values.Linear(W))

    with pytest.raises(ValueError, match=r"heads dim too.*structattn.edges\(\.\.\., heads=H\)"):
        sa.compile(program)(torch.randn(2, 3, 4), torch.randn(2, 5, 4))
