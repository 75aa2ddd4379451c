// bitmosaic bit-plane LUT GEMV for the CPU (SFMP §4.5, App. B, G; T-MAC): y = W x with W held as
// one-bit planes in the block-major layout of bitmosaic/formats/bitplane.py (BITPLANE_VERSION 1).
//
// Layout: block (rb, g) = rows [rb*row_block, ...) x columns of group g, width q = bits[rb, g],
// starting at byte offsets[rb, g].  Inside a block, tiles of 16 rows; a tile with R rows holds,
// for each 32-column chunk c and each plane i, R little-endian uint32 words (bit t = column 32c+t).
// Scales and zero-points are float32 [G, N] (transposed, so 16 rows of a group are contiguous).
//
// Arithmetic (±1 form, App. B Eq. 17): with ŝ = s/2, ẑ = s((2^q - 1)/2 - z) and a bit b meaning
// 2b - 1 in {-1, +1},
//   y[n] = Σ_g ŝ[n,g] Σ_i 2^i Σ_{j in g} (2 b_i[n,j] - 1) x_j  +  ẑ[n,g] Σ_{j in g} x_j.
// The inner sum is table lookups: for every 4 activations (SIMD paths) a table of all 16 signed
// sums ±x0±x1±x2±x3 (index bit t set = +x_t), built once per call, float32, exact up to float
// rounding; a nibble of a plane word indexes it.  AVX-512: vpermps looks up 16 rows at once (the
// table is one zmm register).  AVX2: two vpermps (8-entry halves) and a blend on the nibble's top bit,
// 8 rows at once.  Portable: tables of 8 activations with 128 stored entries, the other half by
// negation (entry p >= 128 is -T[255 - p]), one byte of a word per lookup.  Activations past a
// group's end are zero in its tables, so padding bits (-1) add nothing.
// Threads: the row tiles are split with at::parallel_for (torch.get_num_threads()); the loop runs
// group by group so that a group's tables stay in L1 while its blocks stream through.
// 2-64 rows of x: the GEMV once per row.  More: a tiled dequantize (exactly (c - z) * s) + at::mm; the float
// weight never exists whole.
// ISA (isa.h): chosen per call by the caller (kernels/isa.py); the AVX2 and AVX-512 tiles are one body
// (lutgemv_simd.h) over the vector traits of vec.h, compiled once per ISA in its target region.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <torch/library.h>

#include "isa.h"
#include "vec.h"

namespace {

constexpr int TILE = 16;
constexpr int WCOLS = 32;
// Tiles ahead to prefetch in the GEMV: without it the tiles' loads wait on memory whenever the weight
// is not cache-resident (every layer of a decode step), which cost the LUT its lead over LowBitWeight.
constexpr int64_t PREFETCH_TILES = 4;
constexpr int64_t GEMV_MAX_ROWS = 64;  // up to this many rows of x: the LUT GEMV per row (lut_gemv.py --batch)
// A GEMV over fewer plane bytes than this runs on the calling thread ($BITMOSAIC_LUT_SERIAL_KB, read once;
// default 0: every GEMV splits its tiles over the threads).  Measured at the decode level (decode.py's
// linears ms/token, SmolLM2 W2, 2 threads): on the 2-vCPU Xeon splitting is faster, 5.00 vs 5.41 ms in
// two paired runs each; on the 2-core EPYC an in-cache microbenchmark had found one SmolLM2 GEMV (27-221
// KB of planes, 14-32 us) 1.07-1.40x slower on 2 threads, but its decode runs did not show it (5.85 ms
// split against 6.90 serial, different days).
constexpr int64_t GEMV_SERIAL_BYTES = 0;
int64_t gemv_serial_bytes() {
  static const int64_t bytes = [] {
    const char* e = std::getenv("BITMOSAIC_LUT_SERIAL_KB");
    return e != nullptr && *e != '\0' ? std::max<int64_t>(0, std::atoll(e)) * 1024 : GEMV_SERIAL_BYTES;
  }();
  return bytes;
}

struct Planes {
  const uint8_t* data;
  const int64_t* off;   // [n_rb, G]
  const uint8_t* bits;  // [n_rb, G]
  const float* sT;      // [G, N]
  const float* zT;      // [G, N]
  int64_t N, K, G, gs, rb;
  int64_t tiles_per_rb;
  int64_t nbytes;  // the planes' size
  int64_t cols(int64_t g) const { return std::min(K, (g + 1) * gs) - g * gs; }
  int64_t nch(int64_t g) const { return (cols(g) + WCOLS - 1) / WCOLS; }
};

inline uint32_t load32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;  // little-endian hosts (x86-64, arm64)
}

// Table layout: per group g, chunk c, nibble n (8 per chunk): 16 floats; tbase[g] = first table.
void build_tables4(const Planes& P, const float* x, const std::vector<int64_t>& tbase, float* tab) {
  at::parallel_for(0, P.G, 8, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t c0 = g * P.gs, L = P.cols(g), ntab = P.nch(g) * 8;
      for (int64_t k = 0; k < ntab; ++k) {
        float v[4];
        for (int t = 0; t < 4; ++t) v[t] = (4 * k + t < L) ? x[c0 + 4 * k + t] : 0.f;
        float* T = tab + (tbase[g] + k) * 16;
        for (int p = 0; p < 16; ++p) {
          float s = (p & 1) ? v[0] : -v[0];
          s += (p & 2) ? v[1] : -v[1];
          s += (p & 4) ? v[2] : -v[2];
          s += (p & 8) ? v[3] : -v[3];
          T[p] = s;
        }
      }
    }
  });
}

// 8-activation tables with 128 stored entries (index bit 7 clear); per group g, chunk c, byte b.
void build_tables8(const Planes& P, const float* x, const std::vector<int64_t>& tbase, float* tab) {
  for (int64_t g = 0; g < P.G; ++g) {
    const int64_t c0 = g * P.gs, L = P.cols(g), ntab = P.nch(g) * 4;
    for (int64_t k = 0; k < ntab; ++k) {
      float v[8];
      for (int t = 0; t < 8; ++t) v[t] = (8 * k + t < L) ? x[c0 + 8 * k + t] : 0.f;
      float* T = tab + (tbase[g] + k) * 128;
      for (int p = 0; p < 128; ++p) {
        float s = 0.f;
        for (int t = 0; t < 8; ++t) s += ((p >> t) & 1) ? v[t] : -v[t];
        T[p] = s;
      }
    }
  }
}

// Portable: one tile (R rows starting at row n0) of block (rb, g) at width q, g=8 tables.
void tile_portable(const Planes& P, const uint8_t* blk, int q, int64_t R, int64_t n0, int64_t g,
                   const float* T8, float xs, float* y) {
  const int64_t nch = P.nch(g);
  for (int64_t r = 0; r < R; ++r) {
    float plane_sum[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t c = 0; c < nch; ++c)
      for (int i = 0; i < q; ++i) {
        const uint32_t w = load32(blk + 4 * ((c * q + i) * R + r));
        for (int b = 0; b < 4; ++b) {
          const uint32_t u = (w >> (8 * b)) & 0xFF;
          const float* T = T8 + (c * 4 + b) * 128;
          plane_sum[i] += (u & 0x80) ? -T[255 - u] : T[u];
        }
      }
    float acc = plane_sum[q - 1];
    for (int i = q - 2; i >= 0; --i) acc = acc * 2.f + plane_sum[i];
    const float s = P.sT[g * P.N + n0 + r], z = P.zT[g * P.N + n0 + r];
    const float sh = 0.5f * s, zh = s * ((float)((1 << q) - 1) * 0.5f - z);
    y[n0 + r] += sh * acc + zh * xs;
  }
}

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX2_TARGET)
namespace avx2 {
#include "lutgemv_simd.h"
}  // namespace avx2
BM_END_TARGET
BM_BEGIN_TARGET(BM_AVX512_TARGET)
namespace avx512 {
#include "lutgemv_simd.h"
}  // namespace avx512
BM_END_TARGET
#endif

// the SIMD tile of width q on `isa` (AVX2 or AVX-512)
void tile_simd(int64_t isa, int q, const Planes& P, const uint8_t* blk, int64_t R, int64_t n0, int64_t g, const float* T,
               float xs, float* y) {
#ifdef BM_X86
  bm::dispatch_1to8(q, [&](auto Q) {
    if (isa == bm::kAvx512) avx512::tile<bm::Avx512, decltype(Q)::value>(P, blk, R, n0, g, T, xs, y);
    else avx2::tile<bm::Avx2, decltype(Q)::value>(P, blk, R, n0, g, T, xs, y);
  });
#endif
}

Planes make_planes(const torch::Tensor& data, const torch::Tensor& off, const torch::Tensor& bits, const torch::Tensor& sT,
                   const torch::Tensor& zT, int64_t N, int64_t K, int64_t gs, int64_t rb) {
  TORCH_CHECK(data.dtype() == torch::kUInt8 && data.is_contiguous(), "data must be contiguous uint8");
  TORCH_CHECK(off.dtype() == torch::kInt64 && bits.dtype() == torch::kUInt8, "offsets int64, bits uint8");
  TORCH_CHECK(sT.dtype() == torch::kFloat32 && zT.dtype() == torch::kFloat32 && sT.is_contiguous() && zT.is_contiguous(),
              "scales/zeros must be contiguous float32 [G, N]");
  Planes P;
  P.data = data.data_ptr<uint8_t>();
  P.off = off.data_ptr<int64_t>();
  P.bits = bits.data_ptr<uint8_t>();
  P.sT = sT.data_ptr<float>();
  P.zT = zT.data_ptr<float>();
  P.N = N; P.K = K; P.G = sT.size(0); P.gs = gs; P.rb = rb;
  P.tiles_per_rb = (rb + TILE - 1) / TILE;
  P.nbytes = data.numel();
  return P;
}

// kSpread.v[u]: the 8 bits of byte u moved to the low bit of 8 bytes (bit k -> byte k), so one
// shifted OR adds one plane's bit to 8 codes held as bytes (codes are at most 8 bits wide).
struct Spread {
  uint64_t v[256];
  constexpr Spread() : v() {
    for (int u = 0; u < 256; ++u)
      for (int k = 0; k < 8; ++k)
        if ((u >> k) & 1) v[u] |= 1ull << (8 * k);
  }
};
constexpr Spread kSpread{};

// Rows [r0, r1) of W in float32 into out [r1 - r0, K]: exactly (c - z) * s.  Per 32-column chunk,
// each plane word adds its bit to 32 byte-codes through kSpread (4 table reads), then the bytes
// become floats (a loop the compiler vectorizes); little-endian hosts (x86-64, arm64).
void dequant_rows(const Planes& P, int64_t r0, int64_t r1, float* out) {
  std::vector<uint8_t> codes(P.gs + WCOLS);
  for (int64_t n = r0; n < r1; ++n) {
    const int64_t rbi = n / P.rb, rr = n - rbi * P.rb, t = rr / TILE, r = rr % TILE;
    const int64_t brows = std::min(P.rb, P.N - rbi * P.rb);
    const int64_t R = std::min<int64_t>(TILE, brows - t * TILE);
    for (int64_t g = 0; g < P.G; ++g) {
      const int q = P.bits[rbi * P.G + g];
      const int64_t nch = P.nch(g), L = P.cols(g);
      const uint8_t* blk = P.data + P.off[rbi * P.G + g] + t * TILE * nch * q * 4;
      for (int64_t c = 0; c < nch; ++c) {
        uint64_t acc[4] = {0, 0, 0, 0};
        for (int i = 0; i < q; ++i) {
          const uint32_t w = load32(blk + 4 * ((c * q + i) * R + r));
          for (int k = 0; k < 4; ++k) acc[k] |= kSpread.v[(w >> (8 * k)) & 255u] << i;
        }
        std::memcpy(codes.data() + c * WCOLS, acc, WCOLS);
      }
      const float s = P.sT[g * P.N + n], z = P.zT[g * P.N + n];
      float* o = out + (n - r0) * P.K + g * P.gs;
      const uint8_t* cp = codes.data();
      for (int64_t j = 0; j < L; ++j) o[j] = ((float)cp[j] - z) * s;
    }
  }
}

// yp[0..N) = W x for one activation row x[0..K).
void gemv(const Planes& P, const float* x, int64_t isa, float* yp) {
  std::fill(yp, yp + P.N, 0.f);
  if (P.N == 0 || P.K == 0) return;
  const int per = (isa == bm::kPortable) ? 4 : 8;       // tables per 32-column chunk
  const int entries = (isa == bm::kPortable) ? 128 : 16;
  std::vector<int64_t> tbase(P.G + 1, 0);
  for (int64_t g = 0; g < P.G; ++g) tbase[g + 1] = tbase[g] + P.nch(g) * per;
  std::vector<float> tab(tbase[P.G] * entries);
  std::vector<float> xsum(P.G);
  for (int64_t g = 0; g < P.G; ++g) {
    float s = 0.f;
    for (int64_t j = g * P.gs; j < g * P.gs + P.cols(g); ++j) s += x[j];
    xsum[g] = s;
  }
  if (isa == bm::kPortable) build_tables8(P, x, tbase, tab.data());
  else build_tables4(P, x, tbase, tab.data());
  // tiles that hold rows: every row block is full but the last (so a thread split covers real work)
  const int64_t n_rb = (P.N + P.rb - 1) / P.rb;
  const int64_t ntiles = (n_rb - 1) * P.tiles_per_rb + (P.N - (n_rb - 1) * P.rb + TILE - 1) / TILE;
  at::parallel_for(0, ntiles, P.nbytes < gemv_serial_bytes() ? ntiles : 4, [&](int64_t a, int64_t b) {
    for (int64_t g = 0; g < P.G; ++g) {
      const float* T = tab.data() + tbase[g] * entries;
      const int64_t chunk_bytes = P.nch(g) * 4;  // per row and plane
      for (int64_t id = a; id < b; ++id) {
        const int64_t rbi = id / P.tiles_per_rb, t = id % P.tiles_per_rb;
        const int64_t brows = std::min(P.rb, P.N - rbi * P.rb);
        if (t * TILE >= brows) continue;
        const int64_t R = std::min<int64_t>(TILE, brows - t * TILE), n0 = rbi * P.rb + t * TILE;
        const int q = P.bits[rbi * P.G + g];
        const uint8_t* blk = P.data + P.off[rbi * P.G + g] + t * TILE * chunk_bytes * q;
        if ((t + PREFETCH_TILES) * TILE < brows) {  // a later tile of this block, on its way meanwhile
          const int64_t tb = TILE * chunk_bytes * q;  // bytes of a full tile
          const uint8_t* ahead = blk + PREFETCH_TILES * tb;
          for (int64_t o = 0; o < tb; o += 64) __builtin_prefetch(ahead + o, 0, 3);
        }
        if (isa == bm::kPortable) tile_portable(P, blk, q, R, n0, g, T, xsum[g], yp);
        else tile_simd(isa, q, P, blk, R, n0, g, T, xsum[g], yp);
      }
    }
  });
}

}  // namespace

// out[k] = src[index[k]] for an int32 or int64 index, each entry checked against [0, n).
template <typename T>
void gather_typed(const T* ix, int64_t count, const float* src, int64_t n, float* out, const char* what) {
  for (int64_t k = 0; k < count; ++k) {
    TORCH_CHECK(ix[k] >= 0 && ix[k] < n, what);
    out[k] = src[ix[k]];
  }
}
void gather_checked(const torch::Tensor& index, const float* src, int64_t n, float* out, const char* what) {
  if (index.dtype() == torch::kInt32) gather_typed(index.data_ptr<int32_t>(), index.numel(), src, n, out, what);
  else gather_typed(index.data_ptr<int64_t>(), index.numel(), src, n, out, what);
}

// in_index (optional int32/int64 [K]): the kernel's input is x[:, in_index] (SFMP's column order, Eq. 14);
// out_index (optional int32/int64 [n_out]): the result is y[:, out_index] (the row un-permutation).  At
// batch 1 both are plain loops here, so a permuted layer costs no extra tensor ops per token.
torch::Tensor lut_matmul(torch::Tensor x, torch::Tensor data, torch::Tensor off, torch::Tensor bits, torch::Tensor sT,
                         torch::Tensor zT, int64_t N, int64_t K, int64_t gs, int64_t rb, int64_t tile_rows, int64_t isa,
                         c10::optional<torch::Tensor> in_index, c10::optional<torch::Tensor> out_index) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.dtype() == torch::kFloat32, "x must be float32 [M, K]");
  for (const auto* ix : {&in_index, &out_index})
    if (ix->has_value())
      TORCH_CHECK(((*ix)->dtype() == torch::kInt64 || (*ix)->dtype() == torch::kInt32) && (*ix)->dim() == 1 &&
                      (*ix)->is_contiguous(),
                  "in_index/out_index must be contiguous int32/int64 vectors");
  TORCH_CHECK(!in_index.has_value() || in_index->numel() == K, "in_index must have K entries");
  bm::check_isa(isa);
  x = x.contiguous();
  Planes P = make_planes(data, off, bits, sT, zT, N, K, gs, rb);
  const int64_t M = x.size(0);
  if (M <= GEMV_MAX_ROWS) {  // decode, speculative decode, small batches: one GEMV per row, with the
    // gather and the un-permutation as plain loops (no extra tensor ops per call)
    const int64_t n_out = out_index.has_value() ? out_index->numel() : N;
    auto y = torch::empty({M, n_out}, x.options());
    std::vector<float> xg(in_index.has_value() ? K : 0), yr(out_index.has_value() ? N : 0);
    for (int64_t m = 0; m < M; ++m) {
      const float* xp = x.data_ptr<float>() + m * K;
      float* yp = y.data_ptr<float>() + m * n_out;
      if (in_index.has_value()) {
        gather_checked(*in_index, xp, K, xg.data(), "in_index out of range");
        xp = xg.data();
      }
      gemv(P, xp, isa, out_index.has_value() ? yr.data() : yp);
      if (out_index.has_value()) gather_checked(*out_index, yr.data(), N, yp, "out_index out of range");
    }
    return y;
  }
  if (in_index.has_value()) x = x.index_select(1, *in_index);
  auto y = torch::empty({M, N}, x.options());
  if (N > 0) {
    // prefill: each thread dequantizes its own tiles of rows and multiplies each at once (no barrier
    // between the two, as in qmatmul.cpp; a shared tile stalled whenever one thread was late)
    const int64_t nt = std::max<int64_t>(1, at::get_num_threads());
    const int64_t tr = std::max<int64_t>(8, std::min(tile_rows, (N + nt - 1) / nt));
    auto yt = torch::empty({N, M}, x.options());
    const auto xt = x.t();
    const at::ThreadLocalState tls;  // the caller's inference/grad mode for the tensor ops in the workers
    at::parallel_for(0, (N + tr - 1) / tr, 1, [&](int64_t t0, int64_t t1) {
      at::ThreadLocalStateGuard guard(tls);
      auto tile = torch::empty({std::min(tr, N), K}, x.options());
      float* tp = tile.data_ptr<float>();
      for (int64_t t = t0; t < t1; ++t) {
        const int64_t r0 = t * tr, r1 = std::min(N, r0 + tr);
        dequant_rows(P, r0, r1, tp);
        auto dst = yt.narrow(0, r0, r1 - r0);
        at::mm_out(dst, tile.narrow(0, 0, r1 - r0), xt);
      }
    });
    y = yt.t().contiguous();
  }
  return out_index.has_value() ? y.index_select(1, *out_index) : y;
}

torch::Tensor dequantize(torch::Tensor data, torch::Tensor off, torch::Tensor bits, torch::Tensor sT, torch::Tensor zT,
                         int64_t N, int64_t K, int64_t gs, int64_t rb, int64_t r0, int64_t r1) {
  Planes P = make_planes(data, off, bits, sT, zT, N, K, gs, rb);
  TORCH_CHECK(0 <= r0 && r0 <= r1 && r1 <= N, "row range out of bounds");
  auto out = torch::empty({r1 - r0, K}, sT.options());
  float* op = out.data_ptr<float>();
  at::parallel_for(r0, r1, 8, [&](int64_t a, int64_t b) { dequant_rows(P, a, b, op + (a - r0) * K); });
  return out;
}

// The same function as the CPU kernel of bitmosaic::lut_matmul_ext (ops.py: what a compiled graph calls,
// through the dispatcher with no Python kernel in between; the ISA as its number).
TORCH_LIBRARY_FRAGMENT(bitmosaic, m) {
  m.def(
      "lut_matmul_ext(Tensor x, Tensor data, Tensor offsets, Tensor bits, Tensor scales_t, Tensor zeros_t, int N, "
      "int K, int group_size, int row_block, int tile, int isa, Tensor? in_index, Tensor? out_index) -> Tensor");
}

TORCH_LIBRARY_IMPL(bitmosaic, CPU, m) { m.impl("lut_matmul_ext", &lut_matmul); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("lut_matmul", &lut_matmul, "bit-plane LUT matmul y = x[:, in] W^T [:, out] (batch 1: LUT GEMV; more: tiled)",
        py::arg("x"), py::arg("data"), py::arg("off"), py::arg("bits"), py::arg("sT"), py::arg("zT"), py::arg("N"),
        py::arg("K"), py::arg("gs"), py::arg("rb"), py::arg("tile_rows"), py::arg("isa"),
        py::arg("in_index") = py::none(), py::arg("out_index") = py::none());
  m.def("dequantize", &dequantize, "rows of W in float32, (c - z) * s");
  m.def("isa_supported", &bm::isa_supported, "whether this CPU runs kernel ISA 0 (portable), 1 (AVX2), 2 (AVX-512)");
}
