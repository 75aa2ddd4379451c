// bitmosaic low-bit matmul: the layout view, the portable span decoder and portable kernels.
// Part of qmatmul.cpp (one translation unit); see the layout comment there.
#pragma once
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "isa.h"

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

  const uint8_t* row(int64_t n) const {
    const int64_t rb = n / row_block;
    return data + base[rb] + (n - rb * row_block) * rowlen[rb];
  }
  int64_t glen(int64_t g) const {
    const int64_t c0 = g * group_size;
    return (c0 + group_size <= K) ? group_size : K - c0;
  }
  // Row block rb holds its groups in shared spans (qmatmul.py: groups of 16 or 32 codes of one width side
  // by side in 64-code spans, no padding): its second group starts in the first one's span.
  bool shared(int64_t rb) const { return group_size < 64 && G > 1 && goff[rb * G + 1] == goff[rb * G]; }
  // where group g's first code sits in the span at p + goff (shared spans: its column mod 64; else 0)
  int64_t gskip(int64_t rb, int64_t g) const { return shared(rb) ? (g * group_size) % 64 : 0; }
};

inline uint64_t load64(const uint8_t* p) {
  uint64_t w;
  std::memcpy(&w, p, 8);  // the buffer is padded by 64 bytes: never reads past it
  return w;
}

// The codes of one group as integers (portable): code j of span s sits at bit b * (4 * (j % 16) + (j % 64) / 16)
// of the span; the group's codes start at code `skip` of the first span (shared spans, else 0).
inline void decode_group(const uint8_t* p, int b, int64_t len, int32_t* out, int64_t skip = 0) {
  const uint64_t mask = (1ull << b) - 1;
  for (int64_t i = 0; i < len; ++i) {
    const int64_t j = skip + i;
    const int64_t bit = (j / 64) * 64 * b + b * (4 * (j % 16) + (j % 64) / 16);
    out[i] = (int32_t)((load64(p + (bit >> 3)) >> (bit & 7)) & mask);
  }
}

template <int M>
void gemv_rows_portable(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1) {
  std::vector<int32_t> c(L.group_size);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float out[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      decode_group(row + L.goff[rb * L.G + g], L.bits[rb * L.G + g], len, c.data(), L.gskip(rb, g));
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * L.K + c0;
        float acc = 0.f;
        for (int64_t j = 0; j < len; ++j) acc += (float)c[j] * xm[j];
        out[m] += s * (acc - z * xsum[m * L.G + g]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = out[m];
  }
}

void dequant_rows_portable(const Layout& L, int64_t r0, int64_t r1, float* out) {
  std::vector<int32_t> codes(L.group_size);
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float* o = out + (n - r0) * L.K;
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      decode_group(row + L.goff[rb * L.G + g], L.bits[rb * L.G + g], len, codes.data(), L.gskip(rb, g));
      for (int64_t j = 0; j < len; ++j) o[c0 + j] = ((float)codes[j] - z) * s;  // no contraction
    }
  }
}

}  // namespace
