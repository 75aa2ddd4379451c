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
// k in order, then times its scale (torch scales first: float rounding differs).  ISA (isa.h): the
// loop (mosaic_rows.h) is compiled three times, for the baseline x86-64 and in the AVX2 and AVX-512
// target regions; the caller picks one per call (kernels/isa.py), as for the other two extensions.
// (Measured on an AVX2 CPU against the former target_clones build: 11% slower at one row of x, 1%
// faster at four; GCC spills the 64-byte generic vectors in both; not resolved.)
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

#if (defined(__GNUC__) || defined(__clang__)) && !defined(BM_NO_VEC)  // generic vectors: 16 float lanes
#define BM_VEC 1  // (1 zmm, 2 ymm or 4 xmm; typedef'd in mosaic_rows.h)
#else
#define BM_VEC 0
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

namespace portable {
#include "mosaic_rows.h"
}  // namespace portable
#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX2_TARGET)
namespace avx2 {
#include "mosaic_rows.h"
}  // namespace avx2
BM_END_TARGET
BM_BEGIN_TARGET(BM_AVX512_TARGET)
namespace avx512 {
#include "mosaic_rows.h"
}  // namespace avx512
BM_END_TARGET
#endif

void row_blocks_isa(int64_t isa, const Args& a, int64_t T, int64_t r0, int64_t r1, float* cf) {
#ifdef BM_X86
  if (isa == bm::kAvx512) return avx512::row_blocks_any(a, T, r0, r1, cf);
  if (isa == bm::kAvx2) return avx2::row_blocks_any(a, T, r0, r1, cf);
#endif
  portable::row_blocks_any(a, T, r0, r1, cf);
}

void residual_accumulate(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor cb,
                         torch::Tensor starts, torch::Tensor y, int64_t bm, int64_t isa) {
  bm::check_isa(isa);
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
    row_blocks_isa(isa, a, T, r0, r1, cf.data());
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("residual_accumulate", &residual_accumulate,
        "y += x (M * Q(R))^T over the selected residual blocks (in place, at most 8 rows)", py::arg("x"),
        py::arg("codes"), py::arg("scales"), py::arg("cb"), py::arg("starts"), py::arg("y"), py::arg("bm"),
        py::arg("isa"));
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
