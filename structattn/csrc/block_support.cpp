// Attention over a support read by blocks, on the CPU, forward and backward:
//
//     out_i = sum_{j in Phi_i} P_ij v_j,   P_ij = exp(scale <q_i, k_j> - lse_i) over j in Phi_i,
//
// where the support Phi is given by its tiles (structattn/kinds/blocks.py): for each block of
// BQ children, the key blocks of BK parents that hold one of its pairs (CSR: offsets, blocks),
// each full (mask_index -1: every pair in the support) or partial (its (BQ, BK) mask in
// masks). A child with no parent gets out 0 and lse -inf. The backward is FlashAttention's:
//
//     D_i = <dO_i, out_i>,  dP_ij = <dO_i, v_j>,  dS_ij = P_ij (dP_ij - D_i),
//     dV_j = sum_i P_ij dO_i,  dQ_i = scale sum_j dS_ij k_j,  dK_j = scale sum_i dS_ij q_i.
//
// Runs: a child block's consecutive listed key blocks are read as one run of up to RUN
// parents (one matrix product for the scores, one for P V), each block's mask applied to its
// own columns — a band's blocks are one product, not one per BK parents. Never more than
// BQ x RUN scores at once. The forward's unit of parallel work is a (row, child block) pair,
// rows g being a batch element and head; the backward's a row g (dK, dV accumulate over its
// child blocks), as key_bias.cpp's.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <tuple>
#include <vector>

#include "tiles.h"

namespace {

using structattn::online_softmax_row;
using structattn::vexp;

// the most parents one run reads (or one block, if wider): its scores are BQ x RUN
constexpr int64_t RUN = 512;

// The support's tiles, checked against the sizes C, P, BQ, BK (contiguous copies kept alive).
struct Tiles {
  at::Tensor offsets_t, blocks_t, index_t, masks_t;
  const int64_t *offsets, *blocks, *index;
  const uint8_t* masks;  // bool data read as bytes: a bool load keeps a loop scalar
  int64_t BQ, BK, nq, nk;
};

Tiles tiles_of(const at::Tensor& offsets, const at::Tensor& blocks, const at::Tensor& mask_index,
               const at::Tensor& masks, int64_t C, int64_t P, int64_t block_q, int64_t block_k,
               const char* who) {
  TORCH_CHECK(block_q >= 1 && block_k >= 1, who, ": block_q and block_k must be >= 1; got ",
              block_q, " and ", block_k);
  Tiles t;
  t.BQ = block_q;
  t.BK = block_k;
  t.nq = (C + block_q - 1) / block_q;
  t.nk = (P + block_k - 1) / block_k;
  for (const auto* x : {&offsets, &blocks, &mask_index}) {
    TORCH_CHECK(x->dim() == 1 && x->scalar_type() == at::kLong && x->device().is_cpu(), who,
                ": offsets, blocks and mask_index must be 1-D int64 CPU tensors");
  }
  TORCH_CHECK(offsets.size(0) == t.nq + 1, who, ": offsets must have ceil(C / block_q) + 1 = ",
              t.nq + 1, " entries; got ", offsets.size(0));
  TORCH_CHECK(masks.dim() == 3 && masks.scalar_type() == at::kBool && masks.device().is_cpu() &&
                  masks.size(1) == block_q && masks.size(2) == block_k,
              who, ": masks must be a (n_partial, block_q, block_k) bool CPU tensor");
  const int64_t nnz = blocks.size(0), np = masks.size(0);
  TORCH_CHECK(mask_index.size(0) == nnz, who, ": blocks and mask_index differ in length");
  t.offsets_t = offsets.contiguous();
  t.blocks_t = blocks.contiguous();
  t.index_t = mask_index.contiguous();
  t.masks_t = masks.contiguous();
  t.offsets = t.offsets_t.data_ptr<int64_t>();
  t.blocks = t.blocks_t.data_ptr<int64_t>();
  t.index = t.index_t.data_ptr<int64_t>();
  t.masks = reinterpret_cast<const uint8_t*>(t.masks_t.data_ptr<bool>());
  TORCH_CHECK(t.offsets[0] == 0 && t.offsets[t.nq] == nnz, who,
              ": offsets must run from 0 to len(blocks)");
  for (int64_t r = 0; r < t.nq; ++r) {
    TORCH_CHECK(t.offsets[r] <= t.offsets[r + 1], who, ": offsets must not decrease");
    for (int64_t e = t.offsets[r]; e < t.offsets[r + 1]; ++e) {
      TORCH_CHECK(t.blocks[e] >= 0 && t.blocks[e] < t.nk &&
                      (e == t.offsets[r] || t.blocks[e] > t.blocks[e - 1]),
                  who, ": each child block's key blocks must ascend within [0, ", t.nk, ")");
      TORCH_CHECK(t.index[e] >= -1 && t.index[e] < np, who, ": mask_index must be in [-1, ",
                  np, ")");
    }
  }
  return t;
}

// One listed key block inside a run: its first column in the run, its width, its mask (null:
// full).
struct Segment {
  int64_t col, m;
  const uint8_t* mask;
};

// The run starting at listed tile e of child block r: its key blocks are consecutive and
// span at most RUN parents (at least one block). Fills ``segs``; returns the end e' and sets
// j0 (first parent) and m (parents in the run).
int64_t run_of(const Tiles& t, int64_t e, int64_t end, int64_t P, std::vector<Segment>& segs,
               int64_t& j0, int64_t& m) {
  segs.clear();
  j0 = t.blocks[e] * t.BK;
  m = 0;
  do {
    const int64_t c = t.blocks[e], w = std::min(t.BK, P - c * t.BK);
    const int64_t mi = t.index[e];
    segs.push_back({m, w, mi < 0 ? nullptr : t.masks + mi * t.BQ * t.BK});
    m += w;
    ++e;
  } while (e < end && t.blocks[e] == t.blocks[e - 1] + 1 && m + t.BK <= RUN);
  return e;
}

// s[c] = scale·s[c] on the support (mask[c] ≠ 0, or every c without a mask), −∞ off it;
// returns max(best, max_c s[c]), NaN where best or an s[c] is NaN (the vectorised maximum
// drops NaNs: they are counted apart, so that a NaN score stays a NaN output, never a 0).
// Branch-free loops over bytes, the maximum as a ternary: a bool load or std::max keeps GCC's
// loops scalar (4× slower tiles, measured).
template <typename T>
T scale_and_mask(T* __restrict s, const uint8_t* __restrict mask, int64_t m, T sc, T best) {
  const T ninf = -std::numeric_limits<T>::infinity();
  if (mask) {
#pragma omp simd
    for (int64_t c = 0; c < m; ++c) {
      const T x = sc * s[c];
      s[c] = mask[c] != 0 ? x : ninf;
    }
  } else {
#pragma omp simd
    for (int64_t c = 0; c < m; ++c) s[c] *= sc;
  }
  int nan = best != best;
#pragma omp simd reduction(max : best) reduction(| : nan)
  for (int64_t c = 0; c < m; ++c) {
    const T x = s[c];
    best = best > x ? best : x;
    nan |= x != x;
  }
  return nan ? std::numeric_limits<T>::quiet_NaN() : best;
}

// One run of the forward, children rows r < n: S (n, m) holds <q_i, k_j> and becomes
// e^{s_ij - top_i} on the support (0 off it), s_ij = scale <q_i, k_j>; each child's running
// max ``top``, sum ``total`` and output row A (n, dv) are rescaled to the new max (the caller
// adds P V).
template <typename T>
void forward_run(T* S, int64_t n, int64_t m, const std::vector<Segment>& segs, int64_t BK, T sc,
                 T* top, T* total, T* A, int64_t dv) {
  for (int64_t r = 0; r < n; ++r) {
    T* sr = S + r * m;
    T best = top[r];
    for (const auto& sg : segs) {
      best = scale_and_mask<T>(sr + sg.col, sg.mask ? sg.mask + r * BK : nullptr, sg.m, sc,
                               best);
    }
    online_softmax_row<T>(sr, 0, m, m, best, top[r], total[r], A + r * dv, dv);
  }
}

// A child block done: A (n, dv) divided by each child's sum, L[r] = log sum_j e^{s_ij}; a
// child with no parent (nothing summed) gets 0 and -inf, a NaN score NaN.
template <typename T>
void finish(T* A, int64_t n, int64_t dv, const T* top, const T* total, T* L) {
  for (int64_t r = 0; r < n; ++r) {
    T* ar = A + r * dv;
    if (total[r] == T(0)) {
      std::fill(ar, ar + dv, T(0));
      L[r] = -std::numeric_limits<T>::infinity();
      continue;
    }
    const T inv = T(1) / total[r];
#pragma omp simd
    for (int64_t x = 0; x < dv; ++x) ar[x] *= inv;
    L[r] = top[r] + std::log(total[r]);
  }
}

// One run of the backward, children i0 .. i0 + n - 1: S (n, m) holds <q_i, k_j> and becomes
// P_ij, GP (n, m) holds <dO_i, v_j> and becomes dS_ij (both 0 off the support).
template <typename T>
void backward_run(T* S, T* GP, int64_t n, int64_t m, const std::vector<Segment>& segs,
                  int64_t BK, T sc, const T* L, const T* D) {
  const T ninf = -std::numeric_limits<T>::infinity();
  for (int64_t r = 0; r < n; ++r) {
    T* sr = S + r * m;
    T* gr = GP + r * m;
    const T li = L[r], di = D[r];
    if (li == ninf) {  // a child with no parent: nothing of it in any tile
      std::fill(sr, sr + m, T(0));
      std::fill(gr, gr + m, T(0));
      continue;
    }
    for (const auto& sg : segs) {
      T* __restrict s = sr + sg.col;
      T* __restrict g = gr + sg.col;
      const int64_t w = sg.m;
      if (sg.mask) {
        const uint8_t* __restrict mr = sg.mask + r * BK;
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) {
          const T e = vexp<T>(sc * s[c] - li);
          const T p = mr[c] != 0 ? e : T(0);
          s[c] = p;                // P_ij
          g[c] = p * (g[c] - di);  // dS_ij
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < w; ++c) {
          const T p = vexp<T>(sc * s[c] - li);
          s[c] = p;
          g[c] = p * (g[c] - di);
        }
      }
    }
  }
}

void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* who) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who,
              ": q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv)");
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(1) == q.size(1) && v.size(0) == q.size(0) &&
                  v.size(1) == q.size(1) && k.size(3) == q.size(3) && v.size(2) == k.size(2),
              who, ": shapes: q ", q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && v.device().is_cpu(), who,
              ": CPU tensors");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble, who, ": float32 or float64");
  TORCH_CHECK(k.scalar_type() == dtype && v.scalar_type() == dtype, who,
              ": q, k, v share one dtype");
}

// q (B, H, C, d), k (B, H, P, d), v (B, H, P, dv), any strides; the support's tiles. Returns
// out (B, H, C, dv) and lse (B, H, C) (-inf for a child with no parent).
std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& q_a, const at::Tensor& k_a,
                                           const at::Tensor& v_a, const at::Tensor& offsets,
                                           const at::Tensor& blocks, const at::Tensor& mask_index,
                                           const at::Tensor& masks, int64_t block_q,
                                           int64_t block_k, double scale) {
  at::AutoDispatchBelowADInplaceOrView below;  // its autograd rule is registered (Python)
  const auto q = q_a.detach(), k_in = k_a.detach(), v_in = v_a.detach();
  check_qkv(q, k_in, v_in, "block_support.forward");
  const int64_t B = q.size(0), NH = q.size(1), C = q.size(2), P = k_in.size(2),
                dv = v_in.size(3);
  const Tiles t = tiles_of(offsets, blocks, mask_index, masks, C, P, block_q, block_k,
                           "block_support.forward");
  // every (row, child block) reads its keys and values: contiguous once (no copy when they are)
  const auto k = k_in.contiguous(), v = v_in.contiguous();
  auto out = at::empty({B, NH, C, dv}, q.options());
  auto lse = at::empty({B, NH, C}, q.options());
  AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "block_support.forward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    const T inf = std::numeric_limits<T>::infinity();
    const int64_t BQ = t.BQ;
    at::parallel_for(0, B * NH * t.nq, 1, [&](int64_t w0, int64_t w1) {
      auto opts = q.options();
      const int64_t width = std::max(RUN, t.BK);  // a run's parents at most
      auto s = at::empty({BQ * width}, opts), acc = at::empty({BQ, dv}, opts);  // per thread
      std::vector<T> top(BQ), total(BQ);
      std::vector<Segment> segs;
      for (int64_t w = w0; w < w1; ++w) {
        const int64_t g = w / t.nq, r = w % t.nq, b = g / NH, hh = g % NH;
        const int64_t i0 = r * BQ, n = std::min(BQ, C - i0);
        auto kg = k[b][hh], vg = v[b][hh];
        auto qb = q[b][hh].narrow(0, i0, n).contiguous();
        auto ab = acc.narrow(0, 0, n);
        ab.zero_();
        T* A = ab.data_ptr<T>();
        std::fill(top.begin(), top.begin() + n, -inf);
        std::fill(total.begin(), total.begin() + n, T(0));
        const int64_t end = t.offsets[r + 1];
        for (int64_t e = t.offsets[r]; e < end;) {
          int64_t j0, m;
          e = run_of(t, e, end, P, segs, j0, m);
          auto st = s.narrow(0, 0, n * m).view({n, m});  // contiguous: row stride m
          at::mm_out(st, qb, kg.narrow(0, j0, m).t());    // (n, m) <q_i, k_j>
          forward_run<T>(st.data_ptr<T>(), n, m, segs, t.BK, sc, top.data(), total.data(), A,
                         dv);
          ab.addmm_(st, vg.narrow(0, j0, m));  // += P V
        }
        finish<T>(A, n, dv, top.data(), total.data(), lse[b][hh].data_ptr<T>() + i0);
        out[b][hh].narrow(0, i0, n).copy_(ab);
      }
    });
  });
  return {out, lse};
}

// dout and out (B, H, C, dv), lse (B, H, C), q, k, v and the tiles as the forward's. Returns
// dq, dk, dv in the layouts of q, k, v.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(
    const at::Tensor& dout_a, const at::Tensor& q_a, const at::Tensor& k_a, const at::Tensor& v_a,
    const at::Tensor& out_a, const at::Tensor& lse_a, const at::Tensor& offsets,
    const at::Tensor& blocks, const at::Tensor& mask_index, const at::Tensor& masks,
    int64_t block_q, int64_t block_k, double scale) {
  at::AutoDispatchBelowADInplaceOrView below;  // no graph of its own (this thread) …
  // … nor in at::parallel_for's threads, which do not inherit that guard: detached views
  const auto dout_in = dout_a.detach(), q = q_a.detach(), k = k_a.detach(), v = v_a.detach();
  const auto out_in = out_a.detach(), lse_in = lse_a.detach();
  check_qkv(q, k, v, "block_support.backward");
  const int64_t B = q.size(0), NH = q.size(1), C = q.size(2), P = k.size(2), dv = v.size(3);
  TORCH_CHECK(dout_in.dim() == 4 && dout_in.sizes() == out_in.sizes() && dout_in.size(0) == B &&
                  dout_in.size(1) == NH && dout_in.size(2) == C && dout_in.size(3) == dv &&
                  lse_in.dim() == 3 && lse_in.size(0) == B && lse_in.size(1) == NH &&
                  lse_in.size(2) == C,
              "block_support.backward: dout and out (B, H, C, dv), lse (B, H, C)");
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dout_in.scalar_type() == dtype && out_in.scalar_type() == dtype,
              "block_support.backward: q, k, v, dout, out share one dtype");
  const Tiles t = tiles_of(offsets, blocks, mask_index, masks, C, P, block_q, block_k,
                           "block_support.backward");
  auto lse = lse_in.to(dtype).contiguous();
  auto dq = at::zeros_like(q), dk = at::zeros_like(k), dvv = at::zeros_like(v);
  AT_DISPATCH_FLOATING_TYPES(dtype, "block_support.backward", [&] {
    using T = scalar_t;
    const T sc = static_cast<T>(scale);
    const int64_t BQ = t.BQ;
    at::parallel_for(0, B * NH, 1, [&](int64_t g0, int64_t g1) {
      auto opts = q.options();
      const int64_t width = std::max(RUN, t.BK);  // a run's parents at most
      auto s = at::empty({BQ * width}, opts), dp = at::empty({BQ * width}, opts);
      auto Dbuf = at::empty({BQ}, opts);
      std::vector<Segment> segs;
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t b = g / NH, hh = g % NH;
        // a head's keys and values, read by every child block, copied contiguous once; a
        // block's queries and dO one block at a time
        auto kg = k[b][hh].contiguous(), vg = v[b][hh].contiguous();
        auto qg = q[b][hh], dog_all = dout_in[b][hh], og_all = out_in[b][hh];
        auto dqg = dq[b][hh], dkg = dk[b][hh], dvg = dvv[b][hh];  // written in place
        const T* L = lse[b][hh].data_ptr<T>();
        for (int64_t r = 0; r < t.nq; ++r) {
          const int64_t end = t.offsets[r + 1];
          if (t.offsets[r] == end) continue;  // children with no parent: no gradient
          const int64_t i0 = r * BQ, n = std::min(BQ, C - i0);
          auto qb = qg.narrow(0, i0, n).contiguous(), dob = dog_all.narrow(0, i0, n).contiguous();
          auto dqb = dqg.narrow(0, i0, n);
          auto Db = Dbuf.narrow(0, 0, n);
          at::sum_out(Db, dob * og_all.narrow(0, i0, n), {-1});  // D_i = <dO_i, out_i>
          const T* Dp = Db.data_ptr<T>();
          for (int64_t e = t.offsets[r]; e < end;) {
            int64_t j0, m;
            e = run_of(t, e, end, P, segs, j0, m);
            auto st = s.narrow(0, 0, n * m).view({n, m});
            auto gt = dp.narrow(0, 0, n * m).view({n, m});
            auto kc = kg.narrow(0, j0, m), vc = vg.narrow(0, j0, m);
            at::mm_out(st, qb, kc.t());   // (n, m) <q_i, k_j>
            at::mm_out(gt, dob, vc.t());  // (n, m) <dO_i, v_j>
            backward_run<T>(st.data_ptr<T>(), gt.data_ptr<T>(), n, m, segs, t.BK, sc, L + i0, Dp);
            dvg.narrow(0, j0, m).addmm_(st.t(), dob);          // += P^T dO
            dqb.addmm_(gt, kc, 1, sc);                         // += scale dS K
            dkg.narrow(0, j0, m).addmm_(gt.t(), qb, 1, sc);  // += scale dS^T Q
          }
        }
      }
    });
  });
  return {dq, dk, dvv};
}

}  // namespace

TORCH_LIBRARY(structattn_block_support, m) {
  m.def("forward(Tensor q, Tensor k, Tensor v, Tensor offsets, Tensor blocks, "
        "Tensor mask_index, Tensor masks, int block_q, int block_k, float scale) "
        "-> (Tensor, Tensor)");
  m.def("backward(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
        "Tensor offsets, Tensor blocks, Tensor mask_index, Tensor masks, int block_q, "
        "int block_k, float scale) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(structattn_block_support, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
