// bitmosaic C++ kernel: one row of the approximate MSE scale search (scalesearch.cpp), included inside
// each ISA's namespace (and target region) so that its block() inlines.

// The rest of candidate c's sum after its first B columns (in A[c]), stopped once A[c] (1 - kappa) > thr;
// whether it ran to the end within thr.
inline bool finish_sum(const Args& a, const float* w, int64_t r, int64_t c, int64_t B, double lo, double thr,
                       double* A) {
  double acc = A[c];
  const float s = a.S[r * a.C + c], z = a.Z[r * a.C + c];
  for (int64_t c0 = B; c0 < a.n && acc * lo <= thr; c0 += kBlock)
    acc += block(w, c0, std::min(a.n, c0 + kBlock), s, z, a.maxq);
  A[c] = acc;
  return acc * lo <= thr;
}

// One row: approximate sums with pruning, then the survivors (see the header comment).
inline void search_row(const Args& a, int64_t r, double* A, uint8_t* full) {
  const float* w = a.w + r * a.n;
  for (int64_t j = 0; j < a.n; ++j) {
    if (!std::isfinite(w[j])) {
      a.win[r] = -2;
      return;
    }
  }
  const int64_t B = std::min<int64_t>(a.n, kBlock);
  const double lo = 1.0 - a.kappa, hi = 1.0 + a.kappa;
  int64_t best = 0;
  for (int64_t c = 0; c < a.C; ++c) {
    A[c] = block(w, 0, B, a.S[r * a.C + c], a.Z[r * a.C + c], a.maxq);
    if (A[c] < A[best]) best = c;
  }
  const double inf = std::numeric_limits<double>::infinity();
  finish_sum(a, w, r, best, B, lo, inf, A);
  full[best] = 1;
  double U = A[best];
  double thr = U * hi + a.alpha2;
  for (int64_t c = 0; c < a.C; ++c) {
    if (c == best) continue;
    full[c] = finish_sum(a, w, r, c, B, lo, thr, A) ? 1 : 0;
    if (full[c] && A[c] < U) {
      U = A[c];
      thr = U * hi + a.alpha2;
    }
  }
  int64_t count = 0, last = -1;
  for (int64_t c = 0; c < a.C; ++c) {
    const bool ok = full[c] && A[c] * lo <= thr;
    a.alive[r * a.C + c] = ok ? 1 : 0;
    if (ok) {
      ++count;
      last = c;
    }
  }
  a.win[r] = count == 1 ? (int32_t)last : -1;
}

inline void search_rows(const Args& a) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, a.C * a.n));
  at::parallel_for(0, a.R, grain, [&](int64_t r0, int64_t r1) {
    std::vector<double> A(a.C);
    std::vector<uint8_t> full(a.C);
    for (int64_t r = r0; r < r1; ++r) search_row(a, r, A.data(), full.data());
  });
}


// |d|^2.4 as block() approximates it, for one element d >= 0 (w = d, s = 1, z = 0, maxq = 0: q = 0, the
// distance is d itself); the bound test's entry point, callable from outside the target region.
inline double pow24_one(const float* d) { return block(d, 0, 1, 1.0f, 0.0f, 0.0f); }
