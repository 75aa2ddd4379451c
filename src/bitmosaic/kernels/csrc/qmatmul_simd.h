// bitmosaic low-bit matmul: the SIMD kernels, written once over the vector traits V (vec.h).
// No include guard: qmatmul.cpp includes this file once per ISA, inside that ISA's target region and
// namespace, and instantiates it with that ISA's traits (bm::Avx2, bm::Avx512).
//
// A span (64 codes, 8*B bytes) is P = 16 / V::W registers ("parts") of int32 lanes; part h holds lanes
// W*h .. W*h + W-1 and starts at byte B*W*h/2.  Shifted by t*B and masked, part h gives the codes
// 16t + W*h .. 16t + W*h + W-1 of the span (codes<B, t>).
// Accumulation order (kept from the per-ISA kernels, results unchanged): AVX-512 keeps one chain per
// step t (4 per row of x), AVX2 one chain per part h (2 per row), each chain summing in span order;
// the chains are added pairwise at the end of a group.

// Codes of 1-4 bits on AVX-512 come from a 16-float table (value i mod 2^B at index i) by one vpermps,
// which reads only the low 4 bits of each lane: no mask, no int -> float conversion (the same floats
// exactly: small integers), and the permute runs on port 5 where the shift, conversion and mask
// compete for port 0 with the FMAs on the CPUs measured (benchmarks/kernels/kernel_ab.py --kernel qmatmul).
template <int B>
struct CodeTab {
  alignas(64) float v[16];
  constexpr CodeTab() : v() {
    for (int i = 0; i < 16; ++i) v[i] = (float)(i & ((1 << B) - 1));
  }
};
template <int B>
constexpr CodeTab<B> kCodeTab{};

template <class V, int B, int T>
BM_INLINE typename V::F codes(typename V::I v) {
  typename V::I c = T ? V::srli(v, T * B) : v;
  if constexpr (V::W == 16 && B <= 4) {
    return V::lookup16(kCodeTab<B>.v, c, 0);
  } else {
    constexpr bool clean = (T == 3) && (B == 8 || B == 4 || B == 2);  // nothing above the last code
    if constexpr (!clean) c = V::andi(c, V::set1i((1 << B) - 1));
    return V::cvt(c);
  }
}

template <class V>
constexpr int kParts = 16 / V::W;
template <class V>
constexpr int kChains = kParts<V> == 1 ? 4 : kParts<V>;
template <class V>
constexpr int chain(int h, int t) { return kParts<V> == 1 ? t : h; }

// gv[m] = sum_j c[j] x[m, j] over one group (len codes at p, x already offset to the group's columns)
template <class V, int M, int B>
void group(const uint8_t* p, int64_t len, const float* x, int64_t K, typename V::F* gv) {
  using F = typename V::F;
  constexpr int P = kParts<V>, C = kChains<V>, W = V::W;
  const typename V::Lanes c = V::template consts<B>();
  F a[M][C];
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < C; ++k) a[m][k] = V::zero();
  const int64_t full = len & ~int64_t(63);
  int64_t j = 0;
  for (; j < full; j += 64, p += 8 * B) {
    for (int h = 0; h < P; ++h) {
      const typename V::I v = V::template span<B>(p + B * W * h / 2, c);
      const F cc[4] = {codes<V, B, 0>(v), codes<V, B, 1>(v), codes<V, B, 2>(v), codes<V, B, 3>(v)};
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * K + j + W * h;
        for (int t = 0; t < 4; ++t) a[m][chain<V>(h, t)] = V::fma(cc[t], V::loadu(xm + 16 * t), a[m][chain<V>(h, t)]);
      }
    }
  }
  if (j < len) {  // the zero-padded last span: x is read only inside the group (masked loads; the
    // lanes past it add c * 0 = +0 to accumulators that are never -0, so the sums are unchanged)
    const int64_t rem = len - j;
    for (int h = 0; h < P; ++h) {
      const typename V::I v = V::template span<B>(p + B * W * h / 2, c);
      const F cc[4] = {codes<V, B, 0>(v), codes<V, B, 1>(v), codes<V, B, 2>(v), codes<V, B, 3>(v)};
      const typename V::Mask mk[4] = {V::mask(rem - W * h), V::mask(rem - 16 - W * h), V::mask(rem - 32 - W * h),
                                      V::mask(rem - 48 - W * h)};
      for (int m = 0; m < M; ++m) {  // constant indices: the accumulators stay in registers
        const float* xm = x + m * K + j + W * h;
        for (int t = 0; t < 4; ++t)
          a[m][chain<V>(h, t)] = V::fma(cc[t], V::maskz_load(xm + 16 * t, mk[t]), a[m][chain<V>(h, t)]);
      }
    }
  }
  for (int m = 0; m < M; ++m) {
    if constexpr (C == 4) gv[m] = V::add(V::add(a[m][0], a[m][1]), V::add(a[m][2], a[m][3]));
    else gv[m] = V::add(a[m][0], a[m][1]);
  }
}

// One row in shared spans (Layout::shared: groups of gs = 16 or 32 codes, one width B, K a multiple of 64):
// per span, one chain per step t (16 codes) and row of x; each group of the span sums its gs / 16 steps,
// then racc += s (sum) and rs -= s z sum(x) as for any group.
template <class V, int M, int B>
void shared_row(const Layout& L, const uint8_t* row, int64_t n, const float* x, const float* xsum,
                typename V::F* racc, float* rs) {
  using F = typename V::F;
  constexpr int P = kParts<V>, W = V::W;
  const typename V::Lanes c = V::template consts<B>();
  const int steps = (int)(L.group_size / 16);  // steps t per group: 1 or 2
  for (int64_t j = 0; j < L.K; j += 64, row += 8 * B) {
    F a[M][4];
    for (int m = 0; m < M; ++m)
      for (int t = 0; t < 4; ++t) a[m][t] = V::zero();
    for (int h = 0; h < P; ++h) {
      const typename V::I v = V::template span<B>(row + B * W * h / 2, c);
      const F cc[4] = {codes<V, B, 0>(v), codes<V, B, 1>(v), codes<V, B, 2>(v), codes<V, B, 3>(v)};
      for (int m = 0; m < M; ++m) {
        const float* xm = x + m * L.K + j + W * h;
        for (int t = 0; t < 4; ++t) a[m][t] = V::fma(cc[t], V::loadu(xm + 16 * t), a[m][t]);
      }
    }
    for (int t0 = 0; t0 < 4; t0 += steps) {
      const int64_t g = (j + 16 * t0) / L.group_size;
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      const F sv = V::set1(s);
      for (int m = 0; m < M; ++m) {
        const F gv = steps == 2 ? V::add(a[m][t0], a[m][t0 + 1]) : a[m][t0];
        racc[m] = V::fma(sv, gv, racc[m]);
        rs[m] -= s * (z * xsum[m * L.G + g]);
      }
    }
  }
}

// Bytes ahead of the row being read that the GEMV prefetches (the rows of a matrix are one stream). On the
// 2-vCPU Xeon VM: SmolLM2's 210 W4 decode linears, one thread, 13.3 -> 10.0-10.3 ms a token (0.5-16 KB
// tried; 4 KB best) while the VM's memory was slow (int8 GEMM 1.0 TOPS, the read test 11 GB/s); 0.98-0.99x
// once it was fast (1.7 TOPS, 12.6 GB/s: benchmarks/results/qmatmul_ab_prefetch.md).  Never slower.
constexpr int64_t kGemvPrefetch = 4096;

// y[m, n] for rows n0..n1 of W and the M rows of x (decode; module comment of qmatmul.cpp)
template <class V, int M>
void gemv_rows(const Layout& L, const float* x, const float* xsum, float* y, int64_t n0, int64_t n1) {
  typename V::F gv[M], racc[M];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    if (n + 1 < n1) {  // one row's worth of lines kGemvPrefetch bytes ahead (a prefetch never faults)
      const int64_t len = L.rowlen[rb];
      for (int64_t o = 0; o < len; o += 64) __builtin_prefetch(row + kGemvPrefetch + o, 0, 3);
    }
    float rs[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int m = 0; m < M; ++m) racc[m] = V::zero();
    if (L.shared(rb)) {
      bm::dispatch_1to8(L.bits[rb * L.G], [&](auto b) { shared_row<V, M, decltype(b)::value>(L, row, n, x, xsum, racc, rs); });
      for (int m = 0; m < M; ++m) y[m * L.N + n] = V::reduce(racc[m]) + rs[m];
      continue;
    }
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const uint8_t* p = row + L.goff[rb * L.G + g];
      const float* xg = x + c0;
      bm::dispatch_1to8(L.bits[rb * L.G + g], [&](auto b) { group<V, M, decltype(b)::value>(p, len, xg, L.K, gv); });
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      const typename V::F sv = V::set1(s);
      for (int m = 0; m < M; ++m) {
        racc[m] = V::fma(sv, gv[m], racc[m]);
        rs[m] -= s * (z * xsum[m * L.G + g]);
      }
    }
    for (int m = 0; m < M; ++m) y[m * L.N + n] = V::reduce(racc[m]) + rs[m];
  }
}

// o[j] = (c[j] - z) * s for one group (a subtraction, then a product: bitwise the reference)
template <class V, int B>
void dequant_group(const uint8_t* p, int64_t len, float s, float z, float* o) {
  using F = typename V::F;
  constexpr int P = kParts<V>, W = V::W;
  const typename V::Lanes c = V::template consts<B>();
  const F sv = V::set1(s), zv = V::set1(z);
  for (int64_t j = 0; j < len; j += 64, p += 8 * B) {
    for (int h = 0; h < P; ++h) {
      const typename V::I v = V::template span<B>(p + B * W * h / 2, c);
      const F cc[4] = {codes<V, B, 0>(v), codes<V, B, 1>(v), codes<V, B, 2>(v), codes<V, B, 3>(v)};
      for (int t = 0; t < 4; ++t) {
        const int64_t k = len - j - 16 * t - W * h;
        if (k <= 0) break;
        V::store_tail(o + j + 16 * t + W * h, k, V::mul(V::sub(cc[t], zv), sv));
      }
    }
  }
}

// One row in shared spans: o[j] = (c[j] - z) * s with each 16-code step's group
template <class V, int B>
void shared_dequant_row(const Layout& L, const uint8_t* row, int64_t n, float* o) {
  using F = typename V::F;
  constexpr int P = kParts<V>, W = V::W;
  const typename V::Lanes c = V::template consts<B>();
  for (int64_t j = 0; j < L.K; j += 64, row += 8 * B) {
    for (int h = 0; h < P; ++h) {
      const typename V::I v = V::template span<B>(row + B * W * h / 2, c);
      const F cc[4] = {codes<V, B, 0>(v), codes<V, B, 1>(v), codes<V, B, 2>(v), codes<V, B, 3>(v)};
      for (int t = 0; t < 4; ++t) {
        const int64_t g = (j + 16 * t) / L.group_size;
        const F sv = V::set1(L.scales[n * L.G + g]), zv = V::set1(L.zeros[n * L.G + g]);
        V::storeu(o + j + 16 * t + W * h, V::mul(V::sub(cc[t], zv), sv));
      }
    }
  }
}

template <class V>
void dequant_rows(const Layout& L, int64_t r0, int64_t r1, float* out) {
  for (int64_t n = r0; n < r1; ++n) {
    const uint8_t* row = L.row(n);
    const int64_t rb = n / L.row_block;
    float* o = out + (n - r0) * L.K;
    if (L.shared(rb)) {
      bm::dispatch_1to8(L.bits[rb * L.G], [&](auto b) { shared_dequant_row<V, decltype(b)::value>(L, row, n, o); });
      continue;
    }
    for (int64_t g = 0; g < L.G; ++g) {
      const int64_t c0 = g * L.group_size, len = L.glen(g);
      const uint8_t* p = row + L.goff[rb * L.G + g];
      const float s = L.scales[n * L.G + g], z = L.zeros[n * L.G + g];
      bm::dispatch_1to8(L.bits[rb * L.G + g], [&](auto b) { dequant_group<V, decltype(b)::value>(p, len, s, z, o + c0); });
    }
  }
}
