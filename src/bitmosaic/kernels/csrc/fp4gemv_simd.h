// bitmosaic FP4 LUT GEMV: the SIMD tile, written once over the vector traits V (vec.h).
// No include guard: fp4gemv.cpp includes this file once per ISA, inside that ISA's target region and
// namespace, and instantiates it with that ISA's traits (bm::Avx2, bm::Avx512).
//
// Tile t (16 rows, V::W at a time), columns [c0, c1) of the chunk whose tables are T, M rows of x: per block,
// each quad's word of the rows (8 nibbles: 8 columns) looks up nibble n in T_{8q+n} (V::lookup16), summed in
// two chains (nibbles 0-3 / 4-7); then y += d * sum with the block's divisors d.
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
      const Fv d = V::loadu(F.divT + (b0 / F.block) * F.Npad + t * TILE + h);
      for (int m = 0; m < M; ++m) yv[m] = V::add(yv[m], V::mul(d, V::add(a0[m], a1[m])));
    }
    for (int m = 0; m < M; ++m) V::storeu(yt + m * F.Npad, yv[m]);
  }
}
