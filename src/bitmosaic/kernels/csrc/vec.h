// bitmosaic C++ kernels: vector traits, one struct per instruction set, so that the SIMD kernel bodies
// (qmatmul_simd.h, lutgemv_simd.h) are written once over V and compiled per ISA.  Each struct is
// defined inside its target region (isa.h), as must be every body instantiated with it.
//
//   W                    float lanes per register (AVX2 8, AVX-512 16)
//   F, I, Mask           float / int32 registers, a lane mask
//   zero, set1, set1i    constants
//   loadu, storeu        unaligned full loads / stores
//   mask(k)              lanes i < k (k clamped to [0, W]); maskz_load / maskz_loadi read only those
//                        (zero elsewhere), mask_store writes only those; store_tail(p, k, v): lanes < k
//   add, sub, mul, fma   float arithmetic (fma is one rounding: a * b + c)
//   srli, srlv, andi, cvt  int32 shifts, and, int32 -> float
//   reduce               horizontal sum (a fixed order per ISA)
//   span<B>(p, c)        the int32 lanes of a qmatmul span part (lane i: bits 4Bi .. 4Bi+31), c = consts<B>()
//   lookup16(T, v, s)    per lane, T[(v >> s) & 15] for a 16-float table T (the bit-plane LUT)
#pragma once
#include "isa.h"

#ifdef BM_X86
namespace bm {

// byte gather + per-lane shift so that lane i holds bits [4*b*i, 4*b*i + 32) of a span (compile time)
template <int B, int LANES, int GROUP>
struct LaneTab {
  alignas(64) uint8_t idx[4 * LANES];
  alignas(64) int32_t sh[LANES];
  constexpr LaneTab() : idx(), sh() {
    for (int i = 0; i < LANES; ++i) {
      const int bit = 4 * B * (i % GROUP);  // AVX2: the pattern repeats per 128-bit half (GROUP = 4)
      for (int k = 0; k < 4; ++k) idx[4 * i + k] = (uint8_t)((bit >> 3) + k);
      sh[i] = bit & 7;
    }
  }
};
template <int B, int LANES, int GROUP>
constexpr LaneTab<B, LANES, GROUP> kLaneTab{};

BM_BEGIN_TARGET(BM_AVX2_TARGET)
struct Avx2 {
  static constexpr int W = 8;
  using F = __m256;
  using I = __m256i;
  using Mask = __m256i;
  struct Lanes { I idx, sh; };

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static I set1i(int v) { return _mm256_set1_epi32(v); }
  static F loadu(const float* p) { return _mm256_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm256_storeu_ps(p, v); }
  static Mask mask(int64_t k) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(k < 0 ? 0 : (k > 8 ? 8 : k))), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static F maskz_load(const float* p, Mask m) { return _mm256_maskload_ps(p, m); }
  static I maskz_loadi(const uint8_t* p, Mask m) { return _mm256_maskload_epi32((const int*)p, m); }
  static void mask_store(float* p, Mask m, F v) { _mm256_maskstore_ps(p, m, v); }
  static void store_tail(float* p, int64_t k, F v) {
    if (k >= 8) _mm256_storeu_ps(p, v);
    else _mm256_maskstore_ps(p, mask(k), v);
  }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F sub(F a, F b) { return _mm256_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static I srli(I v, int n) { return _mm256_srli_epi32(v, n); }
  static I srlv(I v, I n) { return _mm256_srlv_epi32(v, n); }
  static I andi(I a, I b) { return _mm256_and_si256(a, b); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static float reduce(F v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
    return _mm_cvtss_f32(s);
  }
  // A span is two parts of 8 lanes; part h starts at byte 4*B*h of the span; within it, lanes 0-3 come
  // from the 16 bytes at its start and lanes 4-7 from the 16 bytes 2*B further (one vpshufb pattern).
  template <int B>
  static Lanes consts() {
    return {_mm256_load_si256((const __m256i*)kLaneTab<B, 8, 4>.idx), _mm256_load_si256((const __m256i*)kLaneTab<B, 8, 4>.sh)};
  }
  template <int B>
  static I span(const uint8_t* p, const Lanes& c) {
    if constexpr (B == 8) return _mm256_loadu_si256((const __m256i*)p);
    else if constexpr (B == 4) return _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    else if constexpr (B == 2) return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
    else {
      const __m256i v = _mm256_loadu2_m128i((const __m128i*)(p + 2 * B), (const __m128i*)p);
      return _mm256_srlv_epi32(_mm256_shuffle_epi8(v, c.idx), c.sh);
    }
  }
  // two 8-entry lookups and a blend on the nibble's bit 3 (moved to the sign bit)
  static F lookup16(const float* T, I v, int s) {
    const I idx = _mm256_srli_epi32(v, s);
    const F lo = _mm256_permutevar8x32_ps(_mm256_loadu_ps(T), idx);
    const F hi = _mm256_permutevar8x32_ps(_mm256_loadu_ps(T + 8), idx);
    return _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(v, 28 - s)));
  }
};
BM_END_TARGET

BM_BEGIN_TARGET(BM_AVX512_TARGET)
struct Avx512 {
  static constexpr int W = 16;
  using F = __m512;
  using I = __m512i;
  using Mask = __mmask16;
  struct Lanes { I idx, sh; };

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static I set1i(int v) { return _mm512_set1_epi32(v); }
  static F loadu(const float* p) { return _mm512_loadu_ps(p); }
  static void storeu(float* p, F v) { _mm512_storeu_ps(p, v); }
  static Mask mask(int64_t k) {
    return k >= 16 ? (__mmask16)0xFFFF : (k <= 0 ? (__mmask16)0 : (__mmask16)((1u << k) - 1));
  }
  static F maskz_load(const float* p, Mask m) { return _mm512_maskz_loadu_ps(m, p); }
  static I maskz_loadi(const uint8_t* p, Mask m) { return _mm512_maskz_loadu_epi32(m, p); }
  static void mask_store(float* p, Mask m, F v) { _mm512_mask_storeu_ps(p, m, v); }
  static void store_tail(float* p, int64_t k, F v) { _mm512_mask_storeu_ps(p, mask(k), v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F sub(F a, F b) { return _mm512_sub_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static I srli(I v, int n) { return _mm512_srli_epi32(v, n); }
  static I srlv(I v, I n) { return _mm512_srlv_epi32(v, n); }
  static I andi(I a, I b) { return _mm512_and_si512(a, b); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static float reduce(F v) { return _mm512_reduce_add_ps(v); }
  // a span is one register of 16 lanes
  template <int B>
  static Lanes consts() {
    return {_mm512_load_si512(kLaneTab<B, 16, 16>.idx), _mm512_load_si512(kLaneTab<B, 16, 16>.sh)};
  }
  template <int B>
  static I span(const uint8_t* p, const Lanes& c) {
    if constexpr (B == 8) return _mm512_loadu_si512(p);
    else if constexpr (B == 4) return _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p));
    else if constexpr (B == 2) return _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
    else return _mm512_srlv_epi32(_mm512_permutexvar_epi8(c.idx, _mm512_loadu_si512(p)), c.sh);
  }
  // one vpermps: the 16-float table is one register
  static F lookup16(const float* T, I v, int s) {
    return _mm512_permutexvar_ps(s ? _mm512_srli_epi32(v, s) : v, _mm512_loadu_ps(T));
  }
};
BM_END_TARGET

}  // namespace bm
#endif  // BM_X86
