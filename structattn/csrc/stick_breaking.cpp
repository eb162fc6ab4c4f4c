// Stick-breaking attention (Tan et al., ICLR 2025), forward and backward, on the CPU.
//
// Child i scans its parents back from i - 1 and breaks at parent l with probability
// beta_il = sigmoid(s_il), s_il = scale * <a_i, b_l>, unless it broke nearer:
//
//     p(phi_i = j) = beta_ij * E_i(j + 1),   E_i(j) = prod_{j<=l<i} (1 - beta_il),
//
// and has no parent with the leftover mass E_i(0). The output is out_i = sum_j p_ij v_j
// (the value of "no parent" is zero). sigmoid(s) and sigmoid(-s) both come from one
// e = exp(-|s|) (1 / (1 + e) and e / (1 + e), by the sign of s): no cancellation, no log.
//
// Tiles: per (row g, block of BQ children) the parents are read in chunks of BK from the
// diagonal back. A chunk's scores come from one matrix product, as (parents, children), so
// the scan along the parents runs over rows and is vectorised across the block's children;
// its exponentials are ATen's (vectorised) exp; the output is one more product. Never more
// than BK x BQ scores at once. A block's scan stops once every child's stick is below
// `stop` (a mass under the dtype's rounding): what lies further back weighs less than that
// together (`stop` is that mass). `start` records, per block, the first parent read, so the backward reads the
// same tiles.
//
// Backward, with u_ij = (dout_i . v_j) p_ij, w_i = dleftover_i * leftover_i and
// D_i = dout_i . out_i = sum_j u_ij (the prefix sum of u as D minus a suffix sum, so the
// backward scans back from the diagonal like the forward, FlashAttention's trick):
//
//     ds_il = u_il - sigmoid(s_il) * (sum_{j<=l} u_ij + w_i)
//           = u_il - sigmoid(s_il) * (D_i - sum_{j>l} u_ij + w_i).
//
// dB and dV accumulate over a row's blocks, so rows g are the backward's unit of parallel
// work (the forward's is (row, block)).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

namespace {

constexpr int64_t BQ = 64;
constexpr int64_t BK = 256;

void check(const at::Tensor& a, const at::Tensor& b, const at::Tensor& v) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && v.dim() == 3,
              "stick_breaking: a, b, v must be (G, n, d)");
  TORCH_CHECK(a.size(0) == b.size(0) && b.size(0) == v.size(0) && b.size(1) == v.size(1) &&
                  a.size(2) == b.size(2) && a.size(1) <= b.size(1),
              "stick_breaking: shapes a (G, C, k), b (G, P, k), v (G, P, d), C <= P");
  TORCH_CHECK(a.scalar_type() == b.scalar_type() && b.scalar_type() == v.scalar_type(),
              "stick_breaking: one dtype");
  TORCH_CHECK(a.scalar_type() == at::kFloat || a.scalar_type() == at::kDouble,
              "stick_breaking: float32 or float64");
  TORCH_CHECK(a.device().is_cpu(), "stick_breaking: CPU tensors");
}

// One chunk's scan, parents j0 + m - 1 down to j0, for children i0 .. i0 + n - 1.
// st: (m, n) scores; ex: (m, n) exp(-|st|); stick: (n) the stick each child has left
// (updated); prob: (m, n) out p_ij. Backward only (g != nullptr): g (m, n) dout_i . v_j,
// suffix (n) the sum of u over parents nearer than the chunk (updated), base (n) D_i + w_i;
// ds (m, n) out.
template <typename T>
void scan(int64_t i0, int64_t n, int64_t j0, int64_t m, const T* st, const T* ex, T* stick,
          T* prob, const T* g = nullptr, T* suffix = nullptr, const T* base = nullptr,
          T* ds = nullptr) {
  for (int64_t r = m - 1; r >= 0; --r) {
    const int64_t j = j0 + r;
    const int64_t first = std::min<int64_t>(n, std::max<int64_t>(0, j + 1 - i0));  // j < i
    const T* s = st + r * n;
    const T* e = ex + r * n;
    T* p = prob + r * n;
    for (int64_t c = 0; c < first; ++c) p[c] = 0;
    if (g == nullptr) {
#pragma omp simd
      for (int64_t c = first; c < n; ++c) {
        const T inv = T(1) / (T(1) + e[c]);
        const bool up = s[c] >= 0;
        const T brk = up ? inv : e[c] * inv, pass = up ? e[c] * inv : inv;
        p[c] = brk * stick[c];
        stick[c] *= pass;
      }
    } else {
      const T* gr = g + r * n;
      T* d = ds + r * n;
      for (int64_t c = 0; c < first; ++c) d[c] = 0;
#pragma omp simd
      for (int64_t c = first; c < n; ++c) {
        const T inv = T(1) / (T(1) + e[c]);
        const bool up = s[c] >= 0;
        const T brk = up ? inv : e[c] * inv, pass = up ? e[c] * inv : inv;
        const T pc = brk * stick[c];
        const T u = gr[c] * pc;
        p[c] = pc;
        d[c] = u - brk * (base[c] - suffix[c]);
        suffix[c] += u;
        stick[c] *= pass;
      }
    }
  }
}

template <typename T>
T largest(const T* x, int64_t n) {
  T out = 0;
  for (int64_t c = 0; c < n; ++c) out = std::max(out, x[c]);
  return out;
}

// -> out (G, C, d), leftover (G, C) (the stick left after the parents read),
//    start (G, ceil(C / BQ)) long: the first parent each block read.
std::tuple<at::Tensor, at::Tensor, at::Tensor> forward(const at::Tensor& a_in, const at::Tensor& b_in,
                                const at::Tensor& v_in, double scale, double stop) {
  check(a_in, b_in, v_in);
  // detached: the op's autograd is its own, and worker threads do not inherit a guard
  auto a = (a_in.detach() * scale).contiguous(), b = b_in.detach().contiguous();
  auto v = v_in.detach().contiguous();
  const int64_t G = a.size(0), C = a.size(1), dv = v.size(2);
  const int64_t nblocks = (C + BQ - 1) / BQ;
  auto out = at::zeros({G, C, dv}, v.options());
  auto leftover = at::ones({G, C}, a.options());
  auto start = at::zeros({G, nblocks}, a.options().dtype(at::kLong));
  auto start_a = start.accessor<int64_t, 2>();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "stick_breaking_forward", [&] {
    const scalar_t small = static_cast<scalar_t>(stop);
    at::parallel_for(0, G * nblocks, 1, [&](int64_t lo, int64_t hi) {
      // flat buffers: a chunk's (m, n) tiles are their first m·n entries, contiguous
      auto st = at::empty({BK * BQ}, a.options()), ex = at::empty({BK * BQ}, a.options());
      auto prob = at::empty({BK * BQ}, a.options());
      for (int64_t t = lo; t < hi; ++t) {
        const int64_t g = t / nblocks, blk = t % nblocks;
        const int64_t i0 = blk * BQ, n = std::min(BQ, C - i0);
        auto ag = a[g].narrow(0, i0, n);
        auto og = out[g].narrow(0, i0, n);  // (n, dv)
        scalar_t* stick = leftover[g].data_ptr<scalar_t>() + i0;
        int64_t j1 = i0 + n - 1;  // parents [j0, j1) of this chunk; j < i
        while (j1 > 0) {
          const int64_t j0 = std::max<int64_t>(0, j1 - BK), m = j1 - j0;
          auto s = st.narrow(0, 0, m * n).view({m, n});
          auto e = ex.narrow(0, 0, m * n).view({m, n});
          at::mm_out(s, b[g].narrow(0, j0, m), ag.t());
          at::abs_out(e, s).neg_().exp_();
          scan<scalar_t>(i0, n, j0, m, s.data_ptr<scalar_t>(), e.data_ptr<scalar_t>(), stick,
                         prob.data_ptr<scalar_t>());
          auto pc = prob.narrow(0, 0, m * n).view({m, n});
          og.addmm_(pc.t(), v[g].narrow(0, j0, m));
          start_a[g][blk] = j0;
          j1 = j0;
          if (largest(stick, n) < small) break;
        }
      }
    });
  });
  return {out, leftover, start};
}

// -> da (G, C, k) (with respect to the unscaled a), db (G, P, k), dv (G, P, d)
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(const at::Tensor& dout_in, const at::Tensor& dleft_in,
                                 const at::Tensor& a_in, const at::Tensor& b_in,
                                 const at::Tensor& v_in, double scale, const at::Tensor& out,
                                 const at::Tensor& leftover, const at::Tensor& start) {
  check(a_in, b_in, v_in);
  // detached: the op's autograd is its own, and worker threads do not inherit a guard
  auto a = (a_in.detach() * scale).contiguous(), b = b_in.detach().contiguous();
  auto v = v_in.detach().contiguous();
  auto dout = dout_in.detach().contiguous();
  // D_i + w_i: dout_i . out_i + dleftover_i * leftover_i
  auto base = ((dout * out.detach()).sum(-1) + dleft_in.detach() * leftover.detach()).contiguous();
  const int64_t G = a.size(0), C = a.size(1);
  const int64_t nblocks = (C + BQ - 1) / BQ;
  auto da = at::zeros_like(a), db = at::zeros_like(b), dv = at::zeros_like(v);
  auto start_a = start.accessor<int64_t, 2>();
  AT_DISPATCH_FLOATING_TYPES(a.scalar_type(), "stick_breaking_backward", [&] {
    at::parallel_for(0, G, 1, [&](int64_t lo, int64_t hi) {
      auto st = at::empty({BK * BQ}, a.options()), ex = at::empty({BK * BQ}, a.options());
      auto prob = at::empty({BK * BQ}, a.options()), gt = at::empty({BK * BQ}, a.options());
      auto ds = at::empty({BK * BQ}, a.options());
      auto stick = at::empty({BQ}, a.options()), suffix = at::empty({BQ}, a.options());
      for (int64_t g = lo; g < hi; ++g) {
        for (int64_t blk = 0; blk < nblocks; ++blk) {
          const int64_t i0 = blk * BQ, n = std::min(BQ, C - i0);
          const int64_t first = start_a[g][blk];
          auto ag = a[g].narrow(0, i0, n), dog = dout[g].narrow(0, i0, n);
          auto dag = da[g].narrow(0, i0, n);
          stick.fill_(1);
          suffix.zero_();
          const scalar_t* bs = base[g].data_ptr<scalar_t>() + i0;
          int64_t j1 = i0 + n - 1;
          while (j1 > first) {
            const int64_t j0 = std::max(first, j1 - BK), m = j1 - j0;
            auto bc = b[g].narrow(0, j0, m), vc = v[g].narrow(0, j0, m);
            auto s = st.narrow(0, 0, m * n).view({m, n});
            auto e = ex.narrow(0, 0, m * n).view({m, n});
            auto gg = gt.narrow(0, 0, m * n).view({m, n});
            at::mm_out(s, bc, ag.t());
            at::mm_out(gg, vc, dog.t());
            at::abs_out(e, s).neg_().exp_();
            scan<scalar_t>(i0, n, j0, m, s.data_ptr<scalar_t>(), e.data_ptr<scalar_t>(),
                           stick.data_ptr<scalar_t>(), prob.data_ptr<scalar_t>(),
                           gg.data_ptr<scalar_t>(), suffix.data_ptr<scalar_t>(), bs,
                           ds.data_ptr<scalar_t>());
            auto pm = prob.narrow(0, 0, m * n).view({m, n});
            auto dm = ds.narrow(0, 0, m * n).view({m, n});
            dag.addmm_(dm.t(), bc);
            db[g].narrow(0, j0, m).addmm_(dm, ag);
            dv[g].narrow(0, j0, m).addmm_(pm, dog);
            j1 = j0;
          }
        }
      }
    });
  });
  return {da.mul_(scale), db, dv};
}

}  // namespace

TORCH_LIBRARY(structattn_stick_breaking, m) {
  m.def("forward(Tensor a, Tensor b, Tensor v, float scale, float stop) -> (Tensor, Tensor, Tensor)");
  m.def("backward(Tensor dout, Tensor dleft, Tensor a, Tensor b, Tensor v, float scale, "
        "Tensor out, Tensor leftover, Tensor start) -> (Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(structattn_stick_breaking, CPU, m) {
  m.impl("forward", &forward);
  m.impl("backward", &backward);
}
