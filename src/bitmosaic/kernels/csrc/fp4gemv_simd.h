// bitmosaic FP4 LUT GEMV: the SIMD tile, written once over the vector traits V (vec.h).
// No include guard: fp4gemv.cpp includes this file once per ISA, inside that ISA's target region and
// namespace, and instantiates it with that ISA's traits (bm::Avx2, bm::Avx512).
//
// Tile t (16 rows, V::W at a time), columns [c0, c1) of the chunk whose tables are T, M rows of x: per block,
// each quad's word of the rows (8 nibbles: 8 columns) looks up nibble n in T_{8q+n} (V::lookup16), summed in
// two chains (nibbles 0-3 / 4-7); then y += d * sum with the block's divisors d (divisors()).

// The divisors of V::W rows from their scale bytes s: widened to int32 lanes, then E8M0 bits (e << 23, the
// subnormal 2^-127 for e = 0, NaN for 255) or E4M3 gathered from the per-call table (fp4gemv.cpp).
template <class V>
typename V::F divisors(const Fp4& F, const uint8_t* s) {
  if constexpr (V::W == 16) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)s));
    if (F.kind == kE4M3) return _mm512_i32gather_ps(e, F.tab, 4);
    __m512i b = _mm512_slli_epi32(e, 23);
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(e, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    b = _mm512_mask_mov_epi32(b, _mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), _mm512_set1_epi32(0x7FC00000));
    return _mm512_castsi512_ps(b);
  } else {
    const __m256i e = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)s));
    if (F.kind == kE4M3) return _mm256_i32gather_ps(F.tab, e, 4);
    __m256i b = _mm256_slli_epi32(e, 23);
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x00400000), _mm256_cmpeq_epi32(e, _mm256_setzero_si256()));
    b = _mm256_blendv_epi8(b, _mm256_set1_epi32(0x7FC00000), _mm256_cmpeq_epi32(e, _mm256_set1_epi32(255)));
    return _mm256_castsi256_ps(b);
  }
}

template <class V, int M>
void tile(const Fp4& F, int64_t t, int64_t c0, int64_t c1, const float* T, float* y) {
  using Fv = typename V::F;
  const int64_t L = c1 - c0;
  const typename V::Mask all = V::mask(V::W);
  for (int h = 0; h < TILE; h += V::W) {
    Fv yv[M];
    float* yt = y + t * TILE + h;
    for (int m = 0; m < M; ++m) yv[m] = V::loadu(yt + m * F.Npad);
    for (int64_t b0 = c0; b0 < c1; b0 += F.block) {
      const int64_t b1 = std::min(c1, b0 + F.block);
      Fv a0[M], a1[M];
      for (int m = 0; m < M; ++m) a0[m] = a1[m] = V::zero();
      const uint8_t* w = F.data + (t * F.Q + b0 / 8) * TILE * 4 + 4 * h;
      for (int64_t j = b0; j < b1; j += 8, w += TILE * 4) {
        const typename V::I v = V::maskz_loadi(w, all);
        for (int m = 0; m < M; ++m) {
          const float* Tm = T + (m * L + (j - c0)) * 16;
          const Fv lo = V::add(V::add(V::lookup16(Tm, v, 0), V::lookup16(Tm + 16, v, 4)),
                               V::add(V::lookup16(Tm + 32, v, 8), V::lookup16(Tm + 48, v, 12)));
          const Fv hi = V::add(V::add(V::lookup16(Tm + 64, v, 16), V::lookup16(Tm + 80, v, 20)),
                               V::add(V::lookup16(Tm + 96, v, 24), V::lookup16(Tm + 112, v, 28)));
          a0[m] = V::add(a0[m], lo);
          a1[m] = V::add(a1[m], hi);
        }
      }
      const Fv d = divisors<V>(F, F.sc + (b0 / F.block) * F.Npad + t * TILE + h);
      for (int m = 0; m < M; ++m) yv[m] = V::add(yv[m], V::mul(d, V::add(a0[m], a1[m])));
    }
    for (int m = 0; m < M; ++m) V::storeu(yt + m * F.Npad, yv[m]);
  }
}
