// bitmosaic C++ kernels: instruction sets, CPU detection and per-call dispatch, shared by the three
// extensions (qmatmul.cpp, lutgemv.cpp, mosaic.cpp).
//
// One numbering, the same as bitmosaic/kernels/isa.py (ISAS = ("portable", "avx2", "avx512")):
//   0 portable  plain C++ (any CPU),
//   1 avx2      AVX2 + FMA,
//   2 avx512    AVX-512 F/BW/VL/DQ/VBMI (+ AVX2, FMA).
// Every extension is compiled for the baseline x86-64; its SIMD code is compiled per ISA inside a
// target region (BM_BEGIN_TARGET ... BM_END_TARGET), so it loads on any CPU.  Python picks the ISA
// of each call (isa.py: the best one isa_supported() reports, or $BITMOSAIC_KERNEL_ISA) and passes its
// number; the kernels check it with check_isa().
#pragma once
#include <torch/extension.h>

#include <cstdint>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define BM_X86 1
#endif

#if defined(__GNUC__) || defined(__clang__)
#define BM_INLINE __attribute__((always_inline)) inline
#else
#define BM_INLINE inline
#endif

// Target regions: every function (and function template) defined between BM_BEGIN_TARGET(t) and
// BM_END_TARGET is compiled for target t (GCC: #pragma GCC target; clang: #pragma clang attribute).
#define BM_PRAGMA(x) _Pragma(#x)
#if defined(__clang__)
#define BM_BEGIN_TARGET(t) BM_PRAGMA(clang attribute push(__attribute__((target(t))), apply_to = function))
#define BM_END_TARGET BM_PRAGMA(clang attribute pop)
#else
#define BM_BEGIN_TARGET(t) BM_PRAGMA(GCC push_options) BM_PRAGMA(GCC target(t))
#define BM_END_TARGET BM_PRAGMA(GCC pop_options)
#endif
#define BM_AVX2_TARGET "avx2,fma"
#define BM_AVX512_TARGET "avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx2,fma"

namespace bm {

enum Isa : int64_t { kPortable = 0, kAvx2 = 1, kAvx512 = 2 };

// Whether this CPU runs `isa` (detected once).
inline bool isa_supported(int64_t isa) {
  if (isa == kPortable) return true;
#ifdef BM_X86
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  static const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                             __builtin_cpu_supports("avx512vbmi");
  if (isa == kAvx2) return avx2;
  if (isa == kAvx512) return avx512;
#endif
  return false;
}

inline void check_isa(int64_t isa) {
  TORCH_CHECK(isa_supported(isa), "kernel ISA ", isa, " (0 portable, 1 avx2, 2 avx512) is not supported by this CPU");
}

// f(std::integral_constant<int, n>{}) for n in 1..8 (anything above 8 runs as 8): the one switch from
// a run-time count (bit width, rows of x) to a compile-time template argument.
template <class F>
BM_INLINE void dispatch_1to8(int64_t n, F&& f) {
  switch (n) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 7: f(std::integral_constant<int, 7>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

}  // namespace bm
