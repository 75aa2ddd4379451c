// bitmosaic MosaicQuant residual pass for decode (see bitmosaic/kernels/mosaic.py).
//
// y[t, n] += scale[b, i] * sum_k codes[b, i, k] * x[t, cb(b) * bk + k]   for n = rb(b) * bm + i,
// for every selected block b, at most 8 rows t of x.  Blocks are sorted by row block; starts[rb] ..
// starts[rb + 1] are the blocks of row block rb.  Edge blocks: rows n >= N and columns >= K are skipped
// (the torch path zero-pads x and drops those rows, so the result is the same).  Threads split the row
// blocks, so every output element is written by one thread only.  Portable C++: the dot products are
// `omp simd` reductions, vectorized by the compiler (reassociated, so summation order differs from torch);
// on x86-64 Linux with GCC/Clang the loop is also compiled for AVX2 and AVX-512 (target_clones), the
// best one picked at load time, since the extension itself is built for the baseline x86-64 (SSE2).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if (defined(__x86_64__) || defined(_M_X64)) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define BM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define BM_CLONES
#endif

namespace {

// y[t, n] += ... for the blocks of row blocks r0..r1 (module comment); cf: a scratch row of bk floats
BM_CLONES void row_blocks(const float* xp, float* yp, const int8_t* cp, const float* sp, const int64_t* cbp,
                          const int64_t* stp, int64_t T, int64_t K, int64_t N, int64_t bm, int64_t bk,
                          int64_t r0, int64_t r1, float* cf) {
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t rows = std::min(bm, N - r * bm);
    for (int64_t b = stp[r]; b < stp[r + 1]; ++b) {
      const int64_t c0 = cbp[b] * bk, kw = std::min(bk, K - c0);
      for (int64_t i = 0; i < rows; ++i) {
        const int8_t* c = cp + (b * bm + i) * bk;
        for (int64_t k = 0; k < kw; ++k) cf[k] = static_cast<float>(c[k]);
        const float s = sp[b * bm + i];
        for (int64_t t = 0; t < T; ++t) {
          const float* xr = xp + t * K + c0;
          float acc = 0.f;
#pragma omp simd reduction(+ : acc)
          for (int64_t k = 0; k < kw; ++k) acc += cf[k] * xr[k];
          yp[t * N + r * bm + i] += s * acc;
        }
      }
    }
  }
}

void residual_accumulate(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor cb,
                         torch::Tensor starts, torch::Tensor y) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.is_contiguous(), "x: float32 [T, K]");
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == torch::kFloat && y.is_contiguous(), "y: float32 [T, N]");
  TORCH_CHECK(codes.dim() == 3 && codes.scalar_type() == torch::kChar && codes.is_contiguous(),
              "codes: int8 [n_sel, bm, bk]");
  const int64_t T = x.size(0), K = x.size(1), N = y.size(1);
  const int64_t nsel = codes.size(0), bm = codes.size(1), bk = codes.size(2);
  const int64_t nrb = starts.numel() - 1;
  TORCH_CHECK(y.size(0) == T && T <= 8, "x and y must have the same rows, at most 8");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && scales.is_contiguous() && scales.numel() == nsel * bm,
              "scales: float32 [n_sel, bm]");
  TORCH_CHECK(cb.scalar_type() == torch::kLong && cb.numel() == nsel, "cb: int64 [n_sel]");
  TORCH_CHECK(starts.scalar_type() == torch::kLong && nrb >= 0 && nrb * bm >= N, "starts: int64 [row blocks + 1]");
  if (nsel == 0 || T == 0) return;
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const float* sp = scales.data_ptr<float>();
  const auto cbc = cb.contiguous();
  const int64_t* cbp = cbc.data_ptr<int64_t>();
  for (int64_t b = 0; b < nsel; ++b) TORCH_CHECK(0 <= cbp[b] && cbp[b] * bk < K, "block column out of range");
  const auto st = starts.contiguous();
  const int64_t* stp = st.data_ptr<int64_t>();
  TORCH_CHECK(stp[0] == 0 && stp[nrb] == nsel, "starts must run from 0 to n_sel");
  for (int64_t r = 0; r < nrb; ++r) TORCH_CHECK(stp[r] <= stp[r + 1], "starts must be non-decreasing");
  // small work runs on the calling thread (a parallel region costs more than it saves)
  const int64_t grain = nsel * bm * bk * T < (1 << 16) ? std::max<int64_t>(nrb, 1) : 1;
  at::parallel_for(0, nrb, grain, [&](int64_t r0, int64_t r1) {
    std::vector<float> cf(bk);
    row_blocks(xp, yp, cp, sp, cbp, stp, T, K, N, bm, bk, r0, r1, cf.data());
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("residual_accumulate", &residual_accumulate,
        "y += x (M * Q(R))^T over the selected residual blocks (in place, at most 8 rows)");
}
