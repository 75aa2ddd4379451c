// bitmosaic low-bit matmul: AVX2 + FMA kernels.
// Part of qmatmul.cpp (one translation unit); see the layout comment there.
#pragma once
#include "qmatmul_common.h"

#ifdef BM_X86
namespace {

// ---------------------------------------------------------------- AVX2: a span is two halves of 8 lanes
// Half h (lanes 8h .. 8h+7) starts at byte 4*b*h of the span; within it, lanes 0-3 come from the 16
// bytes at its start and lanes 4-7 from the 16 bytes 2*b further (one vpshufb pattern for both).
struct Lanes256 { __m256i idx, sh; };

template <int B>
T_AVX2 inline Lanes256 lanes256_consts() {
  return {_mm256_load_si256((const __m256i*)kLaneTab<B, 8, 4>.idx), _mm256_load_si256((const __m256i*)kLaneTab<B, 8, 4>.sh)};
}

template <int B>
T_AVX2 inline __m256i half256(const uint8_t* p, const Lanes256& c) {
  if constexpr (B == 8) return _mm256_loadu_si256((const __m256i*)p);
  else if constexpr (B == 4) return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
  else if constexpr (B == 2) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  else {
    const __m256i v = _mm256_loadu2_m128i((const __m128i*)(p + 2 * B), (const __m128i*)p);
    return _mm256_srlv_epi32(_mm256_shuffle_epi8(v, c.idx), c.sh);
  }
}

template <int B, int T>
T_AVX2 inline __m256 codes256(__m256i v) {
  constexpr bool clean = (T == 3) && (B == 8 || B == 4 || B == 2);
  __m256i c = T ? _mm256_srli_epi32(v, T * B) : v;
  if constexpr (!clean) c = _mm256_and_si256(c, _mm256_set1_epi32((1 << B) - 1));
  return _mm256_cvtepi32_ps(c);
}

T_AVX2 inline __m256i tail_mask256(int64_t k) {  // lanes i < k
  return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k < 0 ? 0 : (k > 8 ? 8 : k))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

template <int M, int B>
T_AVX2 void group256(const uint8_t* p, int64_t len, const float* x, int64_t K, __m256* gv) {
  const Lanes256 c = lanes256_consts<B>();
  __m256 a[M][2];
  for (int m = 0; m < M; ++m) a[m][0] = a[m][1] = _mm256_setzero_ps();
  const int64_t full = len & ~int64_t(63);
  int64_t j = 0;
  for (; j < full; j += 64, p += 8 * B) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = half256<B>(p + 4 * B * h, c);
      const __m256 c0 = codes256<B, 0>(v), c1 = codes256<B, 1>(v), c2 = codes256<B, 2>(v), c3 = codes256<B, 3>(v);
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + j + 8 * h;
        a[m][h] = _mm256_fmadd_ps(c0, _mm256_loadu_ps(xm), a[m][h]);
        a[m][h] = _mm256_fmadd_ps(c1, _mm256_loadu_ps(xm + 16), a[m][h]);
        a[m][h] = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xm + 32), a[m][h]);
        a[m][h] = _mm256_fmadd_ps(c3, _mm256_loadu_ps(xm + 48), a[m][h]);
      }
    }
  }
  if (j < len) {
    const int64_t rem = len - j;
    for (int h = 0; h < 2; ++h) {
      const __m256i v = half256<B>(p + 4 * B * h, c);
      const __m256 cc[4] = {codes256<B, 0>(v), codes256<B, 1>(v), codes256<B, 2>(v), codes256<B, 3>(v)};
      for (int t = 0; t < 4; ++t) {
        const int64_t k = rem - 16 * t - 8 * h;
        if (k <= 0) break;
        const __m256i mk = tail_mask256(k);
        for (int m = 0; m < M; ++m)
          a[m][h] = _mm256_fmadd_ps(cc[t], _mm256_maskload_ps(x + m * K + j + 16 * t + 8 * h, mk), a[m][h]);
      }
    }
  }
  for (int m = 0; m < M; ++m) gv[m] = _mm256_add_ps(a[m][0], a[m][1]);
}

T_AVX2 inline float hsum256(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

template <int M>
T_AVX2 void gemv_rows_avx2(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1) {
  __m256 gv[M], racc[M];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float rs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int m = 0; m < M; ++m) racc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const uint8_t* p = row + L.goff[rb * L.G + g];
      const float* xg = x + c0;
      switch (L.bits[rb * L.G + g]) {
        case 1: group256<M, 1>(p, len, xg, L.K, gv); break;
        case 2: group256<M, 2>(p, len, xg, L.K, gv); break;
        case 3: group256<M, 3>(p, len, xg, L.K, gv); break;
        case 4: group256<M, 4>(p, len, xg, L.K, gv); break;
        case 5: group256<M, 5>(p, len, xg, L.K, gv); break;
        case 6: group256<M, 6>(p, len, xg, L.K, gv); break;
        case 7: group256<M, 7>(p, len, xg, L.K, gv); break;
        default: group256<M, 8>(p, len, xg, L.K, gv); break;
      }
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      const __m256 sv = _mm256_set1_ps(s);
      for (int m = 0; m < M; ++m) {
        racc[m] = _mm256_fmadd_ps(sv, gv[m], racc[m]);
        rs[m] -= s * (z * xsum[m * L.G + g]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = hsum256(racc[m]) + rs[m];
  }
}

template <int B>
T_AVX2 void dequant_group256(const uint8_t* p, int64_t len, float s, float z, float* o) {
  const Lanes256 c = lanes256_consts<B>();
  const __m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);
  for (int64_t j = 0; j < len; j += 64, p += 8 * B) {
    for (int h = 0; h < 2; ++h) {
      const __m256i v = half256<B>(p + 4 * B * h, c);
      const __m256 cc[4] = {codes256<B, 0>(v), codes256<B, 1>(v), codes256<B, 2>(v), codes256<B, 3>(v)};
      for (int t = 0; t < 4; ++t) {
        const int64_t k = len - j - 16 * t - 8 * h;
        if (k <= 0) break;
        const __m256 w = _mm256_mul_ps(_mm256_sub_ps(cc[t], zv), sv);
        float* dst = o + j + 16 * t + 8 * h;
        if (k >= 8) _mm256_storeu_ps(dst, w);
        else _mm256_maskstore_ps(dst, tail_mask256(k), w);
      }
    }
  }
}

T_AVX2 void dequant_rows_avx2(const Layout& L, int64_t r0, int64_t r1, float* out) {
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float* o = out + (n - r0) * L.K;
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const uint8_t* p = row + L.goff[rb * L.G + g];
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      switch (L.bits[rb * L.G + g]) {
        case 1: dequant_group256<1>(p, len, s, z, o + c0); break;
        case 2: dequant_group256<2>(p, len, s, z, o + c0); break;
        case 3: dequant_group256<3>(p, len, s, z, o + c0); break;
        case 4: dequant_group256<4>(p, len, s, z, o + c0); break;
        case 5: dequant_group256<5>(p, len, s, z, o + c0); break;
        case 6: dequant_group256<6>(p, len, s, z, o + c0); break;
        case 7: dequant_group256<7>(p, len, s, z, o + c0); break;
        default: dequant_group256<8>(p, len, s, z, o + c0); break;
      }
    }
  }
}

}  // namespace
#endif  // BM_X86
