// bitmosaic integer-activation matmul: the SIMD kernel, written once over integer vector traits V.
// No include guard: intmm.cpp includes this file once per ISA, inside that ISA's target region and
// namespace, and instantiates it with that ISA's traits (IntAvx2, IntVnni).
//
// Lanes are output rows: a register holds V::R rows x 4 consecutive columns as bytes; a dot step
// (vpdpbusd, or vpmaddubsw + vpmaddwd) adds 4 code x activation products to each row's int32 lane, the
// 4 activations broadcast to every lane.  A 16-row tile is H = 16 / R registers.  Per weight group the
// int32 sums are exact; the epilogue adds (acc - z qsum) (s_w s_a) to float accumulators, so no
// horizontal sum is ever needed.  MB rows of x share every unpacked weight register.

template <class V, bool BYTES>
BM_INLINE void weights(const uint8_t* pair, int h, typename V::I& lo, typename V::I& hi) {
  if constexpr (BYTES) {
    lo = V::load(pair + h * V::R * 4);
    hi = V::load(pair + 64 + h * V::R * 4);
  } else {
    const typename V::I w = V::load(pair + h * V::R * 4);
    const typename V::I m = V::set1_8(15);
    lo = V::and_(w, m);
    hi = V::and_(V::srli16(w, 4), m);
  }
}

template <class V, int NA>
BM_INLINE typename V::I sum(const typename V::I (&a)[NA]) {
  if constexpr (NA == 1) return a[0];
  else return V::add(a[0], a[1]);
}

// The output tile's float sums live in memory (fo [MB][16], L1), touched once per weight group, so the
// registers hold only the MB x H int32 accumulators (one per row of x and register: the MB rows are the
// independent chains; two for fewer than 4 rows), the two weight registers and a broadcast -- no spills
// in the pair loop.

// chains per row and register: decode (1-3 rows of x) needs two for the latency of vpdpbusd
template <int MB>
inline constexpr int kChains = MB < 4 ? 2 : 1;

// this tile's activations: a 16-row panel (row m at 4 m, column chunk c at 64 c) or the rows of q
template <bool PK>
BM_INLINE const int8_t* tile_acts(const Acts& A, int64_t m0) {
  return PK ? A.panel + (m0 / 16) * A.ldq * 16 + (m0 % 16) * 4 : A.q + m0 * A.ldq;
}

// acc = the exact int32 sums of the pairs p0..p1 of row block `base` with rows m0.. of x (q0 = tile_acts)
template <class V, int MB, bool BYTES, bool B8, bool PK>
BM_INLINE void pair_sums(const IntLayout& L, const Acts& A, const uint8_t* base, const int8_t* q0, int64_t p0,
                         int64_t p1, typename V::I (&acc)[MB][16 / V::R][kChains<MB>]) {
  using I = typename V::I;
  constexpr int H = 16 / V::R, NA = kChains<MB>;
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < H; ++h)
      for (int a = 0; a < NA; ++a) acc[m][h][a] = V::zero();
  const int64_t pb = L.pair_bytes();
  for (int64_t p = p0; p < p1; ++p) {
    const uint8_t* pair = base + p * pb;
    const int64_t pc = A.pair_col(p);
    for (int h = 0; h < H; ++h) {
      I lo, hi;
      weights<V, BYTES>(pair, h, lo, hi);
      for (int m = 0; m < MB; ++m) {
        const int8_t* qp = PK ? q0 + pc * 16 + m * 4 : q0 + m * A.ldq + pc;
        acc[m][h][0] = V::template dot<B8>(acc[m][h][0], lo, V::bcast4(qp));
        acc[m][h][NA - 1] = V::template dot<B8>(acc[m][h][NA - 1], hi, V::bcast4(qp + (PK ? 64 : 4)));
      }
    }
  }
}

// runs mode (Acts::qz): per run of one activation scale inside weight group g, the exact int32 sums,
// then only cvt + one FMA with the run's scale into a float sum per group; the weight scale and the
// zero-point term (z qz, qz = sum_r s_a qsum) once per group.  About half the epilogue work of giving
// every run its own group (the SQ-format's 8-column runs).
template <class V, int MB, bool BYTES, bool B8, bool PK>
BM_INLINE void group_runs(const IntLayout& L, const Acts& A, int64_t rb, int64_t m0, int64_t g, const uint8_t* base,
                          float* fo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int H = 16 / V::R;
  const int8_t* q0 = tile_acts<PK>(A, m0);
  F fg[MB][H];
  for (int m = 0; m < MB; ++m)
    for (int h = 0; h < H; ++h) fg[m][h] = V::fzero();
  const int64_t p1 = L.pair1(g);
  for (int64_t k = 0, pr = L.pair0(g); pr < p1; ++k, pr += A.run_pairs) {
    I acc[MB][H][kChains<MB>];
    pair_sums<V, MB, BYTES, B8, PK>(L, A, base, q0, pr, std::min(p1, pr + A.run_pairs), acc);
    const int64_t col = g * A.sub + k;
    const float* st = PK ? A.saT + col * A.ldt + m0 : nullptr;  // this run's scales of the tile's rows
    for (int m = 0; m < MB; ++m) {
      const F sa = V::set1f(PK ? st[m] : A.scale(m0 + m, col));
      for (int h = 0; h < H; ++h) fg[m][h] = V::fma(V::cvt(sum<V, kChains<MB>>(acc[m][h])), sa, fg[m][h]);
    }
  }
  const float* sp = L.sc + (rb * L.G + g) * 16;
  const float* zp = L.zc + (rb * L.G + g) * 16;
  for (int h = 0; h < H; ++h) {
    const F sv = V::loadf(sp + h * V::R), zv = V::loadf(zp + h * V::R);
    for (int m = 0; m < MB; ++m) {
      const F t = V::fnmadd(zv, V::set1f(A.qz[(m0 + m) * A.ldqs + g]), fg[m][h]);
      float* f = fo + m * 16 + h * V::R;
      V::storef(f, V::fma(t, sv, V::loadf(f)));
    }
  }
}

// one weight group, classic mode: exact int32 sums, then (acc - z qsum) (s_w s_a) into fo
template <class V, int MB, bool BYTES, bool B8, bool PK>
BM_INLINE void group_plain(const IntLayout& L, const Acts& A, int64_t rb, int64_t m0, int64_t g, const uint8_t* base,
                           float* fo) {
  using I = typename V::I;
  using F = typename V::F;
  constexpr int H = 16 / V::R;
  I acc[MB][H][kChains<MB>];
  pair_sums<V, MB, BYTES, B8, PK>(L, A, base, tile_acts<PK>(A, m0), L.pair0(g), L.pair1(g), acc);
  const int64_t ga = A.col(g);
  const float* sp = L.sc + (rb * L.G + g) * 16;
  const float* zp = L.zc + (rb * L.G + g) * 16;
  for (int h = 0; h < H; ++h) {
    const F sv = V::loadf(sp + h * V::R), zv = V::loadf(zp + h * V::R);
    for (int m = 0; m < MB; ++m) {
      const F t = V::fnmadd(zv, V::set1f((float)A.qsum[(m0 + m) * A.ldqs + g]), V::cvt(sum<V, kChains<MB>>(acc[m][h])));
      float* f = fo + m * 16 + h * V::R;
      V::storef(f, V::fma(t, V::mulf(sv, V::set1f(A.scale(m0 + m, ga))), V::loadf(f)));
    }
  }
}

// y[m0 .. m0 + MB) x rows of row block rb
template <class V, int MB, bool BYTES, bool B8, bool RUNS, bool PK>
void tile(const IntLayout& L, const Acts& A, int64_t rb, int64_t m0, float* y) {
  alignas(64) float fo[MB * 16];
  for (int i = 0; i < MB * 16; ++i) fo[i] = 0.f;
  const uint8_t* base = L.block(rb);
  for (int64_t g = 0; g < L.G; ++g) {
    if constexpr (RUNS) group_runs<V, MB, BYTES, B8, PK>(L, A, rb, m0, g, base, fo);
    else group_plain<V, MB, BYTES, B8, PK>(L, A, rb, m0, g, base, fo);
  }
  const int64_t n0 = rb * 16;
  const int64_t k = std::min<int64_t>(16, L.N - n0);
  for (int m = 0; m < MB; ++m) {
    float* yp = y + (m0 + m) * L.ldy + n0;
    if (L.accumulate) {  // a part of a larger output: add its rows in
      for (int64_t i = 0; i < k; ++i) yp[i] += fo[m * 16 + i];
    } else {
      std::memcpy(yp, fo + m * 16, k * sizeof(float));
    }
  }
}

// every row of x times the row blocks rb0..rb1: MB rows of x at a time, each unpacked weight register
// used MB times; the row blocks of one call stay in cache while the rows of x stream past them
template <class V, bool BYTES, bool B8, bool RUNS, bool PK>
void rows(const IntLayout& L, const Acts& A, float* y, int64_t rb0, int64_t rb1) {
  constexpr int MB = RUNS ? V::MB_RUNS : V::MB;  // runs mode keeps a float sum per row in registers too
  static_assert(16 % MB == 0, "a tile's rows lie in one 16-row panel");
  int64_t m0 = 0;
  for (; m0 + MB <= A.M; m0 += MB)
    for (int64_t rb = rb0; rb < rb1; ++rb) tile<V, MB, BYTES, B8, RUNS, PK>(L, A, rb, m0, y);
  while (m0 < A.M) {  // the rest: 8, 4, 2, 1 rows at a time (a tile never crosses a panel)
    const int64_t rest = A.M - m0 >= 8 ? 8 : A.M - m0 >= 4 ? 4 : A.M - m0 >= 2 ? 2 : 1;
    bm::dispatch_1to8(rest, [&](auto mb) {
      for (int64_t rb = rb0; rb < rb1; ++rb) tile<V, decltype(mb)::value, BYTES, B8, RUNS, PK>(L, A, rb, m0, y);
    });
    m0 += rest;
  }
}

template <class V, bool RUNS, bool PK>
void rows_mode(const IntLayout& L, const Acts& A, float* y, int64_t rb0, int64_t rb1, bool b8) {
  if (!L.bytes) return rows<V, false, false, RUNS, PK>(L, A, y, rb0, rb1);
  if (b8) return rows<V, true, true, RUNS, PK>(L, A, y, rb0, rb1);
  rows<V, true, false, RUNS, PK>(L, A, y, rb0, rb1);
}

template <class V>
void rows_any(const IntLayout& L, const Acts& A, float* y, int64_t rb0, int64_t rb1, bool b8) {
  if (A.panel) {
    if (A.qz) return rows_mode<V, true, true>(L, A, y, rb0, rb1, b8);
    return rows_mode<V, false, true>(L, A, y, rb0, rb1, b8);
  }
  if (A.qz) return rows_mode<V, true, false>(L, A, y, rb0, rb1, b8);
  rows_mode<V, false, false>(L, A, y, rb0, rb1, b8);
}
