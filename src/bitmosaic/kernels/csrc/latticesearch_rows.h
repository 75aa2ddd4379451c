// bitmosaic C++ kernel: the rows of the lattice codebook search (latticesearch.cpp), included inside each
// ISA's namespace (and target region) so the compiler vectorises the loops over codebook points for it.
// Every float operation is one of the torch reference's (algorithms/gguf_lattice.py::nearest_many), in its
// order, and the build has -ffp-contract=off (no fused multiply-add): the results are the reference's bit
// for bit on every ISA.

// Row i's sums over every codebook point g: A = sum m g^2, B = sum (m a) g and, when F is given,
// F = min (m a) g (the cheapest sign flip of the parity rule).
inline void point_sums(const Args& a, int64_t i, float* A, float* B, float* F) {
  const float inf = std::numeric_limits<float>::infinity();
  const float* ai = a.a + i * a.D;
  const float* mi = a.m + i * a.D;
  for (int64_t g = 0; g < a.P; ++g) {
    A[g] = 0.0f;
    B[g] = 0.0f;
  }
  if (F)
    for (int64_t g = 0; g < a.P; ++g) F[g] = inf;
  for (int64_t j = 0; j < a.D; ++j) {
    const float mj = mi[j], maj = mi[j] * ai[j];
    const float* gj = a.Gt + j * a.P;
    for (int64_t g = 0; g < a.P; ++g) {
      A[g] = A[g] + (mj * gj[g]) * gj[g];
      B[g] = B[g] + maj * gj[g];
    }
    if (F)
      for (int64_t g = 0; g < a.P; ++g) F[g] = std::min(F[g], maj * gj[g]);
  }
}

inline void search_rows(const Args& a) {
  at::parallel_for(0, a.N, 64, [&](int64_t i0, int64_t i1) {
    std::vector<float> A(a.P), B(a.P), F(a.P);
    const float inf = std::numeric_limits<float>::infinity();
    for (int64_t i = i0; i < i1; ++i) {
      point_sums(a, i, A.data(), B.data(), a.parity ? F.data() : nullptr);
      for (int64_t c = 0; c < a.C; ++c) {  // r = s A - 2 B; with the cheapest sign flipped r + 4 F
        const float s = a.s[i * a.C + c];
        float best = inf, fbest = inf;
        int32_t bi = 0, fi = 0;
        for (int64_t g = 0; g < a.P; ++g) {
          const float r = s * A[g] - 2.0f * B[g];
          if (r < best) {
            best = r;
            bi = (int32_t)g;
          }
        }
        if (a.parity)
          for (int64_t g = 0; g < a.P; ++g) {
            const float r = (s * A[g] - 2.0f * B[g]) + 4.0f * F[g];
            if (r < fbest) {
              fbest = r;
              fi = (int32_t)g;
            }
          }
        a.idx[i * a.C + c] = bi;
        a.val[i * a.C + c] = best;
        if (a.parity) {
          a.fidx[i * a.C + c] = fi;
          a.fval[i * a.C + c] = fbest;
        }
      }
    }
  });
}

// The K first points by r = s A - 2 B (one scale per point), ascending, ties in codebook order (a stable
// sort's first K): insertion into a sorted list, strict < so an equal later point goes behind.
inline void topk_rows(const Args& a, int64_t K) {
  at::parallel_for(0, a.N, 16, [&](int64_t i0, int64_t i1) {
    std::vector<float> A(a.P), B(a.P), tv(K);
    std::vector<int32_t> ti(K);
    for (int64_t i = i0; i < i1; ++i) {
      point_sums(a, i, A.data(), B.data(), nullptr);
      const float s = a.s[i];
      int64_t n = 0;
      for (int64_t g = 0; g < a.P; ++g) {
        const float r = s * A[g] - 2.0f * B[g];
        if (n == K && !(r < tv[K - 1])) continue;
        int64_t p = n < K ? n++ : K - 1;  // the slot freed at the end, moved down while r is smaller
        while (p > 0 && r < tv[p - 1]) {
          tv[p] = tv[p - 1];
          ti[p] = ti[p - 1];
          --p;
        }
        tv[p] = r;
        ti[p] = (int32_t)g;
      }
      for (int64_t k = 0; k < K; ++k) {
        a.idx[i * K + k] = ti[k];
        a.val[i * K + k] = tv[k];
      }
    }
  });
}
