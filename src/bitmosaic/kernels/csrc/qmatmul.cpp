// bitmosaic low-bit matmul for the CPU: y = x W^T with W held as packed integer codes.
//
// Layout (see bitmosaic/kernels/qmatmul.py, LAYOUT_VERSION 1): the rows are cut into row blocks of
// `row_block` rows; block (rb, g) -- rows of rb x columns of group g -- has one bit width
// bits[rb, g] in 1..8.  Within row block rb every row has the same byte length rowlen[rb]; row r
// starts at base[rb] + (r - rb*row_block) * rowlen[rb] and its group g at goff[rb, g] bytes into the
// row, packed like bitmosaic.formats.packing (chunks of 8 codes in `bits` bytes, little-endian, the
// group's last chunk zero-padded).  W[n, j] = (c[n, j] - z[n, g]) * s[n, g], g = j / group_size.
//
// Decode (batch <= 8): each output row is a dot product computed group by group,
//   y[m, n] = sum_g s[n,g] * (sum_{j in g} c[n,j] x[m,j] - z[n,g] * sum_{j in g} x[m,j]),
// with the group sums of x computed once per call.  A chunk of 8 codes is one unaligned 64-bit
// load; AVX2 splits it into two 32-bit halves (codes 0-3 and 4-7), shifts every lane by its code's
// position (vpsrlvd), masks, converts to float and multiplies-adds with 8 activations.  Every width
// 1..8 takes the same path, so any mix per block costs no branch inside a group.
// Prefill (batch > 8): a tile of rows is dequantized into a per-call float buffer (bitwise equal
// to the reference (c - z) * s) and multiplied with at::mm; the whole weight never exists in float.
// The AVX2 path is chosen at run time (__builtin_cpu_supports); a portable path serves the rest.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BM_X86 1
#endif

namespace {

struct Layout {
  const uint8_t* data;
  const int64_t* base;
  const int64_t* rowlen;
  const int64_t* goff;   // [nrb, G]
  const uint8_t* bits;   // [nrb, G]
  const float* scales;   // [N, G]
  const float* zeros;    // [N, G]
  int64_t N, K, G, group_size, row_block;
};

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // the buffer is padded by 8 bytes: never reads past it
  return w;
}

// Interleaved blocks (chosen from (bits, len) alone, so no table is needed): 4-bit blocks whose
// length is a multiple of 64 store byte k of every 32 = code k (low nibble) | code k + 32 (high
// nibble); 2-bit blocks whose length is a multiple of 128 store byte k of every 32 = codes k,
// k + 32, k + 64, k + 96 at bits 0, 2, 4, 6.  Every other block uses the chunk packing.
inline int span_of(int b) { return b == 4 ? 64 : (b == 2 ? 128 : 0); }
inline bool interleaved(int b, int64_t len) { const int sp = span_of(b); return sp && len % sp == 0; }

// The codes of one block as integers (any layout).
inline void decode_block(const uint8_t* p, int b, int64_t len, int32_t* out) {
  if (interleaved(b, len)) {
    const int per = 8 / b, mask = (1 << b) - 1;
    for (int64_t j = 0; j < len; j += 32 * per, p += 32)
      for (int k = 0; k < 32; ++k)
        for (int i = 0; i < per; ++i) out[j + i * 32 + k] = (p[k] >> (i * b)) & mask;
    return;
  }
  const uint64_t mask = (b == 8) ? 0xFFull : ((1ull << b) - 1);
  for (int64_t j = 0; j < len; j += 8, p += b) {
    const uint64_t w = load64(p);
    const int64_t cnt = len - j < 8 ? len - j : 8;
    for (int64_t i = 0; i < cnt; ++i) out[j + i] = (int32_t)((w >> (i * b)) & mask);
  }
}

// sum_j c_j * x_j over one group (portable).
inline void group_dot_scalar(const uint8_t* p, int b, int64_t len, const float* const* xs, int M, float* acc) {
  if (interleaved(b, len)) {
    std::vector<int32_t> c(len);
    decode_block(p, b, len, c.data());
    for (int64_t j = 0; j < len; ++j)
      for (int m = 0; m < M; ++m) acc[m] += (float)c[j] * xs[m][j];
    return;
  }
  const uint64_t mask = (b == 8) ? 0xFFull : ((1ull << b) - 1);
  int64_t j = 0;
  for (; j < len; j += 8, p += b) {
    uint64_t w = load64(p);
    int64_t n = len - j < 8 ? len - j : 8;
    for (int64_t i = 0; i < n; ++i) {
      float c = (float)((w >> (i * b)) & mask);
      for (int m = 0; m < M; ++m) acc[m] += c * xs[m][j + i];
    }
  }
}

#ifdef BM_X86
__attribute__((target("avx2,fma"))) inline __m256 decode8(uint64_t w, int b, __m256i shifts, __m256i mask) {
  const int h = 4 * b;  // bits of codes 0-3
  uint32_t lo = (uint32_t)(h == 32 ? w : (w & ((1ull << h) - 1)));
  uint32_t hi = (uint32_t)(w >> h);
  __m256i v = _mm256_set_m128i(_mm_set1_epi32((int)hi), _mm_set1_epi32((int)lo));
  v = _mm256_and_si256(_mm256_srlv_epi32(v, shifts), mask);
  return _mm256_cvtepi32_ps(v);
}

__attribute__((target("avx2,fma"))) inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

// 8 bytes (as uint8 codes) times 8 activations, into accumulator a[m][q].  Four accumulators per
// row of x keep four FMA chains in flight (one chain would wait out the FMA latency every time).
template <int M>
__attribute__((target("avx2,fma"))) inline void fma8(__m128i bytes8, const float* const* xs, int64_t j, __m256 (*a)[4], int q) {
  const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes8));
  for (int m = 0; m < M; ++m) a[m][q] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xs[m] + j), a[m][q]);
}

// 32 codes held one per byte (in order) times x[j .. j + 32)
template <int M>
__attribute__((target("avx2,fma"))) inline void fma32(__m256i v, const float* const* xs, int64_t j, __m256 (*a)[4]) {
  const __m128i lo = _mm256_castsi256_si128(v), hi = _mm256_extracti128_si256(v, 1);
  fma8<M>(lo, xs, j, a, 0);
  fma8<M>(_mm_srli_si128(lo, 8), xs, j + 8, a, 1);
  fma8<M>(hi, xs, j + 16, a, 2);
  fma8<M>(_mm_srli_si128(hi, 8), xs, j + 24, a, 3);
}

template <int M>
__attribute__((target("avx2,fma"))) bool group_dot_fast(const uint8_t* p, int b, int64_t len, const float* const* xs, __m256* gv) {
  __m256 a[M][4];
  for (int m = 0; m < M; ++m)
    for (int q = 0; q < 4; ++q) a[m][q] = _mm256_setzero_ps();
  if (b == 4 && len % 64 == 0) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int64_t j = 0; j < len; j += 64, p += 32) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)p);
      fma32<M>(_mm256_and_si256(v, m4), xs, j, a);
      fma32<M>(_mm256_and_si256(_mm256_srli_epi16(v, 4), m4), xs, j + 32, a);
    }
  } else if (b == 2 && len % 128 == 0) {
    const __m256i m2 = _mm256_set1_epi8(0x03);
    for (int64_t j = 0; j < len; j += 128, p += 32) {
      const __m256i v = _mm256_loadu_si256((const __m256i*)p);
      fma32<M>(_mm256_and_si256(v, m2), xs, j, a);
      fma32<M>(_mm256_and_si256(_mm256_srli_epi16(v, 2), m2), xs, j + 32, a);
      fma32<M>(_mm256_and_si256(_mm256_srli_epi16(v, 4), m2), xs, j + 64, a);
      fma32<M>(_mm256_and_si256(_mm256_srli_epi16(v, 6), m2), xs, j + 96, a);
    }
  } else if (b == 8 && len % 32 == 0) {
    for (int64_t j = 0; j < len; j += 32, p += 32) fma32<M>(_mm256_loadu_si256((const __m256i*)p), xs, j, a);
  } else {
    return false;
  }
  for (int m = 0; m < M; ++m) gv[m] = _mm256_add_ps(_mm256_add_ps(a[m][0], a[m][1]), _mm256_add_ps(a[m][2], a[m][3]));
  return true;
}

// sum_j c_j x_j of one group as a vector gv[m] (its lanes summed later, once per row) plus a
// scalar tail[m] for the group's partial last chunk.
template <int M>
__attribute__((target("avx2,fma"))) void group_vec_avx2(const uint8_t* p, int b, int64_t len, const float* const* xs, __m256* gv, float* tail) {
  if (group_dot_fast<M>(p, b, len, xs, gv)) return;
  const __m256i shifts = _mm256_setr_epi32(0, b, 2 * b, 3 * b, 0, b, 2 * b, 3 * b);
  const __m256i mask = _mm256_set1_epi32((b == 8) ? 0xFF : ((1 << b) - 1));
  __m256 a[M], a2[M];
  for (int m = 0; m < M; ++m) a[m] = a2[m] = _mm256_setzero_ps();
  const int64_t full = len & ~int64_t(15);
  int64_t j = 0;
  for (; j < full; j += 16, p += 2 * b) {  // two chunks, two FMA chains
    const __m256 c = decode8(load64(p), b, shifts, mask), c2 = decode8(load64(p + b), b, shifts, mask);
    for (int m = 0; m < M; ++m) {
      a[m] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xs[m] + j), a[m]);
      a2[m] = _mm256_fmadd_ps(c2, _mm256_loadu_ps(xs[m] + j + 8), a2[m]);
    }
  }
  for (; j + 8 <= len; j += 8, p += b) {
    const __m256 c = decode8(load64(p), b, shifts, mask);
    for (int m = 0; m < M; ++m) a[m] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xs[m] + j), a[m]);
  }
  for (int m = 0; m < M; ++m) gv[m] = _mm256_add_ps(a[m], a2[m]);
  if (j < len) {  // the group's partial last chunk
    const float* xt[8];
    for (int m = 0; m < M; ++m) xt[m] = xs[m] + j;
    group_dot_scalar(p, b, len - j, xt, M, tail);
  }
}

template <int M>
__attribute__((target("avx2,fma"))) void gemv_rows_avx2(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1) {
  const float* xs[8];
  __m256 gv[M], racc[M];
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t rb = n / L.row_block;
    const uint8_t* row = L.data + L.base[rb] + (n - rb * L.row_block) * L.rowlen[rb];
    float rs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int m = 0; m < M; ++m) racc[m] = _mm256_setzero_ps();
    for (int64_t g = 0; g < L.G; ++g) {
      const int b = L.bits[rb * L.G + g];
      const int64_t c0 = g * L.group_size;
      const int64_t len = (c0 + L.group_size <= L.K) ? L.group_size : L.K - c0;
      float tail[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int m = 0; m < M; ++m) xs[m] = x + m * L.K + c0;
      group_vec_avx2<M>(row + L.goff[rb * L.G + g], b, len, xs, gv, tail);
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      const __m256 sv = _mm256_set1_ps(s);
      for (int m = 0; m < M; ++m) {
        racc[m] = _mm256_fmadd_ps(sv, gv[m], racc[m]);
        rs[m] += s * (tail[m] - z * xsum[m * L.G + g]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = hsum(racc[m]) + rs[m];
  }
}
#endif

bool has_avx2() {
#ifdef BM_X86
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

template <int M>
void gemv_rows(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1, bool avx2) {
#ifdef BM_X86
  if (avx2) return gemv_rows_avx2<M>(L, x, xsum, y, n0, n1);
#endif
  const float* xs[8];
  for (int64_t n = n0; n < n1; ++n) {
    const int64_t rb = n / L.row_block;
    const uint8_t* row = L.data + L.base[rb] + (n - rb * L.row_block) * L.rowlen[rb];
    float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t g = 0; g < L.G; ++g) {
      const int b = L.bits[rb * L.G + g];
      const int64_t c0 = g * L.group_size;
      const int64_t len = (c0 + L.group_size <= L.K) ? L.group_size : L.K - c0;
      float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int m = 0; m < M; ++m) xs[m] = x + m * L.K + c0;
      group_dot_scalar(row + L.goff[rb * L.G + g], b, len, xs, M, acc);
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      for (int m = 0; m < M; ++m) out[m] += s * (acc[m] - z * xsum[m * L.G + g]);
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = out[m];
  }
}

Layout make_layout(const torch::Tensor& data, const torch::Tensor& base, const torch::Tensor& rowlen,
                   const torch::Tensor& goff, const torch::Tensor& bits, const torch::Tensor& scales,
                   const torch::Tensor& zeros, int64_t K, int64_t group_size, int64_t row_block) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && zeros.dtype() == torch::kFloat32, "scales/zeros must be float32");
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

// Rows [r0, r1) of W as float32 into out ([r1 - r0, K], contiguous): (c - z) * s exactly.
void dequant_rows(const Layout& L, int64_t r0, int64_t r1, float* out) {
  std::vector<int32_t> codes(L.group_size);
  for (int64_t n = r0; n < r1; ++n) {
    const int64_t rb = n / L.row_block;
    const uint8_t* row = L.data + L.base[rb] + (n - rb * L.row_block) * L.rowlen[rb];
    float* o = out + (n - r0) * L.K;
    for (int64_t g = 0; g < L.G; ++g) {
      const int b = L.bits[rb * L.G + g];
      const int64_t c0 = g * L.group_size;
      const int64_t len = (c0 + L.group_size <= L.K) ? L.group_size : L.K - c0;
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      decode_block(row + L.goff[rb * L.G + g], b, len, codes.data());
      // (c - z) * s in float32, as the reference: a subtraction then a product (no contraction)
      for (int64_t j = 0; j < len; ++j) o[c0 + j] = ((float)codes[j] - z) * s;
    }
  }
}

}  // namespace

torch::Tensor qmatmul(torch::Tensor x, torch::Tensor data, torch::Tensor base, torch::Tensor rowlen,
                      torch::Tensor goff, torch::Tensor bits, torch::Tensor scales, torch::Tensor zeros,
                      int64_t K, int64_t group_size, int64_t row_block, int64_t tile_rows) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.dtype() == torch::kFloat32, "x must be float32 [M, K]");
  x = x.contiguous();
  Layout L = make_layout(data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block);
  const int64_t M = x.size(0);
  auto y = torch::empty({M, L.N}, x.options());
  if (M == 0 || L.N == 0) return y;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= 8) {
    std::vector<float> xsum(M * L.G, 0.f);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t g = 0; g < L.G; ++g) {
        const int64_t c0 = g * group_size, c1 = std::min(K, c0 + group_size);
        float s = 0.f;
        for (int64_t j = c0; j < c1; ++j) s += xp[m * K + j];
        xsum[m * L.G + g] = s;
      }
    const bool avx2 = has_avx2();
    const float* xs = xsum.data();
    at::parallel_for(0, L.N, 16, [&](int64_t n0, int64_t n1) {
      switch (M) {
        case 1: gemv_rows<1>(L, xp, xs, yp, n0, n1, avx2); break;
        case 2: gemv_rows<2>(L, xp, xs, yp, n0, n1, avx2); break;
        case 3: gemv_rows<3>(L, xp, xs, yp, n0, n1, avx2); break;
        case 4: gemv_rows<4>(L, xp, xs, yp, n0, n1, avx2); break;
        case 5: gemv_rows<5>(L, xp, xs, yp, n0, n1, avx2); break;
        case 6: gemv_rows<6>(L, xp, xs, yp, n0, n1, avx2); break;
        case 7: gemv_rows<7>(L, xp, xs, yp, n0, n1, avx2); break;
        default: gemv_rows<8>(L, xp, xs, yp, n0, n1, avx2); break;
      }
    });
    return y;
  }
  // prefill: one tile of rows at a time, dequantized in parallel, then one GEMM into y's columns
  auto tile = torch::empty({std::min(tile_rows, L.N), K}, x.options());
  for (int64_t r0 = 0; r0 < L.N; r0 += tile_rows) {
    const int64_t r1 = std::min(L.N, r0 + tile_rows);
    float* tp = tile.data_ptr<float>();
    at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequant_rows(L, a, b, tp + (a - r0) * K); });
    y.narrow(1, r0, r1 - r0).copy_(at::mm(x, tile.narrow(0, 0, r1 - r0).t()));
  }
  return y;
}

torch::Tensor dequantize(torch::Tensor data, torch::Tensor base, torch::Tensor rowlen, torch::Tensor goff,
                         torch::Tensor bits, torch::Tensor scales, torch::Tensor zeros, int64_t K,
                         int64_t group_size, int64_t row_block, int64_t r0, int64_t r1) {
  Layout L = make_layout(data, base, rowlen, goff, bits, scales, zeros, K, group_size, row_block);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= L.N, "row range out of bounds");
  auto out = torch::empty({r1 - r0, K}, scales.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequant_rows(L, a, b, op + (a - r0) * K); });
  return out;
}

bool avx2_available() { return has_avx2(); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "low-bit matmul y = x W^T");
  m.def("dequantize", &dequantize, "rows of W in float32");
  m.def("avx2_available", &avx2_available, "whether the AVX2 path runs here");
}
