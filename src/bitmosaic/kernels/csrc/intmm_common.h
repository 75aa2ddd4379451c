// bitmosaic integer-activation matmul: the layout view, activation quantization and the portable kernel.
// Part of intmm.cpp (one translation unit); see the layout comment there.
#pragma once
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

namespace {

// The weight in the integer layout: row blocks of 16 rows; per row block, the columns in pairs of
// 4-column chunks ("pairs", 8 columns).  Nibble mode (codes < 16): one 64-byte tile per pair, byte
// 4 r + j = code(r, 8 p + j) | code(r, 8 p + 4 + j) << 4.  Byte mode: two 64-byte tiles per pair, the
// first with byte 4 r + j = code(r, 8 p + j), the second code(r, 8 p + 4 + j).
struct IntLayout {
  const uint8_t* data;  // [nrb][npairs][64 | 128]
  const float* sc;      // [nrb][G][16] weight scales
  const float* zc;      // [nrb][G][16] zero-points
  int64_t N, KP, G, gs, nrb, npairs;
  bool bytes;
  int64_t ldy = 0;          // the output's row stride (N, or the whole output's for a part of it)
  bool accumulate = false;  // add into y instead of storing (the row-block parts of int_parts)

  int64_t pair_bytes() const { return bytes ? 128 : 64; }
  const uint8_t* block(int64_t rb) const { return data + rb * npairs * pair_bytes(); }
  int64_t pair0(int64_t g) const { return g * gs / 8; }
  int64_t pair1(int64_t g) const { return g == G - 1 ? npairs : (g + 1) * gs / 8; }
};

// The quantized activations: q [M][KP] int8 (zero past K), qsum [M][G] the sum of q over each weight
// group, sa [Ms][Ga] the activation scales (Ms 1: shared by every token), weight group g under
// activation scale column min(g / ratio, Ga - 1).
// Runs mode (qz set): activation scales change inside a weight group, every `run_pairs` pairs (a run);
// run r of group g has scale column g * sub + r of sa, and qz [M][G] holds sum_r s_a(r) qsum(r) per
// weight group (float32), so the zero-point term is applied once per group:
//   y += s_w (sum_r s_a(r) acc(r) - z qz)       (qsum unused)
struct Acts {
  const int8_t* q;
  const int32_t* qsum;
  const float* sa;
  int64_t M, Ms, Ga, ratio;
  int64_t ldq = 0, ldqs = 0, lds = 0;  // row strides of q, qsum (or qz), sa (KP, G, Ga; wider for a part)
  const int32_t* pcol = nullptr;       // column of q where each pair of the weight reads (null: 8 p)
  const float* qz = nullptr;           // runs mode: [M][ldqs] sum_r s_a qsum per weight group
  int64_t sub = 1, run_pairs = 0;      // runs mode: scale columns per weight group, pairs per run
  // prefill: q in panels of 16 rows, [M / 16][ldq / 4][16] 4-byte groups (pack_panels), so that the
  // broadcasts of a tile's rows address one base with constant offsets (null: q rows as they are)
  const int8_t* panel = nullptr;
  // with a panel in runs mode: the scales transposed, saT[col * ldt + m] (ldt >= M), so that a run's
  // scales of a tile's rows sit at one base with constant offsets
  const float* saT = nullptr;
  int64_t ldt = 0;

  int64_t pair_col(int64_t p) const { return pcol ? pcol[p] : 8 * p; }

  int64_t col(int64_t g) const { return std::min(g / ratio, Ga - 1); }  // once per group: a division
  float scale(int64_t m, int64_t col) const { return sa[(Ms == 1 ? 0 : m) * lds + col]; }
};

// q = clamp(round_half_even(x / s), -qmax - 1, qmax) per element (the division, not a reciprocal: the
// same float32 operations as formats/act.py fake_quant), then the group sums.  x [M][K], act group
// `ags` columns per scale column.
// n values of one scale (portable; the SIMD versions are IntAvx2/IntVnni::quant, the same operations)
// max |x_j| over n values: eight independent chains, so the latency of max does not serialize the loop
// (one chain was about 4 cycles an element); exact in any order
inline float absmax_portable(const float* x, int64_t n) {
  float a[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    for (int k = 0; k < 8; ++k) a[k] = std::max(a[k], std::fabs(x[j + k]));
  for (; j < n; ++j) a[0] = std::max(a[0], std::fabs(x[j]));
  for (int k = 1; k < 8; ++k) a[0] = std::max(a[0], a[k]);
  return a[0];
}

// VS: one scale per element (s[j]), else s[0] for all; Q: int8_t, or int32_t for 16-bit activations
template <bool VS, class Q = int8_t>
inline void quant_portable_t(const float* x, const float* s, float lo, float hi, Q* q, int64_t n) {
  for (int64_t j = 0; j < n; ++j) q[j] = (Q)std::min(std::max(std::nearbyint(x[j] / s[VS ? j : 0]), lo), hi);
}
inline void quant_portable(const float* x, float s, float lo, float hi, int8_t* q, int64_t n) {
  quant_portable_t<false>(x, &s, lo, hi, q, n);
}
inline void quant32_portable(const float* x, float s, float lo, float hi, int32_t* q, int64_t n) {
  quant_portable_t<false>(x, &s, lo, hi, q, n);
}
inline void quantv_portable(const float* x, const float* s, float lo, float hi, int8_t* q, int64_t n) {
  quant_portable_t<true>(x, s, lo, hi, q, n);
}

inline int32_t sum_i8_portable(const int8_t* q, int64_t n) {
  int32_t s = 0;
  for (int64_t j = 0; j < n; ++j) s += q[j];
  return s;
}

using QuantFn = void (*)(const float*, float, float, float, int8_t*, int64_t);
using AbsmaxFn = float (*)(const float*, int64_t);
using SumFn = int32_t (*)(const int8_t*, int64_t);
using QuantVFn = void (*)(const float*, const float*, float, float, int8_t*, int64_t);
using Quant32Fn = void (*)(const float*, float, float, float, int32_t*, int64_t);

inline void quantize_rows(const float* x, int64_t K, const float* sa, int64_t Ms, int64_t Ga, int64_t ags,
                          float qmax, int64_t KP, int64_t gs, int64_t G, int8_t* q, int32_t* qsum,
                          int64_t m0, int64_t m1, QuantFn quant, SumFn sum) {
  const float lo = -qmax - 1.f;
  for (int64_t m = m0; m < m1; ++m) {
    const float* xm = x + m * K;
    int8_t* qm = q + m * KP;
    const float* sm = sa + (Ms == 1 ? 0 : m) * Ga;
    for (int64_t c0 = 0; c0 < K;) {  // one scale per segment (the last scale column covers the rest)
      const int64_t a = std::min(c0 / ags, Ga - 1);
      const int64_t c1 = (a == Ga - 1) ? K : std::min(K, c0 + ags);
      quant(xm + c0, sm[a], lo, qmax, qm + c0, c1 - c0);
      c0 = c1;
    }
    for (int64_t j = K; j < KP; ++j) qm[j] = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t c0 = g * gs, c1 = std::min(K, c0 + gs);
      qsum[m * G + g] = sum(qm + c0, c1 - c0);
    }
  }
}

// 16-bit activations as two int8 halves: the largest |q| whose halves h, l (q = 256 h + l) both fit int8
constexpr float kSplitQmax = 127.f * 256.f + 127.f;

// quantize_rows at 16 bits (qmax = kSplitQmax): q16 = clamp(round(x / s), -qmax - 1, qmax) (the same
// float32 operations as the int8 rows, integers in int32), then split into h = floor((q16 + 128) / 256)
// and l = q16 - 256 h, both in [-128, 127]: h to row m of q, l to row M + m, each with its group sums.
// q W^T = 256 (h W^T) + l W^T exactly in integers, so one weight pass of the int8 kernel over the 2M rows
// (the halves share every unpacked weight register) gives the 16-bit product.
inline void quantize_rows_split(const float* x, int64_t M, int64_t K, const float* sa, int64_t Ms, int64_t Ga,
                                int64_t ags, int64_t KP, int64_t gs, int64_t G, int8_t* q, int32_t* qsum,
                                int64_t m0, int64_t m1, Quant32Fn quant, SumFn sum) {
  std::vector<int32_t> t(K);
  for (int64_t m = m0; m < m1; ++m) {
    const float* xm = x + m * K;
    const float* sm = sa + (Ms == 1 ? 0 : m) * Ga;
    for (int64_t c0 = 0; c0 < K;) {
      const int64_t a = std::min(c0 / ags, Ga - 1);
      const int64_t c1 = (a == Ga - 1) ? K : std::min(K, c0 + ags);
      quant(xm + c0, sm[a], -kSplitQmax - 1.f, kSplitQmax, t.data() + c0, c1 - c0);
      c0 = c1;
    }
    int8_t* hm = q + m * KP;
    int8_t* lm = q + (M + m) * KP;
    for (int64_t j = 0; j < K; ++j) {
      const int32_t h = (t[j] + 128) >> 8;  // arithmetic shift: the floor
      hm[j] = (int8_t)h;
      lm[j] = (int8_t)(t[j] - h * 256);
    }
    for (int64_t j = K; j < KP; ++j) hm[j] = lm[j] = 0;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t c0 = g * gs, c1 = std::min(K, c0 + gs);
      qsum[m * G + g] = sum(hm + c0, c1 - c0);
      qsum[(M + m) * G + g] = sum(lm + c0, c1 - c0);
    }
  }
}

// q [M][ldq] (ldq a multiple of 4) as 16-row panels: panel t, 4-column chunk c, row r at
// out[((t * (ldq / 4) + c) * 16 + r) * 4], zeros past M
inline void pack_panels(const int8_t* q, int64_t M, int64_t ldq, int8_t* out) {
  const int64_t C = ldq / 4, T = (M + 15) / 16;
  at::parallel_for(0, T, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rows = std::min<int64_t>(16, M - t * 16);
      int32_t* o = reinterpret_cast<int32_t*>(out) + t * C * 16;
      if (rows < 16) std::memset(o, 0, C * 64);
      for (int64_t r = 0; r < rows; ++r) {  // one row's 4-byte groups into every 16th word
        const int8_t* qm = q + (t * 16 + r) * ldq;
        for (int64_t c = 0; c < C; ++c) std::memcpy(o + c * 16 + r, qm + 4 * c, 4);
      }
    }
  });
}

inline int32_t code_at(const IntLayout& L, const uint8_t* pair, int64_t r, int64_t c) {  // c in 0..7
  const int h = (int)(c / 4), j = (int)(c % 4);
  if (L.bytes) return pair[h * 64 + 4 * r + j];
  return (pair[4 * r + j] >> (4 * h)) & 15;
}

// y rows of row blocks rb0..rb1 (portable): exact int32 sums per group, then the float epilogue
// t = acc - z qsum (one rounding), y += t (s_w s_a).
void rows_portable(const IntLayout& L, const Acts& A, float* y, int64_t rb0, int64_t rb1) {
  for (int64_t rb = rb0; rb < rb1; ++rb) {
    const uint8_t* base = L.block(rb);
    for (int64_t r = 0; r < 16 && rb * 16 + r < L.N; ++r) {
      const int64_t n = rb * 16 + r;
      for (int64_t m = 0; m < A.M; ++m) {
        const int8_t* qm = A.q + m * A.ldq;
        float out = 0.f;
        for (int64_t g = 0; g < L.G && A.qz; ++g) {  // runs mode
          float fg = 0.f;
          for (int64_t k = 0, pr = L.pair0(g); pr < L.pair1(g); ++k, pr += A.run_pairs) {
            int32_t acc = 0;
            for (int64_t p = pr; p < std::min(L.pair1(g), pr + A.run_pairs); ++p) {
              const uint8_t* pair = base + p * L.pair_bytes();
              const int64_t c0 = A.pair_col(p);
              for (int64_t c = 0; c < 8; ++c) acc += code_at(L, pair, r, c) * (int32_t)qm[c0 + c];
            }
            fg = std::fma((float)acc, A.scale(m, g * A.sub + k), fg);
          }
          const float s = L.sc[(rb * L.G + g) * 16 + r], z = L.zc[(rb * L.G + g) * 16 + r];
          out = std::fma(std::fma(-z, A.qz[m * A.ldqs + g], fg), s, out);
        }
        for (int64_t g = 0; g < L.G && !A.qz; ++g) {
          const int64_t ga = A.col(g);
          int32_t acc = 0;
          for (int64_t p = L.pair0(g); p < L.pair1(g); ++p) {
            const uint8_t* pair = base + p * L.pair_bytes();
            const int64_t c0 = A.pair_col(p);
            for (int64_t c = 0; c < 8; ++c) acc += code_at(L, pair, r, c) * (int32_t)qm[c0 + c];
          }
          const float s = L.sc[(rb * L.G + g) * 16 + r], z = L.zc[(rb * L.G + g) * 16 + r];
          const float t = std::fma(-z, (float)A.qsum[m * A.ldqs + g], (float)acc);
          out = std::fma(t, s * A.scale(m, ga), out);
        }
        if (L.accumulate) y[m * L.ldy + n] += out;
        else y[m * L.ldy + n] = out;
      }
    }
  }
}

}  // namespace
