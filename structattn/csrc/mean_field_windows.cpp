// The mean-field geometric–Beta iteration of expanding attention, one child at a time.
//
// Children are independent given the scores (each has its own q_i), so each CPU thread
// takes a run of children and iterates each to its own fixed point, scoring its parents
// lazily as its window grows: work Σ_i W_i·(k + iterations_i), one call, no per-step
// tensors. The equations are those of structattn/windows/ (scheme.py, rules.py), step
// for step, so the two agree to rounding; the Python loop is the reference and the path
// on other devices.
//
//   solve:  (a (G, N, k), b (G, P, k), a0, b0 (G,), win0 (G, N), caps (P,)) → (child row q
//           is position offset + q = P − N + q: the children may be the last N of P tokens)
//           final windows, α, β, E[φ], steps, whether it settled and the certified bound on
//           its posterior mass beyond its window (high, slack (G, N): each child's score
//           ceiling and rounding slack, ceilings.score_ceiling), per child (and, when
//           recording, the per-step history (max_iters, G, N) of each child's window, α, β,
//           E[φ]).
//           Without high and slack it computes them, tighter: the slack as
//           ceilings.score_ceiling's, the unseen parents' ceiling from the longest key
//           farther back than the window (windows.scores.BandScores.tail_ceiling's formula).
//   attend: out_i = Σ_{d ≤ W_i} softmax_d(ψ_{i,i−d} + d·e_i) u_{i−d}   (G, N, dv), with
//           e_i = E[ln q_i] under each child's Beta(α_i, β_i) at its fixed point.
//   infer:  solve, then attend — the no-grad reading in one call (one node of a recorded
//           plan where the ceiling and the Beta bookkeeping were twenty): the output alone
//           (each tensor handed back to Python costs ~0.4 µs; a posterior solves again).
//           check: refuse keys b holding NaN or ±inf (a RuntimeError) — b = x W_kᵀ for every
//           token, so a plan that checks x only to protect this call can drop that check.
//   band_forward / band_backward: the output at the fixed point with its gradient (grad="last"),
//           out_i = Σ_{1 ≤ d ≤ W_i} softmax_d(scale·⟨a_i, b_{i−d}⟩ + d·e_i) u_{i−d}, with e_i
//           given (E[ln q_i], differentiable in Python): da, db, du and de. Tiles of CBQ
//           children × CBK parents, each block's parents from its first window start; a tile's
//           scores from one matrix product; the forward an online softmax, the blocks the
//           unit of parallel work whatever the number of rows; the backward one pass per
//           block (db and du by rows, or into one buffer per thread where rows are few).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/native/Math.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "tiles.h"

namespace {

using structattn::online_softmax_row;
using structattn::vexp;

enum Rule : int64_t { kPredictive = 0, kEdge = 1, kEvidence = 2, kCertified = 3 };

template <typename T>
T log_beta(T x, T y) {
  return std::lgamma(x) + std::lgamma(y) - std::lgamma(x + y);
}

// E[ln q] under Beta(α, β): digamma, or ln E[q] plugged in.
template <typename T>
T e_ln_q(T alpha, T beta, bool digamma) {
  if (digamma) return calc_digamma(alpha) - calc_digamma(alpha + beta);
  return std::log(alpha) - std::log(alpha + beta);
}

// P(φ > W) under Beta(α, β): the predictive (digamma) or the plug-in geometric.
template <typename T>
T tail(T alpha, T beta, int64_t w, bool digamma) {
  T wt = static_cast<T>(w);
  if (digamma) return std::exp(log_beta(alpha + wt, beta) - log_beta(alpha, beta));
  return std::pow(alpha / (alpha + beta), wt);
}

// Smallest W in [1, cap] with P(φ > W) < tol (windows.beta_quantile / plug_in_quantile).
template <typename T>
int64_t quantile(T alpha, T beta, T tol, int64_t cap, bool digamma) {
  if (digamma) {
    const T log_tol = std::log(tol);
    const T base = log_beta(alpha, beta);
    int64_t lo = 0, hi = cap, bits = 0;
    for (int64_t c = cap; c > 0; c >>= 1) ++bits;
    for (int64_t it = 0; it < bits + 1; ++it) {
      int64_t mid = (lo + hi) / 2;  // lo, hi ≥ 0: floor division as in Python
      bool below = (log_beta(alpha + static_cast<T>(mid), beta) - base) < log_tol;
      if (below) hi = mid; else lo = mid;
    }
    return std::max<int64_t>(hi, 1);
  }
  T log_q = std::log(alpha / (alpha + beta));
  T w = std::floor(std::log(tol) / log_q) + T(1);
  if (!(w >= T(1))) w = T(1);  // (NaN-safe)
  if (w > static_cast<T>(cap)) w = static_cast<T>(cap);
  return static_cast<int64_t>(w);
}

template <typename T>
T dot(const T* x, const T* y, int64_t k) {
  T acc = 0;
#pragma omp simd reduction(+ : acc)
  for (int64_t j = 0; j < k; ++j) acc += x[j] * y[j];
  return acc;
}

// Scores of child i against parents i − d for d in (have, want], into s[d − 1].
template <typename T>
void score_to(std::vector<T>& s, int64_t& have, int64_t want, const T* ai, const T* bg,
              int64_t i, int64_t k, T scale) {
  for (int64_t d = have + 1; d <= want; ++d) s[d - 1] = scale * dot(ai, bg + (i - d) * k, k);
  if (want > have) have = want;
}

// log Σ_{d ≤ W} exp(s_d + d·e) and E[φ] = Σ d·p_d under that softmax.
template <typename T>
void posterior_moments(const std::vector<T>& s, int64_t w, T e, T& log_z, T& mean) {
  const T* sp = s.data();
  T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t d = 1; d <= w; ++d) mx = std::max(mx, sp[d - 1] + static_cast<T>(d) * e);
  T z = 0, zd = 0;
#pragma omp simd reduction(+ : z, zd)
  for (int64_t d = 1; d <= w; ++d) {
    const T p = std::exp(sp[d - 1] + static_cast<T>(d) * e - mx);
    z += p;
    zd += p * static_cast<T>(d);
  }
  log_z = mx + std::log(z);
  mean = zd / z;
}

// "edge": the evidence alone (softmax of ψ over the window) on its outer half d > W/2.
template <typename T>
T outer_evidence(const std::vector<T>& s, int64_t w) {
  const T* sp = s.data();
  T mx = -std::numeric_limits<T>::infinity();
#pragma omp simd reduction(max : mx)
  for (int64_t d = 1; d <= w; ++d) mx = std::max(mx, sp[d - 1]);
  T z = 0, outer = 0;
  const int64_t half = w / 2;
#pragma omp simd reduction(+ : z, outer)
  for (int64_t d = 1; d <= w; ++d) {
    const T p = std::exp(sp[d - 1] - mx);
    z += p;
    outer += d > half ? p : T(0);
  }
  return outer / z;
}

// "evidence": posterior mass beyond the window, the unseen parents W < d ≤ C given the
// typical likelihood log L̄ = μ + σ²/2 of the window's scores without its best match.
template <typename T>
T typical_score(const std::vector<T>& s, int64_t w) {
  int64_t top = 0;
  for (int64_t d = 1; d < w; ++d) if (s[d] > s[top]) top = d;
  T typical;
  const int64_t count = w - 1;
  if (count > 0) {
    T sum = 0;
    for (int64_t d = 0; d < w; ++d) if (d != top) sum += s[d];
    T mu = sum / static_cast<T>(count);
    T ss = 0;
    for (int64_t d = 0; d < w; ++d) if (d != top) ss += (s[d] - mu) * (s[d] - mu);
    T var = ss / static_cast<T>(std::max<int64_t>(count - 1, 1));
    typical = mu + var / T(2);
  } else {
    typical = s[top];
  }
  return typical;
}

template <typename T>
T beyond_mass(int64_t w, int64_t cap_i, T e, T log_in, T typical) {
  const int64_t unseen_n = std::max<int64_t>(cap_i - w, 0);
  if (unseen_n == 0) return T(0);
  const T wt = static_cast<T>(w), unseen = static_cast<T>(unseen_n);
  T log_out = (wt + T(1)) * e + std::log(-std::expm1(unseen * e)) - std::log(-std::expm1(e)) +
              typical;
  return T(1) / (T(1) + std::exp(log_in - log_out));
}

// Where solve_impl writes each child's fixed point (G·N entries each) and, when recording,
// its per-step history (max_iters·G·N; null otherwise).
template <typename T>
struct SolveOut {
  int64_t* win;
  T* alpha;
  T* beta;
  T* m;
  int64_t* steps;
  bool* settled;
  T* bound;
  int64_t* h_win = nullptr;
  T* h_alpha = nullptr;
  T* h_beta = nullptr;
  T* h_m = nullptr;
};

template <typename T>
void solve_impl(const at::Tensor& a, const at::Tensor& b, int64_t offset, double scale_d,
                const at::Tensor& a0,
                const at::Tensor& b0, const at::Tensor& win0, const at::Tensor& caps,
                double tol_d, double converge_tol_d, int64_t max_iters, int64_t cap,
                bool digamma, bool conjugate, int64_t rule, bool record,
                const T* High, const T* Slack, const SolveOut<T>& o) {
  const int64_t G = a.size(0), N = a.size(1), P = b.size(1), k = a.size(2);
  const T scale = static_cast<T>(scale_d), tol = static_cast<T>(tol_d);
  const T ctol = static_cast<T>(converge_tol_d);
  const T* A = a.data_ptr<T>();
  const T* B = b.data_ptr<T>();
  const T* A0 = a0.data_ptr<T>();
  const T* B0 = b0.data_ptr<T>();
  const int64_t* W0 = win0.data_ptr<int64_t>();
  const int64_t* C = caps.data_ptr<int64_t>();
  int64_t* Wout = o.win;
  T* Aout = o.alpha;
  T* Bout = o.beta;
  T* Mout = o.m;
  int64_t* Sout = o.steps;
  bool* Done = o.settled;
  // Without a given ceiling, in double (windows.scores.BandScores.ceiling's formula): the
  // rounding slack of the window's scores from the longest key of all, γ_k·S_i + 4·tiny with
  // S_i = |scale|·‖a_i‖·max_j ‖b_j‖ (γ_k = k·u/(1 − k·u), the error bound of a k-term dot
  // product in T), and the unseen parents' ceiling per window from the longest key farther
  // back than it, high = |scale|·‖a_i‖·max_{j ≤ i − W − 1} ‖b_j‖ + slack (a running max: a
  // long key nearby does not weigh on the tail)
  std::vector<double> b_run;  // (G, P): max_{j' ≤ j} ‖b_j'‖; its last entry the longest
  const double unit = static_cast<double>(std::numeric_limits<T>::epsilon()) / 2;
  const double gamma = static_cast<double>(k) * unit / (1 - static_cast<double>(k) * unit);
  const double tiny4 = 4 * static_cast<double>(std::numeric_limits<T>::min());
  if (High == nullptr) {
    b_run.assign(G * P, 0.0);
    for (int64_t g = 0; g < G; ++g) {
      double run = 0;
      for (int64_t j = 0; j < P; ++j) {
        const T* bj = B + (g * P + j) * k;
        double ss = 0;
        for (int64_t l = 0; l < k; ++l) ss += static_cast<double>(bj[l]) * bj[l];
        run = std::max(run, std::sqrt(ss));
        b_run[g * P + j] = run;
      }
    }
  }
  T* Bound = o.bound;
  int64_t* HW = record ? o.h_win : nullptr;
  T* HA = record ? o.h_alpha : nullptr;
  T* HB = record ? o.h_beta : nullptr;
  T* HM = record ? o.h_m : nullptr;
  const int64_t stride = G * N;  // one history step

  at::parallel_for(0, G * N, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> s(std::max<int64_t>(cap, 1));
    for (int64_t c = begin; c < end; ++c) {
      const int64_t g = c / N, i = offset + c % N;  // child row c sits at position i
      const T pa = A0[g], pb = B0[g];
      int64_t w = W0[c];
      T alpha = pa, beta = pb, m = 0;
      int64_t steps = 0;
      bool done = true;  // no past: nothing to iterate
      T bound = 0;  // no past: nothing left out
      if (w >= 1) {
        const int64_t cap_i = C[i];
        const T* ai = A + c * k;
        const T* bg = B + g * P * k;
        T high_c = 0, slack_c = 0;
        double a_norm = 0, sl = 0;
        if (High != nullptr) {
          high_c = High[c], slack_c = Slack[c];
        } else {
          double ss = 0;
          for (int64_t l = 0; l < k; ++l) ss += static_cast<double>(ai[l]) * ai[l];
          a_norm = std::sqrt(ss);
          sl = a_norm * std::abs(scale_d) * b_run[g * P + P - 1] * gamma + tiny4;
          slack_c = static_cast<T>(sl);
        }
        // the ceiling of the parents beyond window w (none given: the running max's)
        auto ceiling_at = [&](int64_t width) {
          if (High != nullptr) return;
          const int64_t far = std::min(std::max<int64_t>(i - width - 1, 0), P - 1);
          high_c = static_cast<T>(a_norm * std::abs(scale_d) * b_run[g * P + far] + sl);
        };
        int64_t have = 0, typical_w = 0;  // the window the typical score was taken over
        T typical = 0;
        T m_prev = std::numeric_limits<T>::quiet_NaN();
        for (int64_t t = 0; t < max_iters; ++t) {
          score_to(s, have, w, ai, bg, i, k, scale);
          const T e = e_ln_q(alpha, beta, digamma);
          T log_z, mean;
          posterior_moments(s, w, e, log_z, mean);
          m = mean;
          // certified: every unseen parent of the whole past at its score ceiling beyond the
          // window, against the window's mass less the rounding slack
          ceiling_at(w);
          bound = beyond_mass(w, i, e, log_z - slack_c, high_c);
          const T new_alpha = (conjugate ? pa : alpha) + mean - T(1);
          const T new_beta = (conjugate ? pb : beta) + T(1);
          int64_t new_w = w;
          if (rule == kPredictive) {
            if (tail(new_alpha, new_beta, w, digamma) >= tol && w < cap_i)
              new_w = std::min(quantile(new_alpha, new_beta, tol, cap, digamma), cap_i);
          } else {
            T outer;
            if (rule == kEdge) {
              outer = outer_evidence(s, w);
            } else if (rule == kCertified) {
              outer = bound;
            } else {
              if (typical_w != w) typical = typical_score(s, w), typical_w = w;  // per window
              outer = beyond_mass(w, cap_i, e, log_z, typical);
            }
            if (outer > tol && w < cap_i) new_w = std::min(2 * w, cap_i);
          }
          // NaN m_prev: never settled at the first step
          const bool settled = std::abs(mean - m_prev) <= ctol * std::max(std::abs(mean), T(1)) &&
                               new_w == w;
          if (record) {
            HW[t * stride + c] = w;
            HA[t * stride + c] = alpha;
            HB[t * stride + c] = beta;
            HM[t * stride + c] = mean;
          }
          steps = t + 1;
          done = settled;
          if (settled || t + 1 == max_iters) break;  // its state stays that of this step
          alpha = new_alpha;
          beta = new_beta;
          w = new_w;
          m_prev = mean;
        }
      }
      Wout[c] = w;
      Aout[c] = alpha;
      Bout[c] = beta;
      Mout[c] = m;
      Sout[c] = steps;
      Done[c] = done;
      Bound[c] = bound;
    }
  });
}

void check_problem(const at::Tensor& a, const at::Tensor& b, int64_t offset,
                   const at::Tensor& a0, const at::Tensor& b0, const at::Tensor& win0,
                   const at::Tensor& caps) {
  TORCH_CHECK(a.device().is_cpu() && a.dim() == 3 && b.dim() == 3 && b.size(0) == a.size(0) &&
                  b.size(2) == a.size(2) && offset >= 0 && offset + a.size(1) == b.size(1) &&
                  caps.size(0) == b.size(1),
              "mean_field_windows.solve: a (G, N, k), b (G, offset + N, k), caps (offset + N,) "
              "on the CPU");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && a0.scalar_type() == a.scalar_type() &&
                  b0.scalar_type() == a.scalar_type(),
              "mean_field_windows.solve: a, b, a0, b0 must share one dtype");
  TORCH_CHECK(win0.scalar_type() == at::kLong && caps.scalar_type() == at::kLong,
              "mean_field_windows.solve: win0, caps must be int64");
  TORCH_CHECK(a0.numel() == a.size(0) && b0.numel() == a.size(0) &&
                  win0.numel() == a.size(0) * a.size(1),
              "mean_field_windows.solve: a0, b0 (G,), win0 (G, N)");
}

std::vector<at::Tensor> solve(const at::Tensor& a, const at::Tensor& b, int64_t offset,
                              double scale,
                              const at::Tensor& a0, const at::Tensor& b0,
                              const at::Tensor& win0, const at::Tensor& caps, double tol,
                              double converge_tol, int64_t max_iters, int64_t cap,
                              bool digamma, bool conjugate, int64_t rule, bool record,
                              const std::optional<at::Tensor>& high_in,
                              const std::optional<at::Tensor>& slack_in) {
  check_problem(a, b, offset, a0, b0, win0, caps);
  TORCH_CHECK(high_in.has_value() == slack_in.has_value(),
              "mean_field_windows.solve: give high and slack together, or neither");
  at::Tensor hc, sc;  // undefined: the kernel computes the ceiling
  if (high_in.has_value()) {
    TORCH_CHECK(high_in->scalar_type() == a.scalar_type() &&
                    slack_in->scalar_type() == a.scalar_type() &&
                    high_in->numel() == a.size(0) * a.size(1) &&
                    slack_in->numel() == high_in->numel(),
                "mean_field_windows.solve: high, slack (G, N) in a's dtype");
    hc = high_in->contiguous(), sc = slack_in->contiguous();
  }
  const int64_t G = a.size(0), N = a.size(1);
  auto ac = a.contiguous(), bc = b.contiguous(), a0c = a0.contiguous(), b0c = b0.contiguous();
  auto w0 = win0.contiguous(), cp = caps.contiguous();
  auto lopt = a.options().dtype(at::kLong);
  auto win_out = at::empty({G, N}, lopt), steps = at::empty({G, N}, lopt);
  auto settled = at::empty({G, N}, a.options().dtype(at::kBool));
  auto alpha = at::empty({G, N}, a.options()), beta = at::empty({G, N}, a.options());
  auto m = at::empty({G, N}, a.options()), bound = at::empty({G, N}, a.options());
  const int64_t R = record ? max_iters : 0;
  auto h_win = at::empty({R, G, N}, lopt);
  auto h_alpha = at::empty({R, G, N}, a.options()), h_beta = at::empty({R, G, N}, a.options());
  auto h_m = at::empty({R, G, N}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "mean_field_windows.solve", [&] {
    solve_impl<scalar_t>(ac, bc, offset, scale, a0c, b0c, w0, cp, tol, converge_tol, max_iters, cap,
                         digamma, conjugate, rule, record,
                         hc.defined() ? hc.data_ptr<scalar_t>() : nullptr,
                         sc.defined() ? sc.data_ptr<scalar_t>() : nullptr,
                         SolveOut<scalar_t>{win_out.data_ptr<int64_t>(), alpha.data_ptr<scalar_t>(),
                                            beta.data_ptr<scalar_t>(), m.data_ptr<scalar_t>(),
                                            steps.data_ptr<int64_t>(), settled.data_ptr<bool>(),
                                            bound.data_ptr<scalar_t>(), h_win.data_ptr<int64_t>(),
                                            h_alpha.data_ptr<scalar_t>(), h_beta.data_ptr<scalar_t>(),
                                            h_m.data_ptr<scalar_t>()});
  });
  return {win_out, alpha, beta, m, steps, settled, bound, h_win, h_alpha, h_beta, h_m};
}

template <typename T>
void attend_impl(const at::Tensor& a, const at::Tensor& b, const at::Tensor& u, int64_t offset,
                 double scale_d, const at::Tensor& win, const at::Tensor& alpha,
                 const at::Tensor& beta, bool digamma, at::Tensor& out) {
  const int64_t G = a.size(0), N = a.size(1), P = b.size(1), k = a.size(2), dv = u.size(2);
  const T scale = static_cast<T>(scale_d);
  const T* A = a.data_ptr<T>();
  const T* B = b.data_ptr<T>();
  const T* U = u.data_ptr<T>();
  const int64_t* W = win.data_ptr<int64_t>();
  const T* Al = alpha.data_ptr<T>();
  const T* Be = beta.data_ptr<T>();
  T* O = out.data_ptr<T>();
  at::parallel_for(0, G * N, 16, [&](int64_t begin, int64_t end) {
    std::vector<T> p;
    for (int64_t c = begin; c < end; ++c) {
      const int64_t g = c / N, i = offset + c % N, w = W[c];
      T* o = O + c * dv;
      for (int64_t j = 0; j < dv; ++j) o[j] = 0;
      if (w < 1) continue;  // no past: zero output
      p.resize(w);
      const T* ai = A + c * k;
      const T ei = e_ln_q(Al[c], Be[c], digamma);  // E[ln q_i] at the fixed point
      T mx = -std::numeric_limits<T>::infinity();
      for (int64_t d = 1; d <= w; ++d) {
        p[d - 1] = scale * dot(ai, B + (g * P + i - d) * k, k) + static_cast<T>(d) * ei;
        mx = std::max(mx, p[d - 1]);
      }
      T z = 0;
      T* pp = p.data();
#pragma omp simd reduction(+ : z)
      for (int64_t d = 0; d < w; ++d) z += (pp[d] = std::exp(pp[d] - mx));
      const T inv = T(1) / z;
      for (int64_t d = 1; d <= w; ++d) {
        const T pd = p[d - 1] * inv;
        const T* ud = U + (g * P + i - d) * dv;
#pragma omp simd
        for (int64_t j = 0; j < dv; ++j) o[j] += pd * ud[j];
      }
    }
  });
}

at::Tensor attend(const at::Tensor& a, const at::Tensor& b, const at::Tensor& u, int64_t offset,
                  double scale, const at::Tensor& win, const at::Tensor& alpha,
                  const at::Tensor& beta, bool digamma) {
  TORCH_CHECK(a.device().is_cpu() && a.dim() == 3 && b.dim() == 3 && b.size(0) == a.size(0) &&
                  b.size(2) == a.size(2) && offset >= 0 && offset + a.size(1) == b.size(1) &&
                  u.dim() == 3 && u.size(0) == a.size(0) && u.size(1) == b.size(1),
              "mean_field_windows.attend: a (G, N, k), b (G, offset + N, k), u (G, offset + N, "
              "dv) on the CPU");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && u.scalar_type() == a.scalar_type() &&
                  alpha.scalar_type() == a.scalar_type() && beta.scalar_type() == a.scalar_type() &&
                  win.scalar_type() == at::kLong &&
                  alpha.numel() == a.size(0) * a.size(1) && beta.numel() == alpha.numel() &&
                  win.numel() == alpha.numel(),
              "mean_field_windows.attend: a, b, u, alpha, beta must share one dtype; win int64; "
              "win, alpha, beta (G, N)");
  auto ac = a.contiguous(), bc = b.contiguous(), uc = u.contiguous();
  auto wc = win.contiguous(), alc = alpha.contiguous(), bec = beta.contiguous();
  auto out = at::empty({a.size(0), a.size(1), u.size(2)}, a.options());
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "mean_field_windows.attend", [&] {
    attend_impl<scalar_t>(ac, bc, uc, offset, scale, wc, alc, bec, digamma, out);
  });
  return out;
}

// Whether every entry is finite: Σ x·0 is 0, or NaN at a NaN or ±inf (no overflow).
template <typename T>
bool all_finite(const T* x, int64_t n) {
  T total = 0;
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) total += x[j] * T(0);
  return std::isfinite(total);
}

// The no-grad reading in one call: solve (its ceiling computed here), then attend at each
// child's fixed point. Returns attend's output and the fixed point's window, α and β.
at::Tensor infer(const at::Tensor& a, const at::Tensor& b, const at::Tensor& u,
                 int64_t offset, double scale, const at::Tensor& a0, const at::Tensor& b0,
                 const at::Tensor& win0, const at::Tensor& caps, double tol,
                 double converge_tol, int64_t max_iters, int64_t cap, bool digamma,
                 bool conjugate, int64_t rule, bool check) {
  // solve's work without its other outputs as tensors: each allocation and each tensor
  // handed back to Python costs about what the whole iteration does for one token
  check_problem(a, b, offset, a0, b0, win0, caps);
  const int64_t G = a.size(0), N = a.size(1);
  auto ac = a.contiguous(), bc = b.contiguous(), a0c = a0.contiguous(), b0c = b0.contiguous();
  if (check) {
    bool finite = true;
    AT_DISPATCH_FLOATING_TYPES(b.scalar_type(), "mean_field_windows.infer.check", [&] {
      finite = all_finite(bc.data_ptr<scalar_t>(), bc.numel());
    });
    TORCH_CHECK(finite, "mean_field_windows.infer: the keys b hold NaN or inf");
  }
  auto w0 = win0.contiguous(), cp = caps.contiguous();
  auto win = at::empty({G, N}, a.options().dtype(at::kLong));
  auto alpha = at::empty({G, N}, a.options()), beta = at::empty({G, N}, a.options());
  std::vector<int64_t> steps(G * N);
  std::unique_ptr<bool[]> settled(new bool[G * N]);
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "mean_field_windows.infer", [&] {
    std::vector<scalar_t> m(G * N), bound(G * N);
    solve_impl<scalar_t>(ac, bc, offset, scale, a0c, b0c, w0, cp, tol, converge_tol, max_iters,
                         cap, digamma, conjugate, rule, false, nullptr, nullptr,
                         SolveOut<scalar_t>{win.data_ptr<int64_t>(), alpha.data_ptr<scalar_t>(),
                                            beta.data_ptr<scalar_t>(), m.data(), steps.data(),
                                            settled.get(), bound.data()});
  });
  return attend(ac, bc, u, offset, scale, win, alpha, beta, digamma);
}


// ---- the band per child (band_forward, band_backward) ------------------------------------

constexpr int64_t CBQ = 64;   // children per block
constexpr int64_t CBK = 256;  // parents per tile

// Row i's parents in the tile [j0, j0 + m): columns [lo, hi) with i − w ≤ j ≤ i − 1.
inline void band_columns(int64_t i, int64_t w, int64_t j0, int64_t m, int64_t& lo,
                         int64_t& hi) {
  if (w < 1) {
    lo = hi = 0;
    return;
  }
  lo = std::min(m, std::max<int64_t>(0, i - w - j0));
  hi = std::max(lo, std::min(m, i - j0));
}

// The parents a block of children reads, [first, limit) (first ≥ limit: none).
inline void block_span(int64_t i0, int64_t n, const int64_t* W, int64_t& first,
                       int64_t& limit) {
  first = std::numeric_limits<int64_t>::max();
  limit = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (W[r] < 1) continue;
    first = std::min(first, i0 + r - W[r]);
    limit = std::max(limit, i0 + r);
  }
  first = std::max<int64_t>(first, 0);
}

// One tile of the forward: S (n, m) holds ⟨a_i, b_j⟩ and becomes e^{s_ij − top_i}, s_ij =
// sc·S + (i − j)·e_i on the child's band (0 off it); each child's running max, sum and output
// row A (n, dv) are rescaled to the new max (the caller adds the product P U).
template <typename T>
void child_tile(T* S, int64_t n, int64_t m, int64_t i0, int64_t j0, const int64_t* W,
                const T* E, T sc, T* top, T* total, T* A, int64_t dv) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = i0 + r;
    int64_t lo, hi;
    band_columns(i, W[r], j0, m, lo, hi);
    T* sr = S + r * m;
    const T er = E[r];
    const T base = static_cast<T>(i - j0);  // the distance at column 0
    T best = top[r];
    for (int64_t c = lo; c < hi; ++c) {
      sr[c] = sc * sr[c] + (base - static_cast<T>(c)) * er;
      best = std::max(best, sr[c]);
    }
    online_softmax_row<T>(sr, lo, hi, m, best, top[r], total[r], A + r * dv, dv);
  }
}

// One tile of the backward: S (n, m) holds ⟨a_i, b_j⟩ and becomes P_ij; GP (n, m) holds
// ⟨dout_i, u_j⟩ and becomes dS_ij = P_ij (GP_ij − D_i) (both 0 off the band); with dE,
// dE[r] += Σ_j dS_ij (i − j).
template <typename T>
void child_grad_tile(T* S, T* GP, int64_t n, int64_t m, int64_t i0, int64_t j0,
                     const int64_t* W, const T* E, const T* L, const T* D, T sc, T* dE) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = i0 + r;
    int64_t lo, hi;
    band_columns(i, W[r], j0, m, lo, hi);
    T* sr = S + r * m;
    T* gr = GP + r * m;
    const T er = E[r], lr = L[r], dr = D[r];
    const T base = static_cast<T>(i - j0);
    std::fill(sr, sr + lo, T(0));
    std::fill(gr, gr + lo, T(0));
    T de = 0;
#pragma omp simd reduction(+ : de)
    for (int64_t c = lo; c < hi; ++c) {
      const T d = base - static_cast<T>(c);
      const T p = vexp<T>(sc * sr[c] + d * er - lr);
      const T ds = p * (gr[c] - dr);
      sr[c] = p;
      gr[c] = ds;
      de += ds * d;
    }
    std::fill(sr + hi, sr + m, T(0));
    std::fill(gr + hi, gr + m, T(0));
    if (dE != nullptr) dE[r] += de;
  }
}

void check_band(const at::Tensor& a, const at::Tensor& b, const at::Tensor& u,
                const at::Tensor& e, const at::Tensor& window, int64_t offset) {
  TORCH_CHECK(a.device().is_cpu() && a.dim() == 3 && b.dim() == 3 && u.dim() == 3 &&
                  b.size(0) == a.size(0) && u.size(0) == a.size(0) && b.size(2) == a.size(2) &&
                  u.size(1) == b.size(1) && offset >= 0 && offset + a.size(1) == b.size(1),
              "mean_field_windows.band: a (G, N, k), b (G, offset + N, k), u (G, offset + N, "
              "dv) on the CPU");
  TORCH_CHECK(e.dim() == 2 && e.size(0) == a.size(0) && e.size(1) == a.size(1) &&
                  window.sizes() == e.sizes() && window.scalar_type() == at::kLong,
              "mean_field_windows.band: e (G, N), window (G, N) int64");
  TORCH_CHECK((a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble) &&
                  b.scalar_type() == a.scalar_type() && u.scalar_type() == a.scalar_type() &&
                  e.scalar_type() == a.scalar_type(),
              "mean_field_windows.band: a, b, u, e share one dtype, float32 or float64");
}

std::tuple<at::Tensor, at::Tensor> band_forward(const at::Tensor& a_in, const at::Tensor& b_in,
                                                const at::Tensor& u_in, const at::Tensor& e_in,
                                                const at::Tensor& window, int64_t offset,
                                                double scale) {
  at::AutoDispatchBelowADInplaceOrView below;  // its autograd rule is registered (Python)
  check_band(a_in, b_in, u_in, e_in, window, offset);
  const auto a = a_in.detach().contiguous(), b = b_in.detach().contiguous();
  const auto u = u_in.detach().contiguous(), e = e_in.detach().contiguous();
  const auto win = window.contiguous();
  const int64_t G = a.size(0), N = a.size(1), dv = u.size(2);
  auto out = at::zeros({G, N, dv}, a.options());
  auto lse = at::zeros({G, N}, a.options());
  const int64_t nb = (N + CBQ - 1) / CBQ;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "mean_field_windows.band_forward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    const T inf = std::numeric_limits<T>::infinity();
    const int64_t* Wall = win.data_ptr<int64_t>();
    const T* Eall = e.data_ptr<T>();
    at::parallel_for(0, G * nb, 1, [&](int64_t u0, int64_t u1) {
      auto s = at::empty({CBQ * CBK}, a.options()), acc = at::empty({CBQ, dv}, a.options());
      std::vector<T> top(CBQ), total(CBQ);
      for (int64_t unit = u0; unit < u1; ++unit) {
        const int64_t g = unit / nb, c0 = (unit % nb) * CBQ, n = std::min(CBQ, N - c0);
        const int64_t i0 = offset + c0;
        const int64_t* W = Wall + g * N + c0;
        int64_t first, limit;
        block_span(i0, n, W, first, limit);
        if (first >= limit) continue;  // no child with a past: zeros
        auto qb = a[g].narrow(0, c0, n), bg = b[g], ug = u[g];
        auto ab = acc.narrow(0, 0, n);
        ab.zero_();
        T* A = ab.data_ptr<T>();
        std::fill(top.begin(), top.begin() + n, -inf);
        std::fill(total.begin(), total.begin() + n, T(0));
        for (int64_t j0 = first; j0 < limit; j0 += CBK) {
          const int64_t m = std::min(CBK, limit - j0);
          auto st = s.narrow(0, 0, n * m).view({n, m});
          at::mm_out(st, qb, bg.narrow(0, j0, m).t());  // (n, m) ⟨a_i, b_j⟩
          child_tile<T>(st.data_ptr<T>(), n, m, i0, j0, W, Eall + g * N + c0, sc, top.data(),
                        total.data(), A, dv);
          ab.addmm_(st, ug.narrow(0, j0, m));  // += P U
        }
        T* L = lse.data_ptr<T>() + g * N + c0;
        for (int64_t r = 0; r < n; ++r) {
          if (W[r] < 1) {  // no past: a zero output
            std::fill(A + r * dv, A + (r + 1) * dv, T(0));
            continue;
          }
          const T inv = T(1) / total[r];
          for (int64_t x = 0; x < dv; ++x) A[r * dv + x] *= inv;
          L[r] = top[r] + std::log(total[r]);
        }
        out[g].narrow(0, c0, n).copy_(ab);
      }
    });
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> band_backward(
    const at::Tensor& dout_in, const at::Tensor& a_in, const at::Tensor& b_in,
    const at::Tensor& u_in, const at::Tensor& e_in, const at::Tensor& window,
    const at::Tensor& out_in, const at::Tensor& lse_in, int64_t offset, double scale) {
  at::AutoDispatchBelowADInplaceOrView below;
  check_band(a_in, b_in, u_in, e_in, window, offset);
  const auto a = a_in.detach().contiguous(), b = b_in.detach().contiguous();
  const auto u = u_in.detach().contiguous(), e = e_in.detach().contiguous();
  const auto dout = dout_in.detach().to(a.scalar_type()).contiguous();
  const auto lse = lse_in.detach().contiguous(), win = window.contiguous();
  const int64_t G = a.size(0), N = a.size(1), P = b.size(1), dv = u.size(2);
  TORCH_CHECK(dout.dim() == 3 && dout.size(0) == G && dout.size(1) == N && dout.size(2) == dv &&
                  lse.sizes() == e.sizes(),
              "mean_field_windows.band_backward: dout (G, N, dv), lse (G, N)");
  const auto D = (dout * out_in.detach().to(a.scalar_type())).sum(-1).contiguous();  // Δ_i
  auto da = at::zeros_like(a), db = at::zeros_like(b), du = at::zeros_like(u);
  auto de = at::zeros_like(e);
  const int64_t nb = (N + CBQ - 1) / CBQ;
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "mean_field_windows.band_backward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    const int64_t* Wall = win.data_ptr<int64_t>();
    const T* Eall = e.data_ptr<T>();
    const T* Lall = lse.data_ptr<T>();
    const T* Dall = D.data_ptr<T>();
    // one pass per block of children: da and de its own; db and du added for its parents —
    // by rows g where there are enough for every thread (no two threads on one row), else
    // into one buffer per thread, summed after (the rows are few: the buffers are small)
    const int64_t threads = at::get_num_threads();
    const bool by_row = G >= threads;
    std::vector<at::Tensor> db_t, du_t;
    if (!by_row) {
      for (int64_t t = 0; t < threads; ++t) {
        db_t.push_back(at::zeros_like(b));
        du_t.push_back(at::zeros_like(u));
      }
    }
    auto block = [&](int64_t g, int64_t k0, at::Tensor& dbg, at::Tensor& dug, at::Tensor& s,
                     at::Tensor& gp) {
      const int64_t c0 = k0 * CBQ, n = std::min(CBQ, N - c0), at_ = g * N + c0;
      int64_t first, limit;
      block_span(offset + c0, n, Wall + at_, first, limit);
      auto qb = a[g].narrow(0, c0, n), dob = dout[g].narrow(0, c0, n);
      auto dqb = da[g].narrow(0, c0, n);
      for (int64_t j0 = first; j0 < limit; j0 += CBK) {
        const int64_t m = std::min(CBK, limit - j0);
        auto st = s.narrow(0, 0, n * m).view({n, m}), gt = gp.narrow(0, 0, n * m).view({n, m});
        auto kc = b[g].narrow(0, j0, m);
        at::mm_out(st, qb, kc.t());                        // (n, m) ⟨a_i, b_j⟩
        at::mm_out(gt, dob, u[g].narrow(0, j0, m).t());    // (n, m) ⟨dout_i, u_j⟩
        child_grad_tile<T>(st.data_ptr<T>(), gt.data_ptr<T>(), n, m, offset + c0, j0,
                           Wall + at_, Eall + at_, Lall + at_, Dall + at_, sc,
                           de.data_ptr<T>() + at_);
        dqb.addmm_(gt, kc, 1, sc);                         // += scale dS B
        dbg.narrow(0, j0, m).addmm_(gt.t(), qb, 1, sc);   // += scale dSᵀ A
        dug.narrow(0, j0, m).addmm_(st.t(), dob);         // += Pᵀ dout
      }
    };
    if (by_row) {
      at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
        auto s = at::empty({CBQ * CBK}, a.options()), gp = at::empty({CBQ * CBK}, a.options());
        for (int64_t g = g0; g < g1; ++g) {
          auto dbg = db[g], dug = du[g];
          for (int64_t k0 = 0; k0 < nb; ++k0) block(g, k0, dbg, dug, s, gp);
        }
      });
    } else {
      at::parallel_for(0, G * nb, 1, [&](int64_t u0, int64_t u1) {
        const int64_t t = at::get_thread_num();
        auto s = at::empty({CBQ * CBK}, a.options()), gp = at::empty({CBQ * CBK}, a.options());
        for (int64_t unit = u0; unit < u1; ++unit) {
          const int64_t g = unit / nb;
          auto dbg = db_t[t][g], dug = du_t[t][g];
          block(g, unit % nb, dbg, dug, s, gp);
        }
      });
      for (int64_t t = 0; t < threads; ++t) {
        db.add_(db_t[t]);
        du.add_(du_t[t]);
      }
    }
  });
  return {da, db, du, de};
}
}  // namespace

TORCH_LIBRARY(structattn_mean_field, m) {
  m.def("solve(Tensor a, Tensor b, int offset, float scale, Tensor a0, Tensor b0, Tensor win0, "
        "Tensor caps, float tol, float converge_tol, int max_iters, int cap, bool digamma, "
        "bool conjugate, int rule, bool record, Tensor? high=None, Tensor? slack=None) -> Tensor[]",
        &solve);
  m.def("attend(Tensor a, Tensor b, Tensor u, int offset, float scale, Tensor win, "
        "Tensor alpha, Tensor beta, bool digamma) -> Tensor");
  m.def("infer(Tensor a, Tensor b, Tensor u, int offset, float scale, Tensor a0, Tensor b0, "
        "Tensor win0, Tensor caps, float tol, float converge_tol, int max_iters, int cap, "
        "bool digamma, bool conjugate, int rule, bool check=False) -> Tensor");
  m.def("band_forward(Tensor a, Tensor b, Tensor u, Tensor e, Tensor window, int offset, "
        "float scale) -> (Tensor, Tensor)");
  m.def("band_backward(Tensor dout, Tensor a, Tensor b, Tensor u, Tensor e, Tensor window, "
        "Tensor out, Tensor lse, int offset, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
}

// attend and infer are CPU kernels (not composite) so that their Python fake kernels
// (windows/kernel.py) let a plan be traced on fake tensors
TORCH_LIBRARY_IMPL(structattn_mean_field, CPU, m) {
  m.impl("attend", &attend);
  m.impl("infer", &infer);
  m.impl("band_forward", &band_forward);
  m.impl("band_backward", &band_backward);
}
