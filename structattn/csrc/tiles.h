// What the compiled CPU kernels' tiles share (key_bias.cpp, mean_field_windows.cpp): vexp, exp
// in straight-line arithmetic, and one child's row of an online softmax over a tile.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace structattn {

// exp(x) in straight-line arithmetic the compiler vectorises (the C library's exp is a call
// per entry: a quarter of the backward's time, measured): x = n ln 2 + r, |r| <= ln 2 / 2,
// e^r by its Taylor series (to r^7 in float, r^13 in double: within the dtype's rounding),
// times 2^n built in the exponent bits; within one unit in the last place of the C library's
// (checked from −80 to 5). Below −87 (float) or −708 (double) it gives 0 (the C library a
// denormal, under 1e-38 beside weights summing to 1), −inf included; NaN stays NaN.
template <typename T> struct ExpBits;
template <> struct ExpBits<float> {
  using I = int32_t;
  static constexpr int kMant = 23, kBias = 127, kTerms = 7;
  static constexpr float kLo = -87.0f, kHi = 88.0f;
};
template <> struct ExpBits<double> {
  using I = int64_t;
  static constexpr int kMant = 52, kBias = 1023, kTerms = 13;
  static constexpr double kLo = -708.0, kHi = 709.0;
};

// Horner's rule for e^r = Σ r^t / t!, t ≤ K: 1 + r(1 + r/2 (1 + r/3 (…))), unrolled
template <typename T, int K>
inline T taylor(T r) {
  if constexpr (K == 0) {
    return T(1);
  } else {
    T p = T(1);
#pragma GCC unroll 16
    for (int t = K; t >= 1; --t) p = T(1) + p * r * (T(1) / T(t));  // 1/t: folded constants
    return p;
  }
}

template <typename T>
inline T vexp(T x) {
  using B = ExpBits<T>;
  using I = typename B::I;
  const T lo = B::kLo, hi = B::kHi;  // values, not references: the loop vectorises
  const T xc = x < lo ? lo : (x > hi ? hi : x);
  // n = round(x / ln 2) by the round-to-nearest of adding and removing 1.5·2^mant (floor
  // is not vectorised without -fno-trapping-math)
  const T magic = T(1.5) * T(I(1) << B::kMant);
  const T n = (xc * T(1.4426950408889634) + magic) - magic;
  const T r = (xc - n * T(0.693145751953125)) - n * T(1.428606820309417e-06);
  const T p = taylor<T, B::kTerms>(r);
  const I bits = static_cast<I>((static_cast<I>(n) + B::kBias) << B::kMant);
  T scale;  // the bits as a float (std::bit_cast is C++20; torch builds extensions as C++17)
  std::memcpy(&scale, &bits, sizeof(T));
  return x != x ? x : (x < lo ? T(0) : p * scale);
}

// One child's row of an online softmax over a tile (FlashAttention's): ``sr`` holds its scores
// on columns [lo, hi) and becomes e^{s − best} there and 0 on the rest of its m columns, where
// ``best`` is the running maximum with them (−∞: nothing of the child's yet, the row all 0);
// its running ``top`` and ``total`` and its output row ``ar`` (dv) are rescaled to the new
// maximum (the caller adds the tile's product P V).
template <typename T>
inline void online_softmax_row(T* sr, int64_t lo, int64_t hi, int64_t m, T best, T& top,
                               T& total, T* ar, int64_t dv) {
  if (best == -std::numeric_limits<T>::infinity()) {
    std::fill(sr, sr + m, T(0));
    return;
  }
  const T shrink = vexp<T>(top - best);  // −inf before: 0
  T sum = 0;
  std::fill(sr, sr + lo, T(0));
#pragma omp simd reduction(+ : sum)
  for (int64_t c = lo; c < hi; ++c) {
    const T p = vexp<T>(sr[c] - best);
    sr[c] = p;
    sum += p;
  }
  std::fill(sr + hi, sr + m, T(0));
  total = total * shrink + sum;
  top = best;
  if (shrink != T(1)) {
#pragma omp simd
    for (int64_t x = 0; x < dv; ++x) ar[x] *= shrink;
  }
}

}  // namespace structattn
