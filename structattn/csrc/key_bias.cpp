// Attention under a log prior that separates as g_i + h_j (FoX's forget gate, ALiBi), on the
// CPU, forward and backward, with the gradient of the per-parent term h.
//
//     out_i = sum_j P_ij v_j,  P_ij = exp(scale <q_i, k_j> + h_j - lse_i)  over j <= i (causal)
//                                                                         or every j,
//
// where the forward is PyTorch's fused flash kernel with h as a mask broadcast over the
// children (structattn/kinds/key_bias.py): it returns out and lse. Its backward gives no
// gradient for a mask, which is what this kernel adds, in one pass with the others:
//
//     dV_j = sum_i P_ij dO_i,   dP_ij = <dO_i, v_j>,   dS_ij = P_ij (dP_ij - D_i),
//     D_i = <dO_i, out_i>,      dQ_i = scale sum_j dS_ij k_j,   dK_j = scale sum_i dS_ij q_i,
//     dh_j = sum_i dS_ij.
//
// A band per row (band_forward, band_backward): row g's children read only the parents
// max(0, i − w_g) ≤ j ≤ i (causal), each block from its first window start, the keys and
// values read in place — the certified band of a FoX or ALiBi layer, a width per head.
//
// Tiles: per row g (a batch element and head) the children are read in blocks of BQ and,
// for each, the parents in blocks of BK up to the diagonal; a tile's scores are recomputed
// from one matrix product (never more than BQ x BK at once). dK, dV and dh accumulate over
// a row's blocks, so rows g are the unit of parallel work.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>
#include <tuple>

#include "tiles.h"

namespace {

using structattn::online_softmax_row;
using structattn::vexp;

constexpr int64_t BQ = 128;
constexpr int64_t BK = 256;


// One tile, children i0 .. i0 + n - 1 and parents j0 .. j0 + m - 1: S (n, m) holds <q_i, k_j>
// and becomes P_ij, GP (n, m) holds <dO_i, v_j> and becomes dS_ij (both 0 where j > i,
// causal); dH[j] += sum_i dS_ij.
template <typename T>
void tile(T* S, T* GP, int64_t n, int64_t m, int64_t i0, int64_t j0, bool causal, T sc,
          const T* H, const T* L, const T* D, T* dH, int64_t w = -1) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = i0 + r;
    const int64_t stop = causal ? std::max<int64_t>(0, std::min(m, i - j0 + 1)) : m;
    // a window (w ≥ 0): the parents j ≥ i − w only
    const int64_t start = w < 0 ? 0 : std::min(stop, std::max<int64_t>(0, i - w - j0));
    T* sr = S + r * m;
    T* gr = GP + r * m;
    const T li = L[i], di = D[i];
    for (int64_t c = 0; c < start; ++c) sr[c] = gr[c] = 0;
#pragma omp simd
    for (int64_t c = start; c < stop; ++c) {
      const T p = vexp<T>(sc * sr[c] + H[j0 + c] - li);
      sr[c] = p;                 // P_ij
      gr[c] = p * (gr[c] - di);  // dS_ij
    }
    for (int64_t c = stop; c < m; ++c) sr[c] = gr[c] = 0;
  }
  for (int64_t r = 0; r < n; ++r) {
    const T* gr = GP + r * m;
#pragma omp simd
    for (int64_t c = 0; c < m; ++c) dH[j0 + c] += gr[c];
  }
}

// Each row's window (B·H,) int64 from a (B, H) tensor (any integer dtype), or undefined.
at::Tensor windows(const std::optional<at::Tensor>& window, int64_t B, int64_t NH) {
  if (!window.has_value()) return at::Tensor();
  TORCH_CHECK(window->dim() == 2 && window->size(0) == B && window->size(1) == NH,
              "key_bias: window (B, H), one width per row");
  auto w = window->to(at::kLong).contiguous().view({B * NH});
  TORCH_CHECK(w.numel() == 0 || w.min().item<int64_t>() >= 0, "key_bias: windows ≥ 0");
  return w;
}

// q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), dout and out (B, H, C, dv), any strides
// (the heads of a projection are a transposed view: each head's keys and values, and each
// block's queries and dO, are copied contiguous below); h (B, H, P) and lse (B, H, C).
// Returns dq, dk, dv in the layouts of q, k, v (written in place), and dh (B, H, P).
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward_rows(
    const at::Tensor& dout_a, const at::Tensor& q_a, const at::Tensor& k_a, const at::Tensor& v_a,
    const at::Tensor& h_a, const at::Tensor& out_a, const at::Tensor& lse_a, double scale,
    bool causal, const std::optional<at::Tensor>& window) {
  at::AutoDispatchBelowADInplaceOrView below;  // no graph of its own (this thread) …
  // … nor in at::parallel_for's threads, which do not inherit that guard: detached views
  const auto dout_in = dout_a.detach(), q = q_a.detach(), k = k_a.detach(), v = v_a.detach();
  const auto h_in = h_a.detach(), out_in = out_a.detach(), lse_in = lse_a.detach();
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && h_in.dim() == 3 &&
                  dout_in.dim() == 4 && out_in.dim() == 4 && lse_in.dim() == 3,
              "key_bias.backward: q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), h (B, H, P), "
              "dout and out (B, H, C, dv), lse (B, H, C)");
  const int64_t B = q.size(0), NH = q.size(1), C = q.size(2), P = k.size(2), d = q.size(3),
                dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == NH && v.size(0) == B && v.size(1) == NH &&
                  k.size(3) == d && v.size(2) == P && h_in.size(0) == B && h_in.size(1) == NH &&
                  h_in.size(2) == P && dout_in.sizes() == out_in.sizes() &&
                  dout_in.size(0) == B && dout_in.size(1) == NH && dout_in.size(2) == C &&
                  dout_in.size(3) == dv && lse_in.size(0) == B && lse_in.size(1) == NH &&
                  lse_in.size(2) == C,
              "key_bias.backward: shapes");
  TORCH_CHECK(q.device().is_cpu(), "key_bias.backward: CPU tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "key_bias.backward: float32 or float64");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype &&
                  dout_in.scalar_type() == dtype && out_in.scalar_type() == dtype,
              "key_bias.backward: q, k, v, dout, out share one dtype");
  // h and lse (the fused kernel's lse is float32 for float32 inputs): small, (B, H, n)
  auto h = h_in.to(dtype).contiguous(), lse = lse_in.to(dtype).contiguous();
  const auto win = windows(window, B, NH);
  const int64_t* W = win.defined() ? win.data_ptr<int64_t>() : nullptr;
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dvv = at::zeros_like(v);
  auto dh = at::zeros_like(h);
  AT_DISPATCH_FLOATING_TYPES(dtype, "key_bias.backward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    at::parallel_for(0, B * NH, 1, [&](int64_t g0, int64_t g1) {
      auto opts = q.options();
      auto s = at::empty({BQ * BK}, opts), dp = at::empty({BQ * BK}, opts);
      auto Dbuf = at::empty({BQ}, opts);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t b = g / NH, hh = g % NH;
        // rows read contiguous: a projection's heads are a transposed view, whose rows (H·d
        // apart) cost the tiles' products ~25% (measured). The keys and values of one head,
        // read by every block, are copied once; a block's queries and dO, read by its row
        // of tiles, one block at a time (copying those whole put the peak memory over)
        auto kg = k[b][hh].contiguous(), vg = v[b][hh].contiguous();
        auto qg = q[b][hh], dog_all = dout_in[b][hh], og_all = out_in[b][hh];
        auto dqg_all = dq[b][hh], dkg = dk[b][hh], dvg = dvv[b][hh];  // written in place
        const T* H = h[b][hh].data_ptr<T>();
        const T* L = lse[b][hh].data_ptr<T>();
        T* dH = dh[b][hh].data_ptr<T>();
        const int64_t w = W ? W[g] : -1;
        for (int64_t i0 = 0; i0 < C; i0 += BQ) {
          const int64_t n = std::min(BQ, C - i0);
          auto qb = qg.narrow(0, i0, n).contiguous(), dog = dog_all.narrow(0, i0, n).contiguous();
          auto dqb = dqg_all.narrow(0, i0, n);
          auto Db = Dbuf.narrow(0, 0, n);
          at::sum_out(Db, dog * og_all.narrow(0, i0, n), {-1});  // D_i = <dO_i, out_i>
          const T* Dp = Db.data_ptr<T>() - i0;  // indexed by i
          // causal: j <= i, aligned at the first token (as the fused kernel's is_causal)
          const int64_t limit = causal ? std::min(i0 + n, P) : P;  // parents j < limit
          const int64_t first = w < 0 ? 0 : std::max<int64_t>(0, i0 - w);  // and j ≥ i0 − w
          for (int64_t j0 = first; j0 < limit; j0 += BK) {
            const int64_t m = std::min(BK, limit - j0);
            auto st = s.narrow(0, 0, n * m).view({n, m});  // contiguous: row stride m
            auto gt = dp.narrow(0, 0, n * m).view({n, m});
            auto kc = kg.narrow(0, j0, m), vc = vg.narrow(0, j0, m);
            at::mm_out(st, qb, kc.t());  // (n, m) <q_i, k_j>
            at::mm_out(gt, dog, vc.t());  // (n, m) <dO_i, v_j>
            tile<T>(st.data_ptr<T>(), gt.data_ptr<T>(), n, m, i0, j0, causal, sc, H, L, Dp, dH,
                    w);
            dvg.narrow(0, j0, m).addmm_(st.t(), dog);       // += P^T dO
            dqb.addmm_(gt, kc, 1, sc);                      // += scale dS K
            dkg.narrow(0, j0, m).addmm_(gt.t(), qb, 1, sc);  // += scale dS^T Q
          }
        }
      }
    });
  });
  return {dq, dk, dvv, dh};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& h, const at::Tensor& out, const at::Tensor& lse, double scale,
    bool causal) {
  return backward_rows(dout, q, k, v, h, out, lse, scale, causal, std::nullopt);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> band_backward(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& h, const at::Tensor& out, const at::Tensor& lse, const at::Tensor& window,
    double scale) {
  return backward_rows(dout, q, k, v, h, out, lse, scale, true, window);
}

// One tile of the band's forward, children i0 .. i0 + n − 1 and parents j0 .. j0 + m − 1:
// S (n, m) holds <q_i, k_j> and becomes the tile's e^{s_ij − top_i} (0 off the band
// max(0, i − w) ≤ j ≤ i); each child's running max ``top``, sum ``total`` and output row
// A (n, dv) are rescaled to the new max (the product P V is added by the caller).
template <typename T>
void band_tile(T* S, int64_t n, int64_t m, int64_t i0, int64_t j0, int64_t w, T sc, const T* H,
               T* top, T* total, T* A, int64_t dv) {
  for (int64_t r = 0; r < n; ++r) {
    const int64_t i = i0 + r;
    const int64_t stop = std::max<int64_t>(0, std::min(m, i - j0 + 1));
    const int64_t start = std::min(stop, std::max<int64_t>(0, i - w - j0));
    T* sr = S + r * m;
    T best = top[r];
    for (int64_t c = start; c < stop; ++c) {
      sr[c] = sc * sr[c] + H[j0 + c];
      best = std::max(best, sr[c]);
    }
    online_softmax_row<T>(sr, start, stop, m, best, top[r], total[r], A + r * dv, dv);
  }
}

// The band's rows done: A (n, dv) divided by each child's sum, L[r] = log Σ_j e^{s_ij}.
template <typename T>
void band_finish(T* A, int64_t n, int64_t dv, const T* top, const T* total, T* L) {
  for (int64_t r = 0; r < n; ++r) {
    T* ar = A + r * dv;
    const T inv = T(1) / total[r];
#pragma omp simd
    for (int64_t e = 0; e < dv; ++e) ar[e] *= inv;
    L[r] = top[r] + std::log(total[r]);
  }
}

// The band's forward: per row g (a batch element and head), children in blocks of BQ, each
// reading its parents max(0, i − w_g) ≤ j ≤ i in tiles of BK from the block's first window
// start, by the online softmax (a running max and sum per child), never the band's copies.
// q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), h (B, H, P), window (B, H); children
// aligned at the first token (j ≤ i). Returns out (B, H, C, dv) and lse (B, H, C).
std::tuple<at::Tensor, at::Tensor> band_forward(const at::Tensor& q_a, const at::Tensor& k_a,
                                                const at::Tensor& v_a, const at::Tensor& h_a,
                                                const at::Tensor& window, double scale) {
  at::AutoDispatchBelowADInplaceOrView below;  // its autograd rule is registered (Python)
  const auto q = q_a.detach(), k = k_a.detach(), v = v_a.detach(), h_in = h_a.detach();
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && h_in.dim() == 3,
              "key_bias.band_forward: q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), "
              "h (B, H, P)");
  const int64_t B = q.size(0), NH = q.size(1), C = q.size(2), P = k.size(2), dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(1) == NH && v.size(0) == B && v.size(1) == NH &&
                  k.size(3) == q.size(3) && v.size(2) == P && h_in.size(0) == B &&
                  h_in.size(1) == NH && h_in.size(2) == P,
              "key_bias.band_forward: shapes");
  TORCH_CHECK(q.device().is_cpu(), "key_bias.band_forward: CPU tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble,
              "key_bias.band_forward: float32 or float64");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype,
              "key_bias.band_forward: q, k, v share one dtype");
  auto h = h_in.to(dtype).contiguous();
  const auto win = windows(window, B, NH);
  const int64_t* W = win.data_ptr<int64_t>();
  auto out = at::empty({B, NH, C, dv}, q.options());
  auto lse = at::empty({B, NH, C}, q.options());
  AT_DISPATCH_FLOATING_TYPES(dtype, "key_bias.band_forward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    const T inf = std::numeric_limits<T>::infinity();
    // the unit of parallel work is a block of one row's children (their outputs are their
    // own): a band read for one or two rows still uses every core
    const int64_t nblocks = (C + BQ - 1) / BQ;
    const auto kc = k.contiguous(), vc = v.contiguous();
    at::parallel_for(0, B * NH * nblocks, 1, [&](int64_t t0, int64_t t1) {
      auto opts = q.options();
      auto s = at::empty({BQ * BK}, opts), acc = at::empty({BQ, dv}, opts);  // per thread
      std::vector<T> top(BQ), total(BQ);
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t g = t / nblocks, b = g / NH, hh = g % NH, w = W[g];
        auto kg = kc[b][hh], vg = vc[b][hh];
        auto qg = q[b][hh], og = out[b][hh];
        const T* H = h[b][hh].data_ptr<T>();
        T* L = lse[b][hh].data_ptr<T>();
        {
          const int64_t i0 = (t % nblocks) * BQ;
          const int64_t n = std::min(BQ, C - i0);
          auto qb = qg.narrow(0, i0, n).contiguous();
          auto ab = acc.narrow(0, 0, n);
          ab.zero_();
          T* A = ab.data_ptr<T>();
          std::fill(top.begin(), top.begin() + n, -inf);
          std::fill(total.begin(), total.begin() + n, T(0));
          const int64_t limit = std::min(i0 + n, P), first = std::max<int64_t>(0, i0 - w);
          for (int64_t j0 = first; j0 < limit; j0 += BK) {
            const int64_t m = std::min(BK, limit - j0);
            auto st = s.narrow(0, 0, n * m).view({n, m});
            at::mm_out(st, qb, kg.narrow(0, j0, m).t());  // (n, m) <q_i, k_j>
            band_tile<T>(st.data_ptr<T>(), n, m, i0, j0, w, sc, H, top.data(), total.data(), A,
                         dv);
            ab.addmm_(st, vg.narrow(0, j0, m));  // += P V
          }
          band_finish<T>(A, n, dv, top.data(), total.data(), L + i0);
          og.narrow(0, i0, n).copy_(ab);
        }
      }
    });
  });
  return {out, lse};
}

// The forward: PyTorch's fused flash kernel with h as a mask broadcast over the children,
// for (B, H, C, d) queries, (B, H, P, d) keys, (B, H, P, dv) values (one width: pad the
// narrower) and h (B, H, P). Returns out (B, H, C, dv) and lse (B, H, C) for the backward.
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q, const at::Tensor& k,
                                           const at::Tensor& v, const at::Tensor& h,
                                           double scale, bool causal) {
  at::AutoDispatchBelowADInplaceOrView below;  // its autograd rule is registered (Python)
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && h.dim() == 3,
              "key_bias.forward: q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), h (B, H, P)");
  auto mask = h.to(q.scalar_type()).unsqueeze(-2);  // (B, H, 1, P)
  auto res = at::_scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, mask, scale);
  return {std::get<0>(res), std::get<1>(res)};
}

}  // namespace

TORCH_LIBRARY(structattn_key_bias, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor h, float scale, bool causal) "
        "-> (Tensor, Tensor)");
  m.def("backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor h, Tensor out, Tensor lse, "
        "float scale, bool causal) -> (Tensor, Tensor, Tensor, Tensor)");
  m.def("band_forward(Tensor q, Tensor k, Tensor v, Tensor h, Tensor window, float scale) "
        "-> (Tensor, Tensor)");
  m.def("band_backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor h, Tensor out, "
        "Tensor lse, Tensor window, float scale) -> (Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(structattn_key_bias, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
  m.impl("band_forward", &band_forward);
  m.impl("band_backward", &band_backward);
}
