// Attention under a stationary log prior, a function of the distance d = i − j alone, read
// from its table inside each tile of scores, on the CPU, forward and backward, with the
// gradient of the table:
//
//     out_i = sum_j P_ij v_j,   P_ij = exp(scale <q_i, k_j> + t[i − j + shift] − lse_i)
//                               over the parents j with lo ≤ i − j ≤ hi (0 ≤ j < P),
//
// t (H, T) one row per head (or one row shared by every head). The backward is
// FlashAttention's with the table's gradient summed per distance in the same pass:
//
//     dV_j = sum_i P_ij dO_i,   dP_ij = <dO_i, v_j>,   dS_ij = P_ij (dP_ij − D_i),
//     D_i = <dO_i, out_i>,      dQ_i = scale sum_j dS_ij k_j,   dK_j = scale sum_i dS_ij q_i,
//     dt[d + shift] = sum_{i − j = d} dS_ij.
//
// A child with no parent (every j outside [i − hi, i − lo], or every weight −inf) gets a zero
// output and lse −inf. Tiles: per row g (a batch element and head) the children in blocks of
// BQ and, for each, the parents in blocks of BK over the block's band of distances only; a
// tile's scores come from one matrix product (never more than BQ x BK at once). The table is
// read reversed, r[T − 1 − x] = t[x], so that along a tile's row (j ascending) the bias is
// read ascending: r[T − 1 − shift − i + j]. Memory: O((C + P) d + H T).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <type_traits>
#include <vector>

#include "tiles.h"

namespace {

using structattn::online_softmax_row;
using structattn::vexp;

constexpr int64_t BQ = 128;
constexpr int64_t BK = 512;
// the backward's tiles: two of them live per thread
constexpr int64_t BQ_B = 64;
constexpr int64_t BK_B = 256;

// What both passes need to know of the problem: the sizes and the band of distances.
struct Band {
  int64_t B, NH, C, P, d, dv, T, shift, lo, hi;

  // The parents child i reads in a tile starting at j0 of m: columns [start, stop).
  void columns(int64_t i, int64_t j0, int64_t m, int64_t& start, int64_t& stop) const {
    stop = std::clamp<int64_t>(i - lo - j0 + 1, 0, m);
    start = std::clamp<int64_t>(i - hi - j0, 0, stop);
  }
  // The parents a block of children i0 .. i0 + n − 1 reads: [first, limit).
  void parents(int64_t i0, int64_t n, int64_t& first, int64_t& limit) const {
    first = std::clamp<int64_t>(i0 - hi, 0, P);
    limit = std::clamp<int64_t>(i0 + n - 1 - lo + 1, first, P);
  }
};

// Checks the shapes and the band, and that every distance read lies in the table.
Band check(const char* what, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& t, int64_t shift, int64_t lo, int64_t hi) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && t.dim() == 2, what,
              ": q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), table (H or 1, T)");
  Band s{q.size(0), q.size(1), q.size(2), k.size(2), q.size(3), v.size(3), t.size(1), shift,
         lo, hi};
  TORCH_CHECK(k.size(0) == s.B && k.size(1) == s.NH && v.size(0) == s.B && v.size(1) == s.NH &&
                  k.size(3) == s.d && v.size(2) == s.P &&
                  (t.size(0) == 1 || t.size(0) == s.NH),
              what, ": shapes");
  TORCH_CHECK(q.device().is_cpu(), what, ": CPU tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, what, ": float32 or float64");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, what,
              ": q, k, v share one dtype");
  // the distances read: max(lo, −(P − 1)) … min(hi, C − 1), where any pair is read
  const int64_t dmin = std::max<int64_t>(lo, 1 - s.P), dmax = std::min<int64_t>(hi, s.C - 1);
  TORCH_CHECK(dmin > dmax || (dmin + shift >= 0 && dmax + shift < s.T), what,
              ": the table holds the distances ", -shift, " … ", s.T - 1 - shift,
              " but the band reads ", dmin, " … ", dmax);
  return s;
}

// The Fortran BLAS that PyTorch's CPU build carries (MKL on x86, OpenBLAS elsewhere), weak:
// where a build has none, ATen's mm serves (the same product, a tensor made per call).
extern "C" {
void sgemm_(const char*, const char*, const int*, const int*, const int*, const float*,
            const float*, const int*, const float*, const int*, const float*, float*,
            const int*) __attribute__((weak));
void dgemm_(const char*, const char*, const int*, const int*, const int*, const double*,
            const double*, const int*, const double*, const int*, const double*, double*,
            const int*) __attribute__((weak));
}

// Row-major C (n, m) = alpha op(A) op(B) + beta C, op(A) (n, k), op(B) (k, m): A stored (n, k)
// or, ``ta``, (k, n), with row stride lda; B stored (k, m) or, ``tb``, (m, k), row stride ldb;
// C's row stride ldc. One tile's product without a tensor made per call (at tiles of 64 x 256,
// ATen's mm_out and its views cost a quarter of the forward). BLAS is column-major, where a
// row-major matrix reads as its transpose: C^T = op(B)^T op(A)^T.
template <typename T>
void gemm(bool ta, bool tb, int64_t n, int64_t m, int64_t k, T alpha, const T* A, int64_t lda,
          const T* B, int64_t ldb, T beta, T* C, int64_t ldc) {
  const char fa = ta ? 'T' : 'N', fb = tb ? 'T' : 'N';
  const int M = m, N = n, K = k, la = lda, lb = ldb, lc = ldc;
  if constexpr (std::is_same_v<T, float>) {
    if (sgemm_) return sgemm_(&fb, &fa, &M, &N, &K, &alpha, B, &lb, A, &la, &beta, C, &lc);
  } else {
    if (dgemm_) return dgemm_(&fb, &fa, &M, &N, &K, &alpha, B, &lb, A, &la, &beta, C, &lc);
  }
  const auto opts = at::TensorOptions().dtype(c10::CppTypeToScalarType<T>::value);
  auto a = ta ? at::from_blob(const_cast<T*>(A), {k, n}, {lda, 1}, opts).t()
              : at::from_blob(const_cast<T*>(A), {n, k}, {lda, 1}, opts);
  auto b = tb ? at::from_blob(const_cast<T*>(B), {m, k}, {ldb, 1}, opts).t()
              : at::from_blob(const_cast<T*>(B), {k, m}, {ldb, 1}, opts);
  auto c = at::from_blob(C, {n, m}, {ldc, 1}, opts);
  c.mul_(beta).addmm_(a, b, 1, alpha);
}

// A factor read in place by BLAS, its last dim contiguous (a copy only where it is not).
at::Tensor rows(const at::Tensor& x) {
  const auto y = x.detach();
  return y.stride(-1) == 1 ? y : y.contiguous();
}

// The table reversed and in the factors' dtype: (H or 1, T), row h at r + h·T.
at::Tensor reversed(const at::Tensor& t, at::ScalarType dtype) {
  return t.detach().to(dtype).flip({1}).contiguous();
}

// One tile of the forward, children i0 .. i0 + n − 1 and parents j0 .. j0 + m − 1: S (n, m)
// holds <q_i, k_j> and becomes the tile's e^{s_ij − top_i} (0 off the band); each child's
// running max ``top``, sum ``total`` and output row A (n, dv) are rescaled to the new max.
template <typename T>
void forward_tile(T* S, int64_t n, int64_t m, int64_t i0, int64_t j0, const Band& s, T sc,
                  const T* R, T* top, T* total, T* A) {
  const T inf = std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = i0 + r;
    int64_t start, stop;
    s.columns(i, j0, m, start, stop);
    T* sr = S + r * m;
    const T* bias = R + (s.T - 1 - s.shift - i + j0);  // bias[c]: t[i − (j0 + c) + shift]
    T best = top[r];
    T here = -inf;
    int nan = 0;  // the maximum's reduction drops a NaN: it is carried on by hand
#pragma omp simd reduction(max : here) reduction(| : nan)
    for (int64_t c = start; c < stop; ++c) {
      const T x = sc * sr[c] + bias[c];
      sr[c] = x;
      here = std::max(here, x);
      nan |= (x != x);
    }
    best = nan ? std::numeric_limits<T>::quiet_NaN() : std::max(best, here);
    online_softmax_row<T>(sr, start, stop, m, best, top[r], total[r], A + r * s.dv, s.dv);
  }
}

// A block's rows done: A (n, dv) divided by each child's sum, L[r] = log Σ_j e^{s_ij}; a
// child with no parent (its sum 0): a zero row and −inf; a NaN sum stays NaN.
template <typename T>
void finish(T* A, int64_t n, int64_t dv, const T* top, const T* total, T* L) {
  for (int64_t r = 0; r < n; ++r) {
    T* ar = A + r * dv;
    const bool none = total[r] == T(0);
    const T inv = none ? T(0) : T(1) / total[r];
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) ar[e] *= inv;
    L[r] = none ? -std::numeric_limits<T>::infinity() : top[r] + std::log(total[r]);
  }
}

// q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), table (H or 1, T). Returns out (B, H, C, dv)
// and lse (B, H, C).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_a, const at::Tensor& k_a,
                                           const at::Tensor& v_a, const at::Tensor& t_a,
                                           int64_t shift, int64_t lo, int64_t hi, double scale) {
  at::AutoDispatchBelowADInplaceOrView below;  // its autograd rule is registered (Python)
  const auto q = rows(q_a), k = rows(k_a), v = rows(v_a);
  const Band s = check("distance_table.forward", q, k, v, t_a, shift, lo, hi);
  const auto R = reversed(t_a, q.scalar_type());
  auto out = at::empty({s.B, s.NH, s.C, s.dv}, q.options());
  auto lse = at::empty({s.B, s.NH, s.C}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "distance_table.forward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    const T inf = std::numeric_limits<T>::infinity();
    // each row's factors read in place, rows of their own stride (a projection's heads are
    // a transposed view, (B, N, H, d) in memory); the last dim contiguous (Python's)
    const T* Q = q.data_ptr<T>();
    const T* K = k.data_ptr<T>();
    const T* V = v.data_ptr<T>();
    T* O = out.data_ptr<T>();
    // the unit of parallel work: one block of one row's children (its output rows are its own)
    const int64_t nb = (s.C + BQ - 1) / BQ;
    at::parallel_for(0, s.B * s.NH * nb, 1, [&](int64_t w0, int64_t w1) {
      std::vector<T> sbuf(BQ * BK), acc(BQ * s.dv), top(BQ), total(BQ);
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t g = w / nb, i0 = (w % nb) * BQ, n = std::min(BQ, s.C - i0);
        const int64_t b = g / s.NH, hh = g % s.NH;
        const int64_t qn = q.stride(2), kn = k.stride(2), vn = v.stride(2);
        const T* Qb = Q + b * q.stride(0) + hh * q.stride(1) + i0 * qn;
        const T* Kg = K + b * k.stride(0) + hh * k.stride(1);
        const T* Vg = V + b * v.stride(0) + hh * v.stride(1);
        const T* Rh = R.data_ptr<T>() + (R.size(0) == 1 ? 0 : hh) * s.T;
        T* A = acc.data();
        std::fill(acc.begin(), acc.begin() + n * s.dv, T(0));
        std::fill(top.begin(), top.begin() + n, -inf);
        std::fill(total.begin(), total.begin() + n, T(0));
        int64_t first, limit;
        s.parents(i0, n, first, limit);
        for (int64_t j0 = first; j0 < limit; j0 += BK) {
          const int64_t m = std::min(BK, limit - j0);
          T* S = sbuf.data();
          gemm<T>(false, true, n, m, s.d, T(1), Qb, qn, Kg + j0 * kn, kn, T(0), S, m);  // Q K^T
          forward_tile<T>(S, n, m, i0, j0, s, sc, Rh, top.data(), total.data(), A);
          gemm<T>(false, false, n, s.dv, m, T(1), S, m, Vg + j0 * vn, vn, T(1), A, s.dv);  // += P V
        }
        finish<T>(A, n, s.dv, top.data(), total.data(), lse.data_ptr<T>() + g * s.C + i0);
        std::copy(A, A + n * s.dv, O + (g * s.C + i0) * s.dv);
      }
    });
  });
  return {out, lse};
}

// <x, y> over n entries.
template <typename T>
T dot(const T* x, const T* y, int64_t n) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t e = 0; e < n; ++e) sum += x[e] * y[e];
  return sum;
}

// One tile of the backward: S (n, m) holds <q_i, k_j> and becomes P_ij, GP (n, m) holds
// <dO_i, v_j> and becomes dS_ij (both 0 off the band); dR[r(i, j)] += dS_ij, the table's
// gradient along the same reversed index as the bias.
template <typename T>
void backward_tile(T* S, T* GP, int64_t n, int64_t m, int64_t i0, int64_t j0, const Band& s,
                   T sc, const T* R, const T* L, const T* D, T* dR) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = i0 + r;
    int64_t start, stop;
    s.columns(i, j0, m, start, stop);
    const T li = L[i], di = D[i];
    if (li == -std::numeric_limits<T>::infinity()) stop = start;  // no parent: nothing flows
    T* sr = S + r * m;
    T* gr = GP + r * m;
    const int64_t base = s.T - 1 - s.shift - i + j0;
    const T* bias = R + base;
    T* dbias = dR + base;
    for (int64_t c = 0; c < start; ++c) sr[c] = gr[c] = 0;
#pragma omp simd
    for (int64_t c = start; c < stop; ++c) {
      const T p = vexp<T>(sc * sr[c] + bias[c] - li);
      const T ds = p * (gr[c] - di);
      sr[c] = p;       // P_ij
      gr[c] = ds;      // dS_ij
      dbias[c] += ds;  // distinct c, distinct distances: no two lanes write one entry
    }
    for (int64_t c = stop; c < m; ++c) sr[c] = gr[c] = 0;
  }
}

// dout and out (B, H, C, dv), lse (B, H, C), the rest as the forward's. Returns dq, dk, dv
// in the layouts of q, k, v and dtable (B, H, T), each row's gradient of its table (the
// caller sums what rows share).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_a, const at::Tensor& q_a, const at::Tensor& k_a, const at::Tensor& v_a,
    const at::Tensor& t_a, const at::Tensor& out_a, const at::Tensor& lse_a, int64_t shift,
    int64_t lo, int64_t hi, double scale) {
  at::AutoDispatchBelowADInplaceOrView below;  // no graph of its own (this thread) …
  // … nor in at::parallel_for's threads, which do not inherit that guard: detached views
  const auto dout_in = rows(dout_a), q = rows(q_a), k = rows(k_a), v = rows(v_a);
  const auto out_in = rows(out_a), lse_in = lse_a.detach();
  const Band s = check("distance_table.backward", q, k, v, t_a, shift, lo, hi);
  TORCH_CHECK(dout_in.dim() == 4 && dout_in.sizes() == out_in.sizes() &&
                  dout_in.size(0) == s.B && dout_in.size(1) == s.NH && dout_in.size(2) == s.C &&
                  dout_in.size(3) == s.dv && lse_in.dim() == 3 && lse_in.size(0) == s.B &&
                  lse_in.size(1) == s.NH && lse_in.size(2) == s.C,
              "distance_table.backward: dout and out (B, H, C, dv), lse (B, H, C)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dout_in.scalar_type() == dtype && out_in.scalar_type() == dtype,
              "distance_table.backward: dout and out in q's dtype");
  const auto R = reversed(t_a, dtype);
  auto lse = lse_in.to(dtype).contiguous();
  // the gradients contiguous, (B, H, n, width): each row's own block of memory
  auto dq = at::zeros({s.B, s.NH, s.C, s.d}, q.options());
  auto dk = at::zeros({s.B, s.NH, s.P, s.d}, q.options());
  auto dvv = at::zeros({s.B, s.NH, s.P, s.dv}, q.options());
  auto dR = at::zeros({s.B, s.NH, s.T}, q.options());  // reversed, flipped back below
  AT_DISPATCH_FLOATING_TYPES(dtype, "distance_table.backward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    at::parallel_for(0, s.B * s.NH, 1, [&](int64_t g0, int64_t g1) {
      std::vector<T> sbuf(BQ_B * BK_B), gbuf(BQ_B * BK_B), Dbuf(BQ_B);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t b = g / s.NH, hh = g % s.NH;
        const int64_t qn = q.stride(2), kn = k.stride(2), vn = v.stride(2);
        const int64_t dn = dout_in.stride(2), on = out_in.stride(2);
        const T* Qg = q.data_ptr<T>() + b * q.stride(0) + hh * q.stride(1);
        const T* Kg = k.data_ptr<T>() + b * k.stride(0) + hh * k.stride(1);
        const T* Vg = v.data_ptr<T>() + b * v.stride(0) + hh * v.stride(1);
        const T* dOg = dout_in.data_ptr<T>() + b * dout_in.stride(0) + hh * dout_in.stride(1);
        const T* Og = out_in.data_ptr<T>() + b * out_in.stride(0) + hh * out_in.stride(1);
        T* dQg = dq.data_ptr<T>() + g * s.C * s.d;
        T* dKg = dk.data_ptr<T>() + g * s.P * s.d;
        T* dVg = dvv.data_ptr<T>() + g * s.P * s.dv;
        const T* Rh = R.data_ptr<T>() + (R.size(0) == 1 ? 0 : hh) * s.T;
        const T* L = lse.data_ptr<T>() + g * s.C;
        T* dRh = dR.data_ptr<T>() + g * s.T;
        for (int64_t i0 = 0; i0 < s.C; i0 += BQ_B) {
          const int64_t n = std::min(BQ_B, s.C - i0);
          int64_t first, limit;
          s.parents(i0, n, first, limit);
          if (first >= limit) continue;
          const T* Qb = Qg + i0 * qn;
          const T* dOb = dOg + i0 * dn;
          for (int64_t r = 0; r < n; ++r) Dbuf[r] = dot<T>(dOb + r * dn, Og + (i0 + r) * on, s.dv);
          const T* Dp = Dbuf.data() - i0;  // D_i = <dO_i, out_i>, indexed by i
          for (int64_t j0 = first; j0 < limit; j0 += BK_B) {
            const int64_t m = std::min(BK_B, limit - j0);
            T* S = sbuf.data();
            T* GP = gbuf.data();
            gemm<T>(false, true, n, m, s.d, T(1), Qb, qn, Kg + j0 * kn, kn, T(0), S, m);
            gemm<T>(false, true, n, m, s.dv, T(1), dOb, dn, Vg + j0 * vn, vn, T(0), GP, m);
            backward_tile<T>(S, GP, n, m, i0, j0, s, sc, Rh, L, Dp, dRh);
            // dV += P^T dO, dQ += scale dS K, dK += scale dS^T Q
            gemm<T>(true, false, m, s.dv, n, T(1), S, m, dOb, dn, T(1), dVg + j0 * s.dv, s.dv);
            gemm<T>(false, false, n, s.d, m, sc, GP, m, Kg + j0 * kn, kn, T(1), dQg + i0 * s.d,
                    s.d);
            gemm<T>(true, false, m, s.d, n, sc, GP, m, Qb, qn, T(1), dKg + j0 * s.d, s.d);
          }
        }
      }
    });
  });
  return {dq, dk, dvv, dR.flip({2})};
}

}  // namespace

TORCH_LIBRARY(structattn_distance_table, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor table, int shift, int lo, int hi, "
        "float scale) -> (Tensor, Tensor)");
  m.def("backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor table, Tensor out, "
        "Tensor lse, int shift, int lo, int hi, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(structattn_distance_table, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
