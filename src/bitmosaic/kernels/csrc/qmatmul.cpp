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
// ISA (isa.h): AVX-512 / AVX2+FMA / portable C++, chosen per call by the caller (kernels/isa.py) among
// those the CPU supports.  The AVX2 and AVX-512 kernels are one body (qmatmul_simd.h) over the vector
// traits of vec.h, compiled once per ISA in its target region, so the extension is compiled for the
// baseline x86-64 and loads on any CPU.

#include <torch/library.h>

#include "qmatmul_common.h"
#include "vec.h"

namespace {

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX2_TARGET)
namespace avx2 {
#include "qmatmul_simd.h"
}  // namespace avx2
BM_END_TARGET
BM_BEGIN_TARGET(BM_AVX512_TARGET)
namespace avx512 {
#include "qmatmul_simd.h"
}  // namespace avx512
BM_END_TARGET
#endif

template <int M>
void gemv_rows(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1, int64_t isa) {
#ifdef BM_X86
  if (isa == bm::kAvx512) return avx512::gemv_rows<bm::Avx512, M>(L, x, xsum, y, n0, n1);
  if (isa == bm::kAvx2) return avx2::gemv_rows<bm::Avx2, M>(L, x, xsum, y, n0, n1);
#endif
  gemv_rows_portable<M>(L, x, xsum, y, n0, n1);
}

void dequant_rows(const Layout& L, int64_t r0, int64_t r1, float* out, int64_t isa) {
#ifdef BM_X86
  if (isa == bm::kAvx512) return avx512::dequant_rows<bm::Avx512>(L, r0, r1, out);
  if (isa == bm::kAvx2) return avx2::dequant_rows<bm::Avx2>(L, r0, r1, out);
#endif
  dequant_rows_portable(L, r0, r1, out);
}

Layout make_layout(const torch::Tensor& data, const torch::Tensor& base, const torch::Tensor& rowlen,
                   const torch::Tensor& goff, const torch::Tensor& bits, const torch::Tensor& scales,
                   const torch::Tensor& zeros, int64_t K, int64_t group_size, int64_t row_block, int64_t isa) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  TORCH_CHECK(scales.dtype() == torch::kFloat32 && zeros.dtype() == torch::kFloat32, "scales/zeros must be float32");
  bm::check_isa(isa);
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
      bm::dispatch_1to8(M, [&](auto m) { gemv_rows<decltype(m)::value>(L, xp, xs, yp, n0, n1, isa); });
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

// The same function as the CPU kernel of bitmosaic::qmatmul_ext (ops.py: what a compiled graph calls,
// through the dispatcher with no Python kernel in between; the ISA as its number).
TORCH_LIBRARY_FRAGMENT(bitmosaic, m) {
  m.def(
      "qmatmul_ext(Tensor x, Tensor data, Tensor base, Tensor rowlen, Tensor goff, Tensor bits, Tensor scales, "
      "Tensor zeros, int K, int group_size, int row_block, int tile, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(bitmosaic, CPU, m) { m.impl("qmatmul_ext", &qmatmul); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("qmatmul", &qmatmul, "low-bit matmul y = x W^T");
  m.def("dequantize", &dequantize, "rows of W in float32");
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
