// bitmosaic FP4 LUT GEMV: the SIMD tile, written once over the vector traits V (vec.h).
// No include guard: fp4gemv.cpp includes this file once per ISA, inside that ISA's target region and
// namespace (where load_rows(p) reads V::W rows' bytes as int32 lanes), and instantiates it with that ISA's
// traits (bm::Avx2, bm::Avx512).
//
// Tile t (16 rows, V::W at a time), columns [c0, c1) of the chunk whose tables are T, M rows of x: per block,
// every column pair's byte of the rows looks up the low nibble in T_{2p} and the high nibble in T_{2p+1}
// (V::lookup16), summed in two chains (even / odd pairs); then y += d * sum with the block's divisors d.
template <class V, int M>
void tile(const Fp4& F, int64_t t, int64_t c0, int64_t c1, const float* T, float* y) {
  using Fv = typename V::F;
  const int64_t L = c1 - c0;
  for (int h = 0; h < TILE; h += V::W) {
    Fv yv[M];
    float* yt = y + t * TILE + h;
    for (int m = 0; m < M; ++m) yv[m] = V::loadu(yt + m * F.Npad);
    for (int64_t b0 = c0; b0 < c1; b0 += F.block) {
      const int64_t b1 = std::min(c1, b0 + F.block);
      Fv a0[M], a1[M];
      for (int m = 0; m < M; ++m) a0[m] = a1[m] = V::zero();
      const uint8_t* w = F.data + (t * F.P + b0 / 2) * TILE + h;
      int64_t j = b0;
      for (; j + 2 < b1; j += 4, w += 2 * TILE) {
        const typename V::I v0 = load_rows(w), v1 = load_rows(w + TILE);
        for (int m = 0; m < M; ++m) {
          const float* Tm = T + (m * L + (j - c0)) * 16;
          a0[m] = V::add(a0[m], V::add(V::lookup16(Tm, v0, 0), V::lookup16(Tm + 16, v0, 4)));
          a1[m] = V::add(a1[m], V::add(V::lookup16(Tm + 32, v1, 0), V::lookup16(Tm + 48, v1, 4)));
        }
      }
      if (j < b1) {  // an odd number of pairs in the block
        const typename V::I v0 = load_rows(w);
        for (int m = 0; m < M; ++m) {
          const float* Tm = T + (m * L + (j - c0)) * 16;
          a0[m] = V::add(a0[m], V::add(V::lookup16(Tm, v0, 0), V::lookup16(Tm + 16, v0, 4)));
        }
      }
      const Fv d = V::loadu(F.divT + (b0 / F.block) * F.Npad + t * TILE + h);
      for (int m = 0; m < M; ++m) yv[m] = V::add(yv[m], V::mul(d, V::add(a0[m], a1[m])));
    }
    for (int m = 0; m < M; ++m) V::storeu(yt + m * F.Npad, yv[m]);
  }
}
