// bitmosaic low-bit matmul for the CPU: y = x W^T with W held as packed integer codes.
//
// Layout (see bitmosaic/kernels/qmatmul.py, LAYOUT_VERSION 2): the rows are cut into row blocks of
// `row_block` rows; block (rb, g) -- rows of rb x columns of group g -- has one bit width
// bits[rb, g] in 1..8.  Within row block rb every row has the same byte length rowlen[rb]; row r
// starts at base[rb] + (r - rb*row_block) * rowlen[rb] and its group g at goff[rb, g] bytes into the
// row.  A group of `len` codes at width b is cut into spans of 64 codes (the last one zero-padded),
// each span 8*b bytes read as a little-endian bit stream of 16 "lanes" of 4*b bits: lane i holds
// codes i, 16 + i, 32 + i, 48 + i of the span at bits 0, b, 2b, 3b of the lane.  So one SIMD
// register of 16 (AVX-512) or 8 (AVX2) 32-bit lanes, shifted by t*b and masked, holds 16 or 8
// consecutive codes -- the same three instructions for every width 1..8, any mix per block.
// W[n, j] = (c[n, j] - z[n, g]) * s[n, g], g = j / group_size.
//
// Decode (batch <= 8): y[m, n] = sum_g s[n,g] * (sum_{j in g} c[n,j] x[m,j] - z[n,g] * sum_{j in g} x[m,j]),
// the group sums of x computed once per call; codes are converted to float once and used for
// every row of x.  Prefill (batch > 8): a tile of rows is dequantized into a buffer (bitwise equal
// to the reference (c - z) * s: a subtraction, then a product, never contracted) and multiplied with
// at::mm; the whole weight never exists in float.
// ISA: AVX-512 (F, BW, VL, VBMI) / AVX2+FMA / portable C++, chosen at run time by the caller among
// those the CPU supports (isa_supported); every SIMD function carries its own target attribute, so
// the extension is compiled for the baseline x86-64 and loads on any CPU.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BM_X86 1
#define T_AVX2 __attribute__((target("avx2,fma")))
#define T_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma")))
#endif

namespace {

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

struct Layout {
  const uint8_t* data;
  const int64_t* base;
  const int64_t* rowlen;
  const int64_t* goff;   // [nrb, G]
  const uint8_t* bits;   // [nrb, G]
  const float* scales;   // [N, G]
  const float* zeros;    // [N, G]
  int64_t N, K, G, group_size, row_block;

  const uint8_t* row(int64_t n) const {
    const int64_t rb = n / row_block;
    return data + base[rb] + (n - rb * row_block) * rowlen[rb];
  }
  int64_t glen(int64_t g) const {
    const int64_t c0 = g * group_size;
    return (c0 + group_size <= K) ? group_size : K - c0;
  }
};

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // the buffer is padded by 64 bytes: never reads past it
  return w;
}

// The codes of one group as integers (portable): code j of span s sits at bit b * (4 * (j % 16) + (j % 64) / 16)
// of the span.
inline void decode_group(const uint8_t* p, int b, int64_t len, int32_t* out) {
  const uint64_t mask = (1ull << b) - 1;
  for (int64_t j = 0; j < len; ++j) {
    const int64_t bit = (j / 64) * 64 * b + b * (4 * (j % 16) + (j % 64) / 16);
    out[j] = (int32_t)((load64(p + (bit >> 3)) >> (bit & 7)) & mask);
  }
}

template <int M>
void gemv_rows_portable(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1) {
  std::vector<int32_t> c(L.group_size);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      decode_group(row + L.goff[rb * L.G + g], L.bits[rb * L.G + g], len, c.data());
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * L.K + c0;
        float acc = 0.f;
        for (int64_t j = 0; j < len; ++j) acc += (float)c[j] * xm[j];
        out[m] += s * (acc - z * xsum[m * L.G + g]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = out[m];
  }
}

void dequant_rows_portable(const Layout& L, int64_t r0, int64_t r1, float* out) {
  std::vector<int32_t> codes(L.group_size);
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float* o = out + (n - r0) * L.K;
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      decode_group(row + L.goff[rb * L.G + g], L.bits[rb * L.G + g], len, codes.data());
      for (int64_t j = 0; j < len; ++j) o[c0 + j] = ((float)codes[j] - z) * s;  // no contraction
    }
  }
}

#ifdef BM_X86
// ---------------------------------------------------------------- AVX-512: 16 lanes = one span
struct Lanes512 { __m512i idx, sh; };

// byte gather + per-lane shift so that lane i holds bits [4*b*i, 4*b*i + 32) of the span (compile-time tables)
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
#endif

bool isa_supported_(int64_t isa) {
  if (isa == kPortable) return true;
#ifdef BM_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512vbmi");
  if (isa == kAvx2) return avx2;
  if (isa == kAvx512) return avx512;
#endif
  return false;
}

template <int M>
void gemv_rows(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1, int64_t isa) {
#ifdef BM_X86
  if (isa == kAvx512) return gemv_rows_avx512<M>(L, x, xsum, y, n0, n1);
  if (isa == kAvx2) return gemv_rows_avx2<M>(L, x, xsum, y, n0, n1);
#endif
  gemv_rows_portable<M>(L, x, xsum, y, n0, n1);
}

void dequant_rows(const Layout& L, int64_t r0, int64_t r1, float* out, int64_t isa) {
#ifdef BM_X86
  if (isa == kAvx512) return dequant_rows_avx512(L, r0, r1, out);
  if (isa == kAvx2) return dequant_rows_avx2(L, r0, r1, out);
#endif
  dequant_rows_portable(L, r0, r1, out);
}

Layout make_layout(const torch::Tensor& data, const torch::Tensor& base, const torch::Tensor& rowlen,
                   const torch::Tensor& goff, const torch::Tensor& bits, const torch::Tensor& scales,
                   const torch::Tensor& zeros, int64_t K, int64_t group_size, int64_t row_block, int64_t isa) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && zeros.dtype() == torch::kFloat32, "scales/zeros must be float32");
  TORCH_CHECK(isa_supported_(isa), "kernel ISA ", isa, " is not supported by this CPU");
  Layout L;
  L.data = data.data_ptr<uint8_t>();
  L.base = base.data_ptr<int64_t>();
  L.rowlen = rowlen.data_ptr<int64_t>();
  L.goff = goff.data_ptr<int64_t>();
  L.bits = bits.data_ptr<uint8_t>();
  L.scales = scales.data_ptr<float>();
  L.zeros = zeros.data_ptr<float>();
  L.N = scales.size(0);
  L.G = scales.size(1);
  L.K = K;
  L.group_size = group_size;
  L.row_block = row_block;
  return L;
}

}  // namespace

torch::Tensor qmatmul(torch::Tensor x, torch::Tensor data, torch::Tensor base, torch::Tensor rowlen,
                      torch::Tensor goff, torch::Tensor bits, torch::Tensor scales, torch::Tensor zeros,
                      int64_t K, int64_t group_size, int64_t row_block, int64_t tile_rows, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.dtype() == torch::kFloat32, "x must be float32 [M, K]");
  x = x.contiguous();
  Layout L = make_layout(data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block, isa);
  const int64_t M = x.size(0);
  if (M == 0 || L.N == 0) return torch::zeros({M, L.N}, x.options());
  const float* xp = x.data_ptr<float>();
  if (M <= 8) {
    auto y = torch::empty({M, L.N}, x.options());
    float* yp = y.data_ptr<float>();
    std::vector<float> xsum(M * L.G, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < L.G; ++g) {
        const int64_t c0 = g * group_size, c1 = std::min(K, c0 + group_size);
        float s = 0.f;
        for (int64_t j = c0; j < c1; ++j) s += xp[m * K + j];
        xsum[m * L.G + g] = s;
      }
    const float* xs = xsum.data();
    at::parallel_for(0, L.N, 16, [&](int64_t n0, int64_t n1) {
      switch (M) {
        case 1: gemv_rows<1>(L, xp, xs, yp, n0, n1, isa); break;
        case 2: gemv_rows<2>(L, xp, xs, yp, n0, n1, isa); break;
        case 3: gemv_rows<3>(L, xp, xs, yp, n0, n1, isa); break;
        case 4: gemv_rows<4>(L, xp, xs, yp, n0, n1, isa); break;
        case 5: gemv_rows<5>(L, xp, xs, yp, n0, n1, isa); break;
        case 6: gemv_rows<6>(L, xp, xs, yp, n0, n1, isa); break;
        case 7: gemv_rows<7>(L, xp, xs, yp, n0, n1, isa); break;
        default: gemv_rows<8>(L, xp, xs, yp, n0, n1, isa); break;
      }
    });
    return y;
  }
  auto yt = torch::empty({L.N, M}, x.options());
  const auto xt = x.t();
  if (tile_rows < 0) {  // prefill, shared tiles: dequantized by all threads, then one parallel GEMM each
    const int64_t tr = -tile_rows;
    auto tile = torch::empty({std::min(tr, L.N), K}, x.options());
    for (int64_t r0 = 0; r0 < L.N; r0 += tr) {
      const int64_t r1 = std::min(L.N, r0 + tr);
      float* tp = tile.data_ptr<float>();
      at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequant_rows(L, a, b, tp + (a - r0) * K, isa); });
      auto dst = yt.narrow(0, r0, r1 - r0);
      at::mm_out(dst, tile.narrow(0, 0, r1 - r0), xt);
    }
    return yt.t().contiguous();
  }
  // prefill: each thread dequantizes its own tile of rows (cache-resident) and multiplies it at once
  const int64_t ntiles = (L.N + tile_rows - 1) / tile_rows;
  const at::ThreadLocalState tls;  // the caller's inference/grad mode for the tensor ops in the workers
  at::parallel_for(0, ntiles, 1, [&](int64_t t0, int64_t t1) {
    at::ThreadLocalStateGuard guard(tls);
    auto tile = torch::empty({std::min(tile_rows, L.N), K}, x.options());
    float* tp = tile.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t r0 = t * tile_rows, r1 = std::min(L.N, r0 + tile_rows);
      dequant_rows(L, r0, r1, tp, isa);
      auto dst = yt.narrow(0, r0, r1 - r0);
      at::mm_out(dst, tile.narrow(0, 0, r1 - r0), xt);
    }
  });
  return yt.t().contiguous();
}

torch::Tensor dequantize(torch::Tensor data, torch::Tensor base, torch::Tensor rowlen, torch::Tensor goff,
                         torch::Tensor bits, torch::Tensor scales, torch::Tensor zeros, int64_t K,
                         int64_t group_size, int64_t row_block, int64_t r0, int64_t r1, int64_t isa) {
  Layout L = make_layout(data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block, isa);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= L.N, "row range out of bounds");
  auto out = torch::empty({r1 - r0, K}, scales.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequant_rows(L, a, b, op + (a - r0) * K, isa); });
  return out;
}

bool isa_supported(int64_t isa) { return isa_supported_(isa); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "low-bit matmul y = x W^T");
  m.def("dequantize", &dequantize, "rows of W in float32");
  m.def("isa_supported", &isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
