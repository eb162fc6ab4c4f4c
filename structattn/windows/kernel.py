"""The compiled kernel's side of the mean-field windows: a typed interface in and out.

``solve(ops, KernelProblem) → KernelSolution``: each child's whole iteration in one call of
``csrc/mean_field_windows.cpp`` (``structattn.kernels``), scoring its parents lazily as its
window grows; ``attend``: the output at the fixed point; ``infer``: both in one call — the
no-grad reading, so that a recorded plan holds one node for the inference (the score ceiling
and the Beta bookkeeping around two calls were twenty small operations, each costing a
Python call per replay; the kernel computes both itself); ``band_forward``/``band_backward``:
``grad="last"``'s one differentiable step, each child's window read in place.
``mean_field_compiled`` is the scheme's fast path — on the CPU these, on CUDA the Triton
kernels (``on_triton``): the same equations as the Python loop (``loop.mean_field``), which
stays the reference and the path for ``grad="unroll"``, a per-round history and rules a
kernel does not run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checking._validation import checks_on, is_exporting, is_recording
from ..operators._eager import eager
from . import fixed_point, on_triton
from .history import MeanFieldHistory
from .scores import tail


@dataclass(frozen=True)
class KernelProblem:
    """One family's mean-field problem, flattened over G = batch · heads rows. Child q of N
    sits at position ``offset`` + q of P tokens (the children are the last N)."""

    a: torch.Tensor  # (G, N, k): the children's score factors, ψ_ij = scale·⟨a_i, b_j⟩
    b: torch.Tensor  # (G, P, k): the parents'
    offset: int
    scale: float
    a0: torch.Tensor  # (G,): each row's Beta prior a
    b0: torch.Tensor  # (G,): … and b
    initial_window: torch.Tensor  # (G, N) long
    caps: torch.Tensor  # (P,) long: the most parents position i may read, min(i, cap)
    tol: float
    converge_tol: float
    max_iters: int
    cap: int
    digamma: bool  # E[ln q] by digamma (else ln E[q])
    conjugate: bool  # α ← a + E[φ] − 1 (else accumulate)
    rule: int  # WindowRule.code
    record: bool  # keep the per-round history
    # (G, N): each child's score ceiling plus its rounding slack, and the slack
    # (ceilings.score_ceiling); None: the kernel computes them by that formula (in double,
    # equal to rounding)
    high: torch.Tensor | None = None
    slack: torch.Tensor | None = None


@dataclass(frozen=True)
class KernelSolution:
    """Each child's fixed point ``(G, N)``: ``window`` (long), ``alpha``, ``beta``,
    ``expected_distance``, ``steps`` (long: its own iterations), ``settled`` (bool) and
    ``bound`` (the certified bound on its posterior mass beyond its window); with
    ``record``, the per-round histories ``(max_iters, G, N)`` (a child's row t is its step
    t, rows past its last step unset), else None."""

    window: torch.Tensor
    alpha: torch.Tensor
    beta: torch.Tensor
    expected_distance: torch.Tensor
    steps: torch.Tensor
    settled: torch.Tensor
    bound: torch.Tensor
    history: tuple | None  # (windows, alpha, beta, expected_distance)


def solve(ops, p: KernelProblem) -> KernelSolution:
    """Run the kernel's ``solve`` op on ``p``."""
    out = ops.solve(p.a, p.b, p.offset, p.scale, p.a0, p.b0, p.initial_window, p.caps, p.tol,
                    p.converge_tol, p.max_iters, p.cap, p.digamma, p.conjugate, p.rule, p.record,
                    p.high, p.slack)
    window, alpha, beta, m, steps, settled, bound = out[:7]
    return KernelSolution(window, alpha, beta, m, steps, settled, bound,
                          tuple(out[7:11]) if p.record else None)


def _history(p: KernelProblem, s: KernelSolution, lead, expectation, dtype) -> MeanFieldHistory:
    """The ``MeanFieldHistory`` from the kernel's per-child histories: round t holds each
    child's step min(t, steps − 1) (a settled child keeps its last); ``band``: the widest
    window scored at each round."""
    G, n = s.window.shape
    h_win, h_alpha, h_beta, h_m = s.history
    with torch.no_grad():
        rounds = int(s.steps.max()) if s.steps.numel() else 0
        t = torch.arange(rounds, device=s.window.device)[:, None, None]
        at = torch.minimum(t, (s.steps - 1).clamp(min=0)).expand(rounds, G, n)
        none = s.steps == 0  # no past: window 0, the prior's Beta, E[φ] 0

        def per_round(h, first):
            got = h.gather(0, at) if rounds else h[:0]
            return torch.where(none, first, got).reshape(rounds, *lead, n)
        windows = per_round(h_win, p.initial_window)
        live = (t < s.steps).reshape(rounds, G * n)  # who scored at round t
        widest = [int(windows.reshape(rounds, G * n)[r][live[r]].max()) for r in range(rounds)]
        return MeanFieldHistory(
            windows=windows, alpha=per_round(h_alpha, p.a0[:, None].expand(G, n)),
            beta=per_round(h_beta, p.b0[:, None].expand(G, n)),
            expected_distance=per_round(h_m, torch.zeros((), dtype=h_m.dtype,
                                                         device=h_m.device)),
            band=widest, iterations=rounds, converged=bool(s.settled.all()),
            discarded=tail(s.alpha, s.beta, s.window, expectation).reshape(*lead, n).to(dtype),
            child_iterations=s.steps.reshape(*lead, n), offset=p.offset,
            bound=s.bound.reshape(*lead, n).to(dtype))


def _register(ops) -> None:
    """The ops' Python rules: fake kernels (``attend``, ``infer``, the band's) and the band's
    autograd formula (C++ backward)."""
    lib = "structattn_mean_field"

    @torch.library.register_fake(f"{lib}::band_forward")
    def _(a, b, u, e, window, offset, scale):
        return a.new_empty(a.shape[0], a.shape[1], u.shape[2]), a.new_empty(a.shape[:2])

    @torch.library.register_fake(f"{lib}::attend")
    def _(a, b, u, offset, scale, win, alpha, beta, digamma):
        return a.new_empty(a.shape[0], a.shape[1], u.shape[2])

    @torch.library.register_fake(f"{lib}::infer")
    def _(a, b, u, *solver):  # the solver's settings: the output's shape is the rows'
        return a.new_empty(a.shape[0], a.shape[1], u.shape[2])

    @torch.library.register_fake(f"{lib}::band_backward")
    def _(dout, a, b, u, e, window, out, lse, offset, scale):
        return torch.empty_like(a), torch.empty_like(b), torch.empty_like(u), torch.empty_like(e)

    def setup(ctx, inputs, output):
        a, b, u, e, window, offset, scale = inputs
        out, lse = output
        ctx.save_for_backward(a, b, u, e, window, out, lse)
        ctx.offset, ctx.scale = offset, scale
        ctx.mark_non_differentiable(lse)

    def backward(ctx, dout, _):
        a, b, u, e, window, out, lse = ctx.saved_tensors
        da, db, du, de = ops.band_backward(dout, a, b, u, e, window, out, lse, ctx.offset,
                                           ctx.scale)
        return da, db, du, de, None, None, None

    torch.library.register_autograd(f"{lib}::band_forward", backward, setup_context=setup)


def _last_step(ops, problem: KernelProblem, fixed, tensors, lead, expectation: str,
               band_posterior):
    """``grad="last"``'s reading: one differentiable step from the detached fixed point (as
    the loop takes it) — each child's band read in place by the C++ band op, E[ln q_i] from
    α, β by torch (the prior's a, b get their gradient through it); → (attend,
    dense_posterior)."""
    from .. import kernels

    a, b, a0, b0 = tensors  # (*lead, N, k), (*lead, P, k), (H|1,), (H|1,)
    work, off, (G, n) = problem.a.dtype, problem.offset, problem.initial_window.shape
    n_all = b.shape[-2]
    alpha, beta, e = fixed_point.step_from(fixed().alpha, fixed().beta, a0, b0, lead,
                                           expectation)  # (G, N) each
    kernels.with_rules("mean_field", _register)  # the band op's autograd rule
    a_g = a.to(work).reshape(G, n, a.shape[-1])  # (with their graphs)
    b_g = b.to(work).reshape(G, n_all, b.shape[-1])

    def attend(u):  # each child's band at its fixed point, read in place
        out, _ = ops.band_forward(a_g, b_g, u.to(work).reshape(G, n_all, u.shape[-1]), e,
                                  fixed().window, off, problem.scale)
        return out.reshape(*lead, n, u.shape[-1]).to(u.dtype)

    def dense_posterior():
        p, lay = band_posterior(alpha, beta)
        return lay.to_dense(p)[..., off:, :]
    return attend, dense_posterior


def _fixed_point_reader(ops, q: KernelProblem, solved: list, lead):
    """The no-grad reading's ``attend``: the kernel's output at the fixed point — from
    ``attend`` where it was solved already (a history was asked for), else from ``infer``
    (solve and attend in one call)."""
    (G, n), off = q.initial_window.shape, q.offset

    @eager  # an opaque C++ call: torch.compile runs it eagerly
    def attend(u):  # u: (*batch, H, P, d_v)
        u_rows = u.detach().to(q.a.dtype).reshape(G, -1, u.shape[-1])
        if solved:
            f = solved[0]
            out = ops.attend(q.a, q.b, u_rows, off, q.scale, f.window, f.alpha, f.beta,
                             q.digamma)
        else:  # the output alone: a posterior asked for afterwards solves again (the same
            # code on the same rows: the same fixed point). While a plan is recorded it
            # refuses non-finite keys itself: b = x W_kᵀ over every token, so the plan drops
            # its sum over x (replay._drop_implied_checks) and a call with a NaN in x fails
            # inside the kernel and is read again, check by check
            check = is_recording() and not is_exporting() and checks_on()
            out = ops.infer(q.a, q.b, u_rows, off, q.scale, q.a0, q.b0, q.initial_window,
                            q.caps, q.tol, q.converge_tol, q.max_iters, q.cap, q.digamma,
                            q.conjugate, q.rule, check)
        return out.reshape(*lead, n, u.shape[-1]).to(u.dtype)
    return attend


@eager
def mean_field_compiled(family, factors, scheme, grad: str, record: bool):
    """The scheme's iteration for ``family`` in the compiled CPU kernel, or on CUDA in the
    Triton kernels (``on_triton``); returns ``(attend, dense_posterior, history)``, or None
    (then the Python loop runs) where neither applies — no kernel, a rule or a history the
    kernel lacks, or ``grad="unroll"`` with a gradient to carry (the derivative through every
    iteration needs the loop's graph).

    The kernel returns each child's fixed point (window, α, β); the output is then one more
    posterior at that fixed point — the kernel's ``attend`` without grad, or under
    ``grad="last"`` the differentiable step on the band, exactly as the loop takes it.
    ``history`` is None unless ``record``."""
    from .. import kernels

    prior = family.prior  # a BetaGeometric
    xc = family.children.states
    a, b, scale = factors  # (*batch, H, N, k), (*batch, H, P, k)
    a0, b0 = prior.params(a.device, xc.dtype)  # (H|1,)
    work = a0.dtype
    unrolled = grad == "unroll" and torch.is_grad_enabled() and any(
        t.requires_grad for t in (a, b, a0, b0))
    if on_triton.applies(a, b, scheme, record, unrolled):
        return on_triton.mean_field_triton(family, factors, scheme, grad)
    if xc.device.type != "cpu" or unrolled or work not in (torch.float32, torch.float64) \
            or scheme.window_rule.code is None:
        return None
    ops = kernels.with_rules("mean_field", _register)  # fake kernels, the band's rule
    if ops is None:
        return None
    n, n_all = family.children.size, family.parents.size
    off = n_all - n  # the children are the last n of the n_all tokens
    cap = scheme.cap(family)
    lead = a.shape[:-2]  # (*batch, H)
    caps, win0 = scheme.initial_windows(a0, b0, lead, n, cap, off)
    with torch.no_grad():
        a_rows = a.detach().to(work).reshape(-1, n, a.shape[-1])  # (G, N, k)
        b_rows = b.detach().to(work).reshape(-1, n_all, b.shape[-1])  # (G, P, k)
        G = a_rows.shape[0]
        problem = KernelProblem(
            a_rows, b_rows, off, float(scale), a0.detach().expand(*lead).reshape(G),
            b0.detach().expand(*lead).reshape(G), win0.reshape(G, n), caps, float(scheme.tol),
            float(scheme.converge_tol), scheme.max_iters, cap, scheme.expectation == "digamma",
            scheme.update == "conjugate", scheme.window_rule.code, record)
    # the fixed point, once: from solve, or from infer (its window, α and β only: what
    # band_posterior reads; a history is solved first)
    solved: list[KernelSolution] = []

    def fixed() -> KernelSolution:
        if not solved:
            with torch.no_grad():
                solved.append(solve(ops, problem))
        return solved[0]

    history = _history(problem, fixed(), lead, scheme.expectation, xc.dtype) if record else None

    def band_posterior(alpha, beta):
        return fixed_point.posterior(a, b, scale, off, prior.block_size, work,
                                     scheme.expectation, fixed().window, alpha, beta, xc.dtype)

    if grad == "last" and torch.is_grad_enabled():
        return (*_last_step(ops, problem, fixed, (a, b, a0, b0), lead, scheme.expectation,
                            band_posterior), history)
    attend = _fixed_point_reader(ops, problem, solved, lead)

    def dense_posterior():
        s = fixed()
        p, lay = band_posterior(s.alpha.reshape(*lead, n), s.beta.reshape(*lead, n))
        return lay.to_dense(p)[..., off:, :]
    return attend, dense_posterior, history
