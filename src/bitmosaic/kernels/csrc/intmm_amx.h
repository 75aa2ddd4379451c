// bitmosaic integer-activation matmul: the AMX body for prefill (Intel AMX-INT8 tiles, issue 74).
// Part of intmm.cpp (one translation unit), after intmm_common.h.
//
// One tile product C[m][n] += sum_k A[m][k] B[k][n] (tdpbsud: signed int8 activations x unsigned uint8
// codes, exact int32) covers 16 rows of x, 16 weight rows and 64 columns, 16 times the work of one
// vpdpbusd.  The operands need no repacking of x: A is 16 rows of q as they are (row stride ldq), and
// the B operand's layout -- 16 rows of 4-byte column chunks, byte 4 n + j of chunk c = code(n, 4 c + j)
// -- is the integer layout's own pair tile (intmm_common.h): a byte-mode pair is two B rows as stored,
// a nibble pair is two after one and + shift (unpacked once per row block, reused by every row of x).
// Per weight group: the int32 tile is stored to L1 and the epilogue is the VNNI body's, operation for
// operation (t = acc - z qsum, one rounding; y += t (s_w s_a)), into 16 float registers, one per row of
// x; so the output equals the VNNI and portable kernels' bit for bit (tested).
//
// Used for 16 or more rows of x, plain mode (no activation runs, no gathered columns), when every
// group spans whole 64-column steps (KP % 64 == 0 and G == 1 or gs % 64 == 0), on a CPU with AMX-TILE
// and AMX-INT8 once Linux grants the process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM), unless
// $BITMOSAIC_AMX=0 (read per call, so a benchmark can compare the two bodies in one process).

#ifdef BM_X86
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdlib>
#endif
#include <atomic>

namespace {

// whether this CPU has AMX-INT8 and the kernel gave this process the tile state (asked once)
bool amx_supported() {
#ifdef BM_X86
  static const bool ok = [] {
    if (!bm::isa_supported(bm::kAvx512) || !__builtin_cpu_supports("amx-tile") || !__builtin_cpu_supports("amx-int8"))
      return false;
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;  // linux/arch/x86/include/uapi/asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// calls that ran on the AMX body in this process (tests check that the body they compare ran)
std::atomic<int64_t> amx_calls{0};
int64_t amx_call_count() { return amx_calls.load(); }

bool amx_enabled() {
  if (!amx_supported()) return false;
  const char* e = std::getenv("BITMOSAIC_AMX");
  return !(e && e[0] == '0' && e[1] == '\0');
}

// whether this call runs on the AMX body (see the header comment)
bool amx_applies(const IntLayout& L, const Acts& A, int64_t isa) {
  return isa == bm::kAvx512 && A.M >= 16 && !A.qz && !A.pcol && !L.accumulate && L.KP % 64 == 0 &&
         (L.G == 1 || L.gs % 64 == 0) && amx_enabled();
}

#ifdef BM_X86
BM_BEGIN_TARGET(BM_AVX512_TARGET ",amx-tile,amx-int8")

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0 (C: int32 16 x 16), 1 (A: 16 rows of x x 64 int8), 2 (B: 16 chunks x 64 codes)
inline void amx_configure() {
  TileConfig c;
  for (int t = 0; t < 3; ++t) {
    c.rows[t] = 16;
    c.colsb[t] = 64;
  }
  _tile_loadconfig(&c);
}

// row block rb's B rows (chunk c at 64 c): a byte-mode block as stored, a nibble block unpacked into wb
inline const uint8_t* amx_b_rows(const IntLayout& L, int64_t rb, uint8_t* wb) {
  const uint8_t* base = L.block(rb);
  if (L.bytes) return base;
  const __m512i m = _mm512_set1_epi8(15);
  for (int64_t p = 0; p < L.npairs; ++p) {
    const __m512i w = _mm512_loadu_si512(base + p * 64);
    _mm512_storeu_si512(wb + p * 128, _mm512_and_si512(w, m));
    _mm512_storeu_si512(wb + p * 128 + 64, _mm512_and_si512(_mm512_srli_epi16(w, 4), m));
  }
  return wb;
}

// The epilogue's per-row factors of one call, in float tables [M][G] so that the epilogue broadcasts
// each from memory: qf = (float) qsum (the VNNI body's conversion), sg = the activation scale of weight
// group g (A.scale(m, A.col(g))).
struct AmxTables {
  std::vector<float> qf, sg;
  AmxTables() = default;
  AmxTables(const IntLayout& L, const Acts& A) : qf(A.M * L.G), sg(A.M * L.G) {
    for (int64_t m = 0; m < A.M; ++m)
      for (int64_t g = 0; g < L.G; ++g) {
        qf[m * L.G + g] = (float)A.qsum[m * A.ldqs + g];
        sg[m * L.G + g] = A.scale(m, A.col(g));
      }
  }
};

// y rows m0 .. m0 + rows x row block rb (ROWS: 16, or 0 for `rows` < 16 given at run time); q0: 16
// rows of x at stride ldq (zero rows past `rows`), whose activation rows are m0 ..
template <int ROWS>
BM_INLINE void amx_tile(const IntLayout& L, const AmxTables& T, int64_t rb, int64_t m0, int rows_rt,
                        const int8_t* q0, int64_t ldq, const uint8_t* b, float* y) {
  const int rows = ROWS ? ROWS : rows_rt;
  alignas(64) int32_t c[16 * 16];
  __m512 fo[16];
  for (int m = 0; m < 16; ++m) fo[m] = _mm512_setzero_ps();
  const float* qf = T.qf.data() + m0 * L.G;
  const float* sg = T.sg.data() + m0 * L.G;
  for (int64_t g = 0; g < L.G; ++g) {
    _tile_zero(0);
    for (int64_t k = L.pair0(g) * 8, k1 = L.pair1(g) * 8; k < k1; k += 64) {
      _tile_loadd(1, q0 + k, ldq);
      _tile_loadd(2, b + k * 16, 64);  // chunk k / 4 at 64 (k / 4)
      _tile_dpbsud(0, 1, 2);
    }
    _tile_stored(0, c, 64);
    const __m512 sv = _mm512_loadu_ps(L.sc + (rb * L.G + g) * 16);
    const __m512 zv = _mm512_loadu_ps(L.zc + (rb * L.G + g) * 16);
    for (int m = 0; m < rows; ++m) {  // the VNNI body's epilogue (intmm_simd.h group_plain), per row of x
      const __m512 acc = _mm512_cvtepi32_ps(_mm512_load_si512(c + 16 * m));
      const __m512 t = _mm512_fnmadd_ps(zv, _mm512_set1_ps(qf[m * L.G + g]), acc);
      fo[m] = _mm512_fmadd_ps(t, _mm512_mul_ps(sv, _mm512_set1_ps(sg[m * L.G + g])), fo[m]);
    }
  }
  const int64_t n0 = rb * 16;
  const __mmask16 k = L.N - n0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (L.N - n0)) - 1);
  for (int m = 0; m < rows; ++m) _mm512_mask_storeu_ps(y + (m0 + m) * L.ldy + n0, k, fo[m]);
}

// every row of x times row blocks rb0 .. rb1 (one task of run_all): the blocks' B rows first, then 16
// rows of x at a time across them (the 16 x KP rows of x stay in L1 while the blocks are passed)
void amx_rows(const IntLayout& L, const Acts& A, const AmxTables& T, float* y, int64_t rb0, int64_t rb1) {
  amx_configure();
  const int64_t nb = rb1 - rb0, B = L.npairs * 128;
  std::vector<uint8_t> wb(L.bytes ? 0 : nb * B);
  std::vector<const uint8_t*> b(nb);
  for (int64_t i = 0; i < nb; ++i) b[i] = amx_b_rows(L, rb0 + i, wb.data() + (L.bytes ? 0 : i * B));
  int64_t m0 = 0;
  for (; m0 + 16 <= A.M; m0 += 16)
    for (int64_t i = 0; i < nb; ++i) amx_tile<16>(L, T, rb0 + i, m0, 16, A.q + m0 * A.ldq, A.ldq, b[i], y);
  if (m0 < A.M) {  // the last rows, copied into 16 zero-padded ones
    std::vector<int8_t> pad(16 * A.ldq, 0);
    std::memcpy(pad.data(), A.q + m0 * A.ldq, (A.M - m0) * A.ldq);
    for (int64_t i = 0; i < nb; ++i) amx_tile<0>(L, T, rb0 + i, m0, (int)(A.M - m0), pad.data(), A.ldq, b[i], y);
  }
  _tile_release();
}

BM_END_TARGET
#else
struct AmxTables {
  AmxTables() = default;
  AmxTables(const IntLayout&, const Acts&) {}
};
void amx_rows(const IntLayout&, const Acts&, const AmxTables&, float*, int64_t, int64_t) {}
#endif

}  // namespace
