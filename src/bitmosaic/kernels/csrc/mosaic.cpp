// bitmosaic MosaicQuant residual pass for decode (see bitmosaic/kernels/mosaic.py).
//
// y[t, n] += scale[b, i] * sum_k codes[b, i, k] * x[t, cb(b) * bk + k]   for n = rb(b) * bm + i,
// for every selected block b, at most 8 rows t of x.  The codes come transposed and row-padded,
// codes_t[b, k, i] (int8 [n_sel, bk, bmp], bmp a multiple of 16, padded rows zero): a block is converted
// to float once (one vectorized loop), then 16 consecutive rows of one column are one vector, so the
// products need no horizontal sums and the accumulators stay in registers.  Blocks are sorted by row block;
// starts[rb] .. starts[rb + 1] are the blocks of row block rb.  Edge blocks: rows n >= N and columns
// >= K are skipped (the torch path zero-pads x and drops those rows: the same result).  Threads split
// the row blocks, so every output element is written by one thread only.  Portable C++: GCC/Clang
// generic vectors of 16 floats (no intrinsics; plain loops for other compilers); every output sums over
// k in order, then times its scale (torch scales first: float rounding differs).  On x86-64 Linux with
// GCC/Clang the loop is compiled for AVX2 and AVX-512 too (target_clones), the best one picked at load
// time, since the extension itself is built for the baseline x86-64 (SSE2).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define BM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BM_CLONES
#endif

#if (defined(__GNUC__) || defined(__clang__)) && !defined(BM_NO_VEC)  // generic vectors: 16 float lanes
#define BM_VEC 1                                                       // (1 zmm, 2 ymm or 4 xmm)
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned loads
#else
#define BM_VEC 0
#endif
#if defined(__GNUC__) || defined(__clang__)
#define BM_INLINE __attribute__((always_inline)) inline
#else
#define BM_INLINE inline
#endif

namespace {

constexpr int64_t kLanes = 16;  // rows per register tile (bmp is a multiple of it)

struct Args {
  const float* x;
  float* y;
  const int8_t* ct;
  const float* s;
  const int64_t *cb, *starts;
  int64_t K, N, bm, bk, bmp;
};

// out[t][i] = sum_k cf[k * bmp + i] x[t * K + k] for C x 16 rows i (C x T accumulators in registers)
template <int T, int C>
BM_INLINE void tile(const float* cf, const float* x, int64_t K, int64_t kw, int64_t bmp,
                    float (*out)[C * kLanes]) {
#if BM_VEC
  f32x16 acc[T][C] = {};
  for (int64_t k = 0; k < kw; ++k) {
    const f32x16u* v = reinterpret_cast<const f32x16u*>(cf + k * bmp);
    for (int t = 0; t < T; ++t)
      for (int j = 0; j < C; ++j) acc[t][j] += v[j] * x[t * K + k];
  }
  std::memcpy(out, acc, sizeof acc);
#else
  for (int t = 0; t < T; ++t)
    for (int l = 0; l < C * kLanes; ++l) out[t][l] = 0.f;
  for (int64_t k = 0; k < kw; ++k)
    for (int t = 0; t < T; ++t)
      for (int l = 0; l < C * kLanes; ++l) out[t][l] += cf[k * bmp + l] * x[t * K + k];
#endif
}

// y[t, n0 + l] += s[l] * out[t][l] for l < nl
template <int T, int W>
BM_INLINE void store(const Args& a, const float (*out)[W], const float* s, int64_t n0, int64_t nl) {
  for (int t = 0; t < T; ++t)
    for (int64_t l = 0; l < std::min<int64_t>(W, nl); ++l) a.y[t * a.N + n0 + l] += s[l] * out[t][l];
}

// row blocks r0..r1 for T rows of x (module comment); cf: scratch for one block in float, [bk, bmp].
// Inlined into each clone of row_blocks_any.
template <int T>
BM_INLINE void row_blocks(const Args& a, int64_t r0, int64_t r1, float* cf) {
  constexpr int C = T == 1 ? 4 : T == 2 ? 2 : 1;  // 16-row chunks per tile: about 4 accumulator chains
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t rows = std::min(a.bm, a.N - r * a.bm);
    for (int64_t b = a.starts[r]; b < a.starts[r + 1]; ++b) {
      const int64_t c0 = a.cb[b] * a.bk, kw = std::min(a.bk, a.K - c0);
      const int8_t* c = a.ct + b * a.bk * a.bmp;
      for (int64_t j = 0; j < kw * a.bmp; ++j) cf[j] = static_cast<float>(c[j]);  // vectorized
      const float* x = a.x + c0;
      const float* s = a.s + b * a.bm;
      int64_t i0 = 0;
      for (; C > 1 && i0 + C * kLanes <= a.bmp && i0 < rows; i0 += C * kLanes) {
        float out[T][C * kLanes];
        tile<T, C>(cf + i0, x, a.K, kw, a.bmp, out);
        store<T, C * kLanes>(a, out, s + i0, r * a.bm + i0, rows - i0);
      }
      for (; i0 < rows; i0 += kLanes) {
        float out[T][kLanes];
        tile<T, 1>(cf + i0, x, a.K, kw, a.bmp, out);
        store<T, kLanes>(a, out, s + i0, r * a.bm + i0, rows - i0);
      }
    }
  }
}

BM_CLONES void row_blocks_any(const Args& a, int64_t T, int64_t r0, int64_t r1, float* cf) {
  switch (T) {
    case 1: row_blocks<1>(a, r0, r1, cf); break;
    case 2: row_blocks<2>(a, r0, r1, cf); break;
    case 3: row_blocks<3>(a, r0, r1, cf); break;
    case 4: row_blocks<4>(a, r0, r1, cf); break;
    case 5: row_blocks<5>(a, r0, r1, cf); break;
    case 6: row_blocks<6>(a, r0, r1, cf); break;
    case 7: row_blocks<7>(a, r0, r1, cf); break;
    default: row_blocks<8>(a, r0, r1, cf); break;
  }
}

void residual_accumulate(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor cb,
                         torch::Tensor starts, torch::Tensor y, int64_t bm) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: float32 [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat && y.is_contiguous(), "y: float32 [T, N]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kChar && codes.is_contiguous(),
              "codes: int8 [n_sel, bk, bmp] (transposed, rows padded to a multiple of 16)");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t nsel = codes.size(0), bk = codes.size(1), bmp = codes.size(2);
  TORCH_CHECK(bm >= 1 && bmp == (bm + kLanes - 1) / kLanes * kLanes,
              "codes rows must be bm padded to a multiple of 16");
  const int64_t nrb = starts.numel() - 1;
  TORCH_CHECK(y.size(0) == T && T <= 8, "x and y must have the same rows, at most 8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == nsel * bm,
              "scales: float32 [n_sel, bm]");
  TORCH_CHECK(cb.scalar_type() == torch::kLong && cb.numel() == nsel, "cb: int64 [n_sel]");
  TORCH_CHECK(starts.scalar_type() == torch::kLong && nrb >= 0 && nrb * bm >= N, "starts: int64 [row blocks + 1]");
  if (nsel == 0 || T == 0) return;
  const auto cbc = cb.contiguous(), st = starts.contiguous();
  const Args a{x.data_ptr<float>(), y.data_ptr<float>(), codes.data_ptr<int8_t>(), scales.data_ptr<float>(),
               cbc.data_ptr<int64_t>(), st.data_ptr<int64_t>(), K, N, bm, bk, bmp};
  for (int64_t b = 0; b < nsel; ++b) TORCH_CHECK(0 <= a.cb[b] && a.cb[b] * bk < K, "block column out of range");
  TORCH_CHECK(a.starts[0] == 0 && a.starts[nrb] == nsel, "starts must run from 0 to n_sel");
  for (int64_t r = 0; r < nrb; ++r) TORCH_CHECK(a.starts[r] <= a.starts[r + 1], "starts must be non-decreasing");
  // small work runs on the calling thread (a parallel region costs more than it saves)
  const int64_t grain = nsel * bm * bk * T < (1 << 16) ? std::max<int64_t>(nrb, 1) : 1;
  at::parallel_for(0, nrb, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> cf(bk * bmp);
    row_blocks_any(a, T, r0, r1, cf.data());
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("residual_accumulate", &residual_accumulate,
        "y += x (M * Q(R))^T over the selected residual blocks (in place, at most 8 rows)");
}
