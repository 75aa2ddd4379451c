// bitmosaic FP4 LUT GEMV for the CPU (issue 75 item 5): y = x W^T for W in MXFP4 / NVFP4, at decode (1 row
// of x) and small batches, through lookup tables of the 16 E2M1 values times each activation -- the
// bit-plane LUT kernel's idea (lutgemv.cpp, SFMP §4.5, T-MAC) applied to a 4-bit float code.
//
// W[n, j] = e2m1(c[n, j]) * d[n, j / block], d the block divisor, decoded here from the stored scale byte
// (bitmosaic/formats/mx.py): MXFP4 E8M0 (one byte per 32 values) -> 2^(e - 127), the float built from its
// bits (e << 23; e = 0 is the subnormal 2^-127, e = 255 NaN); NVFP4 E4M3 (one byte per 16) -> a 256-entry
// table of e4m3(s) / g, g the FP32 tensor scale, built per call (each entry rounded once to float32, as
// formats/mx.py element_divisor rounds it: the same divisors bit for bit as a float copy would hold).
// So the kernel's resident bytes per weight are the file's: 4.25 bits (MXFP4), 4.5 bits (NVFP4).
//
// Layout (kernels/fp4lut.py builds it from the stored MXTensor): tiles of 16 rows; tile t holds, for each
// quad q of 8 columns, the 16 rows' 32-bit words: word r = the row's stored bytes of columns 8q .. 8q+7
// (little-endian, so nibble n -- bits 4n .. 4n+3 -- is column 8q + n, as in the saved weight_packed), so
// data[((t * Q + q) * 16 + r) * 4 + b], Q = ceil(K / 8).  Rows past N and columns past K are zero codes
// (+0, their tables are zero).  The scale bytes are uint8 [nb, Npad] (the stored weight_scale transposed:
// 16 rows of a block contiguous), zero past N.
// Arithmetic: for each activation x_j a table T_j[c] = e2m1(c) * x_j (16 floats, one rounding each: 1.5 x
// and 3 x need a 25th bit); per block y[n] += d[n, b] * Σ_{j in b} T_j[c[n, j]] (float32, the block sum in
// one or two chains, then one product and one add per block).  So the result is the reference
// dequantize-then-matmul up to float32 rounding: each term meets at most K + 2 roundings on either side
// (tests/kernels/test_fp4lut.py states the bound).  AVX-512: the 16-float table is one register, a vpermps
// looks up 16 rows at once; AVX2: two 8-entry vpermps and a blend (vec.h lookup16), 8 rows at once;
// portable: scalar lookups.  One load gives 8 columns of 16 rows; vpermps reads the low 4 bits of each
// lane, so nibble n is one shift (the bit-plane LUT's lookup16 on a word of 8 nibbles).  The divisors of
// a block: 16 (AVX2: 8) scale bytes widened to int32 lanes, then shifted into the exponent (E8M0) or
// gathered from the table (E4M3), once per block of 16-32 columns.
// Loop order: each thread takes a range of row tiles; the columns are walked in chunks whose tables (one
// per row of x) stay in L1 while the thread's tiles stream through (the chunk's piece of the next tiles is
// prefetched); the tables of a chunk are built by the thread that uses them.
// Rows of x: up to 8 in one pass (each weight byte loaded once for all of them), more in passes of 8.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"
#include "vec.h"

namespace {

constexpr int TILE = 16;
constexpr int MAX_M = 8;             // rows of x per pass
constexpr int64_t TABLE_FLOATS = 4096;  // floats of tables per chunk (16 KB: L1-resident)
constexpr int64_t PREFETCH_TILES = 2;   // tiles ahead whose chunk piece is prefetched

// E2M1 values of the 16 codes (sign << 3 | index), formats/mx.py E2M1_VALUES
constexpr float kE2M1[16] = {0.f,  0.5f,  1.f,  1.5f,  2.f,  3.f,  4.f,  6.f,
                             -0.f, -0.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

constexpr int64_t kE8M0 = 0, kE4M3 = 1;  // scale encodings (fp4lut.py SCALE_KINDS)

struct Fp4 {
  const uint8_t* data;  // [ntiles, Q, 16, 4]
  const uint8_t* sc;    // scale bytes [nb, Npad]
  const float* tab;     // E4M3: the 256 divisors e4m3(s) / g; E8M0: unused
  int64_t kind;         // kE8M0 or kE4M3
  int64_t N, K, Q, block, nb, ntiles, Npad;
  int64_t chunk;  // columns per table chunk (a multiple of block)
  int64_t kpad() const { return Q * 8; }
};

// tables of columns [c0, c1) for M rows of x (row stride K; zero past K): T[(m * (c1 - c0) + j) * 16 + c]
void build_tables(const float* x, int64_t K, int M, int64_t c0, int64_t c1, float* T) {
  const int64_t L = c1 - c0;
  for (int m = 0; m < M; ++m)
    for (int64_t j = 0; j < L; ++j) {
      const float v = c0 + j < K ? x[m * K + c0 + j] : 0.f;
      float* t = T + (m * L + j) * 16;
      for (int c = 0; c < 16; ++c) t[c] = kE2M1[c] * v;
    }
}

// 2^(e - 127) from its bits: e << 23 for the normal exponents, the subnormal 2^-127 for e = 0, NaN for 255
inline float e8m0_value(uint8_t e) {
  const uint32_t bits = e == 0 ? 0x00400000u : e == 255 ? 0x7FC00000u : uint32_t(e) << 23;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float divisor(const Fp4& F, uint8_t s) { return F.kind == kE8M0 ? e8m0_value(s) : F.tab[s]; }

inline void prefetch(const uint8_t* p, int64_t bytes) {
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(p + o, 0, 3);
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;  // little-endian hosts (x86-64, arm64)
}

// Portable: tile t, columns [c0, c1) (whole blocks but the last, whole quads), M rows of x; y [M, Npad].
template <int M>
void tile_portable(const Fp4& F, int64_t t, int64_t c0, int64_t c1, const float* T, float* y) {
  const int64_t L = c1 - c0;
  float acc[M][TILE];
  for (int64_t b0 = c0; b0 < c1; b0 += F.block) {
    const int64_t b1 = std::min(c1, b0 + F.block), blk = b0 / F.block;
    for (int m = 0; m < M; ++m) std::fill(acc[m], acc[m] + TILE, 0.f);
    for (int64_t j = b0; j < b1; j += 8) {
      const uint8_t* w = F.data + (t * F.Q + j / 8) * TILE * 4;
      for (int r = 0; r < TILE; ++r) {
        const uint32_t u = load32(w + 4 * r);
        for (int m = 0; m < M; ++m) {
          const float* Tm = T + (m * L + (j - c0)) * 16;
          float s = 0.f;
          for (int n = 0; n < 8; ++n) s += Tm[16 * n + ((u >> (4 * n)) & 15)];
          acc[m][r] += s;
        }
      }
    }
    const uint8_t* s = F.sc + blk * F.Npad + t * TILE;
    for (int r = 0; r < TILE; ++r) {
      const float d = divisor(F, s[r]);
      for (int m = 0; m < M; ++m) y[m * F.Npad + t * TILE + r] += d * acc[m][r];
    }
  }
}

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX2_TARGET)
namespace avx2 {
#include "fp4gemv_simd.h"
}  // namespace avx2
BM_END_TARGET
BM_BEGIN_TARGET(BM_AVX512_TARGET)
namespace avx512 {
#include "fp4gemv_simd.h"
}  // namespace avx512
BM_END_TARGET
#endif

template <int M>
void tile_any(int64_t isa, const Fp4& F, int64_t t, int64_t c0, int64_t c1, const float* T, float* y) {
#ifdef BM_X86
  if (isa == bm::kAvx512) return avx512::tile<bm::Avx512, M>(F, t, c0, c1, T, y);
  if (isa == bm::kAvx2) return avx2::tile<bm::Avx2, M>(F, t, c0, c1, T, y);
#endif
  tile_portable<M>(F, t, c0, c1, T, y);
}

// y [M, Npad] (zeroed) += the products of M <= 8 rows of x (row stride K) with W
template <int M>
void pass(const Fp4& F, const float* x, int64_t isa, float* y) {
  const int64_t grain = std::max<int64_t>(1, std::min<int64_t>(4, F.ntiles / std::max(1, at::get_num_threads())));
  at::parallel_for(0, F.ntiles, grain, [&](int64_t a, int64_t b) {
    std::vector<float> T(F.chunk * 16 * M);
    for (int64_t c0 = 0; c0 < F.kpad(); c0 += F.chunk) {
      const int64_t c1 = std::min(F.kpad(), c0 + F.chunk), piece = (c1 - c0) / 2 * TILE;
      build_tables(x, F.K, M, c0, c1, T.data());
      for (int64_t t = a; t < b; ++t) {
        if (t + PREFETCH_TILES < b) prefetch(F.data + ((t + PREFETCH_TILES) * F.Q + c0 / 8) * TILE * 4, piece);
        tile_any<M>(isa, F, t, c0, c1, T.data(), y);
      }
    }
  });
}

}  // namespace

// x float32 [M, K]; data uint8 [ntiles, ceil(K/8), 64]; scales_t uint8 [nb, ntiles*16] (scale_kind 0: E8M0
// bytes, 1: E4M3 bytes, divided by global_scale); returns float32 [M, N]
torch::Tensor fp4_gemv(torch::Tensor x, torch::Tensor data, torch::Tensor scales_t, int64_t N, int64_t K,
                       int64_t block, int64_t scale_kind, double global_scale, int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.dtype() == torch::kFloat32, "x must be float32 [M, K]");
  TORCH_CHECK(block > 0 && block % 8 == 0, "the block must be a multiple of 8 columns");
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous() && data.dim() == 3 && data.size(2) == 4 * TILE &&
                  data.size(1) == (K + 7) / 8 && data.size(0) * TILE >= N,
              "data must be contiguous uint8 [ceil(N/16), ceil(K/8), 64]");
  const int64_t nb = (K + block - 1) / block, ntiles = data.size(0);
  TORCH_CHECK(scales_t.dtype() == torch::kUInt8 && scales_t.is_contiguous() && scales_t.dim() == 2 &&
                  scales_t.size(0) == nb && scales_t.size(1) == ntiles * TILE,
              "scale bytes must be contiguous uint8 [blocks, ceil(N/16)*16]");
  TORCH_CHECK(scale_kind == kE8M0 || scale_kind == kE4M3, "scale_kind must be 0 (E8M0) or 1 (E4M3)");
  bm::check_isa(isa);
  x = x.contiguous();
  const int64_t M = x.size(0);
  alignas(64) float tab[256];  // E4M3: e4m3(s) / g, rounded once to float32 (formats/mx.py element_divisor)
  if (scale_kind == kE4M3) {
    const float g = static_cast<float>(global_scale);
    for (int c = 0; c < 256; ++c)
      tab[c] = static_cast<float>(c10::Float8_e4m3fn(static_cast<uint8_t>(c), c10::Float8_e4m3fn::from_bits())) / g;
  }
  Fp4 F{data.data_ptr<uint8_t>(), scales_t.data_ptr<uint8_t>(), tab, scale_kind, N, K, (K + 7) / 8, block, nb,
        ntiles, ntiles * TILE, 0};
  auto out = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return out;
  auto ybuf = torch::zeros({MAX_M, F.Npad}, x.options());
  float* yp = ybuf.data_ptr<float>();
  for (int64_t m0 = 0; m0 < M; m0 += MAX_M) {
    const int64_t mm = std::min<int64_t>(MAX_M, M - m0);
    // tables of all mm rows in L1: a chunk of TABLE_FLOATS / (16 mm) columns, whole blocks (at least one)
    F.chunk = std::max<int64_t>(1, TABLE_FLOATS / (16 * mm) / block) * block;
    if (m0) ybuf.zero_();
    const float* xp = x.data_ptr<float>() + m0 * K;
    bm::dispatch_1to8(mm, [&](auto m) { pass<decltype(m)::value>(F, xp, isa, yp); });
    for (int64_t m = 0; m < mm; ++m) std::memcpy(out.data_ptr<float>() + (m0 + m) * N, yp + m * F.Npad, N * sizeof(float));
  }
  return out;
}

// The same function as the CPU kernel of bitmosaic::fp4_gemv_ext (fp4lut.py: what a compiled graph calls at
// 1-32 rows of x, through the dispatcher with no Python kernel in between; the ISA as its number).
TORCH_LIBRARY_FRAGMENT(bitmosaic, m) {
  m.def(
      "fp4_gemv_ext(Tensor x, Tensor data, Tensor scales_t, int N, int K, int block, int scale_kind, "
      "float global_scale, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(bitmosaic, CPU, m) { m.impl("fp4_gemv_ext", &fp4_gemv); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("fp4_gemv", &fp4_gemv, "FP4 (E2M1, block-scaled) LUT GEMV y = x W^T for 1-8 rows of x per pass",
        py::arg("x"), py::arg("data"), py::arg("scales_t"), py::arg("N"), py::arg("K"), py::arg("block"),
        py::arg("scale_kind"), py::arg("global_scale"), py::arg("isa"));
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
