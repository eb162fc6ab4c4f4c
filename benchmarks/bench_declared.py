"""What a user's declaration costs against the catalogue's fastest path, forward+backward.

Every row is one compiled layer around the same projections (W_Q, W_K, W_V, W_O; B=1, H=4,
d_k = d_v = 16, d_model = 64, float32, CPU), timed in paired rounds against the REFERENCE,
the catalogue's causal ALiBi (``sa.models.alibi_attention(..., causal=True)``, lowered as a
difference of per-token terms: no N×N table):

- ``alibi_causal``: the reference against a second compiled layer of itself (its ratio is
  the pairing's noise around 1; its peak is the one to read the others against);
- ``alibi_user``: the same prior re-declared by a user, a ``sa.priors.DistancePrior`` that
  states only ``log_at_distance(d) = −m_h·|d|`` (causal), in a user ``sa.Declaration``
  (``sa.nodes``/``sa.edges``/``sa.potential``/``sa.value``) — it computes what the
  reference computes (the max difference is recorded);
- ``power_law``: a user's prior log w(d) = −a_h·log(1 + d), causal, ``a`` an
  ``nn.Parameter`` per head (its gradient is part of the backward);
- ``alibi_noncausal``: the catalogue's ALiBi over both sides (``causal=False``);
- ``relative_positions``: the catalogue's ``relative_position_attention`` (causal, K = 16);
- ``generalised_gaussian``: the catalogue's generalised Gaussian (BAM; no ``tol``);
- ``log_weight``: a user's prior stating ``log_weight`` alone (a slope growing along the
  sequence, learned per head: not a function of i − j), read a block of children at a time;
- ``longformer``: the supports guide's ``Band(w=256) | Global(g=16)`` support under a
  uniform prior (``docs/guide/supports.md``); ``longformer_forward``: the same, forward
  alone under ``no_grad``; ``flex_longformer``: the same mask in PyTorch's FlexAttention
  (``create_block_mask`` from a ``mask_mod`` equal to the support, built once outside the
  timed call; ``flex_attention`` under ``torch.compile``; forward alone — PyTorch has no
  FlexAttention backward on the CPU); ``bigbird``: ``Band | Global | RandomBlocks``,
  BigBird's random attention as a support of one's own: ~2% of the (64 × 64) blocks, drawn
  by a hash of the block indices (no N×N tensor; classified once, like the others);
- ``dense_uniform`` (a uniform prior over a random boolean ``Mask``, density 1/2, with the
  diagonal) and ``dense_categorical`` (a causal ``Categorical`` prior with learned logits
  ``(H, N, N)``), at N ≤ 2,048 only: to watch that no dense case gets slower.

Forward-only rows (``mode`` "fwd") are paired with the reference's forward alone under
``no_grad``, whose own row is ``alibi_causal_forward``.

Each (case, N) runs in a fresh subprocess: it builds the reference and the case, warms each
up (three calls: read, record the plan, replay), measures the case's peak memory — the growth
of the RSS high-water mark during one call (``_memory.py``) — then times the case and the
reference interleaved, the order flipped every round, the garbage collector off; the row
keeps the case's median time and the median of the per-round ratios (``paired``), with their
quartiles, and the share of the CPU that other processes used meanwhile (printed above 10%:
on a shared 2-core machine, ``--threads 1`` is steadier). A (case, N) has a wall-clock
budget (``--budget``, seconds, default 240): the rounds are cut to fit it, and a subprocess
still running a minute past it (the minute for its imports) is stopped, the row recorded as
"skipped: …", as is one that fails or is killed. A case whose reading today is dense (an
N×N mask, an (H, N, N) table) is skipped where a rough estimate of its memory, 4·H·N² bytes
× 3, exceeds ``--max-gb`` (12 GB: N = 16,384). ``--quick`` (N = 64 and 256, one round,
one thread) runs every row in one subprocess, and FlexAttention eagerly (no
``torch.compile``, whose first compile takes ~20 s): it only checks that every path runs,
and fails if one does not.

Each row also records which reading the compiled layer took, ``layer.explain(x)`` where
the layer offers it (None where it does not, and for FlexAttention).

Run: ``python benchmarks/bench_declared.py [--quick] [--sizes N …] [--cases NAME …]
[--rounds R] [--budget S] [--max-gb G] [--threads T] [--json PATH]``. A full run writes
``benchmarks/results/declared.json``.

``--device cuda`` measures the cases on a GPU instead (``_declared_cuda.py``): each layer
with FlexAttention's reading and without it (a Triton kernel, the rows reading or the dense
table), the reading each took, CUDA-event times (``--reps``) and peak memory, at 2,048, 8,192
and 16,384 tokens; ``--budget`` is then the whole run's seconds (default 240). It writes
``declared_cuda.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import structattn as sa  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _results  # noqa: E402  (this script's own folder)
from _memory import measure_peak_mib  # noqa: E402

HEADS, D_K = 4, 16
D_MODEL = HEADS * D_K
BAND, GLOBAL = 256, 16  # Longformer's window w and global tokens g
RANDOM_DENSITY = 0.02  # BigBird's random blocks: the share of (64 × 64) blocks
REFERENCE = "alibi_causal"


# -- a user's priors and supports (docs/guide/supports.md) --------------------------------

class UserALiBi(sa.priors.DistancePrior):
    """ALiBi as a user states it: log w(d) = −m_h·|d| on j ≤ i, nothing else."""

    def __init__(self, slopes):
        self.slopes = slopes  # (H,)
        super().__init__("user ALiBi prior", causal=True)

    def log_at_distance(self, d, dtype=None):
        m = self.slopes.to(device=d.device, dtype=dtype or self.slopes.dtype)
        return -m.reshape(-1, *([1] * d.dim())) * d.abs().to(m.dtype)  # (H, *d)


class PowerLaw(sa.priors.DistancePrior):
    """log w(d) = −a_h·log(1 + d) on j ≤ i; ``a`` may be a learned parameter ``(H,)``."""

    def __init__(self, a):
        self.a = a
        super().__init__("power-law prior", causal=True)

    def log_at_distance(self, d, dtype=None):
        a = self.a.to(dtype or self.a.dtype).reshape(-1, *([1] * d.dim()))
        return -a * torch.log1p(d.abs().to(a.dtype))  # (H, *d)


class Drift(sa.priors.Prior):
    """A prior stating ``log_weight`` alone: log w_ij = −a_h·(i − j)·(1 + i/N) on j ≤ i, a
    slope that grows along the sequence (not a function of i − j), ``a`` learned ``(H,)``."""

    def __init__(self, a):
        self.a = a

    def support(self, num_children, num_parents):
        return sa.kinds.Causal()

    def log_weight(self, child, parent, sizes):
        a = self.a.reshape(-1, 1, 1)
        return -a * (child - parent).to(a.dtype) * (1 + child.to(a.dtype) / sizes[0])


class Band(sa.kinds.Support):
    """|i − j| ≤ w."""

    def __init__(self, w):
        self.w = w

    def contains(self, child, parent):
        return (child - parent).abs() <= self.w


class Global(sa.kinds.Support):
    """The first g tokens: read by every token, reading every token."""

    def __init__(self, g):
        self.g = g

    def contains(self, child, parent):
        return (parent < self.g) | (child < self.g)


class RandomBlocks(sa.kinds.Support):
    """BigBird's random attention: the (``block`` × ``block``) blocks whose hash of (child
    block, parent block, seed) falls under ``share``: a pseudo-random ~``share`` of them."""

    def __init__(self, share, seed=1, block=64):
        self.share, self.seed, self.block = share, seed, block

    def contains(self, child, parent):
        h = (child // self.block) * 7919 + (parent // self.block) * 104729 + self.seed * 31337
        return (h * 2654435761) % 1000003 < self.share * 1000003


class SupportPrior(sa.priors.Prior):
    """A uniform prior over a fixed support (Longformer's, BigBird's)."""

    def __init__(self, support):
        self._support = support

    def support(self, num_children, num_parents):
        return self._support


# -- a user's declaration: the catalogue's projections around one edge family -------------

class UserAttention(sa.Declaration):
    """Multi-head self-attention declared by hand: ψ = (W_Q x_i)ᵀ(W_K x_j)/√d_k, v = W_V x_j,
    y = W_O merge(E[v]); x ``(B, N, d_model)`` → ``(B, N, d_model)``. The prior is
    ``prior()``'s, made at each call from the module's tensors (so learned ones train)."""

    def __init__(self, prior):
        super().__init__()
        self.heads = HEADS
        self.make_prior = prior  # module → Prior
        self.W_q, self.W_k, self.W_v = (nn.Parameter(torch.empty(HEADS * D_K, D_MODEL))
                                        for _ in range(3))
        self.W_o = nn.Parameter(torch.empty(D_MODEL, HEADS * D_K))

    def model(self, x):
        t = sa.nodes("x", x)
        phi = sa.edges("attn", t, t, self.make_prior(self), heads=self.heads)
        sa.potential(phi, sa.potentials.Bilinear(self.W_q, self.W_k, heads=self.heads))
        y = sa.merge_heads(sa.value(phi, sa.values.Linear(self.W_v, heads=self.heads)))
        return F.linear(y, self.W_o)


def random_mask(n, density, seed):
    """A boolean ``(n, n)`` mask of about ``density`` True entries."""
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, n, generator=g) < density


def same_weights(source, *models) -> None:
    """Copy ``source``'s W_q, W_k, W_v, W_o into each of ``models``."""
    with torch.no_grad():
        for m in models:
            for name in ("W_q", "W_k", "W_v", "W_o"):
                getattr(m, name).copy_(getattr(source, name))


# -- the cases: each builds a module (or a function) on the reference's weights -----------

def _catalogue(name, **kw):
    """The catalogue's ``name`` at this benchmark's sizes."""
    return getattr(sa.models, name)(D_MODEL, heads=HEADS, d_k=D_K, d_v=D_K, **kw)


def build_reference():
    """The reference: the catalogue's causal ALiBi (seed 0: its weights are every case's)."""
    torch.manual_seed(0)
    return _catalogue("alibi_attention", causal=True)


def build_alibi_user(ref, n):
    """ALiBi re-declared by a user, with the reference's slopes: the same model."""
    m = UserAttention(lambda self: UserALiBi(self.slopes))
    m.register_buffer("slopes", ref.slopes.clone())  # the paper's 2^(−8h/H)
    return m


def build_power_law(ref, n):
    """A user's power law, a_h = 0.5, 1, 1.5, 2 learned."""
    m = UserAttention(lambda self: PowerLaw(self.a))
    m.a = nn.Parameter(0.5 * torch.arange(1, HEADS + 1, dtype=torch.float32))  # (H,)
    return m


def build_log_weight(ref, n):
    """A user's prior of ``log_weight`` alone (``Drift``), a_h = 2^−h learned."""
    m = UserAttention(lambda self: Drift(self.a))
    m.a = nn.Parameter(2.0 ** -torch.arange(1, HEADS + 1, dtype=torch.float32))  # (H,)
    return m


def build_longformer(ref, n):
    """Longformer: Band(256) | Global(16), uniform on it."""
    return UserAttention(lambda self: SupportPrior(Band(BAND) | Global(GLOBAL)))


def build_bigbird(ref, n):
    """BigBird: Longformer's support | ~2% of the blocks at random, uniform on it."""
    return UserAttention(lambda self: SupportPrior(
        Band(BAND) | Global(GLOBAL) | RandomBlocks(RANDOM_DENSITY)))


def build_dense_uniform(ref, n):
    """A uniform prior over a random boolean mask (density 1/2, and the diagonal)."""
    m = UserAttention(lambda self: sa.priors.Uniform(support=self.mask))
    mask = random_mask(n, 0.5, seed=2) | torch.eye(n, dtype=torch.bool)  # (N, N), no empty row
    m.register_buffer("mask", mask)
    return m


def build_dense_categorical(ref, n):
    """A causal categorical prior with learned logits (H, N, N)."""
    m = UserAttention(lambda self: sa.priors.Categorical(self.logits, causal=True))
    m.logits = nn.Parameter(0.1 * torch.randn(HEADS, n, n))  # (H, N, N), learned
    return m


def flex_longformer(ref, n, compiled=True):
    """Projections around ``flex_attention`` with Longformer's mask as a block mask (built
    here, once); returns the forward ``x → y``."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    def mask_mod(b, h, q, k):  # = Band(BAND) | Global(GLOBAL)
        return ((q - k).abs() <= BAND) | (k < GLOBAL) | (q < GLOBAL)

    block_mask = create_block_mask(mask_mod, None, None, n, n, device="cpu")
    attend = torch.compile(flex_attention) if compiled else flex_attention

    def forward(x):
        q, k, v = (sa.split_heads(F.linear(x, W), HEADS) for W in (ref.W_q, ref.W_k, ref.W_v))
        y = attend(q, k, v, block_mask=block_mask)  # (B, H, N, d_v); scale 1/√d_k
        return F.linear(sa.merge_heads(y), ref.W_o)
    return forward


#: name → (builder (ref, N) → module, forward+backward?, a dense reading (an (H, N, N)
#: table or an N×N mask: the memory guard)?, largest N or None, the row whose output it must equal or None)
CASES = {
    "alibi_causal": (None, True, False, None, None),
    "alibi_causal_forward": (None, False, False, None, None),
    "alibi_user": (build_alibi_user, True, False, None, "alibi_causal"),
    "power_law": (build_power_law, True, False, None, None),
    "alibi_noncausal": (lambda ref, n: _catalogue("alibi_attention", causal=False),
                        True, False, None, None),
    "relative_positions": (lambda ref, n: _catalogue("relative_position_attention", causal=True),
                           True, False, None, None),
    "generalised_gaussian": (lambda ref, n: _catalogue("generalised_gaussian_attention"),
                             True, False, None, None),
    "log_weight": (build_log_weight, True, False, None, None),
    "longformer": (build_longformer, True, False, None, None),
    "longformer_forward": (build_longformer, False, False, None, None),
    "flex_longformer": (flex_longformer, False, False, None, "longformer"),
    "bigbird": (build_bigbird, True, False, None, None),
    "dense_uniform": (build_dense_uniform, True, True, 2048, None),
    "dense_categorical": (build_dense_categorical, True, True, 2048, None),
}


def build_case(name, ref, n, flex_compiled):
    """``(forward x → y, trained parameters, compiled layer or None)`` for ``name`` on
    ``ref``'s weights."""
    builder = CASES[name][0]
    if builder is None:
        layer = sa.compile(ref)
        return layer, list(ref.parameters()), layer
    if name == "flex_longformer":
        return flex_longformer(ref, n, flex_compiled), list(ref.parameters()), None
    m = builder(ref, n)
    same_weights(ref, m)
    layer = sa.compile(m)
    return layer, [p for p in m.parameters() if p.requires_grad], layer


def twin(name, ref, n):
    """The compiled layer whose output a case's must equal (``alibi_user``: the reference;
    ``flex_longformer``: the Longformer declaration), or None."""
    other = CASES[name][4]
    if other is None:
        return None
    if other == REFERENCE:
        return sa.compile(ref)
    m = CASES[other][0](ref, n)
    same_weights(ref, m)
    return sa.compile(m)


# -- one (case, N), in this process --------------------------------------------------------

def call(fn, x, params, backward):
    """One forward+backward (``backward``) or one forward under ``no_grad``."""
    if not backward:
        with torch.no_grad():
            fn(x)
        return
    for p in (x, *params):
        p.grad = None
    fn(x).sum().backward()


def paired_rounds(case, ref, rounds, budget_s) -> dict:
    """``case`` and ``ref`` (each ``() → None``) interleaved for ``rounds`` rounds, the order
    flipped every round, fewer where one round would take the rest past ``budget_s``: the
    case's median seconds and the median and quartiles of the per-round ratios case / ref."""
    times = {"case": [], "ref": []}
    start = time.perf_counter()
    gc.disable()
    try:
        for r in range(rounds):
            for key in (("case", "ref") if r % 2 == 0 else ("ref", "case")):
                t = time.perf_counter()
                (case if key == "case" else ref)()
                times[key].append(time.perf_counter() - t)
            pair = times["case"][-1] + times["ref"][-1]
            if time.perf_counter() - start + pair > budget_s:
                break
    finally:
        gc.enable()
    ratios = sorted(a / b for a, b in zip(times["case"], times["ref"], strict=True))
    q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {"median_s": statistics.median(times["case"]),
            "ref_median_s": statistics.median(times["ref"]), "paired": statistics.median(ratios),
            "paired_quartiles": [q1, q3], "rounds": len(ratios)}


def _cpu_sample():
    """(the machine's busy CPU seconds, this process's own CPU seconds, wall seconds), or None
    where /proc/stat cannot be read."""
    try:
        with open("/proc/stat") as f:
            fields = [int(v) for v in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    own = resource.getrusage(resource.RUSAGE_SELF)
    return ((user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK"),
            own.ru_utime + own.ru_stime, time.perf_counter())


def others_share(start, end) -> float | None:
    """The share of the machine's CPU that *other* processes used between two
    ``_cpu_sample``s: above a few percent, the timings were taken on a contended machine."""
    if start is None or end is None:
        return None
    busy, own, wall = (e - s for e, s in zip(end, start, strict=True))
    capacity = wall * (os.cpu_count() or 1)
    return max(0.0, busy - own) / capacity if capacity > 0 else None


def reading_of(layer, x):
    """What ``layer.explain(x)`` says of the reading each family took (in grad mode, as the
    timed forward + backward reads), one line per family."""
    explain = getattr(layer, "explain", None)
    if explain is None:
        return None
    try:
        return {name: str(lowering) for name, lowering in explain(x).items()}
    except Exception as e:  # noqa: BLE001  (an explain that fails is recorded, not fatal)
        return f"explain failed: {type(e).__name__}: {e}"


def measure(name, n, cfg) -> dict:
    """One (case, N): the case's peak memory over one call, then paired rounds against the
    reference in the same mode (forward+backward, or the forward alone)."""
    start = time.perf_counter()
    backward = CASES[name][1]
    ref = build_reference()
    fn, params, layer = build_case(name, ref, n, cfg["flex_compiled"])
    ref_layer, ref_params = sa.compile(ref), list(ref.parameters())
    torch.manual_seed(1)
    x = torch.randn(1, n, D_MODEL, requires_grad=backward)  # (B, N, d_model)
    row = {"case": name, "N": n, "mode": "fwd+bwd" if backward else "fwd", "skipped": None}
    other = twin(name, ref, n)
    if other is not None:
        with torch.no_grad():
            row["max_difference"] = (fn(x) - other(x)).abs().max().item()
        del other
    for _ in range(3):  # read, record the plan, replay: the timed calls are replays
        call(fn, x, params, backward)
        call(ref_layer, x, ref_params, backward)
    gc.collect()
    row["peak_mib"] = measure_peak_mib(lambda: call(fn, x, params, backward))
    row["reading"] = reading_of(layer, x) if layer is not None else None
    left = cfg["budget_s"] - (time.perf_counter() - start)
    before = _cpu_sample()
    row.update(paired_rounds(lambda: call(fn, x, params, backward),
                             lambda: call(ref_layer, x, ref_params, backward),
                             cfg["rounds"], max(left, 0.0)))
    row["others_cpu_share"] = others_share(before, _cpu_sample())
    return row


def child(cfg, runs) -> None:
    """Internal (``--child``): each ``case:N`` of ``runs`` in turn in this process, one JSON
    line each."""
    if cfg.get("threads"):
        torch.set_num_threads(cfg["threads"])
    for run in runs:
        name, n = run.rsplit(":", 1)
        print(json.dumps(measure(name, int(n), cfg), default=str), flush=True)


# -- the parent: guards, subprocesses, the table --------------------------------------------

def guard(name, n, cfg) -> str | None:
    """Why ``name`` is not run at ``n`` (its size limit, or the dense estimate), or None."""
    _, _, dense, largest, _ = CASES[name]
    if largest is not None and n > largest:
        return f"measured at N ≤ {largest:,} only"
    estimate = 4 * HEADS * n * n * 3  # bytes: an (H, N, N) float32 table, ×3 for its kin
    if dense and estimate > cfg["max_gb"] * 1e9:
        return (f"a dense (H, N, N) reading would need ~{estimate / 1e9:.1f} GB "
                f"> {cfg['max_gb']:g} GB (--max-gb)")
    return None


def in_subprocess(cfg, runs, timeout_s) -> list[dict]:
    """Rows of ``runs`` (``case:N`` each) measured in turn in one fresh subprocess; a run that
    does not come back (past ``timeout_s``, killed, failed) is a skipped row."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(cfg), *runs]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        last = (out.stderr.strip().splitlines() or [""])[-1]  # the exception, if one
        stdout, why = out.stdout, (None if out.returncode == 0 else
                                   f"exit {out.returncode}: {last[-300:]}")
    except subprocess.TimeoutExpired as e:
        stdout = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        why = f"over the {timeout_s:.0f} s budget"
    rows = {(r["case"], r["N"]): r for r in
            (json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{"))}
    out_rows = []
    for run in runs:
        name, n = run.rsplit(":", 1)
        out_rows.append(rows.get((name, int(n)), {"case": name, "N": int(n),
                                                  "skipped": why or "no result"}))
    return out_rows


def fmt_row(r) -> str:
    mode = r.get("mode") or ("fwd+bwd" if CASES[r["case"]][1] else "fwd")
    if r.get("skipped"):
        return f"{r['case']:<22} {mode:<7} {r['N']:>6,}  skipped: {r['skipped']}"
    q1, q3 = r["paired_quartiles"]
    diff = f"  max|Δ| {r['max_difference']:.1e}" if "max_difference" in r else ""
    share = r.get("others_cpu_share")
    busy = f"  (other processes: {share:.0%} of the CPU)" if share and share > 0.1 else ""
    return (f"{r['case']:<22} {mode:<7} {r['N']:>6,} {r['median_s']:9.4f} s "
            f"{r['paired']:8.2f}× ({q1:.2f}–{q3:.2f}) {r['peak_mib']:9.1f} MiB "
            f"{r['rounds']} rounds{diff}{busy}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true",
                   help="N = 64 and 256, one round, every row in one subprocess (smoke test)")
    p.add_argument("--sizes", type=int, nargs="+", metavar="N", help="these N only")
    p.add_argument("--cases", nargs="+", metavar="NAME", choices=list(CASES),
                   help="these cases only (and the reference)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--budget", type=float, metavar="S",
                   help="wall-clock seconds per (case, N) (default 240; --quick 120)")
    p.add_argument("--max-gb", type=float, default=12.0,
                   help="skip a dense-reading case where 4·H·N²·3 bytes exceed this")
    p.add_argument("--threads", type=int, metavar="T",
                   help="torch threads in each subprocess (default torch's own; --quick 1)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="cuda: each case with and without FlexAttention's reading on a GPU")
    p.add_argument("--reps", type=int, default=10, help="--device cuda: timed calls per route")
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)  # CFG CASE:N …
    args = p.parse_args(argv)
    if args.child:
        child(json.loads(args.child[0]), args.child[1:])
        return None
    if args.device == "cuda":
        import _declared_cuda  # noqa: PLC0415  (this script's own folder; CUDA runs only)

        args.budget = args.budget or 240.0
        results = _declared_cuda.run(sys.modules[__name__], args)
        _results.save("declared_cuda", results, args.json, quick=args.quick)
        return results
    cfg = dict(sizes=[2048, 8192, 16384], rounds=args.rounds, max_gb=args.max_gb,
               budget_s=args.budget or 240.0, flex_compiled=True, heads=HEADS, d_k=D_K,
               d_v=D_K, d_model=D_MODEL, batch=1, band=BAND, globals=GLOBAL,
               random_density=RANDOM_DENSITY, threads=args.threads)
    if args.quick:
        cfg.update(sizes=[64, 256], rounds=1, budget_s=args.budget or 120.0,
                   flex_compiled=False, threads=args.threads or 1)
    if args.sizes:
        cfg["sizes"] = args.sizes
    names = [REFERENCE, *(c for c in CASES if c != REFERENCE and (
        not args.cases or c in args.cases))]
    threads = cfg["threads"] or torch.get_num_threads()
    print(f"torch {torch.__version__}, {threads} threads, {os.cpu_count()} "
          f"cores, float32, CPU; B=1, H={HEADS}, d_k=d_v={D_K}; reference {REFERENCE}",
          flush=True)
    print(f"{'case':<22} {'mode':<7} {'N':>6} {'seconds':>11} {'ratio':>9} "
          f"{'(quartiles)':<11} {'peak MiB':>9}", flush=True)
    rows = []
    plan = [(c, n) for n in cfg["sizes"] for c in names]
    todo = [f"{c}:{n}" for c, n in plan if guard(c, n, cfg) is None]
    # --quick: every run in one subprocess; else each in its own, fresh, under the budget
    done = ({(r["case"], r["N"]): r for r in in_subprocess(cfg, todo, 240)}
            if args.quick else {})
    for c, n in plan:
        why = guard(c, n, cfg)
        row = ({"case": c, "N": n, "skipped": why} if why else done.get((c, n)) or
               in_subprocess(cfg, [f"{c}:{n}"], cfg["budget_s"] + 60)[0])
        rows.append(row)
        print(fmt_row(row), flush=True)
    failed = [r for r in rows if (r.get("skipped") or "").startswith(("exit", "no result"))]
    if args.quick and failed:  # the smoke test is there to catch a path that broke
        raise RuntimeError(f"{len(failed)} rows failed: {failed[0]['skipped']}")
    results = {"config": cfg, "reference": REFERENCE, "rows": rows}
    _results.save("declared", results, args.json, quick=args.quick)
    return results


if __name__ == "__main__":
    main()
