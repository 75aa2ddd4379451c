// bitmosaic bit-plane LUT GEMV: the SIMD tile, written once over the vector traits V (vec.h).
// No include guard: lutgemv.cpp includes this file once per ISA, inside that ISA's target region and
// namespace, and instantiates it with that ISA's traits (bm::Avx2, bm::Avx512).
//
// One tile (R <= 16 rows starting at row n0) of block (rb, g) at width Q, V::W rows at a time (AVX-512:
// the whole tile; AVX2: two halves): per 32-column chunk and plane, the 8 nibbles of every row's word
// look up the chunk's 8 tables of 16 signed sums (V::lookup16), summed into two chains (even / odd
// nibbles); the planes then add with weight 2^i, and y[n0 + r] += ŝ * sum + ẑ * Σx (lutgemv.cpp).
template <class V, int Q>
void tile(const Planes& P, const uint8_t* blk, int64_t R, int64_t n0, int64_t g, const float* T4, float xs, float* y) {
  using F = typename V::F;
  const int64_t nch = P.nch(g);
  for (int64_t h = 0; h < R; h += V::W) {
    const typename V::Mask m = V::mask(R - h);
    F acc[Q];
    for (int i = 0; i < Q; ++i) acc[i] = V::zero();
    const uint8_t* p = blk + 4 * h;
    for (int64_t c = 0; c < nch; ++c) {
      const float* T = T4 + c * 8 * 16;
      for (int i = 0; i < Q; ++i, p += 4 * R) {
        const typename V::I v = V::maskz_loadi(p, m);
        F a0 = V::lookup16(T, v, 0), a1 = V::lookup16(T + 16, v, 4);
        for (int n = 2; n < 8; n += 2) {
          a0 = V::add(a0, V::lookup16(T + 16 * n, v, 4 * n));
          a1 = V::add(a1, V::lookup16(T + 16 * n + 16, v, 4 * n + 4));
        }
        acc[i] = V::add(acc[i], V::add(a0, a1));
      }
    }
    F sum = acc[Q - 1];
    for (int i = Q - 2; i >= 0; --i) sum = V::add(V::add(sum, sum), acc[i]);
    const float* sp = P.sT + g * P.N + n0 + h;
    const float* zp = P.zT + g * P.N + n0 + h;
    const F s = V::maskz_load(sp, m), z = V::maskz_load(zp, m);
    const F sh = V::mul(V::set1(0.5f), s);
    const F zh = V::mul(s, V::sub(V::set1((float)((1 << Q) - 1) * 0.5f), z));
    F out = V::maskz_load(y + n0 + h, m);
    out = V::add(out, V::add(V::mul(sh, sum), V::mul(zh, V::set1(xs))));
    V::mask_store(y + n0 + h, m, out);
  }
}
