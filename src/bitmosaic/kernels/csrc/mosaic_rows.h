// bitmosaic MosaicQuant residual pass: the loop over row blocks (mosaic.cpp), written once.
// No include guard: mosaic.cpp includes this file once per ISA (baseline, and inside the AVX2 and
// AVX-512 target regions), each in its own namespace.

#if BM_VEC
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16u __attribute__((vector_size(64), aligned(4), may_alias));  // unaligned loads
#endif

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

void row_blocks_any(const Args& a, int64_t T, int64_t r0, int64_t r1, float* cf) {
  bm::dispatch_1to8(T, [&](auto t) { row_blocks<decltype(t)::value>(a, r0, r1, cf); });
}
