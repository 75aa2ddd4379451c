// bitmosaic C++ kernel: the approximate pass of the MSE scale search (algorithms/scales.py, issue 74).
//
// For every row r of w [R, n] (float32) and candidate c (scale S[r, c], zero Z[r, c], float32 as the
// torch search derives them), the error sum_j |w_j - Q(w_j)|^2.4 is evaluated with
//   * the distance d = |(clamp(round(w / s) + z, 0, maxq) - z) * s - w| computed with exactly torch's
//     float32 operations (correctly rounded add/mul/sub, round half to even; the quotient's rounding
//     from w * (1/s) where that provably agrees, else the division: round_div), so d is torch's d;
//   * d^2.4 approximated (pow24 below) within a relative error kApproxRel, checked exhaustively over
//     every float32 mantissa and exponent by tests/kernels/test_scale_search.py;
//   * the sum accumulated in double.
// Candidates are pruned per row as soon as their partial sum (nonnegative terms: a lower bound of the
// full approximate sum) exceeds the survivor threshold of the best full sum seen so far.  A candidate
// survives when  A_c (1 - kappa) <= A_min (1 + kappa) + 2 alpha,  where |E_c - A_c| <= kappa A_c + alpha
// bounds the gap to torch's float32 error E_c (Python passes kappa and alpha, see kernels/scale_search.py);
// then the true first minimum of E is a survivor.  Output per row: the winner when one candidate
// survives, -1 when several do (their flags in `alive`, re-evaluated exactly by torch), -2 when the
// row holds a non-finite value (left to the torch search).
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "isa.h"

namespace {

// m^2.4 ~ P(m - 1.5) on [1, 2), Horner with FMA in float32 (fitted for relative error)
constexpr float kP0 = 2.6461777687072754f, kP1 = 4.233884811401367f, kP2 = 1.975809097290039f,
                kP3 = 0.1756083071231842f, kP4 = -0.017517898231744766f, kP5 = 0.003910599742084742f,
                kP6 = -0.0012464994797483087f;
// 2^(2.4 r), r = 0..4 (16 entries for the AVX-512 permute; 8 used by AVX2)
alignas(64) const float kT[16] = {1.0f, 5.278031643091577f, 27.857618025475976f, 147.0333894396205f,
                                  776.0469894475276f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
constexpr int kBlock = 32;  // columns between pruning checks

struct Args {
  const float *w, *S, *Z;
  int64_t R, n, C;
  float maxq;
  double kappa, alpha2;
  int32_t* win;
  uint8_t* alive;
};


inline float poly(float t) {
  float p = kP6;
  p = std::fmaf(p, t, kP5);
  p = std::fmaf(p, t, kP4);
  p = std::fmaf(p, t, kP3);
  p = std::fmaf(p, t, kP2);
  p = std::fmaf(p, t, kP1);
  return std::fmaf(p, t, kP0);
}

inline double pow2i(int e) {  // 2^e for -1022 <= e <= 1023
  uint64_t b = (uint64_t)(e + 1023) << 52;
  double d;
  std::memcpy(&d, &b, 8);
  return d;
}

// d^2.4 for a finite d >= 0: d = 2^(k-127) m, k - 127 = 5 j + r - 150, so d^2.4 = m^2.4 2^(2.4 r) 2^(12 j - 360).
// Zero and subnormal d (k = 0) give 0 (their true value is below 2^-302).
inline double pow24_scalar(float d) {
  uint32_t b;
  std::memcpy(&b, &d, 4);
  const int k = (int)(b >> 23);
  if (k == 0) return 0.0;
  const uint32_t mb = (b & 0x7FFFFFu) | 0x3F800000u;
  float m;
  std::memcpy(&m, &mb, 4);
  const int kk = k + 23;
  const int j = (int)std::floor((float)kk * 0.2f);
  const int r = kk - 5 * j;
  const float f = poly(m - 1.5f) * kT[r];
  return (double)f * pow2i(12 * j - 360);
}

inline float dist_scalar(float x, float s, float z, float maxq) {
  float q = std::nearbyint(x / s) + z;
  q = std::min(std::max(q, 0.0f), maxq);
  return std::fabs((q - z) * s - x);
}

namespace portable {
BM_INLINE double block(const float* w, int64_t c0, int64_t c1, float s, float z, float maxq) {
  double acc = 0.0;
  for (int64_t j = c0; j < c1; ++j) acc += pow24_scalar(dist_scalar(w[j], s, z, maxq));
  return acc;
}
#include "scalesearch_rows.h"
}  // namespace portable

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX512_TARGET)
namespace avx512 {
// round(x / s) as torch computes it (correctly rounded quotient, half to even), from x * (1/s): the two
// quotients differ by less than 2^-22 |y|, so they round alike unless a half-integer lies within
// 2^-21 |y| of y; such a vector (rare) takes the division.
BM_INLINE __m512 round_div(__m512 x, __m512 s, __m512 inv) {
  constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m512 y = _mm512_mul_ps(x, inv);
  const __m512 ry = _mm512_roundscale_ps(y, kNear);
  const __m512 half = _mm512_abs_ps(_mm512_sub_ps(_mm512_abs_ps(_mm512_sub_ps(y, ry)), _mm512_set1_ps(0.5f)));
  const __mmask16 risky = _mm512_cmp_ps_mask(half, _mm512_mul_ps(_mm512_abs_ps(y), _mm512_set1_ps(0x1p-21f)), _CMP_LE_OQ);
  if (__builtin_expect(risky != 0, 0)) return _mm512_roundscale_ps(_mm512_div_ps(x, s), kNear);
  return ry;
}

BM_INLINE void acc16(__m512 x, __m512 s, __m512 inv, __m512 z, __m512 maxq, __m512d& a0, __m512d& a1) {
  __m512 q = round_div(x, s, inv);
  q = _mm512_min_ps(_mm512_max_ps(_mm512_add_ps(q, z), _mm512_setzero_ps()), maxq);
  __m512 d = _mm512_sub_ps(_mm512_mul_ps(_mm512_sub_ps(q, z), s), x);
  const __m512i b = _mm512_and_si512(_mm512_castps_si512(d), _mm512_set1_epi32(0x7FFFFFFF));  // |d|
  const __m512i k = _mm512_srli_epi32(b, 23);
  const __mmask16 nz = _mm512_cmpneq_epi32_mask(k, _mm512_setzero_si512());
  const __m512 m = _mm512_castsi512_ps(
      _mm512_or_si512(_mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFF)), _mm512_set1_epi32(0x3F800000)));
  const __m512i kk = _mm512_add_epi32(k, _mm512_set1_epi32(23));
  const __m512 jf = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(kk), _mm512_set1_ps(0.2f)),
                                         _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512i j = _mm512_cvtps_epi32(jf);
  const __m512i r = _mm512_sub_epi32(kk, _mm512_add_epi32(_mm512_slli_epi32(j, 2), j));
  const __m512 t = _mm512_sub_ps(m, _mm512_set1_ps(1.5f));
  __m512 p = _mm512_set1_ps(kP6);
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kP5));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kP4));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kP3));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kP2));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kP1));
  p = _mm512_fmadd_ps(p, t, _mm512_set1_ps(kP0));
  const __m512 f = _mm512_maskz_mul_ps(nz, p, _mm512_permutexvar_ps(r, _mm512_load_ps(kT)));
  // 2^(12 j - 360) as doubles: exponent field 12 j - 360 + 1023
  const __m512i e = _mm512_add_epi32(_mm512_add_epi32(_mm512_slli_epi32(j, 3), _mm512_slli_epi32(j, 2)),
                                     _mm512_set1_epi32(1023 - 360));
  const __m512d e0 = _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_castsi512_si256(e)), 52));
  const __m512d e1 =
      _mm512_castsi512_pd(_mm512_slli_epi64(_mm512_cvtepi32_epi64(_mm512_extracti64x4_epi64(e, 1)), 52));
  a0 = _mm512_add_pd(a0, _mm512_mul_pd(_mm512_cvtps_pd(_mm512_castps512_ps256(f)), e0));
  a1 = _mm512_add_pd(a1, _mm512_mul_pd(_mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1))), e1));
}

BM_INLINE double block(const float* w, int64_t c0, int64_t c1, float s, float z, float maxq) {
  const __m512 vs = _mm512_set1_ps(s), vz = _mm512_set1_ps(z), vm = _mm512_set1_ps(maxq);
  const __m512 vi = _mm512_set1_ps(1.0f / s);
  __m512d a0 = _mm512_setzero_pd(), a1 = _mm512_setzero_pd();
  int64_t j = c0;
  for (; j + 16 <= c1; j += 16) acc16(_mm512_loadu_ps(w + j), vs, vi, vz, vm, a0, a1);
  if (j < c1) {  // masked-off lanes read 0: d = 0 (z is an integer in [0, maxq]), so they add 0
    const __mmask16 mk = (__mmask16)((1u << (c1 - j)) - 1u);
    acc16(_mm512_maskz_loadu_ps(mk, w + j), vs, vi, vz, vm, a0, a1);
  }
  return _mm512_reduce_add_pd(_mm512_add_pd(a0, a1));
}
#include "scalesearch_rows.h"
}  // namespace avx512
BM_END_TARGET

BM_BEGIN_TARGET(BM_AVX2_TARGET)
namespace avx2 {
BM_INLINE __m256 abs8(__m256 v) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), v); }

BM_INLINE __m256 round_div(__m256 x, __m256 s, __m256 inv) {  // as avx512::round_div
  constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  const __m256 y = _mm256_mul_ps(x, inv);
  const __m256 ry = _mm256_round_ps(y, kNear);
  const __m256 half = abs8(_mm256_sub_ps(abs8(_mm256_sub_ps(y, ry)), _mm256_set1_ps(0.5f)));
  const __m256 risky = _mm256_cmp_ps(half, _mm256_mul_ps(abs8(y), _mm256_set1_ps(0x1p-21f)), _CMP_LE_OQ);
  if (__builtin_expect(_mm256_movemask_ps(risky) != 0, 0)) return _mm256_round_ps(_mm256_div_ps(x, s), kNear);
  return ry;
}

BM_INLINE void acc8(__m256 x, __m256 s, __m256 inv, __m256 z, __m256 maxq, __m256d& a0, __m256d& a1) {
  __m256 q = round_div(x, s, inv);
  q = _mm256_min_ps(_mm256_max_ps(_mm256_add_ps(q, z), _mm256_setzero_ps()), maxq);
  __m256 d = _mm256_sub_ps(_mm256_mul_ps(_mm256_sub_ps(q, z), s), x);
  const __m256i b = _mm256_and_si256(_mm256_castps_si256(d), _mm256_set1_epi32(0x7FFFFFFF));
  const __m256i k = _mm256_srli_epi32(b, 23);
  const __m256 nz = _mm256_castsi256_ps(_mm256_cmpgt_epi32(k, _mm256_setzero_si256()));
  const __m256 m = _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x3F800000)));
  const __m256i kk = _mm256_add_epi32(k, _mm256_set1_epi32(23));
  const __m256 jf = _mm256_round_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(kk), _mm256_set1_ps(0.2f)),
                                    _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m256i j = _mm256_cvtps_epi32(jf);
  const __m256i r = _mm256_sub_epi32(kk, _mm256_add_epi32(_mm256_slli_epi32(j, 2), j));
  const __m256 t = _mm256_sub_ps(m, _mm256_set1_ps(1.5f));
  __m256 p = _mm256_set1_ps(kP6);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kP5));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kP4));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kP3));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kP2));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kP1));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(kP0));
  const __m256 f = _mm256_and_ps(nz, _mm256_mul_ps(p, _mm256_permutevar8x32_ps(_mm256_load_ps(kT), r)));
  const __m256i e = _mm256_add_epi32(_mm256_add_epi32(_mm256_slli_epi32(j, 3), _mm256_slli_epi32(j, 2)),
                                     _mm256_set1_epi32(1023 - 360));
  const __m256d e0 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_castsi256_si128(e)), 52));
  const __m256d e1 = _mm256_castsi256_pd(_mm256_slli_epi64(_mm256_cvtepi32_epi64(_mm256_extracti128_si256(e, 1)), 52));
  a0 = _mm256_add_pd(a0, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(f)), e0));
  a1 = _mm256_add_pd(a1, _mm256_mul_pd(_mm256_cvtps_pd(_mm256_extractf128_ps(f, 1)), e1));
}

BM_INLINE double block(const float* w, int64_t c0, int64_t c1, float s, float z, float maxq) {
  const __m256 vs = _mm256_set1_ps(s), vz = _mm256_set1_ps(z), vm = _mm256_set1_ps(maxq);
  const __m256 vi = _mm256_set1_ps(1.0f / s);
  __m256d a0 = _mm256_setzero_pd(), a1 = _mm256_setzero_pd();
  int64_t j = c0;
  for (; j + 8 <= c1; j += 8) acc8(_mm256_loadu_ps(w + j), vs, vi, vz, vm, a0, a1);
  if (j < c1) {
    const __m256i mk = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)(c1 - j)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    acc8(_mm256_maskload_ps(w + j, mk), vs, vi, vz, vm, a0, a1);
  }
  alignas(32) double t[4];
  _mm256_store_pd(t, _mm256_add_pd(a0, a1));
  return (t[0] + t[1]) + (t[2] + t[3]);
}
#include "scalesearch_rows.h"
}  // namespace avx2
BM_END_TARGET
#endif


// The candidates' scales and zeros [R, C] of rows with range [xmin[r], xmax[r]] shrunk by ps[c]: the float32
// operations of algorithms/scales.py range_scale_zero(xmin * p, xmax * p, grid, check=False), in its order
// (its torch ops are elementwise and correctly rounded, so each value is the same float):
//   lo = min(p xmin, 0), hi = max(p xmax, 0) (NaN kept, as torch.minimum / maximum);
//   scale = (2 max(|lo|, hi)) / maxq (symmetric) or (hi - lo) / maxq, at least 2^-24, then the smallest
//   float16 value >= it (fp16_ceil: round to nearest even, one float16 step up where that fell below);
//   zero = sym_zero, or clamp(round_half_even(-lo / scale), 0, maxq).
// The torch form took most of the compiled search's time (elementwise passes over [R, 80], float16
// conversions and nextafter unvectorized); tests/kernels/test_scale_search.py checks it bit for bit.
inline float fp16_ceil(float x) {
  const float h = static_cast<float>(c10::Half(x));  // round to nearest even
  if (!(h < x)) return h;                            // also NaN
  c10::Half up(x);
  up.x = static_cast<uint16_t>(up.x + 1);  // x > 0 here (at least 2^-24): the next float16 up (+inf past 65504)
  return static_cast<float>(up);
}

std::vector<torch::Tensor> candidate_scales(torch::Tensor xmin, torch::Tensor xmax, torch::Tensor ps, int64_t maxq,
                                            bool sym, int64_t sym_zero) {
  TORCH_CHECK(xmin.dim() == 1 && xmin.scalar_type() == torch::kFloat && xmin.is_contiguous(), "xmin: float32 [R]");
  TORCH_CHECK(xmax.sizes() == xmin.sizes() && xmax.scalar_type() == torch::kFloat && xmax.is_contiguous(),
              "xmax: float32 [R]");
  TORCH_CHECK(ps.dim() == 1 && ps.scalar_type() == torch::kFloat && ps.is_contiguous(), "ps: float32 [C]");
  TORCH_CHECK(maxq >= 1 && maxq <= 255, "bad maxq");
  const int64_t R = xmin.size(0), C = ps.size(0);
  auto S = torch::empty({R, C}, torch::kFloat), Z = torch::empty({R, C}, torch::kFloat);
  const float *a = xmin.data_ptr<float>(), *b = xmax.data_ptr<float>(), *p = ps.data_ptr<float>();
  float *sp = S.data_ptr<float>(), *zp = Z.data_ptr<float>();
  const float mq = static_cast<float>(maxq), sz = static_cast<float>(sym_zero), tiny = 5.9604644775390625e-08f;
  at::parallel_for(0, R, 256, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = 0; c < C; ++c) {
        float lo = a[r] * p[c], hi = b[r] * p[c];
        lo = std::isnan(lo) ? lo : (lo < 0.0f ? lo : 0.0f);
        hi = std::isnan(hi) ? hi : (hi > 0.0f ? hi : 0.0f);
        float scale;
        if (sym) {
          const float al = std::fabs(lo);
          const float amax = (std::isnan(al) || std::isnan(hi)) ? std::numeric_limits<float>::quiet_NaN()
                                                                : (al > hi ? al : hi);
          scale = (2.0f * amax) / mq;
        } else {
          scale = (hi - lo) / mq;
        }
        scale = fp16_ceil(scale < tiny ? tiny : scale);
        float z = sz;
        if (!sym) {
          z = std::nearbyint(-lo / scale);
          z = z < 0.0f ? 0.0f : (z > mq ? mq : z);
        }
        sp[r * C + c] = scale;
        zp[r * C + c] = z;
      }
  });
  return {S, Z};
}

// -> (win int32 [R], alive uint8 [R, C]; rows with win >= 0 or -2: alive not written)
std::vector<torch::Tensor> mse_survivors(torch::Tensor w, torch::Tensor S, torch::Tensor Z, int64_t maxq,
                                         double kappa, double alpha2, int64_t isa) {
  bm::check_isa(isa);
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kFloat && w.is_contiguous(), "w: float32 [R, n]");
  const int64_t R = w.size(0), n = w.size(1);
  TORCH_CHECK(S.dim() == 2 && S.size(0) == R && S.scalar_type() == torch::kFloat && S.is_contiguous(),
              "scales: float32 [R, C]");
  TORCH_CHECK(Z.sizes() == S.sizes() && Z.scalar_type() == torch::kFloat && Z.is_contiguous(), "zeros: float32 [R, C]");
  TORCH_CHECK(maxq >= 1 && maxq <= 255 && n >= 1 && kappa >= 0 && kappa < 0.5 && alpha2 >= 0, "bad arguments");
  const int64_t C = S.size(1);
  TORCH_CHECK(C >= 1, "no candidates");
  auto win = torch::empty({R}, torch::kInt);
  auto alive = torch::empty({R, C}, torch::kByte);
  const Args a{w.data_ptr<float>(), S.data_ptr<float>(), Z.data_ptr<float>(), R, n, C, (float)maxq,
               kappa, alpha2, win.data_ptr<int32_t>(), alive.data_ptr<uint8_t>()};
#ifdef BM_X86
  if (isa == bm::kAvx512) {
    avx512::search_rows(a);
    return {win, alive};
  }
  if (isa == bm::kAvx2) {
    avx2::search_rows(a);
    return {win, alive};
  }
#endif
  portable::search_rows(a);
  return {win, alive};
}

// The approximation of |d|^2.4 per element, as each ISA computes it (float64 out), for the bound test.
torch::Tensor pow24(torch::Tensor d, int64_t isa) {
  bm::check_isa(isa);
  TORCH_CHECK(d.dim() == 1 && d.scalar_type() == torch::kFloat && d.is_contiguous(), "d: float32 [N]");
  const int64_t N = d.numel();
  auto out = torch::empty({N}, torch::kDouble);
  const float* p = d.data_ptr<float>();
  double* o = out.data_ptr<double>();
  at::parallel_for(0, N, 4096, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
#ifdef BM_X86
      if (isa == bm::kAvx512) { o[i] = avx512::pow24_one(p + i); continue; }
      if (isa == bm::kAvx2) { o[i] = avx2::pow24_one(p + i); continue; }
#endif
      o[i] = portable::pow24_one(p + i);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mse_survivors", &mse_survivors,
        "approximate MSE scale search with pruning: (winner per row or -1/-2, survivor flags [C, R])",
        py::arg("w"), py::arg("scales"), py::arg("zeros"), py::arg("maxq"), py::arg("kappa"), py::arg("alpha2"),
        py::arg("isa"));
  m.def("candidate_scales", &candidate_scales,
        "the MSE search's candidate scales and zeros [R, C] (range_scale_zero of xmin * p, xmax * p)", py::arg("xmin"),
        py::arg("xmax"), py::arg("ps"), py::arg("maxq"), py::arg("sym"), py::arg("sym_zero"));
  m.def("pow24", &pow24, "the kernel's |d|^2.4 approximation per element (float64)", py::arg("d"), py::arg("isa"));
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
