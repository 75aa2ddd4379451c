// bitmosaic low-bit matmul: AVX-512 (F, BW, VL, DQ, VBMI) kernels.
// Part of qmatmul.cpp (one translation unit); see the layout comment there.
#pragma once
#include "qmatmul_common.h"

#ifdef BM_X86
namespace {

// ---------------------------------------------------------------- AVX-512: 16 lanes = one span
struct Lanes512 { __m512i idx, sh; };

template <int B>
T_AVX512 inline Lanes512 lanes512_consts() {
  return {_mm512_load_si512(kLaneTab<B, 16, 16>.idx), _mm512_load_si512(kLaneTab<B, 16, 16>.sh)};
}

template <int B>
T_AVX512 inline __m512i span512(const uint8_t* p, const Lanes512& c) {
  if constexpr (B == 8) return _mm512_loadu_si512(p);
  else if constexpr (B == 4) return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
  else if constexpr (B == 2) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  else return _mm512_srlv_epi32(_mm512_permutexvar_epi8(c.idx, _mm512_loadu_si512(p)), c.sh);
}

// codes 16t .. 16t+15 of a span (as int32 lanes) from the span's lanes v
template <int B, int T>
T_AVX512 inline __m512 codes512(__m512i v) {
  constexpr bool clean = (T == 3) && (B == 8 || B == 4 || B == 2);  // nothing above the last code
  __m512i c = T ? _mm512_srli_epi32(v, T * B) : v;
  if constexpr (!clean) c = _mm512_and_si512(c, _mm512_set1_epi32((1 << B) - 1));
  return _mm512_cvtepi32_ps(c);
}

inline __mmask16 tail_mask(int64_t rem, int t) {
  const int64_t k = rem - 16 * t;
  return k >= 16 ? (__mmask16)0xFFFF : (k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1));
}

template <int M, int B>
T_AVX512 void group512(const uint8_t* p, int64_t len, const float* x, int64_t K, __m512* gv) {
  const Lanes512 c = lanes512_consts<B>();
  __m512 a[M][4];
  for (int m = 0; m < M; ++m)
    for (int t = 0; t < 4; ++t) a[m][t] = _mm512_setzero_ps();
  const int64_t full = len & ~int64_t(63);
  int64_t j = 0;
  for (; j < full; j += 64, p += 8 * B) {
    const __m512i v = span512<B>(p, c);
    const __m512 c0 = codes512<B, 0>(v), c1 = codes512<B, 1>(v), c2 = codes512<B, 2>(v), c3 = codes512<B, 3>(v);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + j;
      a[m][0] = _mm512_fmadd_ps(c0, _mm512_loadu_ps(xm), a[m][0]);
      a[m][1] = _mm512_fmadd_ps(c1, _mm512_loadu_ps(xm + 16), a[m][1]);
      a[m][2] = _mm512_fmadd_ps(c2, _mm512_loadu_ps(xm + 32), a[m][2]);
      a[m][3] = _mm512_fmadd_ps(c3, _mm512_loadu_ps(xm + 48), a[m][3]);
    }
  }
  if (j < len) {  // the zero-padded last span: x is read only inside the group
    const int64_t rem = len - j;
    const __m512i v = span512<B>(p, c);
    const __m512 c0 = codes512<B, 0>(v), c1 = codes512<B, 1>(v), c2 = codes512<B, 2>(v), c3 = codes512<B, 3>(v);
    const __mmask16 k0 = tail_mask(rem, 0), k1 = tail_mask(rem, 1), k2 = tail_mask(rem, 2), k3 = tail_mask(rem, 3);
    for (int m = 0; m < M; ++m) {  // constant indices: the accumulators stay in registers
      const float* xm = x + m * K + j;
      a[m][0] = _mm512_fmadd_ps(c0, _mm512_maskz_loadu_ps(k0, xm), a[m][0]);
      a[m][1] = _mm512_fmadd_ps(c1, _mm512_maskz_loadu_ps(k1, xm + 16), a[m][1]);
      a[m][2] = _mm512_fmadd_ps(c2, _mm512_maskz_loadu_ps(k2, xm + 32), a[m][2]);
      a[m][3] = _mm512_fmadd_ps(c3, _mm512_maskz_loadu_ps(k3, xm + 48), a[m][3]);
    }
  }
  for (int m = 0; m < M; ++m) gv[m] = _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));
}

template <int M>
T_AVX512 void gemv_rows_avx512(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1) {
  __m512 gv[M], racc[M];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float rs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int m = 0; m < M; ++m) racc[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const uint8_t* p = row + L.goff[rb * L.G + g];
      const float* xg = x + c0;
      switch (L.bits[rb * L.G + g]) {
        case 1: group512<M, 1>(p, len, xg, L.K, gv); break;
        case 2: group512<M, 2>(p, len, xg, L.K, gv); break;
        case 3: group512<M, 3>(p, len, xg, L.K, gv); break;
        case 4: group512<M, 4>(p, len, xg, L.K, gv); break;
        case 5: group512<M, 5>(p, len, xg, L.K, gv); break;
        case 6: group512<M, 6>(p, len, xg, L.K, gv); break;
        case 7: group512<M, 7>(p, len, xg, L.K, gv); break;
        default: group512<M, 8>(p, len, xg, L.K, gv); break;
      }
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      const __m512 sv = _mm512_set1_ps(s);
      for (int m = 0; m < M; ++m) {
        racc[m] = _mm512_fmadd_ps(sv, gv[m], racc[m]);
        rs[m] -= s * (z * xsum[m * L.G + g]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = _mm512_reduce_add_ps(racc[m]) + rs[m];
  }
}

template <int B>
T_AVX512 void dequant_group512(const uint8_t* p, int64_t len, float s, float z, float* o) {
  const Lanes512 c = lanes512_consts<B>();
  const __m512 sv = _mm512_set1_ps(s), zv = _mm512_set1_ps(z);
  for (int64_t j = 0; j < len; j += 64, p += 8 * B) {
    const __m512i v = span512<B>(p, c);
    const __m512 cc[4] = {codes512<B, 0>(v), codes512<B, 1>(v), codes512<B, 2>(v), codes512<B, 3>(v)};
    for (int t = 0; t < 4; ++t) {
      const __mmask16 k = tail_mask(len - j, t);
      if (!k) break;
      _mm512_mask_storeu_ps(o + j + 16 * t, k, _mm512_mul_ps(_mm512_sub_ps(cc[t], zv), sv));
    }
  }
}

T_AVX512 void dequant_rows_avx512(const Layout& L, int64_t r0, int64_t r1, float* out) {
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float* o = out + (n - r0) * L.K;
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const uint8_t* p = row + L.goff[rb * L.G + g];
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      switch (L.bits[rb * L.G + g]) {
        case 1: dequant_group512<1>(p, len, s, z, o + c0); break;
        case 2: dequant_group512<2>(p, len, s, z, o + c0); break;
        case 3: dequant_group512<3>(p, len, s, z, o + c0); break;
        case 4: dequant_group512<4>(p, len, s, z, o + c0); break;
        case 5: dequant_group512<5>(p, len, s, z, o + c0); break;
        case 6: dequant_group512<6>(p, len, s, z, o + c0); break;
        case 7: dequant_group512<7>(p, len, s, z, o + c0); break;
        default: dequant_group512<8>(p, len, s, z, o + c0); break;
      }
    }
  }
}

}  // namespace
#endif  // BM_X86
