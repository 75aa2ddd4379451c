// bitmosaic integer-activation matmul for the CPU: y = Q(x) W^T with int8 activations and integer
// weight codes, int32 sums per weight group, float32 scale products (bitmosaic/kernels/intmm.py).
//
// Activations: q = clamp(round(x / s_a), -qmax - 1, qmax) (int8, any width 2..8), s_a given per token,
// per tensor or per activation group (computed by the caller with formats/act.py, so the integers are
// the simulated path's).  Weights: W[n, j] = (c[n, j] - z[n, g]) s[n, g], codes c in 0..255 held as
// nibbles (widths 1-4) or bytes (5-8) in 16-row tiles (intmm_common.h).  Per output (m, n) and group g:
//   acc = sum_{j in g} c[n, j] q[m, j]   (exact int32: u8 x s8 products, |acc| < 2^31 for K < 65536)
//   y  += (acc - z[n, g] qsum[m, g]) * (s[n, g] s_a[m, g])
// ISA (isa.h numbering): avx512 runs vpdpbusd (AVX-512 VNNI; without VNNI the AVX2 body), avx2 runs
// vpmaddubsw + vpmaddwd (exact below 8 bits: 2 * 127 * 128 < 2^15; 8-bit codes are split into 7 low
// bits and the top bit), portable plain C++.

#include <torch/library.h>

#include "intmm_common.h"
#include "intmm_amx.h"

namespace {

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX2_TARGET)
struct IntAvx2 {
  static constexpr int R = 8;        // rows per register
  static constexpr int MB = 4;       // rows of x per tile: 8 accumulators + 4 weight registers of 16 ymm
  static constexpr int MB_RUNS = 2;  // runs mode: a float sum per accumulator as well
  using I = __m256i;
  using F = __m256;
  static I zero() { return _mm256_setzero_si256(); }
  static I load(const uint8_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
  static I set1_8(int v) { return _mm256_set1_epi8((char)v); }
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I srli16(I a, int n) { return _mm256_srli_epi16(a, n); }
  static I add(I a, I b) { return _mm256_add_epi32(a, b); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
  }
  template <bool B8>
  static I dot(I acc, I w, I a) {
    const I ones = _mm256_set1_epi16(1);
    if constexpr (!B8) return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), ones));
    else {
      const I lo = _mm256_and_si256(w, _mm256_set1_epi8(0x7f));
      const I top = _mm256_and_si256(_mm256_srli_epi16(w, 7), _mm256_set1_epi8(1));
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(lo, a), ones));
      return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(top, a), _mm256_set1_epi16(128)));
    }
  }
  static F fzero() { return _mm256_setzero_ps(); }
  static F loadf(const float* p) { return _mm256_loadu_ps(p); }
  static void storef(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F set1f(float v) { return _mm256_set1_ps(v); }
  static F cvt(I v) { return _mm256_cvtepi32_ps(v); }
  static F mulf(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm256_fnmadd_ps(a, b, c); }
  // VS: one scale per element (s[j]), else s[0] for all
  template <bool VS, class Q = int8_t>
  static void quant_t(const float* x, const float* s, float lo, float hi, Q* q, int64_t n) {
    const F lv = _mm256_set1_ps(lo), hv = _mm256_set1_ps(hi);
    alignas(32) int32_t t[8];
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
      const F sv = VS ? _mm256_loadu_ps(s + j) : _mm256_set1_ps(s[0]);
      const F r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + j), sv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_store_si256((__m256i*)t, _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lv), hv)));
      for (int k = 0; k < 8; ++k) q[j + k] = (Q)t[k];
    }
    quant_portable_t<VS>(x + j, VS ? s + j : s, lo, hi, q + j, n - j);
  }
  static void quant(const float* x, float s, float lo, float hi, int8_t* q, int64_t n) { quant_t<false>(x, &s, lo, hi, q, n); }
  static void quant32(const float* x, float s, float lo, float hi, int32_t* q, int64_t n) { quant_t<false>(x, &s, lo, hi, q, n); }
  static void quantv(const float* x, const float* s, float lo, float hi, int8_t* q, int64_t n) { quant_t<true>(x, s, lo, hi, q, n); }
  // max |x_j| over n values (the portable absmax's result: max(|x|, acc) keeps acc where x is NaN)
  static float absmax(const float* x, int64_t n) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      a = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), mask), a);
      b = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j + 8), mask), b);
    }
    for (; j + 8 <= n; j += 8) a = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + j), mask), a);
    alignas(32) float t[8];
    _mm256_store_ps(t, _mm256_max_ps(a, b));
    return std::max(absmax_portable(t, 8), absmax_portable(x + j, n - j));
  }
  // sum of n int8 values (exact int32): u8 ones x s8 pairs, then pairs of int16 into int32
  static int32_t sum_i8(const int8_t* q, int64_t n) {
    const __m256i ones8 = _mm256_set1_epi8(1), ones16 = _mm256_set1_epi16(1);
    __m256i acc = _mm256_setzero_si256();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32)
      acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ones8, _mm256_loadu_si256((const __m256i*)(q + j))), ones16));
    alignas(32) int32_t t[8];
    _mm256_store_si256((__m256i*)t, acc);
    int32_t s = 0;
    for (int k = 0; k < 8; ++k) s += t[k];
    for (; j < n; ++j) s += q[j];
    return s;
  }
  // rm[r] = max |g| over run r of `run` columns (a multiple of 8), R runs; 8 lanes, then 3 shuffles
  static void run_absmax(const float* g, int64_t run, int64_t R, float* rm) {
    const __m256 mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t r = 0; r < R; ++r) {
      __m256 a = _mm256_setzero_ps();
      for (int64_t c = 0; c < run; c += 8) a = _mm256_max_ps(a, _mm256_and_ps(_mm256_loadu_ps(g + r * run + c), mask));
      a = _mm256_max_ps(a, _mm256_permute2f128_ps(a, a, 1));
      a = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, 0x4E));
      a = _mm256_max_ps(a, _mm256_shuffle_ps(a, a, 0xB1));
      rm[r] = _mm256_cvtss_f32(a);
    }
  }
};
namespace avx2 {
#include "intmm_simd.h"
}  // namespace avx2
BM_END_TARGET

#define BM_VNNI_TARGET BM_AVX512_TARGET ",avx512vnni"
BM_BEGIN_TARGET(BM_VNNI_TARGET)
struct IntVnni {
  static constexpr int R = 16;
  static constexpr int MB = 16;      // 16 int32 accumulators (the float sums in memory) of 32 zmm registers
  static constexpr int MB_RUNS = 8;  // runs mode: 8 int32 accumulators + 8 float sums per run
  using I = __m512i;
  using F = __m512;
  static I zero() { return _mm512_setzero_si512(); }
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1_8(int v) { return _mm512_set1_epi8((char)v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I srli16(I a, int n) { return _mm512_srli_epi16(a, n); }
  static I add(I a, I b) { return _mm512_add_epi32(a, b); }
  static I bcast4(const int8_t* p) {
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
  }
  template <bool B8>
  static I dot(I acc, I w, I a) { return _mm512_dpbusd_epi32(acc, w, a); }
  static F fzero() { return _mm512_setzero_ps(); }
  static F loadf(const float* p) { return _mm512_loadu_ps(p); }
  static void storef(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F set1f(float v) { return _mm512_set1_ps(v); }
  static F cvt(I v) { return _mm512_cvtepi32_ps(v); }
  static F mulf(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F fnmadd(F a, F b, F c) { return _mm512_fnmadd_ps(a, b, c); }
  // the integers (int32 lanes) stored as Q: int8_t, or int32_t for 16-bit activations
  static void store(int8_t* q, __mmask16 k, __m512i v) { _mm512_mask_cvtepi32_storeu_epi8(q, k, v); }
  static void store(int32_t* q, __mmask16 k, __m512i v) { _mm512_mask_storeu_epi32(q, k, v); }
  template <bool VS, class Q = int8_t>
  static void quant_t(const float* x, const float* s, float lo, float hi, Q* q, int64_t n) {
    const F lv = _mm512_set1_ps(lo), hv = _mm512_set1_ps(hi);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      // masked-off lanes divide 0 by 1 (VS) and are not stored
      const F sv = VS ? _mm512_mask_loadu_ps(_mm512_set1_ps(1.f), k, s + j) : _mm512_set1_ps(s[0]);
      const F v = _mm512_div_ps(_mm512_maskz_loadu_ps(k, x + j), sv);
      const F r = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      store(q + j, k, _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lv), hv)));
    }
  }
  // One scale: x * (1 / s) instead of x / s where that cannot change the integer.  With u = 2^-24,
  // y = fl(x fl(1/s)) and fl(x/s) both lie within 3.0002 u |y| of x / s, so they round to the same integer
  // unless a half-integer lies within that distance of y; a vector with a lane within 16 u |y| of one
  // (or a scale outside [2^-100, 2^100], or NaN) is divided as quant_t does: the integers are the
  // division's, bit for bit (tests/kernels/test_intmm.py, half-integers +-ulps included).
  template <class Q>
  static void quant_q(const float* x, float s, float lo, float hi, Q* q, int64_t n) {
    if (!(s >= 0x1p-100f && s <= 0x1p100f)) return quant_t<false>(x, &s, lo, hi, q, n);
    const F sv = _mm512_set1_ps(s), inv = _mm512_set1_ps(1.f / s), half = _mm512_set1_ps(0.5f);
    const F tol = _mm512_set1_ps(0x1p-20f), lv = _mm512_set1_ps(lo), hv = _mm512_set1_ps(hi);
    constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      const F xv = _mm512_maskz_loadu_ps(k, x + j);
      const F y = _mm512_mul_ps(xv, inv);
      F r = _mm512_roundscale_ps(y, kNear);
      const F d = _mm512_abs_ps(_mm512_sub_ps(_mm512_abs_ps(_mm512_sub_ps(y, r)), half));
      if (_mm512_cmp_ps_mask(d, _mm512_mul_ps(tol, _mm512_abs_ps(y)), _CMP_LE_OQ))
        r = _mm512_roundscale_ps(_mm512_div_ps(xv, sv), kNear);
      store(q + j, k, _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(r, lv), hv)));
    }
  }
  static void quant(const float* x, float s, float lo, float hi, int8_t* q, int64_t n) { quant_q(x, s, lo, hi, q, n); }
  static void quant32(const float* x, float s, float lo, float hi, int32_t* q, int64_t n) { quant_q(x, s, lo, hi, q, n); }
  static void quantv(const float* x, const float* s, float lo, float hi, int8_t* q, int64_t n) { quant_t<true>(x, s, lo, hi, q, n); }
  // max |x_j| (masked tail; max(|x|, acc) keeps acc where x is NaN, as the portable absmax does)
  static float absmax(const float* x, int64_t n) {
    F a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 32 <= n; j += 32) {
      a = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j)), a);
      b = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(x + j + 16)), b);
    }
    for (; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      a = _mm512_max_ps(_mm512_abs_ps(_mm512_maskz_loadu_ps(k, x + j)), a);
    }
    return _mm512_reduce_max_ps(_mm512_max_ps(a, b));
  }
  // sum of n int8 values (exact int32): vpdpbusd of u8 ones against the s8 values, 64 a step
  static int32_t sum_i8(const int8_t* q, int64_t n) {
    const I ones = _mm512_set1_epi8(1);
    I acc = _mm512_setzero_si512();
    for (int64_t j = 0; j < n; j += 64) {
      const __mmask64 k = n - j >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << (n - j)) - 1);
      acc = _mm512_dpbusd_epi32(acc, ones, _mm512_maskz_loadu_epi8(k, q + j));
    }
    return _mm512_reduce_add_epi32(acc);
  }
  // v rounded to fp16 and back, in place (IEEE round to nearest even, subnormals kept: c10::Half's result)
  static void fp16_round(float* v, int64_t n) {
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 k = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, v + j), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm512_mask_storeu_ps(v + j, k, _mm512_cvtph_ps(h));
    }
  }
};
namespace vnni {
#include "intmm_simd.h"
}  // namespace vnni
BM_END_TARGET
#endif

bool vnni_supported() {
#ifdef BM_X86
  static const bool ok = bm::isa_supported(bm::kAvx512) && __builtin_cpu_supports("avx512vnni");
  return ok;
#else
  return false;
#endif
}

// The activation quantizer's parts for one ISA (AVX-512F parts run on any AVX-512 CPU; the group sums'
// vpdpbusd needs VNNI, else AVX2's)
struct QuantOps {
  QuantFn quant;
  QuantVFn quantv;
  AbsmaxFn absmax;
  SumFn sum;
  Quant32Fn quant32;  // 16-bit activations (quantize_rows_split)
};

QuantOps quant_ops(int64_t isa) {
#ifdef BM_X86
  if (isa == bm::kAvx512)
    return {&IntVnni::quant, &IntVnni::quantv, &IntVnni::absmax, vnni_supported() ? &IntVnni::sum_i8 : &IntAvx2::sum_i8,
            &IntVnni::quant32};
  if (isa == bm::kAvx2) return {&IntAvx2::quant, &IntAvx2::quantv, &IntAvx2::absmax, &IntAvx2::sum_i8, &IntAvx2::quant32};
#endif
  return {&quant_portable, &quantv_portable, &absmax_portable, &sum_i8_portable, &quant32_portable};
}

void run_rows(const IntLayout& L, const Acts& A, float* y, int64_t rb0, int64_t rb1, bool b8, int64_t isa) {
#ifdef BM_X86
  if (isa == bm::kAvx512 && vnni_supported()) return vnni::rows_any<IntVnni>(L, A, y, rb0, rb1, b8);
  if (isa == bm::kAvx512 || isa == bm::kAvx2) return avx2::rows_any<IntAvx2>(L, A, y, rb0, rb1, b8);
#endif
  rows_portable(L, A, y, rb0, rb1);
}

void check_f32(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dtype() == torch::kFloat32 && t.is_contiguous(), what, " must be contiguous float32");
}

}  // namespace

// (q [M, KP] int8, qsum [M, G] int32, sa) of x [M, K] under scales sa [Ms, Ga] (act group `ags` columns);
// an empty sa: dynamic scales computed here per token and group of `ags` columns (per token: ags >= K),
// max(amax / qmax, 1e-12) in float32 (the same operations as formats/act.py scale_from_amax without pow2).
// qmax = kSplitQmax: 16-bit activations, q [2M, KP] the high then the low halves (quantize_rows_split),
// qsum [2M, G], sa [2M, Ga] (256 s for the high halves, s for the low).
std::vector<torch::Tensor> quantize(torch::Tensor x, torch::Tensor sa, int64_t ags, double qmax, int64_t KP,
                                    int64_t gs, int64_t G, int64_t isa) {
  check_f32(x, "x");
  const int64_t M = x.size(0), K = x.size(1);
  bm::check_isa(isa);
  TORCH_CHECK((qmax >= 1 && qmax <= 127) || qmax == kSplitQmax, "qmax must be 1..127 (int8) or ", kSplitQmax,
              " (16-bit activations as two int8 halves)");
  const bool split = qmax == kSplitQmax;
  const QuantOps ops = quant_ops(isa);
  if (sa.numel() == 0) {
    ags = std::max<int64_t>(std::min(ags, K), 1);
    const int64_t Gd = (K + ags - 1) / ags;
    sa = torch::empty({M, std::max<int64_t>(Gd, 1)}, x.options());
    const float* xp = x.data_ptr<float>();
    float* sp = sa.data_ptr<float>();
    const float qm = (float)qmax, tiny = (float)1e-12;
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m) {
        for (int64_t a0 = 0, c = 0; c < Gd; ++c, a0 += ags) {
          const float a = ops.absmax(xp + m * K + a0, std::min(K, a0 + ags) - a0);
          sp[m * Gd + c] = std::max(a / qm, tiny);
        }
      }
    });
  }
  check_f32(sa, "activation scales");
  TORCH_CHECK(x.dim() == 2 && sa.dim() == 2 && KP >= x.size(1) && ags >= 1 && gs >= 1, "bad quantize arguments");
  TORCH_CHECK(sa.size(0) == 1 || sa.size(0) == M, "activation scales must have 1 or M rows");
  const int64_t rows = split ? 2 * M : M;  // split: the high halves, then the low ones (quantize_rows_split)
  auto q = torch::empty({rows, KP}, x.options().dtype(torch::kInt8));
  auto qsum = torch::empty({rows, G}, x.options().dtype(torch::kInt32));
  const float* xp = x.data_ptr<float>();
  const float* sp = sa.data_ptr<float>();
  int8_t* qp = q.data_ptr<int8_t>();
  int32_t* qs = qsum.data_ptr<int32_t>();
  const int64_t Ms = sa.size(0), Ga = sa.size(1);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    if (split) quantize_rows_split(xp, M, K, sp, Ms, Ga, ags, KP, gs, G, qp, qs, m0, m1, ops.quant32, ops.sum);
    else quantize_rows(xp, K, sp, Ms, Ga, ags, (float)qmax, KP, gs, G, qp, qs, m0, m1, ops.quant, ops.sum);
  });
  if (split) {  // the halves' scales [2M, Ga]: 256 s (a power of two: exact), then s -- raw loops: at decode
    // a few ATen calls per linear cost more than the kernel (profiled: +2.5 ms a SmolLM2 token)
    auto s2 = torch::empty({2 * M, Ga}, sa.options());
    float* o = s2.data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < Ga; ++c) {
        const float v = sp[(Ms == 1 ? 0 : m) * Ga + c];
        o[m * Ga + c] = v * 256.f;
        o[(M + m) * Ga + c] = v;
      }
    sa = s2;
  }
  return {q, qsum, sa};
}

namespace {

IntLayout layout_of(const torch::Tensor& data, const torch::Tensor& sc, const torch::Tensor& zc, int64_t KP, int64_t N,
                    int64_t G, int64_t gs, bool bytes) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  check_f32(sc, "weight scales");
  check_f32(zc, "zero-points");
  TORCH_CHECK(KP % 8 == 0 && (G == 1 || gs % 8 == 0), "bad integer layout");
  IntLayout L;
  L.data = data.data_ptr<uint8_t>();
  L.sc = sc.data_ptr<float>();
  L.zc = zc.data_ptr<float>();
  L.N = N;
  L.KP = KP;
  L.G = G;
  L.gs = gs;
  L.nrb = (N + 15) / 16;
  L.npairs = L.KP / 8;
  L.bytes = bytes;
  L.ldy = N;
  TORCH_CHECK(data.numel() >= L.nrb * L.npairs * L.pair_bytes(), "data is too short for the layout");
  TORCH_CHECK(sc.numel() == L.nrb * G * 16 && zc.numel() == sc.numel(), "scales/zeros must be [nrb, G, 16]");
  return L;
}

torch::Tensor run_all(const IntLayout& L, Acts A, const torch::Tensor& like, bool b8, int64_t isa) {
  auto y = torch::empty({A.M, L.N}, like.options());
  if (A.M == 0 || L.N == 0) return y;
  float* yp = y.data_ptr<float>();
  const bool amx = amx_applies(L, A, isa);  // prefill on AMX tiles: q as it is (intmm_amx.h)
  if (amx) ++amx_calls;
  const AmxTables tables = amx ? AmxTables(L, A) : AmxTables();
  std::vector<int8_t> panel;  // prefill on the SIMD kernels: q in 16-row panels (Acts::panel)
  if (!amx && A.M > 8 && !A.pcol && isa != bm::kPortable && A.ldq % 4 == 0) {
    panel.resize(((A.M + 15) / 16) * 16 * A.ldq);
    pack_panels(A.q, A.M, A.ldq, panel.data());
    A.panel = panel.data();
  }
  std::vector<float> scales_t;  // runs mode with a panel: the scales transposed (Acts::saT)
  if (A.panel && A.qz) {
    A.ldt = ((A.M + 15) / 16) * 16;
    scales_t.assign(A.Ga * A.ldt, 0.f);
    for (int64_t c = 0; c < A.Ga; ++c)
      for (int64_t m = 0; m < A.M; ++m) scales_t[c * A.ldt + m] = A.scale(m, c);
    A.saT = scales_t.data();
  }
  // prefill: tasks of up to 8 row blocks (128 rows: 256 KB of 4-bit weights at K=4096, in L2 while the
  // rows of x stream past them), at least 4 tasks per thread so that small matrices balance
  const int64_t per_thread = (L.nrb + 4 * at::get_num_threads() - 1) / (4 * at::get_num_threads());
  const int64_t chunk = std::max<int64_t>(1, std::min<int64_t>(8, per_thread));
  const int64_t nchunks = (L.nrb + chunk - 1) / chunk;
  at::parallel_for(0, A.M <= 8 ? L.nrb : nchunks, 1, [&](int64_t t0, int64_t t1) {
    if (A.M <= 8) return run_rows(L, A, yp, t0, t1, b8, isa);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t rb0 = t * chunk, rb1 = std::min(L.nrb, (t + 1) * chunk);
      if (amx) amx_rows(L, A, tables, yp, rb0, rb1);
      else run_rows(L, A, yp, rb0, rb1, b8, isa);
    }
  });
  return y;
}

}  // namespace

// y [M, N] float32 from quantized activations and the integer layout
torch::Tensor int_matmul(torch::Tensor q, torch::Tensor qsum, torch::Tensor sa, int64_t ratio, torch::Tensor data,
                         torch::Tensor sc, torch::Tensor zc, int64_t N, int64_t G, int64_t gs, bool bytes, bool b8,
                         int64_t isa) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q must be contiguous int8 [M, KP]");
  TORCH_CHECK(qsum.dtype() == torch::kInt32 && qsum.is_contiguous() && qsum.size(1) == G, "qsum must be int32 [M, G]");
  check_f32(sa, "activation scales");
  TORCH_CHECK(ratio >= 1, "bad integer layout");
  bm::check_isa(isa);
  const IntLayout L = layout_of(data, sc, zc, q.size(1), N, G, gs, bytes);
  TORCH_CHECK(qsum.size(0) == q.size(0) && (sa.size(0) == 1 || sa.size(0) == q.size(0)) && sa.dim() == 2,
              "qsum must have M rows and the activation scales 1 or M");
  Acts A{q.data_ptr<int8_t>(), qsum.data_ptr<int32_t>(), sa.data_ptr<float>(), q.size(0), sa.size(0), sa.size(1), ratio};
  A.ldq = L.KP;
  A.ldqs = G;
  A.lds = sa.size(1);
  return run_all(L, A, sc, b8, isa);
}

// Runs mode (Acts::qz): the activation scale changes every `run` columns inside a weight group (run a
// multiple of 8 dividing the group size, or any multiple of 8 with one group).  sa [Ms, G * sub] holds
// run r of group g at column g * sub + r (sub = runs per group; a shorter last group leaves its unused
// columns unread), qz [M, G] = sum_r s_a qsum over each group's runs.  y equals int_matmul with every run
// its own group up to float32 rounding.
torch::Tensor int_matmul_runs(torch::Tensor q, torch::Tensor qz, torch::Tensor sa, int64_t run, torch::Tensor data,
                              torch::Tensor sc, torch::Tensor zc, int64_t N, int64_t G, int64_t gs, bool bytes, bool b8,
                              int64_t isa) {
  TORCH_CHECK(q.dtype() == torch::kInt8 && q.is_contiguous() && q.dim() == 2, "q must be contiguous int8 [M, KP]");
  check_f32(qz, "qz");
  check_f32(sa, "activation scales");
  bm::check_isa(isa);
  const IntLayout L = layout_of(data, sc, zc, q.size(1), N, G, gs, bytes);
  const int64_t group_pairs = G == 1 ? L.npairs : gs / 8;
  TORCH_CHECK(run >= 8 && run % 8 == 0 && (G == 1 || gs % run == 0), "runs must be a multiple of 8 that divides the group size");
  const int64_t sub = (group_pairs + run / 8 - 1) / (run / 8);
  TORCH_CHECK(qz.dim() == 2 && qz.size(0) == q.size(0) && qz.size(1) == G, "qz must be float32 [M, G]");
  TORCH_CHECK(sa.dim() == 2 && (sa.size(0) == 1 || sa.size(0) == q.size(0)) && sa.size(1) == G * sub,
              "the activation scales must be [1 or M, G * runs per group]");
  Acts A{q.data_ptr<int8_t>(), nullptr, sa.data_ptr<float>(), q.size(0), sa.size(0), sa.size(1), 1};
  A.ldq = L.KP;
  A.ldqs = G;
  A.lds = sa.size(1);
  A.qz = qz.data_ptr<float>();
  A.sub = sub;
  A.run_pairs = run / 8;
  return run_all(L, A, sc, b8, isa);
}

#include "intmm_gather.h"

// Parts of the output added into y [M, N] in place (a block-sparse residual grouped by row block, e.g.
// MosaicQuant's in kernels/mosaic.py MosaicIntActWeight): part p (a row of parts: r0, rows, pc0, ncols,
// g0, G) is a 4-bit integer weight [rows, ncols] (nibble layout, zero-points and scales in its own
// [nrb, G, 16] tables, group size gs) whose pair i of 8 columns reads the activations rq [M, W] at column
// pcols[pc0 + i] (the blocks' own columns: nothing is gathered), with group sums rqs [M, Gtot] and, per
// group, activation scales rsa [Ms, Gtot] from column g0 (or [Ms, 1]: per token or tensor).  The parts'
// tables lie one after another in data / sc / zc.  Parts write disjoint rows; the (part, row block)
// tasks are split across threads.
void int_parts(torch::Tensor y, torch::Tensor rq, torch::Tensor rqs, torch::Tensor rsa, torch::Tensor data,
               torch::Tensor sc, torch::Tensor zc, torch::Tensor parts, torch::Tensor pcols, int64_t gs, int64_t isa) {
  TORCH_CHECK(y.dtype() == torch::kFloat32 && y.is_contiguous() && y.dim() == 2, "y must be contiguous float32 [M, N]");
  TORCH_CHECK(rq.dtype() == torch::kInt8 && rq.is_contiguous() && rq.dim() == 2, "rq must be contiguous int8 [M, W]");
  TORCH_CHECK(rqs.dtype() == torch::kInt32 && rqs.is_contiguous() && rqs.dim() == 2, "rqs must be int32 [M, Gtot]");
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  TORCH_CHECK(parts.dtype() == torch::kLong && parts.is_contiguous() && parts.dim() == 2 && parts.size(1) == 6,
              "parts must be int64 [P, 6]");
  TORCH_CHECK(pcols.dtype() == torch::kInt && pcols.is_contiguous() && pcols.dim() == 1, "pcols must be int32 [pairs]");
  check_f32(rsa, "activation scales");
  check_f32(sc, "weight scales");
  check_f32(zc, "zero-points");
  bm::check_isa(isa);
  const int64_t M = y.size(0), N = y.size(1), W = rq.size(1), Gt = rqs.size(1), P = parts.size(0);
  TORCH_CHECK(rq.size(0) == M && rqs.size(0) == M && rsa.dim() == 2 && (rsa.size(0) == 1 || rsa.size(0) == M),
              "rq, rqs need M rows and the activation scales 1 or M");
  TORCH_CHECK(rsa.size(1) == 1 || rsa.size(1) == Gt, "activation scales must have 1 or Gtot columns");
  TORCH_CHECK(gs >= 8 && gs % 8 == 0, "the parts' group size must be a multiple of 8");
  const int32_t* pc = pcols.data_ptr<int32_t>();
  for (int64_t i = 0; i < pcols.numel(); ++i) TORCH_CHECK(pc[i] >= 0 && pc[i] + 8 <= W, "pair column out of range");
  const int64_t* pt = parts.data_ptr<int64_t>();
  std::vector<IntLayout> Ls(P);
  std::vector<Acts> As(P);
  std::vector<int64_t> task0(P + 1, 0);
  int64_t doff = 0, soff = 0;
  for (int64_t p = 0; p < P; ++p) {
    const int64_t r0 = pt[6 * p], rows = pt[6 * p + 1], pc0 = pt[6 * p + 2], nc = pt[6 * p + 3];
    const int64_t g0 = pt[6 * p + 4], G = pt[6 * p + 5];
    TORCH_CHECK(r0 >= 0 && rows >= 1 && r0 + rows <= N && nc >= 8 && nc % 8 == 0 && pc0 >= 0 &&
                    pc0 + nc / 8 <= pcols.numel() && g0 >= 0 && G >= 1 && g0 + G <= Gt && G * gs == nc,
                "part ", p, " lies outside the output, its pair columns or its groups");
    IntLayout& L = Ls[p];
    L.N = rows;
    L.KP = nc;
    L.G = G;
    L.gs = gs;
    L.nrb = (rows + 15) / 16;
    L.npairs = nc / 8;
    L.bytes = false;
    L.ldy = N;
    L.accumulate = true;
    L.data = data.data_ptr<uint8_t>() + doff;
    L.sc = sc.data_ptr<float>() + soff;
    L.zc = zc.data_ptr<float>() + soff;
    doff += L.nrb * L.npairs * 64;
    soff += L.nrb * G * 16;
    const bool per_group = rsa.size(1) > 1;
    As[p] = Acts{rq.data_ptr<int8_t>(), rqs.data_ptr<int32_t>() + g0,
                 rsa.data_ptr<float>() + (per_group ? g0 : 0), M, rsa.size(0), per_group ? G : 1,
                 per_group ? 1 : G};
    As[p].ldq = W;
    As[p].ldqs = Gt;
    As[p].lds = rsa.size(1);
    As[p].pcol = pc + pc0;
    task0[p + 1] = task0[p] + L.nrb;
  }
  TORCH_CHECK(data.numel() >= doff && sc.numel() >= soff && zc.numel() >= soff, "data or scale tables too short");
  if (M == 0 || P == 0) return;
  float* yp = y.data_ptr<float>();
  const int64_t tasks = task0[P];
  // small work runs on the calling thread (a parallel region costs more than it saves)
  const int64_t grain = M * pcols.numel() * 8 * 16 < (1 << 18) ? tasks : 1;
  at::parallel_for(0, tasks, grain, [&](int64_t t0, int64_t t1) {
    int64_t p = std::upper_bound(task0.begin(), task0.end(), t0) - task0.begin() - 1;
    for (int64_t t = t0; t < t1; ++t) {
      while (t >= task0[p + 1]) ++p;
      const int64_t rb = t - task0[p];
      run_rows(Ls[p], As[p], yp + pt[6 * p], rb, rb + 1, false, isa);
    }
  });
}

// quantize + int_matmul in one call: a linear layer with INT activations (ops.py int_linear).  Registered
// as the CPU kernel of the operator bitmosaic::int_linear below, so a compiled graph reaches it through
// the dispatcher with no Python in between (a Python kernel cost about 5.5 us more per call: 12.8 vs 7.3 us, measured).
torch::Tensor int_linear(torch::Tensor x, std::optional<torch::Tensor> act_scale, int64_t ags, double qmax, int64_t KP,
                         int64_t ratio, torch::Tensor data, torch::Tensor sc, torch::Tensor zc, int64_t N, int64_t G,
                         int64_t gs, bool bytes, bool b8, int64_t isa) {
  auto sa = act_scale.has_value() ? act_scale->to(torch::kFloat32).contiguous() : torch::empty({0}, x.options());
  auto r = quantize(x.contiguous(), sa, ags, qmax, KP, gs, G, isa);
  auto y = int_matmul(r[0], r[1], r[2], ratio, data, sc, zc, N, G, gs, bytes, b8, isa);
  if (qmax != kSplitQmax) return y;
  const int64_t M = x.size(0);  // 16-bit activations: the high halves' product plus the low halves'
  auto out = torch::empty({M, N}, y.options());
  const float* yp = y.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, M, M * N < (1 << 16) ? M : 1, [&](int64_t m0, int64_t m1) {
    for (int64_t i = m0 * N; i < m1 * N; ++i) op[i] = yp[i] + yp[M * N + i];
  });
  return out;
}

TORCH_LIBRARY_FRAGMENT(bitmosaic, m) {
  m.def(
      "int_linear(Tensor x, Tensor? act_scale, int act_group, float qmax, int KP, int ratio, Tensor data, "
      "Tensor sc, Tensor zc, int N, int G, int group_size, bool bytes_layout, bool b8, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(bitmosaic, CPU, m) { m.impl("int_linear", &int_linear); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int_linear", &int_linear, "quantize + int_matmul in one call");
  m.def("quantize", &quantize, "int8 activations and their group sums");
  m.def("int_matmul", &int_matmul, "y = Q(x) W^T from int8 activations and integer weight codes");
  m.def("int_matmul_runs", &int_matmul_runs, "int_matmul with activation scales that change inside weight groups");
  m.def("quantize_gathered", &quantize_gathered, "symmetric quantization of gathered columns in scale runs");
  m.def("int_parts", &int_parts, "y += row-block parts' integer products over gathered activations, in place");
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
  m.def("vnni_supported", &vnni_supported, "whether the avx512 ISA runs AVX-512 VNNI (vpdpbusd)");
  m.def("amx_call_count", &amx_call_count, "calls that ran on the AMX body in this process");
  m.def("amx_enabled", &amx_enabled,
        "whether prefill on the avx512 ISA runs on AMX-INT8 tiles: CPU and OS support, $BITMOSAIC_AMX not 0");
}
